//! AVX2 + FMA + F16C decode-tile loops (see [`DecodeMicro`]).
//!
//! QK: 4 rows x 3 keys per pass as in `avx2` (12 accumulators). Softmax: one max pass and one
//! exp-and-sum pass per row. PV: up to 4 rows x 16 columns in 8 accumulators over every key of
//! the tile, so each accumulator is loaded, scaled by the row's softmax correction and stored
//! once per tile (the correction costs no separate pass over the accumulator). Both loops issue
//! the prefetches of `pf` as they go: for f32 and f16 caches a group of lines every fourth inner
//! step ([`pf_every`]), for bf16 a line or two every step.
//!
//! Reached only through [`Avx2`], which proves the CPU has AVX2, FMA and F16C.

use std::arch::x86_64::*;

use super::avx2::{exp_sub_sum, load8, load_partial, Avx2};
use super::prefetch::Pf;
use super::{bounds, DecodeMicro};
use crate::dtype::{ElemType, Float};
use crate::kernel::softmax::{Lanes, OnlineSoftmax};

/// Inner steps per group of prefetch requests, by cache type (the group is as many lines as
/// those steps would have requested one by one). Measured in-process against a group every
/// step, the build before (AMD EPYC avx2, 2 threads, min of 21-31 interleaved repetitions):
/// every fourth step took 0.88-0.95x the time on f32 decode 16 x 1024 and 4 x 4096 in 8 of 10
/// runs (1.03-1.18x in the other two), 0.91-1.02x on f16 (0.94-0.98x in 5 runs of 4 x 4096),
/// but 1.02-1.14x on bf16; every sixteenth step was slower than every eighth (1.06-1.10x) and
/// every eighth than every fourth with f32 (1.01-1.03x).
#[inline(always)]
fn pf_every<C: Float>() -> usize {
    match C::TYPE {
        ElemType::BF16 => 1,
        _ => 4,
    }
}

