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

/// Index of the first largest value (NaN never wins).
pub fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0usize;
    let mut best_v = f32::NEG_INFINITY;
    for (i, &v) in logits.iter().enumerate() {
        if v > best_v {
            best_v = v;
            best = i;
        }
    }
    best as u32
}

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
    scratch.clear();
    scratch.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, v)| !v.is_nan())
            .map(|(i, &v)| (v, i as u32)),
    );
    if scratch.is_empty() {
        return 0;
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
    let kept: f64 = probs.iter().sum();
    let mut u = rng.next_f64() * kept;
    for (i, p) in probs.iter().enumerate() {
        if u < *p {
            return scratch[i].1;
        }
        u -= p;
    }
    scratch[keep - 1].1
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
}
