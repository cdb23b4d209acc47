//! AVX-512 (F + BW + VL + DQ) micro-kernels: 16-wide f32 vectors, tails done with lane masks
//! (masked loads never touch the lanes they leave out, so no scalar remainder loops).
//!
//! Also the two register blocks the decode and prefill loops of this tier share:
//! - [`qk`]: row-major dot products, up to 4 query rows x 4 keys (or 3 x 5, 2 x 8, 1 x 8) per
//!   pass in 16 (15) accumulators, reduced together by one transposing tree ([`reduce16`]); rows and keys
//!   past the end of a block reuse the last real one and their results are dropped.
//! - [`pv_cols`]: up to 4 (decode) or 6 (prefill) accumulator rows x 64 columns (4 vectors) over
//!   all keys of a tile, the old accumulator scaled by the row's correction as it is loaded.
//!   Weights are addressed by a row and a key stride, so row-major (decode) and transposed
//!   (prefill) weights use the same loop.
//!
//! [`F32x16`] runs the online-softmax step on 16 rows at once (the prefill tiles).
//!
//! f16 rows are widened with `vcvtph2ps`, bf16 rows by shifting the 16 bits into the top of an
//! f32. Every function here is `#[target_feature(enable = "avx512f,avx512bw,avx512vl,
//! avx512dq,avx2,fma,f16c")]`; they are reached only through [`Avx512`], which only
//! [`Avx512::detect`] builds, after the CPU (and OS) reported all of those features.

use std::arch::x86_64::*;

use super::avx2::Avx2;
use super::prefetch::Pf;
use super::{bounds, cephes, Micro};
use crate::dtype::{ElemType, Float};
use crate::kernel::softmax::Lanes;

/// Proof that AVX-512 F/BW/VL/DQ (and with them AVX2, FMA, F16C) are available.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx512 {
    /// This tier reuses a few AVX2 loops that are not worth widening (the panel transpose).
    pub(super) avx2: Avx2,
}

impl Avx512 {
    /// `Some` when this CPU (and OS, which must save the zmm and mask registers) supports
    /// AVX-512 F, BW, VL and DQ, plus AVX2, FMA and F16C.
    pub(crate) fn detect() -> Option<Avx512> {
        let avx2 = Avx2::detect()?;
        (is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl")
            && is_x86_feature_detected!("avx512dq"))
        .then_some(Avx512 { avx2 })
    }
}

/// All 16 lanes.
pub(super) const ALL: __mmask16 = 0xFFFF;

/// The mask of the first `len <= 16` lanes.
#[inline(always)]
pub(super) fn tail(len: usize) -> __mmask16 {
    debug_assert!(len <= 16);
    ((1u32 << len) - 1) as __mmask16
}

impl Micro for Avx512 {
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
        bounds::qk(q.len(), rows, k.len(), n, d, s.len(), lds);
        // SAFETY: `self` proves the features; `bounds::qk` bounds every access.
        unsafe {
            qk::<C>(
                q.as_ptr(),
                rows,
                k.as_ptr(),
                n,
                d,
                s.as_mut_ptr(),
                lds,
                &mut Pf::none(),
                scale,
            )
        }
    }

    fn add_exp_scaled(self, dst: &mut [f32], s: &[f32], m: f32, c: f32) {
        assert!(s.len() >= dst.len());
        // SAFETY: `self` proves the features; accesses stay inside `dst` and `s[..dst.len()]`.
        unsafe { add_exp_scaled(dst, s, m, c) }
    }

    fn scale(self, x: &mut [f32], c: f32) {
        // SAFETY: `self` proves the features; the function stays inside `x`.
        unsafe { scale::<false>(x, c) }
    }

    fn scale_logits(self, s: &mut [f32], c: f32) {
        // SAFETY: `self` proves the features; the function stays inside `s`.
        unsafe { scale::<true>(s, c) }
    }

    fn widen<C: Float>(self, src: &[C], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        // SAFETY: `self` proves the features; `n` elements exist in both slices.
        unsafe { widen::<C>(src.as_ptr(), dst.as_mut_ptr(), n) }
    }

    fn narrow<C: Float>(self, src: &[f32], dst: &mut [C]) {
        let n = src.len().min(dst.len());
        // SAFETY: `self` proves the features; `n` elements exist in both slices.
        unsafe { narrow::<C>(src.as_ptr(), dst.as_mut_ptr(), n) }
    }
}

