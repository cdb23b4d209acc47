//! The scalar [`U8Micro`]: plain loops over u8 cache bytes, the twin the SIMD tiers are tested
//! against; the AVX2 tier runs these loops too (not vectorised yet).

use super::scalar::Scalar;
use super::{u8_bounds, U8Micro};

impl U8Micro for Scalar {
    fn dots(self, q: &[f32], ldq: usize, rows: usize, k: &[u8], zp: f32, out: &mut [f32]) {
        u8_bounds(q.len(), ldq, rows, k.len(), out.len());
        for (r, o) in out.iter_mut().enumerate().take(rows) {
            *o = q[r * ldq..][..k.len()]
                .iter()
                .zip(k)
                .map(|(&x, &b)| x * (b as f32 - zp))
                .sum();
        }
    }

    fn axpys(self, acc: &mut [f32], lda: usize, rows: usize, w: &[f32], v: &[u8], zp: f32) {
        u8_bounds(acc.len(), lda, rows, v.len(), w.len());
        for (r, &wr) in w.iter().enumerate().take(rows) {
            for (a, &b) in acc[r * lda..][..v.len()].iter_mut().zip(v) {
                *a += wr * (b as f32 - zp);
            }
        }
    }

    fn exp_sum(self, s: &mut [f32], sub: f32) -> f32 {
        let mut sum = 0.0;
        for x in s.iter_mut() {
            *x = (*x - sub).exp();
            sum += *x;
        }
        sum
    }
}

#[cfg(target_arch = "x86_64")]
impl U8Micro for super::x86::avx2::Avx2 {
    fn dots(self, q: &[f32], ldq: usize, rows: usize, k: &[u8], zp: f32, out: &mut [f32]) {
        Scalar.dots(q, ldq, rows, k, zp, out)
    }
    fn axpys(self, acc: &mut [f32], lda: usize, rows: usize, w: &[f32], v: &[u8], zp: f32) {
        Scalar.axpys(acc, lda, rows, w, v, zp)
    }
    fn exp_sum(self, s: &mut [f32], sub: f32) -> f32 {
        Scalar.exp_sum(s, sub)
    }
}
