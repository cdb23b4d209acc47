//! AVX-512 [`TileMicro`]: prefill tiles on transposed logits (`st[key][row]`).
//!
//! Register blocking (32 zmm registers): `qk_t` computes up to 64 rows (1 to 4 row vectors) x
//! up to 24 / vectors keys (at most 12) per pass (up to 24 accumulators; per `x`, one panel load
//! per row vector and one broadcast per key: 4 x 6 needs 10 loads per 24 FMAs where 2 x 12
//! needs 14, and loads, not FMAs, are what such blocks wait on), key blocks balanced so no
//! block is left with too few accumulators to hide the FMA latency;
//! `softmax_t` runs 16 rows per vector, two vectors per pass; `pv_t` keeps up to 6 rows x 64
//! columns in 24 accumulators over all keys of a tile (the shared [`pv_cols`] block, weights
//! read transposed). A row count that is a multiple of 8 but not of 16 ends in a half-masked
//! vector; head sizes that are not a multiple of 16 end in a masked column vector.
//! The panel transpose is the AVX2 tier's (once per item, not worth widening).

use std::arch::x86_64::*;

use super::avx512::{exp16_nonpos, pv_cols, tail, Avx512, F32x16, ALL};
use super::prefetch::Pf;
use super::{bounds, TileMicro};
use crate::kernel::softmax::{Lanes, OnlineSoftmax};

/// Row vectors per `qk_t` block at most.
const QK_VECS: usize = 4;
/// Accumulators per `qk_t` block at most (of the 32 zmm registers; the rest hold the panel
/// vectors and a broadcast).
const QK_ACC: usize = 24;
/// Keys per `qk_t` block at most.
const QK_KEYS: usize = 12;
/// Rows per `pv_t` block at most (6 rows x 4 column vectors = 24 accumulators).
const PV_ROWS: usize = 6;

