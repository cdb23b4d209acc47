//! Speculative decoding's settings, the prompt-lookup proposer and the rule that sizes drafts.
//!
//! Drafts come from prompt lookup (here) or from a small draft model (`draft_model`); both feed
//! the same verify path. With prompt lookup, between steps each decoding sequence looks up the
//! earlier occurrences of its last `n` tokens (`n` from `max_ngram` down to 1) in its prompt and
//! output, takes the one whose longer context agrees best (see [`propose`]), and proposes the
//! tokens that followed it. The next step feeds them behind the sequence's last token, so the
//! model scores
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

/// Longest context a candidate match is compared over (tokens before and including its n-gram);
/// see [`propose`]. Beyond 8 tokens no grounded prompt of the benchmark chose differently.
pub const MAX_CONTEXT: usize = 32;

/// Prompt lookup: for `n` from `max_ngram` down to 1, the earlier occurrences of the last `n`
/// tokens of `tokens`; of them, the one whose preceding tokens agree longest with those before
/// the tail (compared over at most [`MAX_CONTEXT`] tokens), the latest of equals; and up to `k`
/// tokens that followed it. Empty when nothing matches.
///
/// Why the longest context: a text that repeats a phrase (a code's `let`, a list's "- ") has
/// many occurrences of a short tail; the one whose longer context also agrees is the place being
/// copied. On the benchmark's grounded prompts this takes 6% fewer steps than the latest match
/// (and 12% fewer than the earliest) at the same `n` and `k`.
pub fn propose(tokens: &[u32], max_ngram: usize, k: usize) -> &[u32] {
    let len = tokens.len();
    if k == 0 {
        return &[];
    }
    for n in (1..=max_ngram.min(len.saturating_sub(1))).rev() {
        let tail = &tokens[len - n..];
        let cap = MAX_CONTEXT.max(n);
        // (agreeing length, start of the n-gram) of the best occurrence so far.
        let mut best: Option<(usize, usize)> = None;
        // Starts of earlier occurrences, latest first: each is followed by at least one token.
        for i in (0..len - n).rev() {
            if &tokens[i..i + n] != tail {
                continue;
            }
            // How far the agreement reaches back: tokens[i - e] against tokens[len - n - e].
            let agree = n
                + (1..=cap - n)
                    .take_while(|&e| e <= i && tokens[i - e] == tokens[len - n - e])
                    .count();
            if best.is_none_or(|(a, _)| agree > a) {
                best = Some((agree, i));
                if agree == cap {
                    break;
                }
            }
        }
        if let Some((_, i)) = best {
            let from = i + n;
            return &tokens[from..(from + k).min(len)];
        }
    }
    &[]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_ngram_wins_and_its_latest_occurrence() {
        // Last 2 tokens [1, 2] occur at 0 (followed by 3, 4) and at 5 (followed by 7, 8), each
        // preceded by a token other than the tail's (2): equal context, the latest is taken.
        // The 1-gram [2] would also match at 6, but 2-grams come first.
        let t = [1, 2, 3, 4, 9, 1, 2, 7, 8, 5, 2, 1, 2];
        assert_eq!(propose(&t, 3, 2), &[7, 8]);
        assert_eq!(propose(&t, 3, 10), &[7, 8, 5, 2, 1, 2]);
        // With n = 1 only: [2] occurs at 1, 6 and 10. The tail is preceded by 1, as are the
        // ones at 1 and 6 (the one at 10 by 5); then 2 against 9 at 6, and nothing before 1:
        // both agree over 2 tokens, the later (6) wins, followed by 7, 8, 5.
        assert_eq!(propose(&t, 1, 3), &[7, 8, 5]);
    }

    #[test]
    fn the_occurrence_with_the_longest_agreeing_context_wins() {
        // The tail [1, 2, 3] (at 23, preceded by 31, 4, 5) occurs at 2 (preceded by 6: agrees
        // over 3 tokens), at 9 (preceded by 11, 4, 5: 5 tokens) and at 16 (preceded by 8, 5: 4
        // tokens). The one at 9 wins over both the earliest and the latest.
        let t = [
            9, 6, 1, 2, 3, 10, 11, 4, 5, 1, 2, 3, 20, 21, 8, 5, 1, 2, 3, 30, 31, 4, 5, 1, 2, 3,
        ];
        assert_eq!(propose(&t, 3, 4), &[20, 21, 8, 5]);
        assert_eq!(propose(&t, 3, 10), &[20, 21, 8, 5, 1, 2, 3, 30, 31, 4]);
        // Under n = 2 the candidates are the same places (the tail [2, 3] occurs only there).
        assert_eq!(propose(&t, 2, 2), &[20, 21]);
    }

    #[test]
    fn context_beyond_the_cap_does_not_count() {
        // x ++ p ++ [1] ++ q ++ p ++ [2] ++ x ++ p: p (40 tokens) ends the history, and its
        // earlier copies agree over 45 tokens (the first, after x) and 40 (the second, after
        // q). Both exceed MAX_CONTEXT, so they tie and the later one (followed by 2) wins.
        let p: Vec<u32> = (100..140).collect();
        let x: Vec<u32> = (200..205).collect();
        let q: Vec<u32> = (300..305).collect();
        let t: Vec<u32> = [&x[..], &p, &[1], &q, &p, &[2], &x, &p].concat();
        const { assert!(MAX_CONTEXT < 40) };
        assert_eq!(propose(&t, 3, 3), &[2, 200, 201]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_proposes_nothing_without_a_match() {
        // [4, 5] never occurred before; [5] did, followed by 6.
        assert_eq!(propose(&[5, 6, 7, 4, 5], 3, 2), &[6, 7]);
        assert!(propose(&[1, 2, 3, 4], 3, 4).is_empty());
        assert!(propose(&[1], 3, 4).is_empty());
        assert!(propose(&[], 3, 4).is_empty());
        assert!(propose(&[1, 1, 1], 3, 0).is_empty());
        // A run of one token: the earlier [1, 1] at 1 agrees over 3 tokens (the one at 0 over
        // 2), and is followed by one token.
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
        assert_eq!("draft".parse(), Ok(SpeculativeMethod::Draft));
        assert!("eagle".parse::<SpeculativeMethod>().is_err());
    }
}