/// The lanes of `k` from 16 elements of type `C` at `p`, widened to f32; other lanes 0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn load16<C: Float>(p: *const C, k: __mmask16) -> __m512 {
    // SAFETY (all arms): the caller guarantees that the elements of type `C` at `p` for the
    // lanes of `k` are readable (masked-out lanes are not accessed); `C::TYPE` names that type,
    // so the reinterpretation reads exactly those bytes.
    unsafe {
        match C::TYPE {
            ElemType::F32 => _mm512_maskz_loadu_ps(k, p as *const f32),
            ElemType::F16 => _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, p as *const i16)),
            // bf16 is the top half of an f32: zero-extend to 32 bits and shift up.
            _ => _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(
                _mm256_maskz_loadu_epi16(k, p as *const i16),
            ))),
        }
    }
}

/// `exp(x)` for 16 lanes; exactly 0 below [`cephes::X_MIN`] (and for -inf), NaN for NaN.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) fn exp16(x: __m512) -> __m512 {
    let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, _mm512_set1_ps(cephes::X_MIN));
    // min/max return their second operand when either is NaN: `x` second keeps NaN.
    let x = _mm512_min_ps(_mm512_set1_ps(cephes::X_MAX), x);
    let x = _mm512_max_ps(_mm512_set1_ps(cephes::X_MIN), x);
    _mm512_maskz_mov_ps(!under, exp16_clamped(x))
}

/// `exp(x)` for `x <= 0` or `-inf` (a softmax subtracting its running max): clamped at -88,
/// where the result is exactly 0, so no overflow clamp or underflow mask is needed. NaN stays
/// NaN (the clamp's `max` returns its second operand, `x`, for NaN).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) fn exp16_nonpos(x: __m512) -> __m512 {
    let (y, fx) = exp16_parts(_mm512_max_ps(_mm512_set1_ps(-88.0), x));
    // y * 2^fx as `vscalefps` (one instruction for the exponent's four): the same correctly
    // rounded product for fx in -126..=0; fx = -127 (x below about -87.68) is exactly 0, as
    // the exponent bits of 0 make it in `exp16_clamped`. NaN (unordered) keeps its lane.
    let live = _mm512_cmp_ps_mask::<_CMP_NLE_UQ>(fx, _mm512_set1_ps(-126.5));
    _mm512_maskz_scalef_ps(live, y, fx)
}

/// `exp(x)` for `x` in `[-88, X_MAX]`; `x` below about -87.68 rounds to the exponent -127,
/// which gives exactly 0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn exp16_clamped(x: __m512) -> __m512 {
    let (y, fx) = exp16_parts(x);
    // 2^fx: fx is in -127..=127, a normal exponent or (at -127) the bits of 0.0.
    let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
        _mm512_cvtps_epi32(fx),
        _mm512_set1_epi32(127),
    ));
    _mm512_mul_ps(y, _mm512_castsi512_ps(e))
}

/// `exp(x) = y * 2^fx` for `x` in `[-88, X_MAX]`: `fx` the nearest integer to `x*log2(e)`
/// (as f32), `y` the polynomial of the rest.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn exp16_parts(x: __m512) -> (__m512, __m512) {
    let fx = _mm512_roundscale_ps::<_MM_FROUND_TO_NEAREST_INT>(_mm512_mul_ps(
        x,
        _mm512_set1_ps(std::f32::consts::LOG2_E),
    ));
    let x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(cephes::LN2_HI), x);
    let x = _mm512_fnmadd_ps(fx, _mm512_set1_ps(cephes::LN2_LO), x);
    let mut y = _mm512_set1_ps(cephes::P[0]);
    for &c in &cephes::P[1..] {
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(c));
    }
    y = _mm512_fmadd_ps(
        y,
        _mm512_mul_ps(x, x),
        _mm512_add_ps(x, _mm512_set1_ps(1.0)),
    );
    (y, fx)
}

