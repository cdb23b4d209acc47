//! AVX-512 decode-tile loops (see [`DecodeMicro`]).
//!
//! QK: the shared [`qk`] block (4 rows x 4 keys, or 1-2 rows x 8 keys, 16-wide columns with a
//! masked tail); for many rows of a small head ([`keys_in_lanes`], e.g. a verify step's
//! tokens x group), [`qk_lanes`] instead: keys transposed into lanes once per tile, so each
//! row's logits need no horizontal sums and no row is padded. Softmax: one max pass and one exp-and-sum pass per row. PV: the shared
//! [`pv_cols`] block over groups of 4 rows, reading the row-major weights in place (a broadcast
//! load per row and key; no staging transpose), each accumulator loaded, scaled by its row's
//! correction and stored once per tile. Both loops issue the prefetches of `pf` a few lines
//! per inner step, as the AVX2 tier does.
//!
//! Reached only through [`Avx512`], which proves the CPU has the features.

use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use super::avx512::{
    exp_sub_sum, load16, pv_cols, qk, qk_ticks, row_max, tail, transpose16, Avx512, F32x16, ALL,
};
use super::prefetch::Pf;
use super::{bounds, DecodeMicro};
use crate::dtype::{ElemType, Float};
use crate::kernel::softmax::{Lanes, OnlineSoftmax};

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
        let (qp, kp, sp) = (q.as_ptr(), k.as_ptr(), s.as_mut_ptr());
        if keys_in_lanes(rows, d) {
            let mut pf = Pf::new(pf, lanes_ticks(rows, n, d));
            // SAFETY: `self` proves the features; `bounds::qk` bounds every access, and
            // `keys_in_lanes` holds `d` within what `qk_lanes` takes.
            unsafe { qk_lanes::<C>(qp, rows, kp, n, d, sp, &mut pf, scale) }
        } else {
            let mut pf = Pf::new(pf, qk_ticks(rows, n, d));
            // SAFETY: `self` proves the features; `bounds::qk` bounds every access.
            unsafe { qk::<C>(qp, rows, kp, n, d, sp, n, &mut pf, scale) }
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

/// Keys per pass of [`qk_lanes`] (two vectors).
const LANE_KEYS: usize = 32;
/// The largest head size [`qk_lanes`] takes: its transposed keys (`LANE_KEYS` x `d` floats,
/// 16 KiB) live on the stack.
const LANES_MAX_D: usize = 128;
// The panel holds whole 16-column blocks of every head size up to it.
const _: () = assert!(LANES_MAX_D.is_multiple_of(16));
/// Query rows per register block of [`qk_lanes`] (x 2 vectors of keys).
const LANE_ROWS: usize = 8;

/// Whether [`qk_lanes`] beats the row-major [`qk`] blocks for `rows` query rows of size `d`.
/// The transpose costs about `d` per key, once; what it saves (the horizontal sums and padded
/// rows of `qk`) grows with the rows. Measured on AMD EPYC Zen 4 (whole decode calls, one
/// thread): at d = 64, 6 rows break even, 9 and 15 take 0.86-0.94x the time; at d = 128, 8
/// rows take 1.05x, 12 break even, 20 take 0.96x; 3 and 4 rows took 1.03x and 1.2x.
fn keys_in_lanes(rows: usize, d: usize) -> bool {
    d <= LANES_MAX_D && rows * 8 >= d + 8
}

/// Row blocks of [`qk_lanes`] for `rows`: as few as [`LANE_ROWS`] allows, of even sizes.
fn lane_blocks(rows: usize) -> (usize, usize) {
    let nb = rows.div_ceil(LANE_ROWS);
    (nb, rows.div_ceil(nb))
}

/// How many prefetch ticks [`qk_lanes`] gives (one per 4 columns of a row block and pass).
fn lanes_ticks(rows: usize, n: usize, d: usize) -> usize {
    n.div_ceil(LANE_KEYS) * lane_blocks(rows).0 * d.div_ceil(4)
}

/// `s[r*n + j] = cap(scale * <q[r*d..][..d], k[j*d..][..d]>)` with keys in lanes: each pass
/// transposes up to 32 keys into a `[d][32]` panel (in registers, 16 keys x 16 columns at a
/// time), then every
/// query row accumulates 32 logits in two vectors, one FMA per column with the query element
/// broadcast, in column order, so no horizontal sums. The caller guarantees the ranges, `s`
/// with row stride `n`, and `d <= LANES_MAX_D`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_lanes<C: Float>(
    q: *const f32,
    rows: usize,
    k: *const C,
    n: usize,
    d: usize,
    s: *mut f32,
    pf: &mut Pf,
    scale: f32,
) {
    debug_assert!(d <= LANES_MAX_D);
    // Column x of keys 16g..16g+16 of the pass is vector 2x + g; only what a pass writes is read.
    let mut panel = MaybeUninit::<[__m512; 2 * LANES_MAX_D]>::uninit();
    let kt = panel.as_mut_ptr() as *mut __m512;
    let (nb, rb) = lane_blocks(rows);
    let mut j0 = 0;
    while j0 < n {
        let kn = (n - j0).min(LANE_KEYS);
        for g in 0..kn.div_ceil(16) {
            let gn = (kn - 16 * g).min(16);
            // SAFETY: keys j0+16g.. of the pass (gn of them) and columns < d are the caller's;
            // the panel holds 2 * LANES_MAX_D >= 2 * d.next_multiple_of(16) vectors.
            unsafe { transpose_keys::<C>(k.add((j0 + 16 * g) * d), gn, d, kt.add(g)) };
        }
        for b in 0..nb {
            let r0 = b * rb;
            let rr = rb.min(rows - r0);
            // SAFETY: rows r0..r0+rr of q and s, keys j0..j0+kn of s; the panel's columns < d
            // of the kn.div_ceil(16) groups were written above.
            unsafe {
                let (qp, sp) = (q.add(r0 * d), s.add(r0 * n + j0));
                macro_rules! rows {
                    ($w:literal) => {
                        match rr {
                            8 => lanes_block::<8, $w>(qp, d, kt, kn, sp, n, pf, scale),
                            7 => lanes_block::<7, $w>(qp, d, kt, kn, sp, n, pf, scale),
                            6 => lanes_block::<6, $w>(qp, d, kt, kn, sp, n, pf, scale),
                            5 => lanes_block::<5, $w>(qp, d, kt, kn, sp, n, pf, scale),
                            4 => lanes_block::<4, $w>(qp, d, kt, kn, sp, n, pf, scale),
                            3 => lanes_block::<3, $w>(qp, d, kt, kn, sp, n, pf, scale),
                            2 => lanes_block::<2, $w>(qp, d, kt, kn, sp, n, pf, scale),
                            _ => lanes_block::<1, $w>(qp, d, kt, kn, sp, n, pf, scale),
                        }
                    };
                }
                if kn > 16 {
                    rows!(2)
                } else {
                    rows!(1)
                }
            }
        }
        j0 += kn;
    }
}

