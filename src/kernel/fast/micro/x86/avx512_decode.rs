//! AVX-512 decode-tile loops (see [`DecodeMicro`]).
//!
//! QK: the shared [`qk`] block (4 rows x 4 keys, or 1-2 rows x 8 keys, 16-wide columns with a
//! masked tail). Softmax: one max pass and one exp-and-sum pass per row. PV: the shared
//! [`pv_cols`] block over groups of 4 rows, reading the row-major weights in place (a broadcast
//! load per row and key; no staging transpose), each accumulator loaded, scaled by its row's
//! correction and stored once per tile. Both loops issue the prefetches of `pf` a few lines
//! per inner step, as the AVX2 tier does.
//!
//! Reached only through [`Avx512`], which proves the CPU has the features.

use super::avx512::{exp_sub_sum, pv_cols, qk, qk_ticks, row_max, Avx512};
use super::prefetch::Pf;
use super::{bounds, DecodeMicro};
use crate::dtype::Float;
use crate::kernel::softmax::OnlineSoftmax;

impl DecodeMicro for Avx512 {
    fn dec_qk<C: Float>(
        self,
        q: &[f32],
        rows: usize,
        k: &[C],
        n: usize,
        d: usize,
        s: &mut [f32],
        pf: &[C],
        scale: f32,
    ) {
        bounds::qk(q.len(), rows, k.len(), n, d, s.len(), n);
        let mut pf = Pf::new(pf, qk_ticks(rows, n, d));
        // SAFETY: `self` proves the features; `bounds::qk` bounds every access.
        unsafe {
            qk::<C>(
                q.as_ptr(),
                rows,
                k.as_ptr(),
                n,
                d,
                s.as_mut_ptr(),
                n,
                &mut pf,
                scale,
            )
        }
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
        pf: &[C],
    ) {
        bounds::dec_softmax_pv(s.len(), rows, n, v.len(), d, st.len(), acc.len());
        let mut pf = Pf::new(pf, rows.div_ceil(4) * d.div_ceil(64) * n);
        let mut r0 = 0;
        while r0 < rows {
            let rr = (rows - r0).min(4);
            // Per row of the group: the correction of its accumulator.
            let mut sc = [1f32; 4];
            for (i, c) in sc.iter_mut().enumerate().take(rr) {
                let r = r0 + i;
                let row = &mut s[r * n..(r + 1) * n];
                // SAFETY: `self` proves the features; `row` holds `n` floats.
                let step = st[r].update(unsafe { row_max(row.as_ptr(), n) });
                *c = step.rescale;
                // SAFETY: `self` proves the features.
                st[r].add(unsafe { exp_sub_sum(row, step.sub) });
            }
            // SAFETY: `self` proves the features; rows r0..r0+rr of `s` (n weights each) and of
            // `acc`, and the `n` value rows are inside the ranges `bounds` checked.
            unsafe {
                pv_cols::<C>(
                    rr,
                    s.as_ptr().add(r0 * n),
                    (n, 1),
                    n,
                    v.as_ptr(),
                    d,
                    sc.as_ptr(),
                    acc.as_mut_ptr().add(r0 * d),
                    &mut pf,
                )
            };
            r0 += rr;
        }
    }
}