/// Transposes 16 rows of 16 32-bit lanes (row `i` in `r[i]`) into 16 columns (column `j` in
/// `r[j]`): u32 words as the bf16 packers pair them, or f32 values cast to integer vectors.
#[target_feature(enable = "avx512f")]
pub(super) fn transpose16(r: &mut [__m512i; 16]) {
    // Within 128-bit lanes: pairs of rows, then groups of four rows (column 4L + k of rows
    // 4g..4g+4 in lane L of `c[4g + k]`).
    let mut c = [_mm512_setzero_si512(); 16];
    for g in 0..4 {
        let (r0, r1, r2, r3) = (r[4 * g], r[4 * g + 1], r[4 * g + 2], r[4 * g + 3]);
        let (a0, b0) = (_mm512_unpacklo_epi32(r0, r1), _mm512_unpackhi_epi32(r0, r1));
        let (a1, b1) = (_mm512_unpacklo_epi32(r2, r3), _mm512_unpackhi_epi32(r2, r3));
        c[4 * g] = _mm512_unpacklo_epi64(a0, a1);
        c[4 * g + 1] = _mm512_unpackhi_epi64(a0, a1);
        c[4 * g + 2] = _mm512_unpacklo_epi64(b0, b1);
        c[4 * g + 3] = _mm512_unpackhi_epi64(b0, b1);
    }
    // Across lanes: column 4L + k gathers lane L of c[k], c[4 + k], c[8 + k], c[12 + k].
    for k in 0..4 {
        let e0 = _mm512_shuffle_i32x4::<0x88>(c[k], c[4 + k]);
        let e1 = _mm512_shuffle_i32x4::<0xDD>(c[k], c[4 + k]);
        let f0 = _mm512_shuffle_i32x4::<0x88>(c[8 + k], c[12 + k]);
        let f1 = _mm512_shuffle_i32x4::<0xDD>(c[8 + k], c[12 + k]);
        r[k] = _mm512_shuffle_i32x4::<0x88>(e0, f0);
        r[4 + k] = _mm512_shuffle_i32x4::<0x88>(e1, f1);
        r[8 + k] = _mm512_shuffle_i32x4::<0xDD>(e0, f0);
        r[12 + k] = _mm512_shuffle_i32x4::<0xDD>(e1, f1);
    }
}

/// Lane `i` of the result is the sum of the 16 lanes of `v[i]`: a tree of in-lane unpacks and
/// shuffles, then 128-bit lane shuffles (45 instructions for 16 sums).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) fn reduce16(v: &[__m512; 16]) -> __m512 {
    // Per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] for the pair (a, b).
    let mut t = [_mm512_setzero_ps(); 8];
    for (i, x) in t.iter_mut().enumerate() {
        let (a, b) = (v[2 * i], v[2 * i + 1]);
        *x = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
    }
    // Per 128-bit lane: the lane's sums of 4 consecutive vectors.
    let mut u = [_mm512_setzero_ps(); 4];
    for (i, x) in u.iter_mut().enumerate() {
        let (a, b) = (t[2 * i], t[2 * i + 1]);
        *x = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(a, b),
            _mm512_shuffle_ps::<0xEE>(a, b),
        );
    }
    // Fold the four 128-bit lanes: pairs of lanes, then pairs of pairs.
    let fold = |a: __m512, b: __m512| {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0x88>(a, b),
            _mm512_shuffle_f32x4::<0xDD>(a, b),
        )
    };
    fold(fold(u[0], u[1]), fold(u[2], u[3]))
}

/// Query rows x keys per [`qk`] block for `left` rows still to do: 16 accumulators (or 8 for
/// a single row, which still hides the FMA latency; 15 for 3 rows, not padded to 4: 0.97x the
/// time of 4 x 4 on SmolLM2 decode calls, 3 rows a KV head, AMD EPYC Zen 4).
fn qk_shape(left: usize) -> (usize, usize) {
    match left {
        1 => (1, 8),
        2 => (2, 8),
        3 => (3, 5),
        _ => (4, 4),
    }
}

/// How many prefetch ticks [`qk`] gives for `rows` x `n` keys of length `d`.
pub(super) fn qk_ticks(rows: usize, n: usize, d: usize) -> usize {
    let (mut r, mut blocks) = (0, 0);
    while r < rows {
        let (rb, kb) = qk_shape(rows - r);
        blocks += n.div_ceil(kb);
        r += rb;
    }
    blocks * d.div_ceil(16)
}