impl DecodeMicro for Avx2 {
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
        let mut pf = Pf::grouped(
            pf,
            rows.div_ceil(4) * n.div_ceil(3) * (d / 8),
            pf_every::<C>(),
        );
        let (qp, kp, sp) = (q.as_ptr(), k.as_ptr(), s.as_mut_ptr());
        // SAFETY: `self` proves the features; `bounds::qk` bounds every access.
        unsafe { dec_qk::<C>(qp, rows, kp, n, d, sp, &mut pf, scale) }
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
        let mut pf = Pf::grouped(pf, rows.div_ceil(4) * d.div_ceil(24) * n, pf_every::<C>());
        // SAFETY: `self` proves the features; `bounds::dec_softmax_pv` bounds every access.
        unsafe {
            dec_softmax_pv::<C>(
                s.as_mut_ptr(),
                rows,
                n,
                v.as_ptr(),
                d,
                st.as_mut_ptr(),
                acc.as_mut_ptr(),
                &mut pf,
            )
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn dec_qk<C: Float>(
    q: *const f32,
    rows: usize,
    k: *const C,
    n: usize,
    d: usize,
    s: *mut f32,
    pf: &mut Pf,
    scale: f32,
) {
    let mut r = 0;
    while r < rows {
        let rr = (rows - r).min(4);
        let mut j = 0;
        while j < n {
            let kk = (n - j).min(3);
            // SAFETY: rows r..r+rr of q (stride d), keys j..j+kk of k and entries (r.., j..)
            // of s (stride n) are inside the ranges the caller checked.
            unsafe {
                let (qp, kp, sp) = (q.add(r * d), k.add(j * d), s.add(r * n + j));
                match (rr, kk) {
                    (4, 3) => *pf = qk_blk::<C, 4, 3>(qp, kp, d, sp, n, *pf, scale),
                    (4, 2) => *pf = qk_blk::<C, 4, 2>(qp, kp, d, sp, n, *pf, scale),
                    (4, _) => *pf = qk_blk::<C, 4, 1>(qp, kp, d, sp, n, *pf, scale),
                    (3, 3) => *pf = qk_blk::<C, 3, 3>(qp, kp, d, sp, n, *pf, scale),
                    (3, 2) => *pf = qk_blk::<C, 3, 2>(qp, kp, d, sp, n, *pf, scale),
                    (3, _) => *pf = qk_blk::<C, 3, 1>(qp, kp, d, sp, n, *pf, scale),
                    (2, 3) => *pf = qk_blk::<C, 2, 3>(qp, kp, d, sp, n, *pf, scale),
                    (2, 2) => *pf = qk_blk::<C, 2, 2>(qp, kp, d, sp, n, *pf, scale),
                    (2, _) => *pf = qk_blk::<C, 2, 1>(qp, kp, d, sp, n, *pf, scale),
                    (_, 3) => *pf = qk_blk::<C, 1, 3>(qp, kp, d, sp, n, *pf, scale),
                    (_, 2) => *pf = qk_blk::<C, 1, 2>(qp, kp, d, sp, n, *pf, scale),
                    (_, _) => *pf = qk_blk::<C, 1, 1>(qp, kp, d, sp, n, *pf, scale),
                }
            }
            j += kk;
        }
        r += rr;
    }
}

/// Dot products of `R` query rows with `K` key rows (length `d`, row stride `d`), stored as
/// `cap(scale * dot)`, one prefetch tick per 8 columns.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_blk<C: Float, const R: usize, const K: usize>(
    q: *const f32,
    k: *const C,
    d: usize,
    s: *mut f32,
    lds: usize,
    mut pf: Pf,
    scale: f32,
) -> Pf {
    let z = _mm256_setzero_ps();
    let mut acc = [[z; K]; R];
    let d8 = d & !7;
    let mut x = 0;
    while x < d8 {
        let mut kv = [z; K];
        for (kk, v) in kv.iter_mut().enumerate() {
            // SAFETY: x + 8 <= d, so 8 elements of key row kk are readable.
            *v = unsafe { load8(k.add(kk * d + x)) };
        }
        for (r, a) in acc.iter_mut().enumerate() {
            // SAFETY: as above, for query row r.
            let qv = unsafe { _mm256_loadu_ps(q.add(r * d + x)) };
            for kk in 0..K {
                a[kk] = _mm256_fmadd_ps(qv, kv[kk], a[kk]);
            }
        }
        pf.tick_every(pf_every::<C>());
        x += 8;
    }
    let mut v = [z; 12];
    for r in 0..R {
        for kk in 0..K {
            v[r * 3 + kk] = acc[r][kk];
        }
    }
    let mut out = [0f32; 12];
    // SAFETY: `out` holds 12 floats.
    unsafe { reduce12(&v, out.as_mut_ptr()) };
    for r in 0..R {
        for kk in 0..K {
            let mut t = out[r * 3 + kk];
            for xx in d8..d {
                // SAFETY: xx < d, inside row r of q and row kk of k.
                t += unsafe { *q.add(r * d + xx) * (*k.add(kk * d + xx)).to_f32() };
            }
            // SAFETY: entry (r, kk) of the caller's s tile.
            unsafe { *s.add(r * lds + kk) = (scale * t).cap() };
        }
    }
    pf
}

/// `out[i] = sum of the 8 lanes of v[i]` for 12 vectors, by a tree of horizontal adds.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn reduce12(v: &[__m256; 12], out: *mut f32) {
    let u0 = _mm256_hadd_ps(v[0], v[1]);
    let u1 = _mm256_hadd_ps(v[2], v[3]);
    let u2 = _mm256_hadd_ps(v[4], v[5]);
    let u3 = _mm256_hadd_ps(v[6], v[7]);
    let u4 = _mm256_hadd_ps(v[8], v[9]);
    let u5 = _mm256_hadd_ps(v[10], v[11]);
    // Lanes: [sums of the low halves of 4 vectors | sums of their high halves].
    let w0 = _mm256_hadd_ps(u0, u1);
    let w1 = _mm256_hadd_ps(u2, u3);
    let w2 = _mm256_hadd_ps(u4, u5);
    let s8 = _mm256_add_ps(
        _mm256_permute2f128_ps::<0x20>(w0, w1),
        _mm256_permute2f128_ps::<0x31>(w0, w1),
    );
    let s4 = _mm_add_ps(_mm256_castps256_ps128(w2), _mm256_extractf128_ps::<1>(w2));
    // SAFETY: the caller gives 12 writable floats at `out`.
    unsafe {
        _mm256_storeu_ps(out, s8);
        _mm_storeu_ps(out.add(8), s4);
    }
}

