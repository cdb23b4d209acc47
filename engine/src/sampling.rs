//! Choosing the next token from a row of logits: greedy, or temperature with top-k and top-p,
//! from a seeded generator (same seed, same tokens, on every machine: the generator is the
//! project's SplitMix64, whose stream does not depend on a crate's version).

use paged_attention::cache::SplitMix64;

/// How a sequence samples.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sampling {
    /// 0: greedy (the first largest logit).
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p` (1: all).
    pub top_p: f32,
}

impl Default for Sampling {
    fn default() -> Sampling {
        Sampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
        }
    }
}

impl Sampling {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }
}

/// What a sequence's own tokens do to its logits before sampling, as OpenVINO GenAI applies them
/// (neutral by default). Applied in this order: repetition, presence, frequency, then the bias.
#[derive(Clone, Debug, PartialEq)]
pub struct Penalties {
    /// Each distinct token of the prompt or of the output so far, once: a logit >= 0 is divided
    /// by it, a negative one multiplied (1: none).
    pub repetition: f32,
    /// Each distinct token of the output so far (not the prompt), once: moved toward 0 by it (a
    /// logit >= 0 lowered, a negative one raised, as GenAI does).
    pub presence: f32,
    /// Each token of the output so far, by its count: moved toward 0 by it times the count.
    pub frequency: f32,
    /// Added to the logit of a token, after the penalties: (token, bias), tokens distinct.
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for Penalties {
    fn default() -> Penalties {
        Penalties {
            repetition: 1.0,
            presence: 0.0,
            frequency: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

impl Penalties {
    /// Whether these change nothing.
    pub fn is_neutral(&self) -> bool {
        !self.uses_prompt()
            && self.presence == 0.0
            && self.frequency == 0.0
            && self.logit_bias.is_empty()
    }

    /// Whether the prompt's tokens matter (the repetition penalty counts them).
    pub fn uses_prompt(&self) -> bool {
        self.repetition != 1.0
    }

    /// Applies these to `logits` of a sequence whose prompt has the distinct, sorted tokens
    /// `prompt` and whose output so far is `generated`; `counts` is reused between calls. The
    /// arithmetic is GenAI's: in f64 on the f32 logit, rounded back to f32. Ids outside `logits`
    /// are skipped (the engine refuses them before).
    pub fn apply(
        &self,
        logits: &mut [f32],
        prompt: &[u32],
        generated: &[u32],
        counts: &mut Vec<(u32, u32)>,
    ) {
        counts.clear();
        if self.uses_prompt() || self.presence != 0.0 || self.frequency != 0.0 {
            counts.extend(generated.iter().map(|&t| (t, 1)));
            counts.sort_unstable();
            counts.dedup_by(|b, a| {
                let same = a.0 == b.0;
                if same {
                    a.1 += 1;
                }
                same
            });
        }
        let toward_zero = |v: &mut f32, by: f64| {
            let x = *v as f64;
            *v = if x >= 0.0 { x - by } else { x + by } as f32;
        };
        if self.uses_prompt() {
            let r = self.repetition as f64;
            let penalize = |v: &mut f32| {
                let x = *v as f64;
                *v = if x >= 0.0 { x / r } else { x * r } as f32;
            };
            for &t in prompt {
                if let Some(v) = logits.get_mut(t as usize) {
                    penalize(v);
                }
            }
            for &(t, _) in counts.iter() {
                if prompt.binary_search(&t).is_err() {
                    if let Some(v) = logits.get_mut(t as usize) {
                        penalize(v);
                    }
                }
            }
        }
        if self.presence != 0.0 {
            for &(t, _) in counts.iter() {
                if let Some(v) = logits.get_mut(t as usize) {
                    toward_zero(v, self.presence as f64);
                }
            }
        }
        if self.frequency != 0.0 {
            for &(t, n) in counts.iter() {
                if let Some(v) = logits.get_mut(t as usize) {
                    toward_zero(v, self.frequency as f64 * n as f64);
                }
            }
        }
        for &(t, b) in &self.logit_bias {
            if let Some(v) = logits.get_mut(t as usize) {
                *v += b;
            }
        }
    }
}

/// The most top log-probabilities a token can ask for (OpenAI's `top_logprobs` range).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// A token's log-probability in a logits row (the row's log-softmax, before any sampling
/// modifier), and the row's most likely tokens with theirs.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub token: u32,
    pub logprob: f32,
    /// The `n` most likely tokens of the row, most likely first (ties by id).
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability in `row` and the row's `top_n` most likely tokens. The log-sum-exp
/// is summed in f64 from the largest logit, so no term overflows and no small one is lost; NaN
/// logits take no part (their own log-probability is NaN). `scratch` is reused between calls.
pub fn logprobs(
    row: &[f32],
    token: u32,
    top_n: usize,
    scratch: &mut Vec<(f32, u32)>,
) -> TokenLogprobs {
    let max = row
        .iter()
        .copied()
        .filter(|v| !v.is_nan())
        .fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = row
        .iter()
        .filter(|v| !v.is_nan())
        .map(|&v| (v as f64 - max).exp())
        .sum();
    let lse = max + sum.ln();
    let lp = |v: f32| (v as f64 - lse) as f32;
    let mut top = Vec::new();
    let n = top_n.min(row.len());
    if n > 0 {
        scratch.clear();
        scratch.extend(
            row.iter()
                .enumerate()
                .filter(|(_, v)| !v.is_nan())
                .map(|(i, &v)| (v, i as u32)),
        );
        let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        let n = n.min(scratch.len());
        if n > 0 && n < scratch.len() {
            scratch.select_nth_unstable_by(n - 1, by_logit);
        }
        scratch.truncate(n);
        scratch.sort_unstable_by(by_logit);
        top.extend(scratch.iter().map(|&(v, i)| (i, lp(v))));
    }
    TokenLogprobs {
        token,
        logprob: row
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&v| lp(v)),
        top,
    }
}

/// Index of the first largest value (NaN never wins; 0 when no value exceeds -inf).
///
/// Two passes the compiler vectorises: the largest value, kept per lane of [`ARGMAX_LANES`]
/// (a lane keeps its value unless a larger one comes, so NaN never enters), then the first index
/// holding it. A single pass carrying the index is one serial compare chain: on a 49,152-token
/// vocabulary it took several times as long, and greedy speculative decoding runs it on every
/// verified row.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut lanes = [f32::NEG_INFINITY; ARGMAX_LANES];
    let chunks = logits.chunks_exact(ARGMAX_LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let best = lanes
        .iter()
        .chain(tail)
        .fold(f32::NEG_INFINITY, |m, &v| if v > m { v } else { m });
    if best == f32::NEG_INFINITY {
        return 0;
    }
    // `best` is a value of the row, so it is found; -0.0 and 0.0 are equal, as the rule has it.
    logits.iter().position(|&v| v == best).unwrap_or(0) as u32
}

/// Lanes of [`argmax`]'s first pass: 16 f32 fill one AVX-512 register or four SSE ones.
const ARGMAX_LANES: usize = 16;

/// The next token of `logits` under `s`, drawing from `rng` unless greedy. `scratch` is reused
/// between calls.
pub fn sample(
    logits: &[f32],
    s: &Sampling,
    rng: &mut SplitMix64,
    scratch: &mut Vec<(f32, u32)>,
) -> u32 {
    if s.is_greedy() || logits.len() <= 1 {
        return argmax(logits);
    }
    let Some(probs) = distribution(logits, s, scratch) else {
        return 0;
    };
    draw(&probs, scratch, rng.next_f64() * probs.iter().sum::<f64>())
}

/// The sampling distribution of `logits` under `s` (temperature, top-k, top-p): the kept tokens,
/// most likely first, in `scratch`, and their unnormalised weights. `None` when every logit is
/// NaN.
fn distribution(logits: &[f32], s: &Sampling, scratch: &mut Vec<(f32, u32)>) -> Option<Vec<f64>> {
    scratch.clear();
    scratch.extend(
        logits
            .iter()
            .enumerate()
            // -inf (a token masked out) has probability 0: left out, the sort stays short.
            .filter(|(_, v)| !v.is_nan() && **v != f32::NEG_INFINITY)
            .map(|(i, &v)| (v, i as u32)),
    );
    if scratch.is_empty() {
        return None;
    }
    // Most likely first; ties by token id, so the order (and the draw) is deterministic.
    let by_logit = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let k = if s.top_k == 0 {
        scratch.len()
    } else {
        s.top_k.min(scratch.len())
    };
    if k < scratch.len() {
        scratch.select_nth_unstable_by(k - 1, by_logit);
        scratch.truncate(k);
    }
    scratch.sort_unstable_by(by_logit);
    let inv_t = 1.0 / s.temperature as f64;
    let top = scratch[0].0 as f64;
    let mut probs: Vec<f64> = scratch
        .iter()
        .map(|&(v, _)| ((v as f64 - top) * inv_t).exp())
        .collect();
    let total: f64 = probs.iter().sum();
    let mut keep = probs.len();
    if s.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, p) in probs.iter().enumerate() {
            cum += p / total;
            if cum >= s.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
    }
    probs.truncate(keep);
    scratch.truncate(keep);
    Some(probs)
}

/// The token at `u` (in `[0, sum of probs)`) of the weights `probs` over `tokens`.
fn draw(probs: &[f64], tokens: &[(f32, u32)], mut u: f64) -> u32 {
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return tokens[i].1;
        }
        u -= p;
    }
    tokens[probs.len() - 1].1
}

/// Verifies a draft token against the target's `logits` (speculative decoding): `None` when
/// `draft` is accepted, else the token to emit in its place. Greedy: accepted when it is the
/// argmax, else the argmax. Sampling: the speculative-sampling rule for a draft drawn from a
/// point mass (prompt lookup): accepted with probability `p(draft)` under `s`; on rejection the
/// token comes from the residual `p` without `draft`, renormalised. Either way the emitted token
/// is distributed as `p`, as if sampled directly.
pub fn verify_draft(
    logits: &[f32],
    s: &Sampling,
    draft: u32,
    rng: &mut SplitMix64,
    scratch: &mut Vec<(f32, u32)>,
) -> Option<u32> {
    if s.is_greedy() || logits.len() <= 1 {
        let best = argmax(logits);
        return (best != draft).then_some(best);
    }
    let mut probs = distribution(logits, s, scratch)?;
    let total: f64 = probs.iter().sum();
    let at = scratch.iter().position(|&(_, t)| t == draft);
    let p_draft = at.map_or(0.0, |i| probs[i] / total);
    if rng.next_f64() < p_draft {
        return None;
    }
    if let Some(i) = at {
        probs[i] = 0.0;
    }
    let rest: f64 = probs.iter().sum();
    Some(draw(&probs, scratch, rng.next_f64() * rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_takes_the_first_largest_and_ignores_nan() {
        assert_eq!(argmax(&[1.0, 3.0, f32::NAN, 3.0]), 1);
        let mut rng = SplitMix64::new(1);
        let mut scratch = Vec::new();
        assert_eq!(
            sample(
                &[0.0, 5.0, 1.0],
                &Sampling::default(),
                &mut rng,
                &mut scratch
            ),
            1
        );
    }

    #[test]
    fn argmax_is_the_first_largest_on_long_rows() {
        // The rule written out plainly: the first index whose value is not NaN and is not
        // below any other non-NaN value; 0 when every value is NaN or -inf.
        fn first_largest(v: &[f32]) -> u32 {
            let top = v
                .iter()
                .filter(|x| !x.is_nan())
                .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            if top == f32::NEG_INFINITY {
                return 0;
            }
            v.iter().position(|&x| x == top).unwrap() as u32
        }
        let mut rng = SplitMix64::new(7);
        for len in [1, 15, 16, 17, 33, 100, 49_152 + 5] {
            let mut v: Vec<f32> = (0..len)
                .map(|_| (rng.next_f64() * 20.0 - 10.0) as f32)
                .collect();
            assert_eq!(argmax(&v), first_largest(&v), "len {len}");
            // Ties in different lanes and in the tail: the first one wins.
            let (a, b) = (len / 3, len - 1);
            v[a] = 50.0;
            v[b] = 50.0;
            assert_eq!(argmax(&v), first_largest(&v), "len {len}, tie");
            assert_eq!(argmax(&v), a as u32);
            // NaN never wins, wherever it sits.
            v[0] = f32::NAN;
            v[len / 2] = f32::NAN;
            assert_eq!(argmax(&v), first_largest(&v), "len {len}, NaN");
            v.iter_mut().for_each(|x| *x = f32::NEG_INFINITY);
            assert_eq!(argmax(&v), 0);
            v[len - 1] = -1e30;
            assert_eq!(argmax(&v), (len - 1) as u32);
            v.iter_mut().for_each(|x| *x = f32::NAN);
            assert_eq!(argmax(&v), 0);
        }
        assert_eq!(argmax(&[]), 0);
        assert_eq!(argmax(&[-0.0, 0.0, 0.0]), 0);
        // Masked logits (structured output): only the allowed token is finite.
        let mut m = vec![f32::NEG_INFINITY; 40];
        m[37] = -3.0;
        assert_eq!(argmax(&m), 37);
    }

    #[test]
    fn top_k_1_and_tiny_top_p_are_greedy_and_seeds_repeat() {
        let logits: Vec<f32> = (0..50).map(|i| ((i * 37) % 11) as f32 * 0.3).collect();
        let best = argmax(&logits);
        let mut scratch = Vec::new();
        for seed in 0..20 {
            let mut rng = SplitMix64::new(seed);
            let k1 = Sampling {
                temperature: 1.0,
                top_k: 1,
                top_p: 1.0,
            };
            assert_eq!(sample(&logits, &k1, &mut rng, &mut scratch), best);
            let p0 = Sampling {
                temperature: 1.0,
                top_k: 0,
                top_p: 1e-6,
            };
            assert_eq!(sample(&logits, &p0, &mut rng, &mut scratch), best);
        }
        let s = Sampling {
            temperature: 0.8,
            top_k: 10,
            top_p: 0.9,
        };
        let draw = |seed| {
            let mut rng = SplitMix64::new(seed);
            let mut scratch = Vec::new();
            (0..30)
                .map(|_| sample(&logits, &s, &mut rng, &mut scratch))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn frequencies_follow_the_softmax() {
        // Two tokens with logits ln 3 and 0: probabilities 3/4 and 1/4 at temperature 1.
        let logits = [3f32.ln(), 0.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        };
        let mut rng = SplitMix64::new(3);
        let mut scratch = Vec::new();
        let n = 20000;
        let zeros = (0..n)
            .filter(|_| sample(&logits, &s, &mut rng, &mut scratch) == 0)
            .count();
        let f = zeros as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.015, "{f}");
        // top_p 0.7 keeps only the first token.
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.7,
        };
        assert!((0..200).all(|_| sample(&logits, &s, &mut rng, &mut scratch) == 0));
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_top_is_sorted_with_ties_by_id() {
        // A plain f64 log-softmax of the row, written from its definition.
        let row = [1.0f32, 3.0, -2.0, 3.0, 0.5];
        let z: f64 = row.iter().map(|&v| (v as f64).exp()).sum();
        let want = |i: usize| ((row[i] as f64).exp() / z).ln() as f32;
        let lp = logprobs(&row, 2, 3, &mut Vec::new());
        assert_eq!(lp.token, 2);
        assert!(
            (lp.logprob - want(2)).abs() < 1e-6,
            "{} vs {}",
            lp.logprob,
            want(2)
        );
        let ids: Vec<u32> = lp.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [1, 3, 0], "most likely first, the tie 1 = 3 by id");
        for &(i, v) in &lp.top {
            assert!((v - want(i as usize)).abs() < 1e-6);
        }
        let p: f64 = (0..row.len()).map(|i| (want(i) as f64).exp()).sum();
        assert!((p - 1.0).abs() < 1e-6);
        // No top asked: none computed; more than the row: the whole row.
        assert!(logprobs(&row, 0, 0, &mut Vec::new()).top.is_empty());
        assert_eq!(logprobs(&row, 0, 50, &mut Vec::new()).top.len(), 5);
    }

    #[test]
    fn logprobs_stay_finite_for_huge_logits_and_skip_nan() {
        // exp(1000) overflows f64: the sum must start from the largest logit.
        let row = [1000.0f32, 1000.0, f32::NAN, -1000.0];
        let lp = logprobs(&row, 1, 2, &mut Vec::new());
        assert!(
            (lp.logprob - (-std::f32::consts::LN_2)).abs() < 1e-6,
            "{}",
            lp.logprob
        );
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [0, 1]);
        assert!(logprobs(&row, 2, 0, &mut Vec::new()).logprob.is_nan());
        assert!(logprobs(&row, 3, 0, &mut Vec::new()).logprob < -1999.0);
    }

    #[test]
    fn repetition_divides_positive_multiplies_negative_once_per_token() {
        // Prompt {1, 2}, output [2, 3, 3]: tokens 1, 2, 3 each penalized once.
        let p = Penalties {
            repetition: 2.0,
            ..Penalties::default()
        };
        let mut l = [4.0, 4.0, -4.0, 3.0, 5.0];
        p.apply(&mut l, &[1, 2], &[2, 3, 3], &mut Vec::new());
        assert_eq!(l, [4.0, 2.0, -8.0, 1.5, 5.0]);
        // 0 counts as positive: it stays 0.
        let mut l = [0.0f32];
        p.apply(&mut l, &[0], &[], &mut Vec::new());
        assert_eq!(l, [0.0]);
    }

    #[test]
    fn presence_and_frequency_count_the_output_only_and_move_toward_zero() {
        let p = Penalties {
            presence: 0.5,
            frequency: 0.25,
            ..Penalties::default()
        };
        // Prompt token 0 is not counted; 1 once, 2 three times (a negative logit is raised).
        let mut l = [1.0, 1.0, -1.0, 1.0];
        p.apply(&mut l, &[0], &[2, 1, 2, 2], &mut Vec::new());
        assert_eq!(l, [1.0, 1.0 - 0.5 - 0.25, -1.0 + 0.5 + 0.75, 1.0]);
        // The sign is read after each penalty: 0.3 - 0.5 = -0.2 goes back up by 0.25.
        let mut l = [0.3f32];
        p.apply(&mut l, &[], &[0], &mut Vec::new());
        let want = ((0.3f32 as f64 - 0.5) as f32 as f64 + 0.25) as f32;
        assert_eq!(l, [want]);
    }

    #[test]
    fn bias_is_added_after_the_penalties_and_out_of_range_ids_are_skipped() {
        let p = Penalties {
            repetition: 2.0,
            logit_bias: vec![(1, 100.0), (9, 5.0)],
            ..Penalties::default()
        };
        let mut l = [3.0, 2.0];
        p.apply(&mut l, &[1], &[7], &mut Vec::new());
        assert_eq!(l, [3.0, 101.0]);
        assert!(Penalties::default().is_neutral());
        assert!(!p.is_neutral());
    }

    #[test]
    fn a_verified_draft_leaves_the_target_distribution_unchanged() {
        // Target p = softmax(ln [4, 3, 2, 1]) = [0.4, 0.3, 0.2, 0.1]; draft token 1 (p 0.3) and
        // token 3 (p 0.1). The emitted token (the draft when accepted, else the residual's
        // draw) must follow p, and the draft must be accepted with probability p(draft).
        let logits: Vec<f32> = [4f32, 3.0, 2.0, 1.0].iter().map(|x| x.ln()).collect();
        let want = [0.4, 0.3, 0.2, 0.1];
        let s = Sampling {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
        };
        let mut rng = SplitMix64::new(41);
        let mut scratch = Vec::new();
        let n = 40000;
        for draft in [1u32, 3] {
            let mut counts = [0usize; 4];
            let mut accepted = 0;
            for _ in 0..n {
                let t = match verify_draft(&logits, &s, draft, &mut rng, &mut scratch) {
                    None => {
                        accepted += 1;
                        draft
                    }
                    Some(t) => {
                        assert_ne!(t, draft, "a rejected draft is never emitted");
                        t
                    }
                };
                counts[t as usize] += 1;
            }
            let rate = accepted as f64 / n as f64;
            assert!(
                (rate - want[draft as usize]).abs() < 0.01,
                "draft {draft} accepted at {rate}, want {}",
                want[draft as usize]
            );
            for (t, &c) in counts.iter().enumerate() {
                let f = c as f64 / n as f64;
                // 4 sigma of a binomial proportion at n = 40000 is under 0.01.
                assert!(
                    (f - want[t]).abs() < 0.01,
                    "draft {draft}: token {t} at {f}, want {}",
                    want[t]
                );
            }
        }
    }

    #[test]
    fn a_verified_draft_outside_top_k_is_always_rejected_and_greedy_is_exact() {
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
        };
        let mut rng = SplitMix64::new(5);
        let mut scratch = Vec::new();
        for _ in 0..200 {
            let t = verify_draft(&logits, &s, 3, &mut rng, &mut scratch);
            assert!(matches!(t, Some(0 | 1)), "{t:?}");
        }
        let g = Sampling::default();
        assert_eq!(verify_draft(&logits, &g, 0, &mut rng, &mut scratch), None);
        assert_eq!(
            verify_draft(&logits, &g, 2, &mut rng, &mut scratch),
            Some(0)
        );
    }
}
