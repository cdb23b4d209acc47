//! Prompt-lookup speculative decoding: the draft proposer and the rule that sizes drafts.
//!
//! Between steps, each decoding sequence looks up the latest earlier occurrence of its last `n`
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

use std::str::FromStr;

/// Rows (decode tokens plus drafts) a step verifies at most, by default; see the module
/// comment. SmolLM2-135M at f32 on 2 shared Zen 4 cores (`examples/step_rows.rs`, load 4):
/// a decode step of 1, 4, 8, 16, 24 and 32 rows took 40, 49, 66, 81, 105 and 119 ms, so
/// past about 8 rows each row costs about 4.5 ms (the step is compute-bound). At 8 sequences
/// a draft then pays only if it is accepted with a probability above about 0.5 (4.5 ms against
/// 66 ms / 8 tokens a step): 1, 2 and 3 drafts gave 1.15, 1.19 and 1.12 times the decode
/// tokens/s of none, and on text with nothing to copy (acceptance 40-50%) 24 rows cost more
/// than 16. Hence 16 (1 draft each at 8 sequences, none from 9).
pub const VERIFY_ROWS: usize = 16;

/// How drafts are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpeculativeMethod {
    /// N-gram lookup in the sequence's own prompt and output.
    PromptLookup,
}

impl SpeculativeMethod {
    /// The one name table (what `--speculative` takes).
    const NAMES: [(SpeculativeMethod, &'static str); 1] =
        [(SpeculativeMethod::PromptLookup, "prompt-lookup")];

    pub fn as_str(self) -> &'static str {
        SpeculativeMethod::NAMES
            .iter()
            .find(|(m, _)| *m == self)
            .map_or("prompt-lookup", |(_, n)| n)
    }
}

impl FromStr for SpeculativeMethod {
    type Err = String;
    fn from_str(s: &str) -> Result<SpeculativeMethod, String> {
        SpeculativeMethod::NAMES
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(m, _)| *m)
            .ok_or_else(|| format!("unknown speculative method `{s}` (prompt-lookup)"))
    }
}

/// Speculative decoding's settings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpeculativeConfig {
    pub method: SpeculativeMethod,
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
            ..c
        };
        assert_eq!(c.draft_len(8), 1);
        assert_eq!(c.draft_len(9), 0);
        // The default, by hand: 16 / b - 1 (integer division) drafts, at most k = 4; no
        // decoding sequence counts as one.
        let got: Vec<usize> = (0..=17).map(|b| c.draft_len(b)).collect();
        let want = [4, 4, 4, 4, 3, 2, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(got, want);
        // Rows verified never exceed the limit once anything is drafted.
        for b in 1..=17 {
            let d = c.draft_len(b);
            assert!(
                d == 0 || b * (1 + d) <= VERIFY_ROWS,
                "{b} sequences, {d} drafts"
            );
        }
        assert_eq!("prompt-lookup".parse(), Ok(SpeculativeMethod::PromptLookup));
        assert!("draft".parse::<SpeculativeMethod>().is_err());
    }
}
