//! Scalar micro-kernels: the same loops as `avx2`, one element at a time.

use super::Micro;
use crate::dtype::Float;
use crate::kernel::softmax::Lanes;

#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Scalar;

impl Micro for Scalar {
    fn qk<C: Float>(
        self,
        q: &[f32],
        rows: usize,
        k: &[C],
        n: usize,
        d: usize,
        s: &mut [f32],
        lds: usize,
        scale: f32,
    ) {
        for r in 0..rows {
            let qr = &q[r * d..(r + 1) * d];
            for j in 0..n {
                let kj = &k[j * d..(j + 1) * d];
                let mut dot = 0f32;
                for x in 0..d {
                    dot += qr[x] * kj[x].to_f32();
                }
                s[r * lds + j] = (scale * dot).cap();
            }
        }
    }

    fn add_exp_scaled(self, dst: &mut [f32], s: &[f32], m: f32, c: f32) {
        for (o, &x) in dst.iter_mut().zip(s) {
            *o += (x - m).exp() * c;
        }
    }

    fn scale(self, x: &mut [f32], c: f32) {
        x.iter_mut().for_each(|v| *v *= c);
    }

    fn scale_logits(self, s: &mut [f32], c: f32) {
        s.iter_mut().for_each(|v| *v = (*v * c).cap());
    }

    fn widen<C: Float>(self, src: &[C], dst: &mut [f32]) {
        for (o, v) in dst.iter_mut().zip(src) {
            *o = v.to_f32();
        }
    }

    fn narrow<C: Float>(self, src: &[f32], dst: &mut [C]) {
        for (o, &v) in dst.iter_mut().zip(src) {
            *o = C::from_f32(v);
        }
    }
}

/// `s[j] = exp(s[j] - m)` in place; returns their sum (in order).
pub(super) fn exp_sub_sum(s: &mut [f32], m: f32) -> f32 {
    let mut sum = 0f32;
    for x in s.iter_mut() {
        *x = (*x - m).exp();
        sum += *x;
    }
    sum
}
