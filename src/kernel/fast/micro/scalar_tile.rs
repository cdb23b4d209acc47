//! Scalar [`TileMicro`]: the same loops as `avx2_tile`, one element at a time.

use super::scalar::Scalar;
use super::TileMicro;
use crate::kernel::softmax::{Lanes, OnlineSoftmax};

impl TileMicro for Scalar {
    fn qk_t<C>(
        self,
        qt: &[f32],
        ldq: usize,
        rows: usize,
        k: &[f32],
        n: usize,
        d: usize,
        st: &mut [f32],
        ldt: usize,
        scale: f32,
        _pf: &[C],
    ) {
        for j in 0..n {
            let kj = &k[j * d..(j + 1) * d];
            for r in 0..rows {
                let mut dot = 0f32;
                for (x, &kv) in kj.iter().enumerate() {
                    dot += qt[x * ldq + r] * kv;
                }
                st[j * ldt + r] = (dot * scale).cap();
            }
        }
    }

    fn softmax_t(
        self,
        st: &mut [f32],
        ldt: usize,
        rows: usize,
        n: usize,
        m: &mut [f32],
        l: &mut [f32],
        c: &mut [f32],
    ) {
        for r in 0..rows {
            let mut row = OnlineSoftmax {
                max: m[r],
                sum: l[r],
            };
            let mt = (0..n)
                .map(|j| st[j * ldt + r])
                .fold(f32::NEG_INFINITY, f32::max);
            let step = row.update(mt);
            let mut sum = 0f32;
            for j in 0..n {
                let e = (st[j * ldt + r] - step.sub).exp();
                st[j * ldt + r] = e;
                sum += e;
            }
            row.add(sum);
            (m[r], l[r], c[r]) = (row.max, row.sum, step.rescale);
        }
    }

    fn transpose(self, src: &[f32], rows: usize, d: usize, dst: &mut [f32], ldd: usize) {
        for r in 0..rows.div_ceil(8) * 8 {
            for x in 0..d {
                dst[x * ldd + r] = src[r * d + x];
            }
        }
    }

    fn pv_t<C>(
        self,
        pt: &[f32],
        ldp: usize,
        rows: usize,
        v: &[f32],
        n: usize,
        d: usize,
        c: &[f32],
        acc: &mut [f32],
        _pf: &[C],
    ) {
        for r in 0..rows {
            let a = &mut acc[r * d..(r + 1) * d];
            a.iter_mut().for_each(|x| *x *= c[r]);
            for j in 0..n {
                let w = pt[j * ldp + r];
                for (x, &vv) in a.iter_mut().zip(&v[j * d..(j + 1) * d]) {
                    *x += w * vv;
                }
            }
        }
    }
}