/// `s[r*lds + j] = cap(scale * <q[r*d..][..d], k[j*d..][..d]>)` for `r < rows`, `j < n`, one
/// `pf` tick per 16 columns of a block. The caller guarantees those ranges.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn qk<C: Float>(
    q: *const f32,
    rows: usize,
    k: *const C,
    n: usize,
    d: usize,
    s: *mut f32,
    lds: usize,
    pf: &mut Pf,
    scale: f32,
) {
    let mut r = 0;
    while r < rows {
        let (rb, kb) = qk_shape(rows - r);
        let rn = rb.min(rows - r);
        let mut j = 0;
        while j < n {
            let kn = kb.min(n - j);
            // SAFETY: rows r..r+rn of q, keys j..j+kn of k and entries (r.., j..) of s are inside
            // the caller's ranges.
            unsafe {
                let (qp, kp, sp) = (q.add(r * d), k.add(j * d), s.add(r * lds + j));
                match rb {
                    1 => qk_block::<C, 1, 8>(qp, rn, kp, kn, d, sp, lds, pf, scale),
                    2 => qk_block::<C, 2, 8>(qp, rn, kp, kn, d, sp, lds, pf, scale),
                    3 => qk_block::<C, 3, 5>(qp, rn, kp, kn, d, sp, lds, pf, scale),
                    _ => qk_block::<C, 4, 4>(qp, rn, kp, kn, d, sp, lds, pf, scale),
                }
            }
            j += kn;
        }
        r += rn;
    }
}

/// Dot products of `rn <= R` query rows with `kn <= K` key rows (row stride `d`); missing rows
/// and keys repeat the last real one (always readable) and are not stored.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn qk_block<C: Float, const R: usize, const K: usize>(
    q: *const f32,
    rn: usize,
    k: *const C,
    kn: usize,
    d: usize,
    s: *mut f32,
    lds: usize,
    pf: &mut Pf,
    scale: f32,
) {
    let z = _mm512_setzero_ps();
    let qp: [*const f32; R] = std::array::from_fn(|i| q.wrapping_add(i.min(rn - 1) * d));
    let kp: [*const C; K] = std::array::from_fn(|i| k.wrapping_add(i.min(kn - 1) * d));
    let mut acc = [[z; K]; R];
    let mut x = 0;
    while x < d {
        let mask = if d - x >= 16 { ALL } else { tail(d - x) };
        let mut kv = [z; K];
        for (v, p) in kv.iter_mut().zip(&kp) {
            // SAFETY: the lanes of `mask` are columns x.. < d of a key row the caller gave.
            *v = unsafe { load16(p.add(x), mask) };
        }
        for (a, p) in acc.iter_mut().zip(&qp) {
            // SAFETY: as above, for a query row.
            let qv = unsafe { _mm512_maskz_loadu_ps(mask, p.add(x)) };
            for kk in 0..K {
                a[kk] = _mm512_fmadd_ps(qv, kv[kk], a[kk]);
            }
        }
        pf.tick();
        x += 16;
    }
    let mut v = [z; 16];
    for r in 0..R {
        v[r * K..(r + 1) * K].copy_from_slice(&acc[r]);
    }
    let sums = F32x16(_mm512_mul_ps(reduce16(&v), _mm512_set1_ps(scale)))
        .cap()
        .0;
    let lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for r in 0..rn {
        // Row r's sums are lanes r*K..r*K+K: move them to the bottom and store the first kn.
        let row = _mm512_permutexvar_ps(
            _mm512_add_epi32(lanes, _mm512_set1_epi32((r * K) as i32)),
            sums,
        );
        // SAFETY: entries (r, 0..kn) of the caller's s block.
        unsafe { _mm512_mask_storeu_ps(s.add(r * lds), tail(kn), row) };
    }
}

