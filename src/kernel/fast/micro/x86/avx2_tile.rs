//! AVX2 + FMA [`TileMicro`]: prefill tiles on transposed logits (`st[key][row]`).
//!
//! Register blocking: `qk_t` computes 16 rows x 6 keys per pass (12 accumulators; per `x`, two
//! loads of the `[D][rows]` query panel and six key broadcasts), so no horizontal sums;
//! `softmax_t` runs 8 rows per vector (row max, exp, row sums are lane-wise); `pv_t` keeps
//! 6 rows x 16 output columns in 12 accumulators over all keys of a tile, broadcasting the
//! weights and scaling the old accumulator by the softmax correction as it is loaded.
//! Inputs are f32: the caller widens f16/bf16 tiles once per tile, not once per row block.

use std::arch::x86_64::*;

use super::avx2::{exp8_nonpos, Avx2, F32x8};
use super::{bounds, TileMicro};
use crate::kernel::softmax::{Lanes, OnlineSoftmax};

impl TileMicro for Avx2 {
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
        bounds::qk_t(qt.len(), ldq, rows, k.len(), n, d, st.len(), ldt);
        let rows8 = rows.div_ceil(8) * 8;
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
        // SAFETY: `self` proves the features; `bounds::softmax_t` bounds every access.
        unsafe {
            softmax_t(
                st.as_mut_ptr(),
                ldt,
                rows8,
                n,
                m.as_mut_ptr(),
                l.as_mut_ptr(),
                c.as_mut_ptr(),
            )
        }
    }

    fn transpose(self, src: &[f32], rows: usize, d: usize, dst: &mut [f32], ldd: usize) {
        bounds::transpose(src.len(), rows, d, dst.len(), ldd);
        let rows8 = rows.div_ceil(8) * 8;
        // SAFETY: `self` proves the features; `bounds::transpose` bounds every access.
        unsafe { transpose(src.as_ptr(), rows8, d, dst.as_mut_ptr(), ldd) }
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
        bounds::pv_t(pt.len(), ldp, rows, v.len(), n, d, c.len(), acc.len());
        // SAFETY: `self` proves the features; `bounds::pv_t` bounds every access.
        unsafe {
            pv_t(
                pt.as_ptr(),
                ldp,
                rows,
                v.as_ptr(),
                n,
                d,
                c.as_ptr(),
                acc.as_mut_ptr(),
            )
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
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
) {
    let mut r = 0;
    while r < rows8 {
        let two = rows8 - r >= 16;
        let mut j = 0;
        while j < n {
            // 7 or 8 keys left: 4 + 3 or 4 + 4 (a 1- or 2-key block would run on FMA latency).
            let kk = match n - j {
                7 | 8 => 4,
                left => left.min(6),
            };
            // SAFETY: rows r..r+8*RV (< rows8) of the panel, keys j..j+kk of k and the matching
            // st entries are inside the ranges `check_qk` asserted.
            unsafe {
                let (qp, kp, sp) = (qt.add(r), k.add(j * d), st.add(j * ldt + r));
                macro_rules! go {
                    ($rv:literal) => {
                        match kk {
                            6 => qk_t_block::<$rv, 6>(qp, ldq, kp, d, sp, ldt, scale),
                            5 => qk_t_block::<$rv, 5>(qp, ldq, kp, d, sp, ldt, scale),
                            4 => qk_t_block::<$rv, 4>(qp, ldq, kp, d, sp, ldt, scale),
                            3 => qk_t_block::<$rv, 3>(qp, ldq, kp, d, sp, ldt, scale),
                            2 => qk_t_block::<$rv, 2>(qp, ldq, kp, d, sp, ldt, scale),
                            _ => qk_t_block::<$rv, 1>(qp, ldq, kp, d, sp, ldt, scale),
                        }
                    };
                }
                if two {
                    go!(2)
                } else {
                    go!(1)
                }
            }
            j += kk;
        }
        r += if two { 16 } else { 8 };
    }
}

/// `8*RV` rows x `K` keys of `st` (stride `ldt`, scaled and capped) from the query panel
/// (stride `ldq`) and `K` key rows (stride `d`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_t_block<const RV: usize, const K: usize>(
    qt: *const f32,
    ldq: usize,
    k: *const f32,
    d: usize,
    st: *mut f32,
    ldt: usize,
    scale: f32,
) {
    let z = _mm256_setzero_ps();
    let sc = _mm256_set1_ps(scale);
    let mut a = [[z; RV]; K];
    for x in 0..d {
        let mut qv = [z; RV];
        for (i, q) in qv.iter_mut().enumerate() {
            // SAFETY: panel row x < d, lanes 8i..8i+8 of the caller's rows.
            *q = unsafe { _mm256_loadu_ps(qt.add(x * ldq + 8 * i)) };
        }
        for (kk, ak) in a.iter_mut().enumerate() {
            // SAFETY: element x < d of key row kk < K.
            let b = unsafe { _mm256_broadcast_ss(&*k.add(kk * d + x)) };
            for i in 0..RV {
                ak[i] = _mm256_fmadd_ps(qv[i], b, ak[i]);
            }
        }
    }
    for (kk, ak) in a.iter().enumerate() {
        for (i, v) in ak.iter().enumerate() {
            let v = F32x8(_mm256_mul_ps(*v, sc)).cap();
            // SAFETY: entry (key kk, rows 8i..8i+8) of the caller's st block.
            unsafe { _mm256_storeu_ps(st.add(kk * ldt + 8 * i), v.0) };
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_t(
    st: *mut f32,
    ldt: usize,
    rows8: usize,
    n: usize,
    m: *mut f32,
    l: *mut f32,
    c: *mut f32,
) {
    let mut r = 0;
    // Two row vectors per pass: two independent max/exp/sum chains (each row still sums its
    // keys in order).
    while r + 16 <= rows8 {
        // SAFETY: rows r..r+16 <= rows8, as the caller asserted.
        unsafe { softmax_rows::<2>(st.add(r), ldt, n, m.add(r), l.add(r), c.add(r)) };
        r += 16;
    }
    if r < rows8 {
        // SAFETY: rows r..r+8 <= rows8, as the caller asserted.
        unsafe { softmax_rows::<1>(st.add(r), ldt, n, m.add(r), l.add(r), c.add(r)) };
    }
}

/// [`TileMicro::softmax_t`] for `8*RV` rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn softmax_rows<const RV: usize>(
    st: *mut f32,
    ldt: usize,
    n: usize,
    m: *mut f32,
    l: *mut f32,
    c: *mut f32,
) {
    let z = _mm256_setzero_ps();
    // SAFETY (whole block): lanes 0..8*RV of m, l, c and of every st row j < n are inside the
    // ranges the caller asserted.
    unsafe {
        let mut mt = [_mm256_set1_ps(f32::NEG_INFINITY); RV];
        for j in 0..n {
            for (i, x) in mt.iter_mut().enumerate() {
                *x = _mm256_max_ps(*x, _mm256_loadu_ps(st.add(j * ldt + 8 * i)));
            }
        }
        let mut rows = [OnlineSoftmax {
            max: F32x8(z),
            sum: F32x8(z),
        }; RV];
        let mut sub = [z; RV];
        for (i, row) in rows.iter_mut().enumerate() {
            row.max = F32x8(_mm256_loadu_ps(m.add(8 * i)));
            row.sum = F32x8(_mm256_loadu_ps(l.add(8 * i)));
            let step = row.update(F32x8(mt[i]));
            sub[i] = step.sub.0;
            _mm256_storeu_ps(c.add(8 * i), step.rescale.0);
        }
        let mut sum = [z; RV];
        for j in 0..n {
            for i in 0..RV {
                let p = st.add(j * ldt + 8 * i);
                let e = exp8_nonpos(_mm256_sub_ps(_mm256_loadu_ps(p), sub[i]));
                _mm256_storeu_ps(p, e);
                sum[i] = _mm256_add_ps(sum[i], e);
            }
        }
        for (i, row) in rows.iter_mut().enumerate() {
            row.add(F32x8(sum[i]));
            _mm256_storeu_ps(m.add(8 * i), row.max.0);
            _mm256_storeu_ps(l.add(8 * i), row.sum.0);
        }
    }
}

/// 8x8 blocks of `src` (`rows8` rows of `d`) into `dst` (`d` rows of stride `ldd`).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose(src: *const f32, rows8: usize, d: usize, dst: *mut f32, ldd: usize) {
    let d8 = d & !7;
    for r in (0..rows8).step_by(8) {
        // SAFETY (whole block): rows r..r+8 <= rows8 of src and columns < d; dst rows x < d,
        // lanes r..r+8 <= rows8 <= ldd; all inside the ranges the caller asserted.
        unsafe {
            let s = src.add(r * d);
            for x in (0..d8).step_by(8) {
                let l = |i: usize| _mm256_loadu_ps(s.add(i * d + x));
                let (a0, a1, a2, a3) = (l(0), l(1), l(2), l(3));
                let (a4, a5, a6, a7) = (l(4), l(5), l(6), l(7));
                let t0 = _mm256_unpacklo_ps(a0, a1);
                let t1 = _mm256_unpackhi_ps(a0, a1);
                let t2 = _mm256_unpacklo_ps(a2, a3);
                let t3 = _mm256_unpackhi_ps(a2, a3);
                let t4 = _mm256_unpacklo_ps(a4, a5);
                let t5 = _mm256_unpackhi_ps(a4, a5);
                let t6 = _mm256_unpacklo_ps(a6, a7);
                let t7 = _mm256_unpackhi_ps(a6, a7);
                let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
                let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
                let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
                let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
                let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
                let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
                let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
                let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
                let o = |i: usize| dst.add((x + i) * ldd + r);
                _mm256_storeu_ps(o(0), _mm256_permute2f128_ps::<0x20>(u0, u4));
                _mm256_storeu_ps(o(1), _mm256_permute2f128_ps::<0x20>(u1, u5));
                _mm256_storeu_ps(o(2), _mm256_permute2f128_ps::<0x20>(u2, u6));
                _mm256_storeu_ps(o(3), _mm256_permute2f128_ps::<0x20>(u3, u7));
                _mm256_storeu_ps(o(4), _mm256_permute2f128_ps::<0x31>(u0, u4));
                _mm256_storeu_ps(o(5), _mm256_permute2f128_ps::<0x31>(u1, u5));
                _mm256_storeu_ps(o(6), _mm256_permute2f128_ps::<0x31>(u2, u6));
                _mm256_storeu_ps(o(7), _mm256_permute2f128_ps::<0x31>(u3, u7));
            }
            for x in d8..d {
                for i in 0..8 {
                    *dst.add(x * ldd + r + i) = *s.add(i * d + x);
                }
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_t(
    pt: *const f32,
    ldp: usize,
    rows: usize,
    v: *const f32,
    n: usize,
    d: usize,
    c: *const f32,
    acc: *mut f32,
) {
    let mut r = 0;
    while r < rows {
        let rr = (rows - r).min(6);
        // SAFETY (whole block): rows r..r+rr of pt, c and acc, columns x..x+16 / x..x+8 < d of
        // v and acc, all inside the ranges the caller asserted.
        unsafe {
            let (pp, cp, ap) = (pt.add(r), c.add(r), acc.add(r * d));
            let mut x = 0;
            while x + 16 <= d {
                pv_t_rows::<2>(rr, pp, ldp, v.add(x), n, d, cp, ap.add(x));
                x += 16;
            }
            if x + 8 <= d {
                pv_t_rows::<1>(rr, pp, ldp, v.add(x), n, d, cp, ap.add(x));
                x += 8;
            }
            for rrow in 0..rr {
                for xx in x..d {
                    let mut t = *ap.add(rrow * d + xx) * *cp.add(rrow);
                    for j in 0..n {
                        t += *pp.add(j * ldp + rrow) * *v.add(j * d + xx);
                    }
                    *ap.add(rrow * d + xx) = t;
                }
            }
        }
        r += rr;
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_t_rows<const DV: usize>(
    rr: usize,
    p: *const f32,
    ldp: usize,
    v: *const f32,
    n: usize,
    d: usize,
    c: *const f32,
    acc: *mut f32,
) {
    // SAFETY: forwarded from `pv_t`.
    unsafe {
        match rr {
            6 => pv_t_block::<6, DV>(p, ldp, v, n, d, c, acc),
            5 => pv_t_block::<5, DV>(p, ldp, v, n, d, c, acc),
            4 => pv_t_block::<4, DV>(p, ldp, v, n, d, c, acc),
            3 => pv_t_block::<3, DV>(p, ldp, v, n, d, c, acc),
            2 => pv_t_block::<2, DV>(p, ldp, v, n, d, c, acc),
            _ => pv_t_block::<1, DV>(p, ldp, v, n, d, c, acc),
        }
    }
}

/// `R` accumulator rows (stride `d`) x `8*DV` columns, scaled by `c[r]`, += transposed
/// weights `p[j*ldp + r]` x `n` value rows (stride `d`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_t_block<const R: usize, const DV: usize>(
    p: *const f32,
    ldp: usize,
    v: *const f32,
    n: usize,
    d: usize,
    c: *const f32,
    acc: *mut f32,
) {
    let z = _mm256_setzero_ps();
    let mut a = [[z; DV]; R];
    for (r, ar) in a.iter_mut().enumerate() {
        // SAFETY: c[r] and 8*DV columns of accumulator row r are inside the caller's ranges.
        unsafe {
            let cr = _mm256_broadcast_ss(&*c.add(r));
            for (dv, x) in ar.iter_mut().enumerate() {
                *x = _mm256_mul_ps(_mm256_loadu_ps(acc.add(r * d + dv * 8)), cr);
            }
        }
    }
    for j in 0..n {
        let mut vv = [z; DV];
        for (dv, x) in vv.iter_mut().enumerate() {
            // SAFETY: value row j < n, 8*DV columns from the caller's column offset, all < d.
            *x = unsafe { _mm256_loadu_ps(v.add(j * d + dv * 8)) };
        }
        for (r, ar) in a.iter_mut().enumerate() {
            // SAFETY: weight (key j, row r) is inside the caller's pt tile.
            let w = unsafe { _mm256_broadcast_ss(&*p.add(j * ldp + r)) };
            for dv in 0..DV {
                ar[dv] = _mm256_fmadd_ps(w, vv[dv], ar[dv]);
            }
        }
    }
    for (r, ar) in a.iter().enumerate() {
        for (dv, x) in ar.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm256_storeu_ps(acc.add(r * d + dv * 8), *x) };
        }
    }
}
