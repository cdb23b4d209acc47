//! Structured output: a request's [`Constraint`] compiled by llguidance into a per-output
//! matcher, which gives the tokens that may come next (a mask over the vocabulary) and consumes
//! the token sampled. The token trie is built from the model's `tokenizer.json` (llguidance's own
//! reader of it), so the engine's tokenizer is the only one.

use crate::request::{Constraint, RequestError};
use crate::tokenizer::TextTokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use std::sync::Arc;
use std::time::{Duration, Instant};
use toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// The model's vocabulary as llguidance sees it: each token's bytes, and our tokenizer for text.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<TextTokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(s, |s| {
            self.tokenizer.encode(s, false).unwrap_or_default()
        })
    }
}

/// Compiles constraints for one model (built once per engine: the trie of its vocabulary).
pub struct Grammars {
    factory: ParserFactory,
}

impl Grammars {
    /// The grammars of `tokenizer`'s vocabulary; `eos` are the ids that end a text (allowed where
    /// a constraint is complete).
    pub fn new(tokenizer: Arc<TextTokenizer>, eos: &[u32]) -> Result<Grammars, String> {
        let json = tokenizer.to_json()?;
        // The reader asserts on malformed byte-fallback names: a panic here is a refusal.
        let bytes = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| "cannot read the vocabulary of tokenizer.json".to_owned())?
            .map_err(|e| format!("cannot read the vocabulary of tokenizer.json: {e}"))?;
        let n = bytes.len().max(tokenizer.vocab_size());
        let mut bytes = bytes;
        // Ids the vocabulary skips: special tokens no text can produce.
        for (i, b) in bytes.iter_mut().enumerate() {
            if b.is_empty() {
                *b = [
                    &[TokTrie::SPECIAL_TOKEN_MARKER][..],
                    format!("<[{i}]>").as_bytes(),
                ]
                .concat();
            }
        }
        while bytes.len() < n {
            let i = bytes.len();
            bytes.push(
                [
                    &[TokTrie::SPECIAL_TOKEN_MARKER][..],
                    format!("<[{i}]>").as_bytes(),
                ]
                .concat(),
            );
        }
        let first_eos = eos.first().copied().unwrap_or(0);
        let info = TokRxInfo::new(n as u32, first_eos);
        let mut trie = TokTrie::from(&info, &bytes);
        if eos.len() > 1 {
            trie = trie.with_eos_tokens(eos);
        }
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        // Errors come back to the caller; nothing on stderr.
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A matcher of `c` at the start of a text, or why `c` does not compile (blamed on
    /// [`Constraint::param`]).
    pub fn compile(&self, c: &Constraint) -> Result<TokenMatcher, RequestError> {
        c.validate()?;
        let grammar = match c {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(&serde_json::json!({"type": "object"})))
            }
            Constraint::JsonSchema(s) => TopLevelGrammar::from_json_schema(compact(s)),
            Constraint::Regex(r) => TopLevelGrammar::from_regex(r),
            Constraint::Lark(g) => TopLevelGrammar::from_lark(g.clone()),
        };
        let what = match c {
            Constraint::JsonObject | Constraint::JsonSchema(_) => "the JSON schema",
            Constraint::Regex(_) => "the regular expression",
            Constraint::Lark(_) => "the Lark grammar",
        };
        let parser = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.factory.create_parser(grammar)
        }))
        .map_err(|_| "the library failed on it".to_owned())
        .and_then(|r| r.map_err(|e| e.to_string()))
        .map_err(|e| RequestError::param(c.param(), format!("{what} does not compile: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(RequestError::param(
                c.param(),
                format!("{what} does not compile: {e}"),
            ));
        }
        Ok(TokenMatcher::new(matcher))
    }
}

/// The one whitespace rule of the JSON the engine writes or constrains (`response_format`,
/// tool-call arguments, calls written back into a prompt): Python's `json.dumps`, which chat
/// templates' `tojson` follows: these separators and no other whitespace. Free whitespace lets
/// a small model run on in newlines until `max_tokens`.
const ITEM_SEPARATOR: &str = ", ";
const KEY_SEPARATOR: &str = ": ";