/// All `d` columns of `rr` accumulator rows (stride `d`, `rr <= 6`): `acc = acc * c[r] + sum_j
/// w(r, j) * v[j*d..]` over `n` keys in order, where `w(r, j) = p[r*ws.0 + j*ws.1]`; passes of
/// 64 columns, the last pass as many vectors as columns remain, its last vector masked. One
/// `pf` tick per key and pass. The caller guarantees those ranges.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn pv_cols<C: Float>(
    rr: usize,
    p: *const f32,
    ws: (usize, usize),
    n: usize,
    v: *const C,
    d: usize,
    c: *const f32,
    acc: *mut f32,
    pf: &mut Pf,
) {
    let mut x = 0;
    while x < d {
        let left = d - x;
        let nv = left.div_ceil(16).min(4);
        let rem = left - (nv - 1) * 16;
        let last = if rem >= 16 { ALL } else { tail(rem) };
        // SAFETY: columns x..x+16*nv (the last vector masked to < d) of the caller's rows.
        unsafe {
            let (vp, ap) = (v.add(x), acc.add(x));
            macro_rules! rows {
                ($dv:literal) => {
                    match rr {
                        6 => pv_block::<C, 6, $dv>(p, ws, n, vp, d, c, ap, last, pf),
                        5 => pv_block::<C, 5, $dv>(p, ws, n, vp, d, c, ap, last, pf),
                        4 => pv_block::<C, 4, $dv>(p, ws, n, vp, d, c, ap, last, pf),
                        3 => pv_block::<C, 3, $dv>(p, ws, n, vp, d, c, ap, last, pf),
                        2 => pv_block::<C, 2, $dv>(p, ws, n, vp, d, c, ap, last, pf),
                        _ => pv_block::<C, 1, $dv>(p, ws, n, vp, d, c, ap, last, pf),
                    }
                };
            }
            match nv {
                4 => rows!(4),
                3 => rows!(3),
                2 => rows!(2),
                _ => rows!(1),
            }
        }
        x += 16 * nv;
    }
}

/// `R` accumulator rows x `DV` vectors of columns (the last masked by `last`), see
/// [`pv_cols`].
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn pv_block<C: Float, const R: usize, const DV: usize>(
    p: *const f32,
    ws: (usize, usize),
    n: usize,
    v: *const C,
    d: usize,
    c: *const f32,
    acc: *mut f32,
    last: __mmask16,
    pf: &mut Pf,
) {
    let z = _mm512_setzero_ps();
    let mask = |dv: usize| if dv + 1 == DV { last } else { ALL };
    let mut a = [[z; DV]; R];
    for (r, ar) in a.iter_mut().enumerate() {
        // SAFETY: c[r] and the masked columns of accumulator row r are the caller's.
        unsafe {
            let cr = _mm512_set1_ps(*c.add(r));
            for (dv, x) in ar.iter_mut().enumerate() {
                let old = _mm512_maskz_loadu_ps(mask(dv), acc.add(r * d + dv * 16));
                *x = _mm512_mul_ps(old, cr);
            }
        }
    }
    let (mut vp, mut wp) = (v, p);
    for _ in 0..n {
        let mut vv = [z; DV];
        for (dv, x) in vv.iter_mut().enumerate() {
            // SAFETY: the masked columns of a value row j < n.
            *x = unsafe { load16(vp.add(dv * 16), mask(dv)) };
        }
        for (r, ar) in a.iter_mut().enumerate() {
            // SAFETY: weight (r, j) of the caller's weights.
            let w = _mm512_set1_ps(unsafe { *wp.add(r * ws.0) });
            for dv in 0..DV {
                ar[dv] = _mm512_fmadd_ps(w, vv[dv], ar[dv]);
            }
        }
        pf.tick();
        // Wrapping: after the last key these point past the tile (never read).
        vp = vp.wrapping_add(d);
        wp = wp.wrapping_add(ws.1);
    }
    for (r, ar) in a.iter().enumerate() {
        for (dv, x) in ar.iter().enumerate() {
            // SAFETY: as for the loads above.
            unsafe { _mm512_mask_storeu_ps(acc.add(r * d + dv * 16), mask(dv), *x) };
        }
    }
}

