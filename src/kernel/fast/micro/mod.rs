//! Micro-kernels: the few inner loops every attention tile is made of, behind one trait so the
//! tile drivers (`attention`, `scores`) are written once and run on every SIMD level.
//!
//! - `scalar`: plain loops; the fast path's own twin, and what runs without AVX2.
//! - `avx2`: AVX2 + FMA + F16C (`std::arch`), chosen only after runtime detection.
//!
//! All arithmetic is f32: f16/bf16 cache rows are widened as they are loaded, because summing
//! in half precision would lose the small softmax weights of long contexts.

pub(crate) mod avx2;
pub(crate) mod scalar;

use crate::dtype::Float;

/// The inner loops of a tile. Implementors are zero-sized tokens; holding one proves the CPU
/// supports the instructions it uses.
pub(crate) trait Micro: Copy + Send + Sync {
    /// `s[r*lds + j] = <q[r*d..][..d], k[j*d..][..d]>` for `r < rows`, `j < n`.
    fn qk<C: Float>(
        self,
        q: &[f32],
        rows: usize,
        k: &[C],
        n: usize,
        d: usize,
        s: &mut [f32],
        lds: usize,
    );
    /// `acc[r*d..][..d] += sum_j p[r*ldp + j] * v[j*d..][..d]` for `r < rows`.
    fn pv<C: Float>(
        self,
        p: &[f32],
        ldp: usize,
        rows: usize,
        v: &[C],
        n: usize,
        d: usize,
        acc: &mut [f32],
    );
    /// `s[j] = exp(s[j] - m)` in place; returns the sum (in a fixed order).
    fn exp_sub_sum(self, s: &mut [f32], m: f32) -> f32;
    /// `dst[j] += exp(s[j] - m) * c`.
    fn add_exp_scaled(self, dst: &mut [f32], s: &[f32], m: f32, c: f32);
    /// `x[j] *= c`.
    fn scale(self, x: &mut [f32], c: f32);
    /// `dst[j] = src[j]` widened to f32.
    fn widen<C: Float>(self, src: &[C], dst: &mut [f32]);
}
