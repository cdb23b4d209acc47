//! Speculative decoding's settings, the prompt-lookup proposer and the rule that sizes drafts.
//!
//! Drafts come from prompt lookup (here) or from a small draft model (`draft_model`); both feed
//! the same verify path. With prompt lookup, between steps each decoding sequence looks up the
//! earlier occurrences of its last `n` tokens (`n` from `max_ngram` down to 1) in its prompt and
//! output, takes the one whose longer context agrees best (see [`propose`]), and proposes the
//! tokens that followed it (a match near the end copied on through its period). The next step
//! feeds them behind the sequence's last token, so the model scores `1 + d` positions in one
//! pass over the weights; the engine core keeps the longest prefix the model agrees with plus
//! the model's own next token (`sampling::verify_draft`), and the scheduler rolls the rest back.
//!
//! A structured output drafts too: its drafts are cut to the prefix its grammar allows, and
//! each verified row is masked at the grammar's place after the drafts before it
//! (`structured::TokenMatcher::prepare`, beside the model's run), so the accepted tokens are
//! those decoding without drafts would give.
//!
//! **How long each draft is.** Every decoding sequence gets its own draft length, from what
//! its draft is expected to gain and what a row costs:
//!
//! - *Gain.* The `d`-th draft token adds a token to the output only if drafts `1..=d` are all
//!   accepted. [`Acceptance`] estimates that probability, `e(c, d)`, as the product of running
//!   acceptance rates of positions `1..=d` (each conditional on the ones before being
//!   accepted), kept per *class* `c` of proposal: for prompt lookup the length of context its
//!   match agrees over ([`propose`]; on SmolLM2 a first draft whose match agrees over 1 token
//!   was accepted 20-33% of the time, over 8 or more 95-100%), for a draft model one class.
//!   The counts are the engine's (every sequence's verified drafts), halved once a position
//!   has seen [`WINDOW`] drafts, so they follow the text being written.
//! - *Cost.* On a CPU a decode step is bound by reading the weights, so rows are cheap while
//!   the step is small, and cost compute once the matrix products are compute-bound. The step
//!   time relative to a one-row step, from measured steps ([`LOW_ROW_COST`], [`ROW_COST`]), is
//!   `T(R) = 1 + LOW_ROW_COST * (min(R, KNEE_ROWS) - 1) + ROW_COST * max(0, R - KNEE_ROWS)`
//!   for `R` rows.
//! - *Rule.* A row that adds `e` expected tokens for `dT` more time raises the step's tokens per
//!   second `E / T` if `e / dT > E / T`, i.e. if `e > dT * E / T(R)` ([`threshold`]), where `E`
//!   is the tokens the step is expected to give so far (one per decoding sequence plus the
//!   `e` of the drafts taken). Rows are handed out one at a time, always to the draft position
//!   with the highest `e` (the lowest sequence id among equals), while that `e` clears the
//!   threshold, `k` per sequence and `max_rows` a step at most ([`Acceptance::allocate`]).
//!   With one sequence the threshold starts at 0.04, so drafts of 4 go on whenever a match
//!   is likely at all; with 8 sequences (8 rows) at 0.44, so a match agreeing over 1 token
//!   (20-33%) drafts nothing; from about 11 sequences even an even chance does not pay;
//!   perfect drafts always pay.
//! - *Probes.* A class whose first draft never clears the threshold would never be measured
//!   again: every [`PROBE_EVERY`]-th proposal of a class turned down drafts its first token
//!   anyway, so a draft model or a kind of match that starts to agree is drafted again.
//!
//! Every input is a count of tokens, never a time, so greedy output is unchanged and a seeded
//! sampled run repeats itself. Drafts also count against the step's token budget and shrink
//! before a sequence would be preempted for their blocks (the scheduler's part).

use crate::config::named;
use std::path::PathBuf;

/// Rows (decode tokens plus drafts) a step verifies at most, by default. The curve the cost
/// model rests on: SmolLM2-135M at f32 on 2 shared Zen 4 cores (`examples/step_rows.rs`,
/// load 4), a decode step of 1, 4, 8, 16, 24 and 32 rows took 40, 49, 66, 81, 105 and 119 ms:
/// bound by reading the weights up to 6-8 rows, then about 4.5 ms a row. Past 16 rows nothing
/// was measured to pay, so this caps what the rule may hand out.
pub const VERIFY_ROWS: usize = 16;

