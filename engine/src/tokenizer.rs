//! Text in and out: `tokenizer.json` through the `tokenizers` crate, the chat template of
//! `tokenizer_config.json` through minijinja (with Python string methods, as Hugging Face
//! templates use them), and a streaming decoder that never emits a partial UTF-8 sequence.

use crate::error::{read_json, EngineError, Result};
use crate::request::ChatMessage;
use serde_json::Value;
use std::path::Path;

/// The model directory's tokenizer.
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// Bytes of the longest token's text (its vocabulary entry, added tokens included): no token
    /// covers more of a prompt, so a prompt of more than `n * max_token_bytes` bytes has more than
    /// `n` tokens, which is known before tokenizing it.
    max_token_bytes: usize,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

fn token_text(v: Option<&Value>) -> Option<String> {
    match v {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Object(o)) => o.get("content").and_then(Value::as_str).map(str::to_owned),
        _ => None,
    }
}

impl TextTokenizer {
    /// `tokenizer.json`, and from `tokenizer_config.json` (optional) the chat template and the
    /// special tokens it refers to.
    pub fn from_dir(dir: &Path) -> Result<TextTokenizer> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| EngineError::Model {
            path: path.clone(),
            detail: format!("cannot load the tokenizer: {e}"),
        })?;
        let cfg_path = dir.join("tokenizer_config.json");
        let cfg = if cfg_path.is_file() {
            read_json(&cfg_path)?
        } else {
            Value::Null
        };
        let chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: the "default" one.
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_owned),
            _ => None,
        };
        let chat_template =
            chat_template.or_else(|| std::fs::read_to_string(dir.join("chat_template.jinja")).ok());
        let max_token_bytes = inner
            .get_vocab(true)
            .keys()
            .map(String::len)
            .max()
            .unwrap_or(1)
            .max(1);
        Ok(TextTokenizer {
            inner,
            max_token_bytes,
            chat_template,
            bos_token: token_text(cfg.get("bos_token")),
            eos_token: token_text(cfg.get("eos_token")),
        })
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (a BOS
    /// token, typically), as Hugging Face and GenAI do for a plain prompt.
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| EngineError::Tokenizer(format!("cannot encode: {e}")))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens skipped.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        self.inner
            .decode(ids, true)
            .map_err(|e| EngineError::Tokenizer(format!("cannot decode: {e}")))
    }

    /// One token's own text, special tokens included (as vLLM names a token in its logprobs); a
    /// token holding part of a character gives U+FFFD for it.
    pub fn token_text(&self, id: u32) -> String {
        self.inner.decode(&[id], false).unwrap_or_default()
    }

    pub fn eos_token_id(&self) -> Option<u32> {
        self.eos_token
            .as_deref()
            .and_then(|t| self.inner.token_to_id(t))
    }

    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// The tokenizer as `tokenizer.json` holds it.
    pub fn to_json(&self) -> std::result::Result<Value, String> {
        let text = self
            .inner
            .to_string(false)
            .map_err(|e| format!("cannot serialize the tokenizer: {e}"))?;
        serde_json::from_str(&text).map_err(|e| format!("cannot read the tokenizer's JSON: {e}"))
    }

    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// How `other`'s vocabulary (tokens and their ids, added tokens included) differs from this
    /// one's: `None` when they are the same, else the first difference (by id) in words.
    pub fn vocabulary_difference(&self, other: &TextTokenizer) -> Option<String> {
        let (a, b) = (self.inner.get_vocab(true), other.inner.get_vocab(true));
        if a.len() != b.len() {
            return Some(format!("{} tokens against {}", b.len(), a.len()));
        }
        let mut diff: Vec<(u32, &String)> = a
            .iter()
            .filter(|(t, id)| b.get(*t) != Some(*id))
            .map(|(t, &id)| (id, t))
            .collect();
        diff.sort_unstable();
        diff.first().map(|(id, t)| match b.get(*t) {
            Some(other_id) => format!("token {t:?} is id {other_id} there, {id} here"),
            None => format!("token {t:?} (id {id} here) is missing there"),
        })
    }

    pub fn has_chat_template(&self) -> bool {
        self.chat_template.is_some()
    }

    /// The chat template's source, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the chat template (`messages`, `tools` (none when `None`), `add_generation_prompt`,
    /// `bos_token`, `eos_token`, as transformers passes them) into at most `max_bytes` bytes: a
    /// template whose output would be longer is stopped there and refused (the request's text
    /// alone decides how long it runs). The result already holds the template's special tokens:
    /// encode it with `add_special_tokens = false`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[Value]>,
        add_generation_prompt: bool,
        max_bytes: usize,
    ) -> Result<String> {
        let template = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::Tokenizer(
                "the model directory has no chat template (tokenizer_config.json `chat_template`)"
                    .into(),
            )
        })?;
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |msg: String| -> std::result::Result<String, minijinja::Error> {
                Err(minijinja::Error::new(
                    minijinja::ErrorKind::InvalidOperation,
                    msg,
                ))
            },
        );
        let ctx = minijinja::context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_deref().unwrap_or(""),
            eos_token => self.eos_token.as_deref().unwrap_or(""),
        };
        let tmpl = env
            .template_from_str(template)
            .map_err(|e| EngineError::Tokenizer(format!("chat template: {e:#}")))?;
        let mut out = Capped {
            bytes: Vec::new(),
            max: max_bytes,
        };
        let rendered = tmpl.render_captured_to(ctx, &mut out).map(|_| ());
        match rendered {
            Ok(_) => String::from_utf8(out.bytes)
                .map_err(|_| EngineError::Tokenizer("chat template: output is not UTF-8".into())),
            Err(_) if out.bytes.len() >= max_bytes => Err(EngineError::Tokenizer(format!(
                "the chat template's output is over {max_bytes} bytes, more than the model's context holds"
            ))),
            Err(e) => Err(EngineError::Tokenizer(format!("chat template: {e:#}"))),
        }
    }
}

