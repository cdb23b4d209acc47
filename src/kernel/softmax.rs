//! The online-softmax step, written once: every kernel (reference, decode and prefill tiles on
//! every SIMD level, the AMX items, the merge of key chunks, the scores) keeps its rows' running
//! max and sum in an [`OnlineSoftmax`] and moves it only through [`OnlineSoftmax::update`] /
//! [`OnlineSoftmax::add`] (a block of keys), [`OnlineSoftmax::merge`] (a partial softmax of
//! other keys) and reads it through [`OnlineSoftmax::norm`] / [`OnlineSoftmax::weight`].
//!
//! A block is any set of keys whose largest logit is known: one key (reference), a cache block
//! (tiles), a span (AMX). Per block, with `s` its logits (masked ones `-inf`):
//! 1. `step = state.update(max(s))`: the running max is raised, the sum multiplied by
//!    `step.rescale`, which the caller also applies to its accumulator;
//! 2. the caller computes the weights `exp(s - step.sub)` and their sum (its SIMD loops), adds
//!    the weighted values to its accumulator and the sum with `state.add(sum)`.
//!
//! At the end the output is `acc * state.norm()`.
//!
//! The state is generic over [`Lanes`]: `f32` for one row, or a SIMD vector holding one row per
//! lane (the transposed prefill tiles), so the vector tiers run the same step lane-wise.
//!
//! Non-finite logits (docs/contract.md, "Non-finite values") need no case of their own here:
//! - every logit goes through [`Lanes::cap`] when it is made (scale, then ALiBi), so `+inf`
//!   (overflow) is `f32::MAX`: the max stays finite, `s - max` is never `inf - inf`, and the
//!   keys whose logits overflowed get weight `exp(0) = 1` each, sharing the row equally;
//! - a `-inf` logit has weight `exp(-inf - max) = 0`; a row whose logits are all `-inf` ends
//!   with sum 0 and accumulator 0, and `acc * norm()` is `0 * inf = NaN` (no distribution);
//! - a NaN logit makes its weight NaN (the `exp` loops of every tier keep NaN), hence the sum,
//!   the output and the row's scores; whether a max ignores it does not matter.
//!
//! Masked keys are `-inf` logits too, but their values must not be read: `0 * inf` would be
//! NaN. The tile drivers keep them out of the value products (see `fast::tile::finite_outside`).

/// The arithmetic the step needs, on one row (`f32`) or lane-wise on a vector of rows.
pub(crate) trait Lanes: Copy {
    fn max(self, other: Self) -> Self;
    fn sub(self, other: Self) -> Self;
    fn mul(self, other: Self) -> Self;
    fn add(self, other: Self) -> Self;
    /// `self`, with 0 in the lanes that are `-inf`.
    fn zero_if_neg_inf(self) -> Self;
    /// `exp(self)` for `self <= 0` or `-inf` (exactly 0 at `-inf`, NaN at NaN).
    fn exp_nonpos(self) -> Self;
    /// A logit as the softmax takes it: `+inf` becomes `f32::MAX`, anything else (NaN too)
    /// stays.
    fn cap(self) -> Self;
}

impl Lanes for f32 {
    #[inline(always)]
    fn max(self, other: f32) -> f32 {
        f32::max(self, other)
    }
    #[inline(always)]
    fn sub(self, other: f32) -> f32 {
        self - other
    }
    #[inline(always)]
    fn mul(self, other: f32) -> f32 {
        self * other
    }
    #[inline(always)]
    fn add(self, other: f32) -> f32 {
        self + other
    }
    #[inline(always)]
    fn zero_if_neg_inf(self) -> f32 {
        if self == f32::NEG_INFINITY {
            0.0
        } else {
            self
        }
    }
    #[inline(always)]
    fn exp_nonpos(self) -> f32 {
        // A block that does not raise the max rescales by exp(0) = 1 (exact): no libm call.
        if self == 0.0 {
            1.0
        } else {
            self.exp()
        }
    }
    #[inline(always)]
    fn cap(self) -> f32 {
        // `>` is false for NaN, which stays.
        if self > f32::MAX {
            f32::MAX
        } else {
            self
        }
    }
}

/// Running max and sum of exponentials of one row (or one row per lane).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OnlineSoftmax<L = f32> {
    pub max: L,
    pub sum: L,
}

/// What one block of keys does to the row: subtract `sub` from its logits before `exp`, and
/// multiply the accumulator of the blocks before it by `rescale`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Step<L = f32> {
    pub sub: L,
    pub rescale: L,
}

impl<L: Lanes> OnlineSoftmax<L> {
    /// Takes in a block whose largest logit is `block_max` (`-inf`: every key masked).
    #[inline(always)]
    pub fn update(&mut self, block_max: L) -> Step<L> {
        let max = self.max.max(block_max);
        // A row that has seen only masked keys subtracts 0: its weights are exp(-inf) = 0 and
        // its rescale 0 (its sum and accumulator are 0), never -inf - -inf = NaN.
        let sub = max.zero_if_neg_inf();
        let rescale = self.max.sub(sub).exp_nonpos();
        self.max = max;
        self.sum = self.sum.mul(rescale);
        Step { sub, rescale }
    }

