//! Scalar decode-tile loops: the twin of `avx2_decode`, one element at a time (no prefetch).

use super::scalar::Scalar;
use super::{DecodeMicro, Micro};
use crate::dtype::Float;

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
    ) {
        self.qk(q, rows, k, n, d, s, n);
    }

    fn dec_softmax_pv<C: Float>(
        self,
        s: &mut [f32],
        rows: usize,
        n: usize,
        v: &[C],
        d: usize,
        m: &mut [f32],
        l: &mut [f32],
        acc: &mut [f32],
        _pf: &[C],
    ) {
        for r in 0..rows {
            let row = &mut s[r * n..(r + 1) * n];
            let mt = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if mt == f32::NEG_INFINITY {
                continue;
            }
            let a = &mut acc[r * d..(r + 1) * d];
            if mt > m[r] {
                if m[r] != f32::NEG_INFINITY {
                    let c = (m[r] - mt).exp();
                    l[r] *= c;
                    self.scale(a, c);
                }
                m[r] = mt;
            }
            l[r] += self.exp_sub_sum(row, m[r]);
            self.pv(row, n, 1, v, n, d, a);
        }
    }
}
