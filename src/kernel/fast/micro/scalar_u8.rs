//! The scalar [`QuantMicro`]: plain loops over u8 cache bytes and u4 nibbles ([`QRows::at`]), the
//! twin the SIMD tiers are tested against.

use super::scalar::Scalar;
use super::{exp_sum_bounds, pv_bounds, qk_bounds, QRows, QuantMicro};
use crate::kernel::fast::prefetch_part;
use crate::kernel::quant::dequant;

impl QuantMicro for Scalar {
    fn qk(
        self,
        q: &[f32],
        ldq: usize,
        rows: usize,
        k: QRows<'_>,
        zp: &[f32],
        len: usize,
        s: &mut [f32],
        lds: usize,
        pf: &[u8],
    ) {
        // All the lines at once: the scalar loop is slow enough for them to arrive in time.
        prefetch_part(pf, 0, 1);
        qk_bounds(q.len(), ldq, rows, k, zp.len(), len, s.len(), lds);
        for r in 0..rows {
            for (t, &z) in zp.iter().enumerate() {
                s[r * lds + t] = q[r * ldq..][..len]
                    .iter()
                    .enumerate()
                    .map(|(c, &x)| x * (k.at(t, c) as f32 - z))
                    .sum();
            }
        }
    }

    fn pv(
        self,
        acc: &mut [f32],
        lda: usize,
        rows: usize,
        w: &[f32],
        v: QRows<'_>,
        zp: &[f32],
        len: usize,
        pf: &[u8],
    ) {
        prefetch_part(pf, 0, 1);
        let n = zp.len();
        pv_bounds(acc.len(), lda, rows, w.len(), v, n, len);
        for r in 0..rows {
            for (t, &z) in zp.iter().enumerate() {
                let wr = w[r * n + t];
                for (c, a) in acc[r * lda..][..len].iter_mut().enumerate() {
                    *a += wr * (v.at(t, c) as f32 - z);
                }
            }
        }
    }

    fn exp_sum(self, s: &mut [f32], lds: usize, n: usize, subs: &[f32], sums: &mut [f32]) {
        exp_sum_bounds(s.len(), lds, n, subs.len(), sums.len());
        for (r, (&sub, out)) in subs.iter().zip(sums.iter_mut()).enumerate() {
            let mut sum = 0.0;
            for x in &mut s[r * lds..][..n] {
                *x = (*x - sub).exp();
                sum += *x;
            }
            *out = sum;
        }
    }

    fn dequant(self, src: &[u8], zp: &[f32], scale: &[f32], out: &mut [f32]) {
        let (src, zp, scale) = (&src[..out.len()], &zp[..out.len()], &scale[..out.len()]);
        for (i, o) in out.iter_mut().enumerate() {
            *o = dequant(src[i], scale[i], zp[i]);
        }
    }

    fn dequant_uniform(self, src: &[u8], zp: f32, scale: f32, out: &mut [f32]) {
        let src = &src[..out.len()];
        for (o, &q) in out.iter_mut().zip(src) {
            *o = dequant(q, scale, zp);
        }
    }
}
