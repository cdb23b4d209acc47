//! Speculative decoding's settings, the prompt-lookup proposer and the rule that sizes drafts.
//!
//! Drafts come from prompt lookup (here) or from a small draft model (`draft_model`); both feed
//! the same verify path. With prompt lookup, between steps each decoding sequence looks up the latest earlier occurrence of its last `n`
//! tokens (`n` from `max_ngram` down to 1) in its prompt and output, and proposes the tokens that
//! followed it. The next step feeds them behind the sequence's last token, so the model scores
//! `1 + d` positions in one pass over the weights; the engine core keeps the longest prefix the
//! model agrees with plus the model's own next token (`sampling::verify_draft`), and the
//! scheduler rolls the rest back.
//!
//! A structured output drafts too: its drafts are cut to the prefix its grammar allows, and
//! each verified row is masked at the grammar's place after the drafts before it
//! (`structured::TokenMatcher::prepare`, beside the model's run), so the accepted tokens are
//! those decoding without drafts would give.
//!
//! **When drafts shrink.** On a CPU a decode step is bound by reading the weights, so extra
//! rows are nearly free while the step is small, and cost full compute once the matrix products
//! are compute-bound. A step verifies at most `max_rows` rows over its decoding sequences
//! (default [`VERIFY_ROWS`]): with `b` of them, each gets `min(k, max_rows / b - 1)` drafts, so
//! `k` falls to 0 at `b > max_rows / 2`. Drafts also count against the step's token budget and shrink before a
//! sequence would be preempted for their blocks (the scheduler's part).

use crate::config::Names;
use std::path::PathBuf;
use std::str::FromStr;

/// Rows (decode tokens plus drafts) a step verifies at most, by default; see the module
/// comment. With SmolLM2-135M at f32 on 2 busy Zen 4 cores, 8 sequences with 3 drafts each
/// (32 rows) made steps about 2.7 times as long as 8-row decode steps, eating the gain; 16 rows
/// (1 draft each at 8 sequences) is the default until a quiet machine tunes it.
pub const VERIFY_ROWS: usize = 16;

/// How drafts are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpeculativeMethod {
    /// N-gram lookup in the sequence's own prompt and output.
    PromptLookup,
    /// A small model sharing the target's tokenizer drafts greedily
    /// ([`SpeculativeConfig::draft_model`]).
    Draft,
}

impl SpeculativeMethod {
    /// The one name table (what `--speculative` takes).
    const NAMES: Names<SpeculativeMethod> = Names(&[
        (SpeculativeMethod::PromptLookup, "prompt-lookup"),
        (SpeculativeMethod::Draft, "draft"),
    ]);

    pub fn as_str(self) -> &'static str {
        SpeculativeMethod::NAMES.name(self)
    }
}

impl FromStr for SpeculativeMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<SpeculativeMethod, String> {
        SpeculativeMethod::NAMES.parse(s, "speculative method")
    }
}

/// Speculative decoding's settings.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
    /// The draft model's directory (`--draft-model`; with [`SpeculativeMethod::Draft`] only).
    pub draft_model: Option<PathBuf>,
    /// Draft tokens per sequence and step at most (`k`, `--num-speculative-tokens`).
    pub num_tokens: usize,
    /// Longest n-gram looked up (`--max-ngram-size`).
    pub max_ngram: usize,
    /// Rows a step verifies at most (`--speculative-max-rows`, default [`VERIFY_ROWS`]).
    pub max_rows: usize,
}

impl SpeculativeConfig {
    /// Draft tokens each of `decoding` sequences may propose this step (the rule above).
    pub fn draft_len(&self, decoding: usize) -> usize {
        self.num_tokens
            .min((self.max_rows / decoding.max(1)).saturating_sub(1))
    }
}

/// Prompt lookup: for `n` from `max_ngram` down to 1, the latest earlier occurrence of the last
/// `n` tokens of `tokens`, and up to `k` tokens that followed it. Empty when nothing matches.
pub fn propose(tokens: &[u32], max_ngram: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 {
        return &[];
    }
    for n in (1..=max_ngram.min(len.saturating_sub(1))).rev() {
        let tail = &tokens[len - n..];
        // Starts of earlier occurrences, latest first: each is followed by at least one token.
        for i in (0..len - n).rev() {
            if &tokens[i..i + n] == tail {
                let from = i + n;
                return &tokens[from..(from + k).min(len)];
            }
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_ngram_wins_and_its_latest_occurrence() {
        // Last 2 tokens [1, 2] occur at 0 (followed by 3, 4) and at 5 (followed by 7, 8): the
        // latest is taken. The 1-gram [2] would also match at 6, but 2-grams come first.
        let t = [1, 2, 3, 4, 9, 1, 2, 7, 8, 5, 2, 1, 2];
        assert_eq!(propose(&t, 3, 2), &[7, 8]);
        assert_eq!(propose(&t, 3, 10), &[7, 8, 5, 2, 1, 2]);
        // With n = 1 only, the latest 2 before the end is at 10, followed by 1.
        assert_eq!(propose(&t, 1, 3), &[1, 2]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_proposes_nothing_without_a_match() {
        // [4, 5] never occurred before; [5] did, followed by 6.
        assert_eq!(propose(&[5, 6, 7, 4, 5], 3, 2), &[6, 7]);
        assert!(propose(&[1, 2, 3, 4], 3, 4).is_empty());
        assert!(propose(&[1], 3, 4).is_empty());
        assert!(propose(&[], 3, 4).is_empty());
        assert!(propose(&[1, 1, 1], 3, 0).is_empty());
        // A run of one token: the latest earlier [1, 1] is at 1, followed by one token.
        assert_eq!(propose(&[1, 1, 1, 1], 2, 5), &[1]);
    }

    #[test]
    fn drafts_shrink_to_zero_as_the_batch_grows() {
        let c = SpeculativeConfig {
            method: SpeculativeMethod::PromptLookup,
            draft_model: None,
            num_tokens: 4,
            max_ngram: 3,
            max_rows: 32,
        };
        let got: Vec<usize> = [1, 4, 8, 10, 16, 17, 64]
            .iter()
            .map(|&b| c.draft_len(b))
            .collect();
        assert_eq!(got, vec![4, 4, 3, 2, 1, 0, 0]);
        let c = SpeculativeConfig {
            max_rows: VERIFY_ROWS,
            ..c.clone()
        };
        assert_eq!(c.draft_len(8), 1);
        assert_eq!(c.draft_len(9), 0);
        assert_eq!("prompt-lookup".parse(), Ok(SpeculativeMethod::PromptLookup));
        assert_eq!("draft".parse(), Ok(SpeculativeMethod::Draft));
        assert!("eagle".parse::<SpeculativeMethod>().is_err());
    }
}