impl TileMicro for Avx512 {
    // Four row vectors x 6 keys: each broadcast feeds four FMAs and each panel load six, the
    // fewest loads per FMA 24 accumulators allow.
    const QK_ROWS: usize = 64;
    const PREFETCHES: bool = true;

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
        pf: &[C],
    ) {
        bounds::qk_t(qt.len(), ldq, rows, k.len(), n, d, st.len(), ldt);
        let rows8 = rows.div_ceil(8) * 8;
        // One tick per two panel rows of each block (blocks of 64 rows x 6 keys at most):
        // about a line per 24 FMAs, which the line fill buffers keep up with.
        let mut pf = Pf::new(pf, rows8.div_ceil(64) * n.div_ceil(6) * d.div_ceil(2));
        // SAFETY: `self` proves the features; `bounds::qk_t` bounds every access.
        unsafe {
            qk_t(
                qt.as_ptr(),
                ldq,
                rows8,
                k.as_ptr(),
                n,
                d,
                st.as_mut_ptr(),
                ldt,
                scale,
                &mut pf,
            )
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
        bounds::softmax_t(st.len(), ldt, rows, n, m.len(), l.len(), c.len());
        let rows8 = rows.div_ceil(8) * 8;
        let mut r = 0;
        while r < rows8 {
            let left = rows8 - r;
            // SAFETY: `self` proves the features; lanes r..r+min(left, 32) < rows8 of m, l, c
            // and of every st row j < n are inside the ranges `bounds::softmax_t` checked.
            unsafe {
                let (sp, mp, lp, cp) = (
                    st.as_mut_ptr().add(r),
                    m.as_mut_ptr().add(r),
                    l.as_mut_ptr().add(r),
                    c.as_mut_ptr().add(r),
                );
                if left > 16 {
                    softmax_rows::<2>(sp, ldt, n, mp, lp, cp, tail((left - 16).min(16)));
                } else {
                    softmax_rows::<1>(sp, ldt, n, mp, lp, cp, tail(left));
                }
            }
            r += 32;
        }
    }

    fn transpose(self, src: &[f32], rows: usize, d: usize, dst: &mut [f32], ldd: usize) {
        self.avx2.transpose(src, rows, d, dst, ldd)
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
        pf: &[C],
    ) {
        bounds::pv_t(pt.len(), ldp, rows, v.len(), n, d, c.len(), acc.len());
        // One tick per key of each block (6 rows x 64 columns at most).
        let mut pf = Pf::new(pf, rows.div_ceil(PV_ROWS) * d.div_ceil(64) * n);
        let mut r = 0;
        while r < rows {
            // Balanced blocks: 8 rows go 4 + 4, not 6 + 2.
            let left = rows - r;
            let rr = left.div_ceil(left.div_ceil(PV_ROWS));
            // SAFETY: `self` proves the features; rows r..r+rr of pt (key stride ldp), c and
            // acc, and the n value rows are inside the ranges `bounds::pv_t` checked.
            unsafe {
                pv_cols::<f32>(
                    rr,
                    pt.as_ptr().add(r),
                    (1, ldp),
                    n,
                    v.as_ptr(),
                    d,
                    c.as_ptr().add(r),
                    acc.as_mut_ptr().add(r * d),
                    &mut pf,
                )
            };
            r += rr;
        }
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_t(
    qt: *const f32,
    ldq: usize,
    rows8: usize,
    k: *const f32,
    n: usize,
    d: usize,
    st: *mut f32,
    ldt: usize,
    scale: f32,
    pf: &mut Pf,
) {
    let mut r = 0;
    while r < rows8 {
        let left = rows8 - r;
        let nv = left.div_ceil(16).min(QK_VECS);
        let last = tail((left - 16 * (nv - 1)).min(16));
        // As many keys as keep the block within QK_ACC accumulators.
        let most = (QK_ACC / nv).min(QK_KEYS);
        let mut j = 0;
        while j < n {
            let kl = n - j;
            let kk = kl.div_ceil(kl.div_ceil(most));
            // SAFETY: panel lanes r..r+min(left, 16*nv) (the last vector masked to < rows8),
            // keys j..j+kk of k and the matching st entries are inside the ranges
            // `bounds::qk_t` asserted.
            unsafe {
                let (qp, kp, sp) = (qt.add(r), k.add(j * d), st.add(j * ldt + r));
                macro_rules! go {
                    ($rv:literal, $ds:literal; $($k:literal)*) => {
                        match kk {
                            $($k => qk_t_block::<$rv, $k, $ds>(qp, ldq, kp, d, sp, ldt, scale, last, pf),)*
                            _ => qk_t_block::<$rv, 1, 0>(qp, ldq, kp, d, sp, ldt, scale, last, pf),
                        }
                    };
                }
                // The common head sizes get the key stride as a constant: the key broadcasts
                // then address their rows by immediate offsets from one pointer, leaving the
                // ports the FMAs share free of address arithmetic.
                match (nv, d) {
                    (4, 128) => go!(4, 128; 6 5 4 3 2),
                    (4, 64) => go!(4, 64; 6 5 4 3 2),
                    (4, _) => go!(4, 0; 6 5 4 3 2),
                    (3, _) => go!(3, 0; 8 7 6 5 4 3 2),
                    (2, _) => go!(2, 0; 12 11 10 9 8 7 6 5 4 3 2),
                    _ => go!(1, 0; 12 11 10 9 8 7 6 5 4 3 2),
                }
            }
            j += kk;
        }
        r += 16 * nv;
    }
}

/// `16*RV` rows (the last vector masked by `last`) x `K` keys of `st` (stride `ldt`, scaled
/// and capped) from the query panel (stride `ldq`) and `K` key rows (stride `d`, which equals
/// `DS` unless `DS` is 0).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_t_block<const RV: usize, const K: usize, const DS: usize>(
    qt: *const f32,
    ldq: usize,
    k: *const f32,
    d: usize,
    st: *mut f32,
    ldt: usize,
    scale: f32,
    last: __mmask16,
    pf: &mut Pf,
) {
    debug_assert!(DS == 0 || DS == d);
    let d = if DS == 0 { d } else { DS };
    let z = _mm512_setzero_ps();
    let sc = _mm512_set1_ps(scale);
    let mask = |i: usize| if i + 1 == RV { last } else { ALL };
    let mut a = [[z; RV]; K];
    for x in 0..d {
        let mut qv = [z; RV];
        for (i, q) in qv.iter_mut().enumerate() {
            // SAFETY: panel row x < d, the masked lanes 16i.. of the caller's rows.
            *q = unsafe { _mm512_maskz_loadu_ps(mask(i), qt.add(x * ldq + 16 * i)) };
        }
        for (kk, ak) in a.iter_mut().enumerate() {
            // SAFETY: element x < d of key row kk < K.
            let b = _mm512_set1_ps(unsafe { *k.add(kk * d + x) });
            for i in 0..RV {
                ak[i] = _mm512_fmadd_ps(qv[i], b, ak[i]);
            }
        }
        if x % 2 == 1 {
            pf.tick();
        }
    }
    for (kk, ak) in a.iter().enumerate() {
        for (i, v) in ak.iter().enumerate() {
            let v = F32x16(_mm512_mul_ps(*v, sc)).cap();
            // SAFETY: entry (key kk, the masked rows 16i..) of the caller's st block.
            unsafe { _mm512_mask_storeu_ps(st.add(kk * ldt + 16 * i), mask(i), v.0) };
        }
    }
}

/// [`TileMicro::softmax_t`] for `16*RV` rows, the last vector masked by `last` (masked-out
/// lanes are neither read nor written).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn softmax_rows<const RV: usize>(
    st: *mut f32,
    ldt: usize,
    n: usize,
    m: *mut f32,
    l: *mut f32,
    c: *mut f32,
    last: __mmask16,
) {
    let z = _mm512_setzero_ps();
    // SAFETY (whole block): the caller's contract, as `softmax_step`'s and `softmax_end`'s.
    unsafe {
        let (rows, sub) = softmax_step::<RV>(st, ldt, n, m, l, c, last);
        let mut sum = [z; RV];
        for j in 0..n {
            for i in 0..RV {
                let p = st.add(j * ldt + 16 * i);
                let x = _mm512_maskz_loadu_ps(row_mask::<RV>(i, last), p);
                let e = exp16_nonpos(_mm512_sub_ps(x, sub[i]));
                _mm512_mask_storeu_ps(p, row_mask::<RV>(i, last), e);
                sum[i] = _mm512_add_ps(sum[i], e);
            }
        }
        softmax_end::<RV>(rows, sum, m, l, last);
    }
}