/// Rows a step verifies at about the price of reading the weights once (see [`threshold`]).
pub const KNEE_ROWS: usize = 8;
/// What a row adds to a step below [`KNEE_ROWS`], relative to a one-row step: on a quiet
/// machine a one-row step took about 28 ms, an eight-row one (8 sequences) 35.4 ms.
pub const LOW_ROW_COST: f64 = 0.04;
/// What a row adds to a step beyond [`KNEE_ROWS`], relative to a one-row step: with 8
/// sequences, fixed drafts of 1-4 tokens made steps of 11.7 rows on average take 42.3 ms
/// against 35.4 ms for 8 rows (1.9 ms a row, quiet machine).
pub const ROW_COST: f64 = 0.07;
/// Counts a (class, position) keeps before they are halved.
pub const WINDOW: u32 = 64;
/// A class's first draft is drafted anyway after this many proposals turned down.
pub const PROBE_EVERY: u32 = 32;
/// Classes of proposal ([`class_of`]).
pub const CLASSES: usize = 8;

/// The class of a proposal whose match agrees over `context` tokens (0: no such signal, a
/// draft model's): 1, 2 and 3 tokens are classes 1-3, then 4-5, 6-7, 8-15 and 16 or more.
pub fn class_of(context: usize) -> usize {
    match context {
        0..=3 => context,
        4..=5 => 4,
        6..=7 => 5,
        8..=15 => 6,
        _ => 7,
    }
}

/// Step time at `rows` rows relative to a one-row step (the module comment's `T`).
pub fn step_time(rows: usize) -> f64 {
    let r = rows.max(1);
    1.0 + LOW_ROW_COST * (r.min(KNEE_ROWS) - 1) as f64
        + ROW_COST * r.saturating_sub(KNEE_ROWS) as f64
}

/// The expected accepted tokens a row must add to a step of `rows` rows that is expected to
/// give `tokens` tokens, to raise its tokens per second: `dT * tokens / T(rows)`, where `dT`
/// is the row's cost plus `extra` (a draft model's share of its call, see [`Acceptance`]).
pub fn threshold(rows: usize, tokens: f64, extra: f64) -> f64 {
    let dt = step_time(rows + 1) - step_time(rows) + extra;
    dt * tokens / step_time(rows)
}

/// Running acceptance counts of verified drafts, per class and draft position, and the rule
/// that sizes each sequence's draft from them (the module comment).
///
/// A draft model's draft token also costs a call of the draft model; one call drafts a position
/// for every sequence, so each row is charged `draft_cost / decoding sequences` on top, where
/// `draft_cost` is the draft's weights over the target's (both calls are bound by reading
/// them): 0.37 for SmolLM2's first 6 layers, 1 for the target itself, which then never pays.
#[derive(Clone, Debug)]
pub struct Acceptance {
    /// Positions per class (`k`).
    k: usize,
    /// A draft-model call's cost relative to a one-row step of the target (0: prompt lookup).
    draft_cost: f64,
    /// `[accepted, tested]` at class `c`, position `d` (0-based) at `c * k + d`: a position
    /// is tested when every draft before it was accepted.
    counts: Vec<[u32; 2]>,
    /// Per class, proposals turned down since its last first draft.
    turned_down: [u32; CLASSES],
}

impl Acceptance {
    pub fn new(k: usize, draft_cost: f64) -> Acceptance {
        Acceptance {
            k,
            draft_cost,
            counts: vec![[0, 0]; CLASSES * k],
            turned_down: [0; CLASSES],
        }
    }

    /// The acceptance rate of position `d` (0-based) of class `c`, given those before it were
    /// accepted: `(accepted + 2) / (tested + 3)`, so an unmeasured position starts at 2/3.
    pub fn rate(&self, c: usize, d: usize) -> f64 {
        let [a, n] = self.counts[c * self.k + d];
        (a as f64 + 2.0) / (n as f64 + 3.0)
    }