/// Largest of `n` floats at `p` (`-inf` when `n == 0`).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn row_max(p: *const f32, n: usize) -> f32 {
    let ninf = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut mx = ninf;
    let mut j = 0;
    while j < n {
        let k = tail((n - j).min(16));
        // SAFETY: the lanes of `k` are floats j.. < n at p.
        mx = _mm512_max_ps(mx, unsafe { _mm512_mask_loadu_ps(ninf, k, p.add(j)) });
        j += 16;
    }
    _mm512_reduce_max_ps(mx)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn exp_sub_sum(s: &mut [f32], m: f32) -> f32 {
    let mv = _mm512_set1_ps(m);
    let mut sum = _mm512_setzero_ps();
    let (n, p) = (s.len(), s.as_mut_ptr());
    let mut j = 0;
    while j < n {
        let k = tail((n - j).min(16));
        // SAFETY: the lanes of `k` are elements j.. < n of `s`; the lanes outside `k` are
        // zeroed after the exp, so they add nothing.
        unsafe {
            let x = _mm512_maskz_loadu_ps(k, p.add(j));
            let e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(x, mv)));
            _mm512_mask_storeu_ps(p.add(j), k, e);
            sum = _mm512_add_ps(sum, e);
        }
        j += 16;
    }
    _mm512_reduce_add_ps(sum)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn add_exp_scaled(dst: &mut [f32], s: &[f32], m: f32, c: f32) {
    let (mv, cv) = (_mm512_set1_ps(m), _mm512_set1_ps(c));
    let (n, dp, sp) = (dst.len(), dst.as_mut_ptr(), s.as_ptr());
    let mut j = 0;
    while j < n {
        let k = tail((n - j).min(16));
        // SAFETY: the lanes of `k` are elements j.. < n <= s.len() (checked by the caller).
        unsafe {
            let e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sp.add(j)), mv));
            let r = _mm512_fmadd_ps(e, cv, _mm512_maskz_loadu_ps(k, dp.add(j)));
            _mm512_mask_storeu_ps(dp.add(j), k, r);
        }
        j += 16;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn scale<const CAP: bool>(x: &mut [f32], c: f32) {
    let cv = _mm512_set1_ps(c);
    let (n, p) = (x.len(), x.as_mut_ptr());
    let mut j = 0;
    while j < n {
        let k = tail((n - j).min(16));
        // SAFETY: the lanes of `k` are elements j.. < n of `x`.
        unsafe {
            let v = F32x16(_mm512_mul_ps(_mm512_maskz_loadu_ps(k, p.add(j)), cv));
            let v = if CAP { v.cap() } else { v };
            _mm512_mask_storeu_ps(p.add(j), k, v.0);
        }
        j += 16;
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn widen<C: Float>(src: *const C, dst: *mut f32, n: usize) {
    let mut j = 0;
    while j < n {
        let k = tail((n - j).min(16));
        // SAFETY: the lanes of `k` are elements j.. < n of both buffers.
        unsafe { _mm512_mask_storeu_ps(dst.add(j), k, load16(src.add(j), k)) };
        j += 16;
    }
}

/// `dst[..n] = C::from_f32(src[..n])`: f16 by `vcvtps2ph` (what `half` itself uses on F16C
/// CPUs), bf16 by [`bf16_bits16`]; 16 lanes per step, the tail masked.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn narrow<C: Float>(src: *const f32, dst: *mut C, n: usize) {
    let mut j = 0;
    while j < n {
        let k = tail((n - j).min(16));
        // SAFETY: the lanes of `k` are elements j.. < n of both buffers; `C::TYPE` names the
        // element type of `dst`, so each arm writes exactly its elements.
        unsafe {
            let x = _mm512_maskz_loadu_ps(k, src.add(j));
            match C::TYPE {
                ElemType::F32 => _mm512_mask_storeu_ps(dst.add(j) as *mut f32, k, x),
                ElemType::F16 => _mm256_mask_storeu_epi16(
                    dst.add(j) as *mut i16,
                    k,
                    _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x),
                ),
                _ => _mm256_mask_storeu_epi16(
                    dst.add(j) as *mut i16,
                    k,
                    _mm512_cvtepi32_epi16(bf16_bits16(x)),
                ),
            }
        }
        j += 16;
    }
}

/// The bf16 bits of 16 f32 lanes (in the low half of each 32-bit lane), as `half`'s
/// `bf16::from_f32`: round to nearest even (`x + 0x7fff + lsb`, carrying into the exponent
/// up to infinity), NaN kept quiet with its sign and top payload bits. `vcvtneps2bf16` is not
/// used: it flushes denormal inputs to zero.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
fn bf16_bits16(x: __m512) -> __m512i {
    let b = _mm512_castps_si512(x);
    let lsb = _mm512_and_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(1));
    let bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(b, bias));
    let nan = _mm512_cmpgt_epu32_mask(
        _mm512_and_si512(b, _mm512_set1_epi32(0x7fff_ffff)),
        _mm512_set1_epi32(0x7f80_0000),
    );
    let quiet = _mm512_or_si512(_mm512_srli_epi32::<16>(b), _mm512_set1_epi32(0x40));
    _mm512_mask_mov_epi32(rounded, nan, quiet)
}

