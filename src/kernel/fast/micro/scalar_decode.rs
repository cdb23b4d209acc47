//! Scalar decode-tile loops: the twin of `avx2_decode`, one element at a time (no prefetch).

use super::scalar::{exp_sub_sum, Scalar};
use super::{DecodeMicro, Micro};
use crate::dtype::Float;
use crate::kernel::softmax::OnlineSoftmax;

impl DecodeMicro for Scalar {
    fn dec_qk<C: Float>(
        self,
        q: &[f32],
        rows: usize,
        k: &[C],
        n: usize,
        d: usize,
        s: &mut [f32],
        _pf: &[C],
        scale: f32,
    ) {
        self.qk(q, rows, k, n, d, s, n, scale);
    }

    fn dec_softmax_pv<C: Float>(
        self,
        s: &mut [f32],
        rows: usize,
        n: usize,
        v: &[C],
        d: usize,
        st: &mut [OnlineSoftmax],
        acc: &mut [f32],
        _pf: &[C],
    ) {
        for r in 0..rows {
            let row = &mut s[r * n..(r + 1) * n];
            let step = st[r].update(row.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            st[r].add(exp_sub_sum(row, step.sub));
            let a = &mut acc[r * d..(r + 1) * d];
            self.scale(a, step.rescale);
            for (j, &w) in row.iter().enumerate() {
                for (o, x) in a.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                    *o += w * x.to_f32();
                }
            }
        }
    }
}