    /// Records a verified draft of class `c`: `drafted` tokens, the first `accepted` of them
    /// accepted, and whether the next one (if any was drafted) was rejected (else verification
    /// stopped at an end of the output before it).
    pub fn record(&mut self, c: usize, drafted: usize, accepted: usize, rejected: bool) {
        let tested = (accepted + usize::from(rejected && accepted < drafted)).min(self.k);
        for d in 0..tested {
            let cell = &mut self.counts[c * self.k + d];
            if cell[1] >= WINDOW {
                *cell = [cell[0] / 2, cell[1] / 2];
            }
            cell[0] += u32::from(d < accepted);
            cell[1] += 1;
        }
    }

    /// Draft lengths for `proposals` (each a class and the most drafts it has, in a fixed
    /// order) when `decoding` sequences decode and a step verifies `max_rows` rows at most: rows
    /// go one at a time to the draft position with the highest expected acceptance while it
    /// clears [`threshold`]; then a class turned down [`PROBE_EVERY`] times gets one draft.
    pub fn allocate(
        &mut self,
        proposals: &[(usize, usize)],
        decoding: usize,
        max_rows: usize,
    ) -> Vec<usize> {
        let mut len = vec![0usize; proposals.len()];
        // The probability that each proposal's next draft position (and those before) is
        // accepted.
        let mut next: Vec<f64> = proposals.iter().map(|&(c, _)| self.rate(c, 0)).collect();
        let mut rows = decoding.max(1);
        let mut tokens = rows as f64;
        let extra = self.draft_cost / rows as f64;
        while rows < max_rows {
            let best = (0..proposals.len())
                .filter(|&i| len[i] < proposals[i].1.min(self.k))
                .fold(None, |b: Option<usize>, i| match b {
                    Some(j) if next[j] >= next[i] => Some(j),
                    _ => Some(i),
                });
            let Some(i) = best else { break };
            let e = next[i];
            if e < threshold(rows, tokens, extra) {
                break;
            }
            len[i] += 1;
            rows += 1;
            tokens += e;
            if len[i] < self.k {
                next[i] = e * self.rate(proposals[i].0, len[i]);
            }
        }
        for (i, &(c, most)) in proposals.iter().enumerate() {
            if len[i] > 0 || most == 0 {
                continue;
            }
            self.turned_down[c] += 1;
            if self.turned_down[c] >= PROBE_EVERY && rows < max_rows {
                len[i] = 1;
                rows += 1;
            }
        }
        for (i, &(c, _)) in proposals.iter().enumerate() {
            if len[i] > 0 {
                self.turned_down[c] = 0;
            }
        }
        len
    }
}

/// How drafts are made.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpeculativeMethod {
    /// N-gram lookup in the sequence's own prompt and output.
    PromptLookup,
    /// A small model sharing the target's tokenizer drafts greedily
    /// ([`SpeculativeConfig::draft_model`]).
    Draft,
}

named!(SpeculativeMethod, "speculative method", {
    PromptLookup => "prompt-lookup",
    Draft => "draft",
});

/// How long each sequence's draft is (`--speculative-draft-length`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftLength {
    /// As long as its expected acceptance pays for ([`Acceptance::allocate`]).
    Adaptive,
    /// `k` for every sequence, within the row limit: with `b` decoding sequences
    /// `min(k, max_rows / b - 1)` ([`SpeculativeConfig::fixed_len`]).
    Fixed,
}

named!(DraftLength, "draft length", { Adaptive => "adaptive", Fixed => "fixed" });

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
    /// How each draft's length is chosen.
    pub draft_length: DraftLength,
}

impl SpeculativeConfig {
    /// [`DraftLength::Fixed`]'s drafts for each of `decoding` sequences.
    pub fn fixed_len(&self, decoding: usize) -> usize {
        self.num_tokens
            .min((self.max_rows / decoding.max(1)).saturating_sub(1))
    }
}

/// Longest context a candidate match is compared over (tokens before and including its n-gram);
/// see [`propose`]. Beyond 8 tokens no grounded prompt of the benchmark chose differently.
pub const MAX_CONTEXT: usize = 32;