/// Sixteen rows' softmax state, one per lane (see [`Lanes`]). Built only from vectors the
/// AVX-512 loops loaded, i.e. inside functions with this tier's features reached through
/// [`Avx512`] (so the CPU has them), and only used there; the methods are inlined into them.
#[derive(Clone, Copy)]
pub(super) struct F32x16(pub __m512);

impl Lanes for F32x16 {
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // SAFETY: an F32x16 exists only inside the AVX-512 functions (see the type).
        F32x16(unsafe { _mm512_max_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: an F32x16 exists only inside the AVX-512 functions (see the type).
        F32x16(unsafe { _mm512_sub_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: an F32x16 exists only inside the AVX-512 functions (see the type).
        F32x16(unsafe { _mm512_mul_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: an F32x16 exists only inside the AVX-512 functions (see the type).
        F32x16(unsafe { _mm512_add_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn zero_if_neg_inf(self) -> Self {
        // SAFETY: an F32x16 exists only inside the AVX-512 functions (see the type).
        F32x16(unsafe {
            let is = _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(self.0, _mm512_set1_ps(f32::NEG_INFINITY));
            _mm512_mask_mov_ps(self.0, is, _mm512_setzero_ps())
        })
    }
    #[inline(always)]
    fn exp_nonpos(self) -> Self {
        // SAFETY: an F32x16 exists only inside the AVX-512 functions (see the type).
        F32x16(unsafe { exp16_nonpos(self.0) })
    }
    #[inline(always)]
    fn cap(self) -> Self {
        // SAFETY: an F32x16 exists only inside the AVX-512 functions (see the type). `min`
        // returns its second operand, `self`, for NaN.
        F32x16(unsafe { _mm512_min_ps(_mm512_set1_ps(f32::MAX), self.0) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The softmax's `exp` (its exponent by `vscalefps`) equals the clamped `exp` with the
    /// exponent built in the bits, bit for bit, on every input it takes: x <= 0 (down to the
    /// clamp and the exponents -126 and -127 around -87.68, subnormal results included),
    /// -inf (exactly 0) and NaN (NaN).
    #[test]
    fn exp_nonpos_equals_the_exponent_bits_product() {
        let Some(_) = super::super::detected(Avx512::detect(), "AVX-512", "exp") else {
            return;
        };
        let mut x: Vec<f32> = (0..200_000).map(|i| -(i as f32) * 4.5e-4).collect();
        x.extend((0..20_000).map(|i| -87.0 - i as f32 * 5e-5));
        x.extend([
            -0.0,
            -1e-30,
            -88.0,
            -88.5,
            -1e30,
            f32::MIN,
            f32::NEG_INFINITY,
            f32::NAN,
        ]);
        #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
        fn both(x: &[f32; 16]) -> ([f32; 16], [f32; 16]) {
            let mut out = ([0f32; 16], [0f32; 16]);
            // SAFETY: 16 floats each.
            unsafe {
                let v = _mm512_loadu_ps(x.as_ptr());
                _mm512_storeu_ps(out.0.as_mut_ptr(), exp16_nonpos(v));
                let clamped = _mm512_max_ps(_mm512_set1_ps(-88.0), v);
                _mm512_storeu_ps(out.1.as_mut_ptr(), exp16_clamped(clamped));
            }
            out
        }
        let mut subnormal = 0;
        for c in x.chunks(16) {
            let mut a = [-1f32; 16];
            a[..c.len()].copy_from_slice(c);
            // SAFETY: the test returned above unless the CPU has AVX-512 (and AVX2, FMA, F16C).
            let (got, want) = unsafe { both(&a) };
            for i in 0..16 {
                assert_eq!(got[i].to_bits(), want[i].to_bits(), "exp({:e})", a[i]);
                subnormal += (got[i] != 0.0 && !got[i].is_normal()) as usize;
            }
        }
        assert!(subnormal > 0, "no subnormal result was checked");
        // SAFETY: as above.
        let (z, _) = unsafe { both(&[f32::NEG_INFINITY; 16]) };
        assert_eq!(z, [0.0; 16]);
    }
}