/// Largest of `n` floats at `p` (`-inf` when `n == 0`).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_max(p: *const f32, n: usize) -> f32 {
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut j = 0;
    while j + 8 <= n {
        // SAFETY: j + 8 <= n floats at p.
        mx = _mm256_max_ps(mx, unsafe { _mm256_loadu_ps(p.add(j)) });
        j += 8;
    }
    if j < n {
        // SAFETY: n - j < 8 floats remain.
        mx = _mm256_max_ps(mx, unsafe {
            load_partial(p.add(j), n - j, f32::NEG_INFINITY)
        });
    }
    let h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps::<1>(mx));
    let h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    let h = _mm_max_ss(h, _mm_shuffle_ps::<1>(h, h));
    _mm_cvtss_f32(h)
}

/// Keys whose weights are staged (transposed) at a time.
const WK: usize = 64;

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn dec_softmax_pv<C: Float>(
    s: *mut f32,
    rows: usize,
    n: usize,
    v: *const C,
    d: usize,
    st: *mut OnlineSoftmax,
    acc: *mut f32,
    pf: &mut Pf,
) {
    // Weights of up to 4 rows for WK keys, key-major (`wt[j*4 + i]`), so the PV loop reads the
    // 4 weights of a key from one pointer.
    // Uninitialised: `transpose_weights` writes every entry the PV loop reads.
    let mut wt = std::mem::MaybeUninit::<[f32; 4 * WK]>::uninit();
    let wt = wt.as_mut_ptr() as *mut f32;
    let mut r0 = 0;
    while r0 < rows {
        let rr = (rows - r0).min(4);
        // Per row of the group: the correction of its accumulator.
        let mut sc = [1f32; 4];
        for (i, c) in sc.iter_mut().enumerate().take(rr) {
            let r = r0 + i;
            // SAFETY (block): row r < rows of s (n floats) and of st (checked by the caller).
            unsafe {
                let (row, st) = (s.add(r * n), &mut *st.add(r));
                let step = st.update(row_max(row, n));
                *c = step.rescale;
                st.add(exp_sub_sum(
                    std::slice::from_raw_parts_mut(row, n),
                    step.sub,
                ));
            }
        }
        let mut j0 = 0;
        while j0 < n {
            let kc = (n - j0).min(WK);
            // SAFETY (block): rows r0..r0+rr of s (keys j0..j0+kc), `wt` (4*WK floats), value
            // rows j0..j0+kc and accumulator rows r0..r0+rr, all inside the checked ranges.
            unsafe {
                transpose_weights(s.add(r0 * n + j0), n, rr, kc, wt);
                let (vp, ap) = (v.add(j0 * d), acc.add(r0 * d));
                pv_cols::<C>(rr, wt, kc, vp, d, ap, &sc, pf);
            }
            // The correction applies once per tile.
            sc = [1.0; 4];
            j0 += kc;
        }
        r0 += rr;
    }
}

/// `wt[j*4 + i] = p[i*ldp + j]` for `i < rr`, `j < kc` (0 for `i >= rr`); `kc <= WK`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn transpose_weights(p: *const f32, ldp: usize, rr: usize, kc: usize, wt: *mut f32) {
    let z = _mm256_setzero_ps();
    let mut j = 0;
    while j < kc {
        let w = (kc - j).min(8);
        let mut r = [z; 4];
        for (i, x) in r.iter_mut().enumerate().take(rr) {
            // SAFETY: row i < rr, keys j..j+w of the caller's p.
            *x = unsafe {
                if w == 8 {
                    _mm256_loadu_ps(p.add(i * ldp + j))
                } else {
                    load_partial(p.add(i * ldp + j), w, 0.0)
                }
            };
        }
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        // u_k: [key k of rows 0..4 | key k+4 of rows 0..4].
        let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
        let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
        // SAFETY: keys j..j+8 <= WK of `wt` (4 floats each); keys past kc get weight 0 and are
        // never read.
        unsafe {
            let o = wt.add(j * 4);
            _mm256_storeu_ps(o, _mm256_permute2f128_ps::<0x20>(u0, u1));
            _mm256_storeu_ps(o.add(8), _mm256_permute2f128_ps::<0x20>(u2, u3));
            _mm256_storeu_ps(o.add(16), _mm256_permute2f128_ps::<0x31>(u0, u1));
            _mm256_storeu_ps(o.add(24), _mm256_permute2f128_ps::<0x31>(u2, u3));
        }
        j += 8;
    }
}