/// Writes column `x` of `1 <= kn <= 16` keys (row stride `d`, widened to f32) as lane `i` =
/// key `i` of vector `dst[2x]`, for `x < d.next_multiple_of(16)` (columns past `d` are 0, lanes
/// past `kn` repeat key `kn - 1`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn transpose_keys<C: Float>(k: *const C, kn: usize, d: usize, dst: *mut __m512) {
    // Keys past `kn` repeat the last one (always readable); their lanes are never stored.
    let kp: [*const C; 16] = std::array::from_fn(|i| k.wrapping_add(i.min(kn - 1) * d));
    let mut x = 0;
    if C::TYPE == ElemType::F32 {
        // `C::TYPE` names the element type: these rows are f32 (read as such below).
        let kp = kp.map(|p| p as *const f32);
        while x + 16 <= d {
            // P[4a + m]: quarter L = columns x+4m..x+4m+4 of key 4L + a, so no shuffle moves
            // data across quarters (the loads place it).
            let p: [__m512; 16] = std::array::from_fn(|i| {
                let (a, c) = (i / 4, x + 4 * (i % 4));
                // SAFETY: columns x..x+16 <= d (f32) of keys < kn (or the last one repeated).
                unsafe {
                    let v = _mm512_castps128_ps512(_mm_loadu_ps(kp[a].add(c)));
                    let v = _mm512_insertf32x4::<1>(v, _mm_loadu_ps(kp[4 + a].add(c)));
                    let v = _mm512_insertf32x4::<2>(v, _mm_loadu_ps(kp[8 + a].add(c)));
                    _mm512_insertf32x4::<3>(v, _mm_loadu_ps(kp[12 + a].add(c)))
                }
            });
            // A 4 x 4 transpose in every quarter of P[m], P[4+m], P[8+m], P[12+m] gives
            // columns x+4m..x+4m+4 with lane 4L + a = key 4L + a.
            for m in 0..4 {
                let (a0, a1, a2, a3) = (p[m], p[4 + m], p[8 + m], p[12 + m]);
                let t0 = _mm512_unpacklo_ps(a0, a1);
                let t1 = _mm512_unpackhi_ps(a0, a1);
                let t2 = _mm512_unpacklo_ps(a2, a3);
                let t3 = _mm512_unpackhi_ps(a2, a3);
                let c = [
                    _mm512_shuffle_ps::<0x44>(t0, t2),
                    _mm512_shuffle_ps::<0xEE>(t0, t2),
                    _mm512_shuffle_ps::<0x44>(t1, t3),
                    _mm512_shuffle_ps::<0xEE>(t1, t3),
                ];
                for (e, r) in c.iter().enumerate() {
                    // SAFETY: vector 2(x + 4m + e) of the caller's panel.
                    unsafe { dst.add(2 * (x + 4 * m + e)).write(*r) };
                }
            }
            x += 16;
        }
    }
    while x < d {
        let mask = if d - x >= 16 { ALL } else { tail(d - x) };
        // SAFETY: the lanes of `mask` are columns x.. < d of a key < kn.
        let mut t: [__m512i; 16] = std::array::from_fn(|i| {
            // SAFETY: as above.
            _mm512_castps_si512(unsafe { load16(kp[i].add(x), mask) })
        });
        transpose16(&mut t);
        for (c, r) in t.iter().enumerate() {
            // SAFETY: vector 2(x + c) of the caller's panel.
            unsafe { dst.add(2 * (x + c)).write(_mm512_castsi512_ps(*r)) };
        }
        x += 16;
    }
}