/// `schema` held to [the compact rule](ITEM_SEPARATOR), unless it sets llguidance's own
/// `x-guidance` options.
pub fn compact(schema: &serde_json::Value) -> serde_json::Value {
    let mut s = match schema {
        serde_json::Value::Bool(true) => serde_json::json!({}),
        s => s.clone(),
    };
    if let Some(o) = s.as_object_mut() {
        o.entry("x-guidance").or_insert_with(|| {
            serde_json::json!({
                "whitespace_flexible": false,
                "item_separator": ITEM_SEPARATOR,
                "key_separator": KEY_SEPARATOR,
            })
        });
    }
    s
}

/// `v` written by [the compact rule](ITEM_SEPARATOR), as a constrained output writes it.
pub fn to_compact_string(v: &serde_json::Value) -> String {
    struct Separators;
    impl serde_json::ser::Formatter for Separators {
        fn begin_array_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            if first {
                Ok(())
            } else {
                w.write_all(ITEM_SEPARATOR.as_bytes())
            }
        }
        fn begin_object_key<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
            first: bool,
        ) -> std::io::Result<()> {
            self.begin_array_value(w, first)
        }
        fn begin_object_value<W: ?Sized + std::io::Write>(
            &mut self,
            w: &mut W,
        ) -> std::io::Result<()> {
            w.write_all(KEY_SEPARATOR.as_bytes())
        }
    }
    let mut out = Vec::new();
    let mut ser = serde_json::Serializer::with_formatter(&mut out, Separators);
    match serde::Serialize::serialize(v, &mut ser) {
        Ok(()) => String::from_utf8(out).unwrap_or_else(|_| v.to_string()),
        Err(_) => v.to_string(),
    }
}

/// One output's place in its constraint.
///
/// With speculative decoding a step verifies drafts behind the output's last token: row `j` of
/// the step needs the mask after the first `j` drafts. [`TokenMatcher::prepare`] walks the
/// matcher through the drafts, keeping each place's mask, and rolls it back, so that only the
/// accepted tokens advance it ([`TokenMatcher::consume`], one at a time, as without drafts).
pub struct TokenMatcher {
    matcher: Matcher,
    /// The drafts the masks past the first follow.
    drafts: Vec<u32>,
    /// The tokens allowed at the current place (`masks[0]`) and after each draft
    /// (`masks[j]` after `drafts[..j]`), once computed; `None`: nothing may come there (the
    /// constraint is complete, or failed).
    masks: Vec<Option<SimpleVob>>,
    /// Time spent computing masks since the last [`TokenMatcher::take_mask_time`].
    mask_time: Duration,
}

impl TokenMatcher {
    fn new(matcher: Matcher) -> TokenMatcher {
        TokenMatcher {
            matcher,
            drafts: Vec::new(),
            masks: Vec::new(),
            mask_time: Duration::ZERO,
        }
    }

    /// The mask of the place the matcher is at now (`None` when it is stopped or fails).
    fn current_mask(&mut self) -> Option<SimpleVob> {
        if self.matcher.is_stopped() {
            return None;
        }
        self.matcher.compute_mask().ok()
    }

    /// Computes the masks of the next token and of the token after each of `drafts` (those of
    /// the step verifying them), unless done already for this place and these drafts. A draft
    /// the constraint refuses ends the walk: no row past it can be reached.
    pub fn prepare(&mut self, drafts: &[u32]) {
        if !self.masks.is_empty() && self.drafts == drafts {
            return;
        }
        let t = Instant::now();
        if self.masks.is_empty() {
            let m = self.current_mask();
            self.masks.push(m);
        }
        self.masks.truncate(1);
        self.drafts.clear();
        self.drafts.extend_from_slice(drafts);
        let mut walked = 0;
        for &d in drafts {
            let allowed = self.masks[walked].as_ref().is_some_and(|m| m.is_allowed(d));
            if !allowed || self.matcher.consume_token(d).is_err() {
                break;
            }
            walked += 1;
            let m = self.current_mask();
            self.masks.push(m);
        }
        if walked > 0 && self.matcher.rollback(walked).is_err() {
            // The matcher cannot return to its place: it fails, and the output ends.
            self.masks = vec![None];
        }
        self.mask_time += t.elapsed();
    }

    /// How many of `drafts` the constraint allows in a row from the current place (drafts
    /// past them would be rejected anyway).
    pub fn valid_drafts(&mut self, drafts: &[u32]) -> usize {
        if self.matcher.is_stopped() {
            return 0;
        }
        self.matcher.validate_tokens(drafts).unwrap_or(0)
    }