/// A writer that takes at most `max` bytes and fails past them.
struct Capped {
    bytes: Vec<u8>,
    max: usize,
}

impl std::io::Write for Capped {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let room = self.max - self.bytes.len();
        if buf.len() > room {
            self.bytes.extend_from_slice(&buf[..room]);
            return Err(std::io::Error::other("over the cap"));
        }
        self.bytes.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Incremental detokenization: feed generated ids one by one, get the text they complete. Text
/// is held back while the ids decode to an incomplete UTF-8 sequence (a trailing U+FFFD), so
/// the concatenated pieces equal the decode of all ids and no piece splits a character.
#[derive(Clone, Debug, Default)]
pub struct StreamDecoder {
    ids: Vec<u32>,
    /// Start of the ids decoded as context for the next piece.
    prefix: usize,
    /// End of the ids already turned into text.
    read: usize,
}

impl StreamDecoder {
    /// The new text `id` completes (possibly empty).
    pub fn push(&mut self, tok: &TextTokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        if now.len() > before.len()
            && !now.ends_with('\u{FFFD}')
            && now.is_char_boundary(before.len())
        {
            let piece = now[before.len()..].to_string();
            self.prefix = self.read;
            self.read = self.ids.len();
            Ok(piece)
        } else {
            Ok(String::new())
        }
    }

    /// Whatever text is still held back (at the end of a sequence).
    pub fn flush(&mut self, tok: &TextTokenizer) -> Result<String> {
        let before = tok.decode(&self.ids[self.prefix..self.read])?;
        let now = tok.decode(&self.ids[self.prefix..])?;
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::ToolCall;
    use serde_json::json;

    /// A one-word tokenizer with `template` as its chat template, in a fresh directory.
    fn with_template(template: &str) -> TextTokenizer {
        let dir = std::env::temp_dir().join(format!(
            "pa-template-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let tokenizer = json!({"version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [], "normalizer": null, "pre_tokenizer": null,
            "post_processor": null, "decoder": null,
            "model": {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}});
        std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).expect("write");
        let cfg = json!({"chat_template": template, "eos_token": "a"});
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).expect("write");
        let t = TextTokenizer::from_dir(&dir).expect("tokenizer");
        let _ = std::fs::remove_dir_all(&dir);
        t
    }

    #[test]
    fn tools_and_tool_messages_reach_the_template_as_transformers_passes_them() {
        // What tool templates (Qwen2.5's, Llama 3.1's) read: `tools` (none without them),
        // `'tool_calls' in message` only on messages with calls, arguments as a mapping, and a
        // tool message's `tool_call_id`.
        let t = with_template(concat!(
            "{% if tools is none %}no tools{% else %}{% for t in tools %}{{ t.function.name }};",
            "{% endfor %}{% endif %}",
            "{% for m in messages %}[{{ m.role }}",
            "{% if 'tool_calls' in m %} calls:{% for c in m.tool_calls %}",
            "{{ c.function.name }}/{{ c.function.arguments.city }}/{{ c.id }}{% endfor %}{% endif %}",
            "{% if m.tool_call_id is defined %} for {{ m.tool_call_id }}{% endif %}",
            "] {{ m.content }}{% endfor %}"
        ));
        let messages = vec![
            ChatMessage {
                role: "user".into(),
                content: "Weather?".into(),
                ..ChatMessage::default()
            },
            ChatMessage {
                role: "assistant".into(),
                tool_calls: Some(vec![ToolCall {
                    id: "call_9".into(),
                    name: "get_weather".into(),
                    arguments: r#"{"city": "Oslo"}"#.into(),
                }]),
                ..ChatMessage::default()
            },
            ChatMessage {
                role: "tool".into(),
                content: "cold".into(),
                tool_call_id: Some("call_9".into()),
                ..ChatMessage::default()
            },
        ];
        let tools = [json!({"type": "function", "function": {"name": "get_weather"}})];
        let out = t
            .apply_chat_template(&messages, Some(&tools), false, 1 << 20)
            .expect("renders");
        assert_eq!(
            out,
            "get_weather;[user] Weather?[assistant calls:get_weather/Oslo/call_9] [tool for call_9] cold"
        );
        let out = t
            .apply_chat_template(&messages[..1], None, false, 1 << 20)
            .expect("renders");
        assert_eq!(out, "no tools[user] Weather?");
    }
}