/// `R` query rows (stride `d`) x `16W` keys of the panel `kt` (see [`qk_lanes`]); stores the
/// first `kn` logits of each row (stride `lds`). One `pf` tick per 4 columns.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn lanes_block<const R: usize, const W: usize>(
    q: *const f32,
    d: usize,
    kt: *const __m512,
    kn: usize,
    s: *mut f32,
    lds: usize,
    pf: &mut Pf,
    scale: f32,
) {
    let z = _mm512_setzero_ps();
    let mut a = [[z; W]; R];
    for x in 0..d {
        // SAFETY: panel vectors 2x.. of the groups written; element x of each query row.
        unsafe {
            let kv: [__m512; W] = std::array::from_fn(|w| *kt.add(2 * x + w));
            for (r, ar) in a.iter_mut().enumerate() {
                let qb = _mm512_set1_ps(*q.add(r * d + x));
                for w in 0..W {
                    ar[w] = _mm512_fmadd_ps(kv[w], qb, ar[w]);
                }
            }
        }
        if x % 4 == 3 {
            pf.tick();
        }
    }
    let sc = _mm512_set1_ps(scale);
    for (r, ar) in a.iter().enumerate() {
        for (w, v) in ar.iter().enumerate() {
            let m = tail((kn - (16 * w).min(kn)).min(16));
            let v = F32x16(_mm512_mul_ps(*v, sc)).cap().0;
            // SAFETY: logits (r, 16w..16w+16 masked to < kn) of the caller's block.
            unsafe { _mm512_mask_storeu_ps(s.add(r * lds + 16 * w), m, v) };
        }
    }
}