/// The mask of row vector `i` of `RV`, the last one `last`.
#[inline(always)]
pub(super) fn row_mask<const RV: usize>(i: usize, last: __mmask16) -> __mmask16 {
    if i + 1 == RV {
        last
    } else {
        ALL
    }
}

/// The first half of a softmax step over `16*RV` rows (lanes; the last vector masked by
/// `last`) of the logits `st[j*ldt + r]`, `j < n`: the rows' running max and sum from `m`
/// and `l`, updated by the step's max, the factor `c` the old accumulator needs (stored), and
/// the value each row's logits are reduced by before `exp` (`sub`).
///
/// # Safety
/// AVX-512F/BW/VL/DQ, AVX2, FMA; the masked lanes of `m`, `l`, `c` and of every st row
/// `j < n` (stride `ldt`) are inside live allocations.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn softmax_step<const RV: usize>(
    st: *const f32,
    ldt: usize,
    n: usize,
    m: *const f32,
    l: *const f32,
    c: *mut f32,
    last: __mmask16,
) -> ([OnlineSoftmax<F32x16>; RV], [__m512; RV]) {
    let z = _mm512_setzero_ps();
    let mask = |i: usize| row_mask::<RV>(i, last);
    // SAFETY (whole block): the masked lanes 16i.. of m, l, c and of every st row j < n are
    // inside the ranges the caller asserted.
    unsafe {
        let mut mt = [_mm512_set1_ps(f32::NEG_INFINITY); RV];
        for j in 0..n {
            for (i, x) in mt.iter_mut().enumerate() {
                let s = _mm512_maskz_loadu_ps(mask(i), st.add(j * ldt + 16 * i));
                *x = _mm512_max_ps(*x, s);
            }
        }
        let mut rows = [OnlineSoftmax {
            max: F32x16(z),
            sum: F32x16(z),
        }; RV];
        let mut sub = [z; RV];
        for (i, row) in rows.iter_mut().enumerate() {
            row.max = F32x16(_mm512_maskz_loadu_ps(mask(i), m.add(16 * i)));
            row.sum = F32x16(_mm512_maskz_loadu_ps(mask(i), l.add(16 * i)));
            let step = row.update(F32x16(mt[i]));
            sub[i] = step.sub.0;
            _mm512_mask_storeu_ps(c.add(16 * i), mask(i), step.rescale.0);
        }
        (rows, sub)
    }
}

/// The second half of a softmax step ([`softmax_step`]): adds the step's sums of weights to
/// the rows' running sums and stores the rows' max and sum in `m` and `l`.
///
/// # Safety
/// As [`softmax_step`] (for `m` and `l`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn softmax_end<const RV: usize>(
    mut rows: [OnlineSoftmax<F32x16>; RV],
    sum: [__m512; RV],
    m: *mut f32,
    l: *mut f32,
    last: __mmask16,
) {
    let mask = |i: usize| row_mask::<RV>(i, last);
    // SAFETY (whole block): the masked lanes 16i.. of m and l, as the caller asserted.
    unsafe {
        for (i, row) in rows.iter_mut().enumerate() {
            row.add(F32x16(sum[i]));
            _mm512_mask_storeu_ps(m.add(16 * i), mask(i), row.max.0);
            _mm512_mask_storeu_ps(l.add(16 * i), mask(i), row.sum.0);
        }
    }
}