/// All `d` columns of `rr <= 4` accumulator rows: `acc = acc * sc[i] + sum_j wt[j*4 + i] *
/// v[j*d..]` over `kc` keys, in passes of 24 columns (12 accumulators), then 16, 8 and single
/// columns.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_cols<C: Float>(
    rr: usize,
    wt: *const f32,
    kc: usize,
    v: *const C,
    d: usize,
    acc: *mut f32,
    sc: &[f32; 4],
    pf: &mut Pf,
) {
    // Column vectors of 8: as many passes of 3 as leave an even rest, the rest in passes of 2.
    let cv = d / 8;
    let (p3, p2) = match cv % 3 {
        0 => (cv / 3, 0),
        2 => (cv / 3, 1),
        _ if cv >= 4 => (cv / 3 - 1, 2),
        _ => (0, 0),
    };
    let mut x = 0;
    // SAFETY (block): columns x.. < d of rows < rr of acc and of kc value rows, as checked by
    // the caller.
    unsafe {
        for _ in 0..p3 {
            pv_rows::<C, 3>(rr, wt, kc, v.add(x), d, acc.add(x), sc, pf);
            x += 24;
        }
        for _ in 0..p2 {
            pv_rows::<C, 2>(rr, wt, kc, v.add(x), d, acc.add(x), sc, pf);
            x += 16;
        }
        if x + 8 <= d {
            pv_rows::<C, 1>(rr, wt, kc, v.add(x), d, acc.add(x), sc, pf);
            x += 8;
        }
        for (i, &c) in sc.iter().enumerate().take(rr) {
            for xx in x..d {
                let mut t = *acc.add(i * d + xx) * c;
                for j in 0..kc {
                    t += *wt.add(j * 4 + i) * (*v.add(j * d + xx)).to_f32();
                }
                *acc.add(i * d + xx) = t;
            }
        }
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_rows<C: Float, const DV: usize>(
    rr: usize,
    wt: *const f32,
    kc: usize,
    v: *const C,
    d: usize,
    acc: *mut f32,
    sc: &[f32; 4],
    pf: &mut Pf,
) {
    // SAFETY: forwarded from `pv_cols`.
    unsafe {
        match rr {
            4 => *pf = pv_blk::<C, 4, DV>(wt, kc, v, d, acc, sc, *pf),
            3 => *pf = pv_blk::<C, 3, DV>(wt, kc, v, d, acc, sc, *pf),
            2 => *pf = pv_blk::<C, 2, DV>(wt, kc, v, d, acc, sc, *pf),
            _ => *pf = pv_blk::<C, 1, DV>(wt, kc, v, d, acc, sc, *pf),
        }
    }
}

/// `R` accumulator rows (stride `d`), `8*DV` columns: `acc = acc * sc[r] + sum_j wt[j*4 + r] *
/// v[j*d..]`, the `kc` keys in order, one prefetch tick per key.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_blk<C: Float, const R: usize, const DV: usize>(
    wt: *const f32,
    kc: usize,
    v: *const C,
    d: usize,
    acc: *mut f32,
    sc: &[f32; 4],
    mut pf: Pf,
) -> Pf {
    let z = _mm256_setzero_ps();
    let mut a = [[z; DV]; R];
    for (r, ar) in a.iter_mut().enumerate() {
        let c = _mm256_set1_ps(sc[r]);
        for (dv, x) in ar.iter_mut().enumerate() {
            // SAFETY: 8*DV columns of accumulator row r are inside `acc` (caller).
            *x = _mm256_mul_ps(unsafe { _mm256_loadu_ps(acc.add(r * d + dv * 8)) }, c);
        }
    }
    let mut vp = v;
    let mut wp = wt;
    for _ in 0..kc {
        let mut vv = [z; DV];
        for (dv, x) in vv.iter_mut().enumerate() {
            // SAFETY: value row j < kc, 8*DV columns from the caller's column offset, all < d.
            *x = unsafe { load8(vp.add(dv * 8)) };
        }
        for (r, ar) in a.iter_mut().enumerate() {
            // SAFETY: weight (j, r) of the staged weights (j < kc <= WK).
            let w = unsafe { _mm256_broadcast_ss(&*wp.add(r)) };
            for dv in 0..DV {
                ar[dv] = _mm256_fmadd_ps(w, vv[dv], ar[dv]);
            }
        }
        pf.tick_every(pf_every::<C>());
        // Wrapping: after the last key these point past the tile (never read).
        vp = vp.wrapping_add(d);
        wp = wp.wrapping_add(4);
    }
    for (r, ar) in a.iter().enumerate() {
        for (dv, x) in ar.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm256_storeu_ps(acc.add(r * d + dv * 8), *x) };
        }
    }
    pf
}
