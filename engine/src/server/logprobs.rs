//! Log-probabilities in OpenAI's shapes, from the engine's per-token values: chat's
//! `logprobs.content` list of `{token, logprob, bytes, top_logprobs}`, and completions' four
//! parallel lists (`tokens`, `token_logprobs`, `top_logprobs` as token -> logprob maps with the
//! chosen token among them, `text_offset`). A token is named by its own text, special tokens
//! included; its bytes are that text's UTF-8.

use crate::request::Event;
use crate::sampling::TokenLogprobs;
use crate::tokenizer::TextTokenizer;
use serde_json::{json, Map, Value};

/// One token of a choice: its log-probabilities, or `None` for a prompt's first token (echoed),
/// which has none.
pub(crate) struct Entry {
    pub token: u32,
    pub logprobs: Option<TokenLogprobs>,
}

impl Entry {
    /// The entries of a `PromptLogprobs` event (empty for any other event).
    pub fn of_prompt(e: &Event) -> Vec<Entry> {
        let Event::PromptLogprobs {
            first, logprobs, ..
        } = e
        else {
            return Vec::new();
        };
        let mut out = Vec::with_capacity(logprobs.len() + 1);
        out.push(Entry {
            token: *first,
            logprobs: None,
        });
        out.extend(logprobs.iter().map(|lp| Entry {
            token: lp.token,
            logprobs: Some(lp.clone()),
        }));
        out
    }
}

/// A log-probability as JSON: at least -9999, as vLLM sends it (JSON has no -inf); a NaN
/// logit's is `null`.
fn number(lp: f32) -> Value {
    if lp.is_nan() {
        Value::Null
    } else {
        json!(lp.max(-9999.0))
    }
}

/// Chat's `logprobs` object of `entries`.
pub(crate) fn chat(tok: &TextTokenizer, entries: &[Entry]) -> Value {
    let named = |id: u32, lp: Value| {
        let text = tok.token_text(id);
        json!({"token": text, "logprob": lp, "bytes": text.as_bytes()})
    };
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let (lp, top) = match &e.logprobs {
                Some(l) => (number(l.logprob), l.top.as_slice()),
                None => (Value::Null, &[][..]),
            };
            let mut v = named(e.token, lp);
            v["top_logprobs"] = top.iter().map(|&(t, lp)| named(t, number(lp))).collect();
            v
        })
        .collect();
    json!({ "content": content })
}

/// Completions' `logprobs` object of `entries`; `offset` is the text offset of the first of
/// them, advanced past them (each token's text length, in characters).
pub(crate) fn completion(tok: &TextTokenizer, entries: &[Entry], offset: &mut usize) -> Value {
    let (mut tokens, mut token_lps, mut tops, mut offsets) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for e in entries {
        let text = tok.token_text(e.token);
        offsets.push(*offset);
        *offset += text.chars().count();
        match &e.logprobs {
            Some(l) => {
                let mut top = Map::new();
                for &(t, lp) in &l.top {
                    top.entry(tok.token_text(t)).or_insert(number(lp));
                }
                top.entry(text.clone()).or_insert(number(l.logprob));
                token_lps.push(number(l.logprob));
                tops.push(Value::Object(top));
            }
            None => {
                token_lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
        tokens.push(Value::String(text));
    }
    json!({"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops,
           "text_offset": offsets})
}