    /// Sets every logit the constraint does not allow at row `j` of the step (after the first
    /// `j` drafts given to [`prepare`](Self::prepare)) to -inf, ids past the vocabulary
    /// included. Returns false when no token at all is allowed there (the constraint is stopped
    /// or failed): the output must end.
    pub fn apply(&mut self, j: usize, logits: &mut [f32]) -> bool {
        if self.masks.is_empty() {
            self.prepare(&[]);
        }
        let Some(Some(mask)) = self.masks.get(j) else {
            return false;
        };
        let mut any = false;
        let words = mask.as_slice();
        for (i, chunk) in logits.chunks_mut(32).enumerate() {
            let w = words.get(i).copied().unwrap_or(0);
            if w == u32::MAX && chunk.len() == 32 {
                any = true;
                continue;
            }
            for (b, v) in chunk.iter_mut().enumerate() {
                if w & (1 << b) == 0 {
                    *v = f32::NEG_INFINITY;
                } else {
                    any = true;
                }
            }
        }
        any
    }

    /// Whether the constraint is complete after the first `j` drafts (nothing more may follow
    /// them): a step that accepts them ends the output there.
    pub fn done_after(&self, j: usize) -> bool {
        j > 0 && matches!(self.masks.get(j), Some(None))
    }

    /// Whether `token` is allowed next (computing the mask when needed).
    pub fn allows(&mut self, token: u32) -> bool {
        if self.masks.is_empty() {
            self.prepare(&[]);
        }
        self.masks[0].as_ref().is_some_and(|m| m.is_allowed(token))
    }

    /// Moves past `token`. Returns whether the constraint is now done (nothing more may follow,
    /// or the token was refused: the output ends either way).
    pub fn consume(&mut self, token: u32) -> bool {
        self.masks.clear();
        self.drafts.clear();
        if self.matcher.is_stopped() {
            return true;
        }
        self.matcher.consume_token(token).is_err() || self.matcher.is_stopped()
    }