    /// Adds the sum of the block's weights `exp(s - step.sub)`.
    #[inline(always)]
    pub fn add(&mut self, block_sum: L) {
        self.sum = self.sum.add(block_sum);
    }
}

impl OnlineSoftmax<f32> {
    /// No key seen yet.
    pub const EMPTY: OnlineSoftmax = OnlineSoftmax {
        max: f32::NEG_INFINITY,
        sum: 0.0,
    };

    /// Folds in a partial softmax computed over other keys (a chunk): returns the factors for
    /// this row's accumulator and for the partial's, or `None` when the partial saw no key
    /// (its accumulator is then not read).
    #[inline]
    pub fn merge(&mut self, part: OnlineSoftmax) -> Option<(f32, f32)> {
        if part.sum == 0.0 {
            return None;
        }
        let step = self.update(part.max);
        let f = (part.max - step.sub).exp();
        self.add(part.sum * f);
        Some((step.rescale, f))
    }

    /// The factor that turns the accumulator into the output.
    #[inline(always)]
    pub fn norm(&self) -> f32 {
        1.0 / self.sum
    }

    /// Ends a row: folds in its attention sink, if it has one (a logit `sink` that joins the
    /// max and the sum and has no value), and returns the factor that turns the accumulator
    /// into the output. Every kernel ends its rows here, so the sink is written once; the
    /// state then gives the final weights ([`weight`](Self::weight), [`factor`](Self::factor))
    /// with the sink in the denominator.
    ///
    /// A sink is capped like any logit; a `-inf` sink changes nothing, a NaN one makes the row
    /// NaN, and a row that saw only masked keys gets output 0 (all weight on the sink).
    #[inline]
    pub fn finish(&mut self, sink: Option<f32>) -> f32 {
        let Some(sink) = sink else {
            return self.norm();
        };
        let sink = sink.cap();
        let step = self.update(sink);
        self.add((sink - step.sub).exp());
        step.rescale * self.norm()
    }

    /// The final softmax weight of a key with logit `s` (the scores).
    #[inline(always)]
    pub fn weight(&self, s: f32) -> f32 {
        (s - self.max).exp() * self.norm()
    }

    /// What turns a block's weights `exp(s - step.sub)` into final weights (the scores),
    /// given `block_max`, the running max right after that block's [`update`](Self::update):
    /// `exp(block_max - max) * norm()`, so no logit needs a second `exp`. A block before any
    /// unmasked key (`block_max` `-inf`) had weights exactly 0 and gets factor 0, as
    /// `weight(-inf)` is 0; `block_max <= max` keeps the factor finite.
    #[inline(always)]
    pub fn factor(&self, block_max: f32) -> f32 {
        (block_max - self.max).exp() * self.norm()
    }
}

impl Default for OnlineSoftmax<f32> {
    fn default() -> Self {
        OnlineSoftmax::EMPTY
    }
}

#[cfg(test)]
mod tests {
    use super::OnlineSoftmax;

    /// Scores from stored block weights ([`OnlineSoftmax::factor`]) against `exp(s - max) /
    /// sum` in float64, over blocks that raise the max, blocks that do not, and a first block
    /// with every key masked.
    #[test]
    fn block_weights_times_factor_are_the_final_weights() {
        // Logits -100 and lower: `exp(0 - max)` overflows f32, so a factor of 0 for the masked
        // block is what keeps its weights (0) from becoming 0 * inf = NaN.
        let blocks: [&[f32]; 4] = [
            &[f32::NEG_INFINITY; 3],
            &[-130.0, -120.5, f32::NEG_INFINITY],
            &[-100.25, -101.0, -140.0],
            &[-115.0, -100.5, -100.25],
        ];
        let mut st = OnlineSoftmax::EMPTY;
        let mut kept = Vec::new();
        for b in blocks {
            let step = st.update(b.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            let w: Vec<f32> = b.iter().map(|&s| (s - step.sub).exp()).collect();
            st.add(w.iter().sum());
            kept.push((w, st.max));
        }
        let all: Vec<f64> = blocks.concat().iter().map(|&s| s as f64).collect();
        let max = all.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = all.iter().map(|s| (s - max).exp()).sum();
        let mut i = 0;
        for (w, block_max) in kept {
            let f = st.factor(block_max);
            for x in w {
                let (got, want) = (x * f, (all[i] - max).exp() / sum);
                assert!(
                    (got as f64 - want).abs() <= 1e-6 * want + 1e-30,
                    "key {i}: {got} want {want}"
                );
                i += 1;
            }
        }
        assert_eq!(i, all.len());
    }
}