/// Prompt lookup: for `n` from `max_ngram` down to 1, the earlier occurrences of the last `n`
/// tokens of `tokens`; of them, the one whose preceding tokens agree longest with those before
/// the tail (compared over at most [`MAX_CONTEXT`] tokens), the latest of equals; and the `k`
/// tokens that follow it, with how many tokens that occurrence agrees over (its n-gram and
/// the context before it: the proposal's confidence, [`class_of`]). Empty (and 0) when nothing
/// matches.
///
/// Why the longest context: a text that repeats a phrase (a code's `let`, a list's "- ") has
/// many occurrences of a short tail; the one whose longer context also agrees is the place being
/// copied. On the benchmark's grounded prompts this takes 6% fewer steps than the latest match
/// (and 12% fewer than the earliest) at the same `n` and `k`.
///
/// Why `k` tokens even when fewer follow the match: an occurrence `p` tokens before the tail
/// says the text repeats with period `p`, so the copy goes on through the tokens it proposes
/// (as an LZ77 copy may overlap its own output): `[a, b, a, b, a]` proposes `b, a, b, a`, not
/// the one token after the match. A model stuck in a loop (a list of the same line, a run of
/// `#`) is then verified `k` tokens a step. On the benchmark's eight grounded prompts this
/// took 519 steps to 507 (the third prompt, whose output loops over 2 tokens, 69 to 57).
pub fn propose(tokens: &[u32], max_ngram: usize, k: usize) -> (Vec<u32>, usize) {
    let len = tokens.len();
    if k == 0 {
        return (Vec::new(), 0);
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
        if let Some((agree, i)) = best {
            // The occurrence ends before the tail does (`from < len`): the text from `from`
            // on repeats with period `len - from`, and the copy goes round it.
            let from = i + n;
            let period = len - from;
            let draft = (0..k).map(|j| tokens[from + j % period]).collect();
            return (draft, agree);
        }
    }
    (Vec::new(), 0)
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
        assert_eq!(propose(&t, 3, 2).0, &[7, 8]);
        // The match at 5 is 6 tokens before the tail: the 6 tokens after it, then the copy
        // repeats its own first 4.
        assert_eq!(propose(&t, 3, 10).0, &[7, 8, 5, 2, 1, 2, 7, 8, 5, 2]);
        // With n = 1 only: [2] occurs at 1, 6 and 10. The tail is preceded by 1, as are the
        // ones at 1 and 6 (the one at 10 by 5); then 2 against 9 at 6, and nothing before 1:
        // both agree over 2 tokens, the later (6) wins, followed by 7, 8, 5.
        assert_eq!(propose(&t, 1, 3).0, &[7, 8, 5]);
    }

    #[test]
    fn the_occurrence_with_the_longest_agreeing_context_wins() {
        // The tail [1, 2, 3] (at 23, preceded by 31, 4, 5) occurs at 2 (preceded by 6: agrees
        // over 3 tokens), at 9 (preceded by 11, 4, 5: 5 tokens) and at 16 (preceded by 8, 5: 4
        // tokens). The one at 9 wins over both the earliest and the latest.
        let t = [
            9, 6, 1, 2, 3, 10, 11, 4, 5, 1, 2, 3, 20, 21, 8, 5, 1, 2, 3, 30, 31, 4, 5, 1, 2, 3,
        ];
        assert_eq!(propose(&t, 3, 4).0, &[20, 21, 8, 5]);
        assert_eq!(propose(&t, 3, 10).0, &[20, 21, 8, 5, 1, 2, 3, 30, 31, 4]);
        // Under n = 2 the candidates are the same places (the tail [2, 3] occurs only there).
        assert_eq!(propose(&t, 2, 2).0, &[20, 21]);
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
        assert_eq!(propose(&t, 3, 3).0, &[2, 200, 201]);
    }

    #[test]
    fn falls_back_to_shorter_ngrams_and_proposes_nothing_without_a_match() {
        // [4, 5] never occurred before; [5] did, followed by 6.
        assert_eq!(propose(&[5, 6, 7, 4, 5], 3, 2).0, &[6, 7]);
        assert!(propose(&[1, 2, 3, 4], 3, 4).0.is_empty());
        assert!(propose(&[1], 3, 4).0.is_empty());
        assert!(propose(&[], 3, 4).0.is_empty());
        assert!(propose(&[1, 1, 1], 3, 0).0.is_empty());
        // A run of one token: the earlier [1, 1] at 1 agrees over 3 tokens (the one at 0 over
        // 2); one token follows it, and the run goes on for all 5.
        assert_eq!(propose(&[1, 1, 1, 1], 2, 5).0, &[1; 5]);
    }

    #[test]
    fn a_match_near_the_end_is_copied_on_with_its_period() {
        // [a, b, a] at 0 is 2 tokens before the tail: b, a follow it, then b, a again.
        assert_eq!(
            propose(&[10, 11, 10, 11, 10], 3, 4),
            (vec![11, 10, 11, 10], 3)
        );
        // Period 3 through the 1-gram [12] (n = 1 only): 10, 11, 12 follow it, then again.
        assert_eq!(
            propose(&[10, 11, 12, 10, 11, 12], 1, 7).0,
            &[10, 11, 12, 10, 11, 12, 10]
        );
        // A match far from the end needs no extension: the tokens after it.
        assert_eq!(propose(&[5, 6, 7, 8, 9, 5], 3, 3).0, &[6, 7, 8]);
    }

    #[test]
    fn a_match_agreeing_longer_is_a_higher_class() {
        // [9, 1, 2] agrees over 3 tokens with the tail [9, 1, 2]: class 3.
        assert_eq!(propose(&[9, 1, 2, 5, 9, 1, 2], 3, 1), (vec![5], 3));
        // No match: no draft, no context.
        assert_eq!(propose(&[1, 2, 3], 3, 2), (vec![], 0));
        let want = [0, 1, 2, 3, 4, 4, 5, 5, 6, 6, 6, 6, 6, 6, 6, 6, 7, 7, 7];
        let got: Vec<usize> = (0..want.len()).map(class_of).collect();
        assert_eq!(got, want);
        assert_eq!(class_of(usize::MAX), CLASSES - 1);
    }

    #[test]
    fn the_cost_model_and_its_threshold_by_hand() {
        // T(R) = 1 + 0.04 (min(R, 8) - 1) + 0.07 max(0, R - 8).
        let close = |a: f64, b: f64| (a - b).abs() < 1e-12;
        assert!(close(step_time(1), 1.0));
        assert!(close(step_time(0), 1.0));
        assert!(close(step_time(4), 1.12));
        assert!(close(step_time(8), 1.28));
        assert!(close(step_time(10), 1.42));
        // One sequence: a row costs 4% of the step, which gives 1 token.
        assert!(close(threshold(1, 1.0, 0.0), 0.04));
        // Eight sequences at the knee: 0.07 * 8 / 1.28.
        assert!(close(threshold(8, 8.0, 0.0), 0.56 / 1.28));
        // Seven rows: the eighth is still below the knee.
        assert!(close(threshold(7, 7.0, 0.0), 0.04 * 7.0 / 1.24));
        // A draft model at 0.37 of the target, its call shared by 2 sequences: (0.04 + 0.185)
        // * 2 / 1.04.
        assert!(close(threshold(2, 2.0, 0.185), 0.225 * 2.0 / 1.04));
    }

    #[test]
    fn acceptance_counts_only_the_positions_verified() {
        let mut a = Acceptance::new(4, 0.0);
        assert_eq!(a.rate(7, 0), 2.0 / 3.0);
        // 4 drafted, the first accepted, the second rejected: positions 3 and 4 untested.
        a.record(7, 4, 1, true);
        assert_eq!(a.rate(7, 0), 3.0 / 4.0);
        assert_eq!(a.rate(7, 1), 2.0 / 4.0);
        assert_eq!(a.rate(7, 2), 2.0 / 3.0);
        // 3 drafted, 1 accepted, then the output ended (no rejection): only position 1.
        a.record(7, 3, 1, false);
        assert_eq!(a.rate(7, 0), 4.0 / 5.0);
        assert_eq!(a.rate(7, 1), 2.0 / 4.0);
        // All accepted.
        a.record(7, 2, 2, false);
        assert_eq!(a.rate(7, 0), 5.0 / 6.0);
        assert_eq!(a.rate(7, 1), 3.0 / 5.0);
        // Other classes are untouched.
        assert_eq!(a.rate(6, 0), 2.0 / 3.0);
        // A position that saw WINDOW drafts is halved before the next one counts.
        let mut b = Acceptance::new(1, 0.0);
        for _ in 0..WINDOW {
            b.record(2, 1, 1, false);
        }
        assert_eq!(b.rate(2, 0), 66.0 / 67.0);
        b.record(2, 1, 0, true);
        assert_eq!(b.rate(2, 0), 34.0 / 36.0);
    }

    /// Class 3 accepted half of its first drafts and almost none of its second.
    fn half_first(k: usize) -> Acceptance {
        let mut a = Acceptance::new(k, 0.0);
        for _ in 0..30 {
            a.record(3, 4, 0, true);
            a.record(3, 4, 1, true);
        }
        a
    }

    #[test]
    fn drafts_shrink_as_the_batch_grows() {
        let a = half_first(4);
        // First position 32/63, second 2/33: e = 0.508, then 0.031.
        assert_eq!(a.rate(3, 0), 32.0 / 63.0);
        assert_eq!(a.rate(3, 1), 2.0 / 33.0);
        let lens = |b: usize| a.clone().allocate(&vec![(3, 4); b], b, 64);
        // One sequence: 0.508 >= 0.04 (T(1) = 1); then 0.031 < 0.04 * 1.508 / 1.04 = 0.058.
        assert_eq!(lens(1), vec![1]);
        // Four: thresholds 0.04 * E / T(R) for R = 4..7, at most 0.04 * 5.52 / 1.24 = 0.18.
        assert_eq!(lens(4), vec![1; 4]);
        // Eight: 0.07 * 8 / 1.28 = 0.44 for the first, and after m more drafts
        // 0.07 (8 + 0.508 m) / (1.28 + 0.07 m), 0.46 at m = 7: all below 0.508.
        assert_eq!(lens(8), vec![1; 8]);
        // Eleven: 0.07 * 11 / T(11) = 0.77 / 1.49 = 0.517 > 0.508.
        assert_eq!(lens(11), vec![0; 11]);
        // The row cap binds first: no row left beside the sequence's own.
        assert_eq!(a.clone().allocate(&[(3, 4)], 1, 1), vec![0]);
        // No proposal (0 tokens), no draft.
        assert_eq!(a.clone().allocate(&[(3, 0)], 1, 64), vec![0]);
    }

    #[test]
    fn rows_go_to_the_likeliest_drafts_first() {
        let mut a = half_first(4);
        // Class 7 accepted everything 60 times: each position 62/63.
        for _ in 0..60 {
            a.record(7, 4, 4, false);
        }
        let r = 62.0 / 63.0;
        assert_eq!(a.rate(7, 3), r);
        // Eight sequences, alternating classes 3 and 7. Class 7's positions have e = r, r^2,
        // r^3, r^4 (0.98 to 0.94): taken in that order over the sequences (the lowest index
        // first among equals) until the cap of 16 rows, before class 3's 0.508.
        let p: Vec<(usize, usize)> = (0..8)
            .map(|i| (if i % 2 == 0 { 3 } else { 7 }, 4))
            .collect();
        assert_eq!(a.clone().allocate(&p, 8, 16), vec![0, 2, 0, 2, 0, 2, 0, 2]);
        // 14 rows: 6 drafts, the four first positions and then two second ones.
        assert_eq!(a.clone().allocate(&p, 8, 14), vec![0, 2, 0, 2, 0, 1, 0, 1]);
        // Without the cap all 16: at 24 rows E = 8 + 4 (r + r^2 + r^3 + r^4) = 23.6 and the
        // threshold 0.07 * 23.6 / T(24) = 0.69 (T(24) = 2.40) is below r^4 = 0.94, and
        // above class 3's 0.508.
        assert_eq!(a.clone().allocate(&p, 8, 64), vec![0, 4, 0, 4, 0, 4, 0, 4]);
        // A proposal of 2 tokens drafts at most 2; k = 4 caps a longer one.
        assert_eq!(a.clone().allocate(&[(7, 2), (7, 9)], 2, 64), vec![2, 4]);
    }

    #[test]
    fn a_draft_model_pays_for_its_calls() {
        // Fresh counts (2/3, 4/9, 8/27): prompt lookup drafts 3 at batch 1 (thresholds 0.04,
        // 0.064, 0.078); a draft at 0.37 of the target only where e clears (0.04 + 0.37) E / T:
        // 0.41 for the first, 0.41 * 1.67 / 1.04 = 0.66 > 4/9 for the second.
        assert_eq!(Acceptance::new(3, 0.0).allocate(&[(0, 3)], 1, 16), vec![3]);
        assert_eq!(Acceptance::new(3, 0.37).allocate(&[(0, 3)], 1, 16), vec![1]);
        // The target as its own draft: a call costs a step, so no e < 1 pays.
        assert_eq!(Acceptance::new(3, 1.0).allocate(&[(0, 3)], 1, 16), vec![0]);
        // Four sequences share a call: (0.04 + 0.0925) * E / T(R) for R = 4..7 is 0.47, 0.53,
        // 0.59, 0.64 < 2/3; at 8 rows (0.07 + 0.0925) * 6.67 / 1.28 = 0.85 > 4/9.
        let four = Acceptance::new(3, 0.37).allocate(&[(0, 3); 4], 4, 16);
        assert_eq!(four, vec![1; 4]);
    }

    #[test]
    fn a_class_turned_down_is_probed_now_and_then() {
        // A draft model whose drafts are never accepted: its first position at 2/63.
        let mut a = Acceptance::new(3, 0.0);
        for _ in 0..60 {
            a.record(0, 3, 0, true);
        }
        assert_eq!(a.rate(0, 0), 2.0 / 63.0);
        // One sequence: 0.032 < 0.04, turned down 31 times, drafted once on the 32nd.
        for i in 1..PROBE_EVERY {
            assert_eq!(a.allocate(&[(0, 3)], 1, 16), vec![0], "call {i}");
        }
        assert_eq!(a.allocate(&[(0, 3)], 1, 16), vec![1]);
        assert_eq!(a.allocate(&[(0, 3)], 1, 16), vec![0]);
        // Two sequences share the class's count: 16 calls turn 32 proposals down, the last
        // probe goes to the second sequence (the 32nd turned down), within the row cap.
        let mut b = a.clone();
        b.turned_down = [0; CLASSES];
        for _ in 1..PROBE_EVERY / 2 {
            assert_eq!(b.allocate(&[(0, 3), (0, 3)], 2, 16), vec![0, 0]);
        }
        assert_eq!(b.allocate(&[(0, 3), (0, 3)], 2, 16), vec![0, 1]);
        // No row left: no probe.
        let mut c = a.clone();
        c.turned_down = [PROBE_EVERY; CLASSES];
        assert_eq!(c.allocate(&[(0, 3)], 1, 1), vec![0]);
        // Once the drafts are accepted again the class drafts on its own.
        for _ in 0..60 {
            a.record(0, 3, 3, false);
        }
        assert_eq!(a.allocate(&[(0, 3)], 1, 16), vec![3]);
    }

    #[test]
    fn fixed_drafts_shrink_to_zero_as_the_batch_grows() {
        let c = SpeculativeConfig {
            method: SpeculativeMethod::PromptLookup,
            draft_model: None,
            num_tokens: 4,
            max_ngram: 3,
            max_rows: VERIFY_ROWS,
            draft_length: DraftLength::Fixed,
        };
        // By hand: 16 / b - 1 (integer division) drafts, at most k = 4; no decoding sequence
        // counts as one.
        let got: Vec<usize> = (0..=17).map(|b| c.fixed_len(b)).collect();
        let want = [4, 4, 4, 4, 3, 2, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        assert_eq!(got, want);
    }

    #[test]
    fn method_names() {
        assert_eq!("fixed".parse(), Ok(DraftLength::Fixed));
        assert_eq!("adaptive".parse(), Ok(DraftLength::Adaptive));
        assert!("auto".parse::<DraftLength>().is_err());
        assert_eq!("prompt-lookup".parse(), Ok(SpeculativeMethod::PromptLookup));
        assert_eq!("draft".parse(), Ok(SpeculativeMethod::Draft));
        assert!("eagle".parse::<SpeculativeMethod>().is_err());
    }
}