    /// Whether the text so far is complete under the constraint.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// The mask time since the last call.
    pub fn take_mask_time(&mut self) -> Duration {
        std::mem::take(&mut self.mask_time)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A byte-level BPE tokenizer: the 256 bytes (GPT-2's byte-to-character map), the merged
    /// tokens "ab" and "12", and the special token "<eos>" (id 258).
    fn tokenizer() -> Arc<TextTokenizer> {
        let mut vocab = serde_json::Map::new();
        let mut k = 0x100u32;
        for b in 0..=255u32 {
            let c = char::from_u32(b).unwrap();
            let self_mapped = matches!(c, '!'..='~' | '\u{A1}'..='\u{AC}' | '\u{AE}'..='\u{FF}');
            let ch = if self_mapped {
                c
            } else {
                k += 1;
                char::from_u32(k - 1).unwrap()
            };
            vocab.insert(ch.to_string(), json!(b));
        }
        vocab.insert("ab".into(), json!(256));
        vocab.insert("12".into(), json!(257));
        let tj = json!({
            "version": "1.0",
            "added_tokens": [{"id": 258, "content": "<eos>", "single_word": false, "lstrip": false,
                              "rstrip": false, "normalized": false, "special": true}],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                              "use_regex": true},
            "post_processor": null,
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                        "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": ["a b", "1 2"]}
        });
        // A directory per call: the tests run in parallel threads of one process.
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("pa-structured-{}-{call}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("tokenizer.json"), tj.to_string()).unwrap();
        let t = TextTokenizer::from_dir(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        Arc::new(t)
    }

    const EOS: u32 = 258;

    fn allowed(m: &mut TokenMatcher, n: u32) -> Vec<u32> {
        (0..n).filter(|&t| m.allows(t)).collect()
    }

    #[test]
    fn a_regex_allows_its_next_bytes_only_and_eos_where_complete() {
        let g = Grammars::new(tokenizer(), &[EOS]).unwrap();
        let mut m = g.compile(&Constraint::Regex("(ab|cd)x?".into())).unwrap();
        // First: "a", "c" and the merged "ab"; not "b", not the end.
        assert_eq!(allowed(&mut m, 259), vec![b'a' as u32, b'c' as u32, 256]);
        assert!(!m.consume(256));
        // After "ab" the text is complete ("x" may follow): "x" or the end.
        assert_eq!(allowed(&mut m, 259), vec![b'x' as u32, EOS]);
        assert!(m.is_accepting());
        // After "x" nothing may follow: the constraint is done.
        assert!(m.consume(b'x' as u32));
    }

    #[test]
    fn drafts_get_the_mask_after_each_and_leave_the_matcher_in_place() {
        let g = Grammars::new(tokenizer(), &[EOS]).unwrap();
        let mut m = g
            .compile(&Constraint::Regex("[0-2]{3}(d|e)".into()))
            .unwrap();
        let [z, o, w, d, e, x] = [b'0', b'1', b'2', b'd', b'e', b'x'].map(u32::from);
        // The constraint allows "002" in a row, then refuses "x".
        assert_eq!(m.valid_drafts(&[z, z, w, x]), 3);
        m.prepare(&[z, z, w, x]);
        let row = |m: &mut TokenMatcher, j: usize| {
            let mut l = vec![0.0f32; 259];
            m.apply(j, &mut l);
            (0..259u32)
                .filter(|&t| l[t as usize] == 0.0)
                .collect::<Vec<_>>()
        };
        // "12" (257) fits while two digits remain.
        assert_eq!(row(&mut m, 0), vec![z, o, w, 257]);
        assert_eq!(row(&mut m, 1), vec![z, o, w, 257]);
        assert_eq!(row(&mut m, 2), vec![z, o, w]);
        assert_eq!(row(&mut m, 3), vec![d, e]);
        // No row after the refused draft: it cannot be reached.
        assert!(!m.apply(4, &mut [0.0; 259]));
        assert!(!m.done_after(3));
        // The drafts were rolled back: the accepted tokens advance the matcher one at a time.
        assert!(m.allows(257) && !m.allows(d));
        for t in [z, z] {
            assert!(!m.consume(t));
        }
        assert!(!m.allows(257));
        // A draft that completes the constraint: nothing may follow it.
        m.prepare(&[w, e]);
        assert_eq!(row(&mut m, 1), vec![d, e]);
        assert!(m.done_after(2) && !m.done_after(1));
        assert!(!m.consume(w));
        assert!(m.consume(e));
    }

    #[test]
    fn apply_masks_the_row_to_minus_infinity_past_the_vocabulary_too() {
        let g = Grammars::new(tokenizer(), &[EOS]).unwrap();
        let mut m = g.compile(&Constraint::Regex("[0-9]+".into())).unwrap();
        // A row longer than the vocabulary (padded logits): the extra ids are never allowed.
        let mut row: Vec<f32> = (0..300).map(|i| i as f32).collect();
        assert!(m.apply(0, &mut row));
        for (t, v) in row.iter().enumerate() {
            let digit = (b'0' as usize..=b'9' as usize).contains(&t) || t == 257;
            assert_eq!(
                *v,
                if digit { t as f32 } else { f32::NEG_INFINITY },
                "token {t}"
            );
        }
    }

    #[test]
    fn json_schema_enum_steps_through_its_values() {
        let g = Grammars::new(tokenizer(), &[EOS]).unwrap();
        let c = Constraint::JsonSchema(json!({"enum": ["ab", "cd"]}));
        let mut m = g.compile(&c).unwrap();
        assert_eq!(allowed(&mut m, 259), vec![b'"' as u32]);
        for t in [b'"' as u32, b'c' as u32, b'd' as u32] {
            assert!(!m.consume(t));
        }
        assert_eq!(allowed(&mut m, 259), vec![b'"' as u32]);
        // The closing quote completes the only value: nothing may follow.
        assert!(m.consume(b'"' as u32) || allowed(&mut m, 259) == vec![EOS]);
    }

    #[test]
    fn what_does_not_compile_is_refused_naming_the_field() {
        let g = Grammars::new(tokenizer(), &[EOS]).unwrap();
        for (c, param) in [
            (
                Constraint::JsonSchema(json!({"type": "integer", "minimum": 5, "maximum": 1})),
                "response_format",
            ),
            (Constraint::JsonSchema(json!(3)), "response_format"),
            (Constraint::Regex("(a".into()), "guided_regex"),
            (Constraint::Lark("start: nowhere".into()), "guided_grammar"),
            (Constraint::Lark("  ".into()), "guided_grammar"),
        ] {
            let e = g.compile(&c).err().expect("refused");
            assert_eq!(e.param, Some(param), "{c:?}: {}", e.message);
            assert!(!e.message.is_empty());
        }
    }
}
