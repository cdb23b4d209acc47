//! The AVX2 [`QuantMicro`]: 8 elements at a time zero-extended to i32 and converted to f32
//! (`vpmovzxbd`, `vcvtdq2ps`; u4 rows: 4 bytes split into high and low nibbles and
//! interleaved back into element order in a register, [`load_q`]), the zero point subtracted
//! once per 8 elements for all rows (not at
//! all when the driver folded the zero points, which it does for by-channel keys and values);
//! logits in tiles of up to 4 rows x 3 keys (12 sums, 3 key chunks and a query chunk: the 16
//! registers, no spills). Tails of fewer than 8 elements go through zero-padded copies (AVX2 has
//! no masked byte loads). Reached only through [`Avx2`], which only `Avx2::detect` builds.

use std::arch::x86_64::*;

use super::super::{
    all_zero, exp_sum_bounds, fold_bounds, pv_bounds, qk_bounds, QRows, QuantMicro,
};
use super::avx2::{exp_sub_sum_rows, hsum4, load_partial, Avx2};
use super::prefetch::Pf;
use super::u8_loops::{self, PvArgs, QkArgs, QuantLoops};

u8_loops::u8_loops_by!(Avx2);

impl QuantMicro for Avx2 {
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
        let n = zp.len();
        qk_bounds(q.len(), ldq, rows, k, n, len, s.len(), lds);
        // One group of lines before each tile.
        let pf = Pf::new(pf, rows.div_ceil(4) * n.div_ceil(3));
        let args = (q, ldq, rows, k.bytes, k.ld, zp, len, s, lds);
        // By-channel keys come with zero points 0 (folded into the query by the driver): one
        // subtraction fewer per 8 elements.
        // SAFETY: `self` proves the features; `qk_bounds` checked the arguments (rows of
        // `k.span(len)` bytes).
        unsafe { u8_loops::qk::<Self>(args, (!all_zero(zp), k.u4()), pf) }
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
        let n = zp.len();
        pv_bounds(acc.len(), lda, rows, w.len(), v, n, len);
        // One group of lines before each block of 16 columns.
        let pf = Pf::new(pf, rows.div_ceil(4) * len.div_ceil(16));
        let args = (acc, lda, rows, w, v.bytes, v.ld, zp, len);
        // Zero points all 0 (folded into the weights by the driver): one subtraction fewer.
        // SAFETY: `self` proves the features; `pv_bounds` checked the arguments (rows of
        // `v.span(len)` bytes).
        unsafe { u8_loops::pv::<Self>(args, (!all_zero(zp), v.u4()), pf) }
    }

    fn fold(
        self,
        x: &[f32],
        ldx: usize,
        rows: usize,
        scale: &[f32],
        zp: &[f32],
        out: &mut [f32],
        ldo: usize,
        cst: &mut [f32],
    ) {
        let len = scale.len();
        fold_bounds(x.len(), ldx, rows, len, zp.len(), out.len(), ldo, cst.len());
        // SAFETY: `self` proves the features; `fold_bounds` checked that rows `..rows` of `x`
        // and `out` (at their strides), `zp` and `cst` hold what the loop touches.
        unsafe {
            fold_rows(
                (x.as_ptr(), ldx),
                scale,
                zp.as_ptr(),
                (out.as_mut_ptr(), ldo),
                &mut cst[..rows],
            )
        };
    }

    fn max(self, s: &[f32]) -> f32 {
        // SAFETY: `self` proves the features; the loop reads only elements of `s`.
        unsafe { max(s) }
    }

    fn exp_sum(self, s: &mut [f32], lds: usize, n: usize, subs: &[f32], sums: &mut [f32]) {
        exp_sum_bounds(s.len(), lds, n, subs.len(), sums.len());
        // Up to four rows at a time: their exp chains overlap (one row of a decode block is
        // only four vectors, too few to hide the latency).
        let mut r = 0;
        while r < subs.len() {
            let take = (subs.len() - r).min(4);
            let p = s[r * lds..].as_mut_ptr();
            let (m, o) = (&subs[r..r + take], &mut sums[r..r + take]);
            // SAFETY: `self` proves the features; `exp_sum_bounds` checked that rows
            // `r..r + take` of `n` floats at stride `lds` lie inside `s`.
            unsafe {
                match take {
                    4 => o.copy_from_slice(&exp_sub_sum_rows(p, lds, n, [m[0], m[1], m[2], m[3]])),
                    3 => o.copy_from_slice(&exp_sub_sum_rows(p, lds, n, [m[0], m[1], m[2]])),
                    2 => o.copy_from_slice(&exp_sub_sum_rows(p, lds, n, [m[0], m[1]])),
                    _ => o.copy_from_slice(&exp_sub_sum_rows(p, lds, n, [m[0]])),
                }
            }
            r += take;
        }
    }

    fn dequant(self, src: &[u8], zp: &[f32], scale: &[f32], out: &mut [f32]) {
        let n = out.len();
        assert!(
            src.len() >= n && zp.len() >= n && scale.len() >= n,
            "u8 dequant"
        );
        // SAFETY: `self` proves the features; every slice holds `n` elements (asserted).
        unsafe { dequant(src.as_ptr(), zp.as_ptr(), scale.as_ptr(), false, out) }
    }

    fn dequant_uniform(self, src: &[u8], zp: f32, scale: f32, out: &mut [f32]) {
        assert!(src.len() >= out.len(), "u8 dequant");
        // SAFETY: `self` proves the features; `src` holds `out.len()` bytes (asserted), and
        // uniform parameters are read once, from the one element each points to.
        unsafe { dequant(src.as_ptr(), &zp, &scale, true, out) }
    }
}

/// Elements `c..c + 8` of the row at `row` as f32: bytes, or (`U4`) nibbles, the even element
/// high (4 bytes split into high and low nibbles and interleaved back into element order).
///
/// # Safety
/// The CPU has AVX2; the bytes of elements `c..c + 8` are readable (`c` even for u4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_q<const U4: bool>(row: *const u8, c: usize) -> __m256 {
    // SAFETY: the caller guarantees the bytes of elements `c..c + 8` are readable.
    let b = unsafe {
        if U4 {
            let x = _mm_cvtsi32_si128(std::ptr::read_unaligned(row.add(c / 2) as *const i32));
            let low = _mm_set1_epi8(15);
            _mm_unpacklo_epi8(
                _mm_and_si128(_mm_srli_epi16::<4>(x), low),
                _mm_and_si128(x, low),
            )
        } else {
            _mm_loadl_epi64(row.add(c) as *const __m128i)
        }
    };
    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b))
}

/// Elements `c..c + cnt.min(8)` of the row at `row` as f32 minus `zp` ([`load_q`]; lanes past
/// `cnt` hold `-zp`, through a zero-padded copy: AVX2 has no masked byte loads).
///
/// # Safety
/// The CPU has AVX2; the bytes of elements `c..c + cnt.min(8)` are readable (`c` even for u4).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_sub<const U4: bool>(row: *const u8, c: usize, cnt: usize, zp: __m256) -> __m256 {
    if cnt >= 8 {
        // SAFETY: the caller's guarantee.
        return _mm256_sub_ps(unsafe { load_q::<U4>(row, c) }, zp);
    }
    let mut buf = [0u8; 8];
    let (at, nb) = if U4 {
        (c / 2, cnt.div_ceil(2))
    } else {
        (c, cnt)
    };
    // SAFETY: the caller guarantees the `nb` bytes of elements `c..c + cnt` at `row + at`;
    // `buf` holds 8 (whole elements 0..8 for `load_q`).
    unsafe { std::ptr::copy_nonoverlapping(row.add(at), buf.as_mut_ptr(), nb) };
    if U4 && cnt % 2 == 1 {
        buf[nb - 1] &= 0xf0; // the low nibble is the element past `cnt`
    }
    // SAFETY: `buf` holds the bytes of elements 0..8.
    _mm256_sub_ps(unsafe { load_q::<U4>(buf.as_ptr(), 0) }, zp)
}

/// `len` floats at `p` (8 when `len >= 8`); lanes past `len` are 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_f32(p: *const f32, len: usize) -> __m256 {
    // SAFETY: the caller guarantees `len.min(8)` readable floats at `p`.
    unsafe {
        if len >= 8 {
            _mm256_loadu_ps(p)
        } else {
            load_partial(p, len, 0.0)
        }
    }
}

/// Stores the first `len.min(8)` lanes of `x` at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn store_f32(p: *mut f32, len: usize, x: __m256) {
    // SAFETY: the caller guarantees `len.min(8)` writable floats at `p`; `buf` holds 8.
    unsafe {
        if len >= 8 {
            _mm256_storeu_ps(p, x)
        } else {
            let mut buf = [0f32; 8];
            _mm256_storeu_ps(buf.as_mut_ptr(), x);
            std::ptr::copy_nonoverlapping(buf.as_ptr(), p, len);
        }
    }
}

/// [`QuantMicro::qk`] in tiles of up to 4 rows x 3 keys, `pf` ticked before each; `SUB`: whether
/// the zero points are subtracted (they are all 0 when not).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C (an [`Avx2`] exists) and the arguments pass `qk_bounds`.
#[allow(clippy::type_complexity)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_tiles<const SUB: bool, const U4: bool>(
    (q, ldq, rows, k, ldk, zp, len, s, lds): (
        &[f32],
        usize,
        usize,
        &[u8],
        usize,
        &[f32],
        usize,
        &mut [f32],
        usize,
    ),
    mut pf: Pf,
) {
    let n = zp.len();
    let mut r = 0;
    while r < rows {
        let tr = (rows - r).min(4);
        let mut t = 0;
        while t < n {
            let tk = (n - t).min(3);
            pf.tick();
            // SAFETY: the caller guarantees the features and that `qk_bounds` checked rows
            // `r..r + tr` of `q` and `s`, and key rows `t..t + tk` of `k` (each `len` long at
            // its stride).
            unsafe {
                let (qp, kp) = (q.as_ptr().add(r * ldq), k.as_ptr().add(t * ldk));
                let (zp, sp) = (zp.as_ptr().add(t), s.as_mut_ptr().add(r * lds + t));
                let a = (qp, ldq, kp, ldk, zp, len, sp, lds);
                match (tr, tk) {
                    (4, 3) => qk_rk::<SUB, U4, 4, 3>(a),
                    (3, 3) => qk_rk::<SUB, U4, 3, 3>(a),
                    (2, 3) => qk_rk::<SUB, U4, 2, 3>(a),
                    (1, 3) => qk_rk::<SUB, U4, 1, 3>(a),
                    (4, 2) => qk_rk::<SUB, U4, 4, 2>(a),
                    (3, 2) => qk_rk::<SUB, U4, 3, 2>(a),
                    (2, 2) => qk_rk::<SUB, U4, 2, 2>(a),
                    (1, 2) => qk_rk::<SUB, U4, 1, 2>(a),
                    (4, _) => qk_rk::<SUB, U4, 4, 1>(a),
                    (3, _) => qk_rk::<SUB, U4, 3, 1>(a),
                    (2, _) => qk_rk::<SUB, U4, 2, 1>(a),
                    _ => qk_rk::<SUB, U4, 1, 1>(a),
                }
            }
            t += tk;
        }
        r += tr;
    }
}

/// R query rows x K keys in R*K accumulators (at most 4 x 3: with the K key chunks and a query
/// chunk they fit the 16 registers): each query chunk loaded once for the K keys, each key chunk
/// converted once for the R rows; full chunks of 8 straight from memory, a shorter last chunk
/// through zero-padded copies; one `hsum4` per 4 sums at the end. `SUB`: whether the zero
/// points are subtracted (all 0 when not).
#[allow(clippy::type_complexity)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_rk<const SUB: bool, const U4: bool, const R: usize, const K: usize>(
    (q, ldq, k, ldk, zp, len, s, lds): (
        *const f32,
        usize,
        *const u8,
        usize,
        *const f32,
        usize,
        *mut f32,
        usize,
    ),
) {
    let mut acc = [[_mm256_setzero_ps(); K]; R];
    let mut zv = [_mm256_setzero_ps(); K];
    for (j, z) in zv.iter_mut().enumerate() {
        // SAFETY: `zp` holds K entries (the caller's bounds).
        *z = _mm256_set1_ps(if SUB { unsafe { *zp.add(j) } } else { 0.0 });
    }
    let full = len / 8 * 8;
    let mut c = 0;
    while c < full {
        // SAFETY: columns `c..c + 8` lie inside the R query rows and the K key rows (the
        // caller's bounds).
        unsafe {
            let mut kv = [_mm256_setzero_ps(); K];
            for (j, kv) in kv.iter_mut().enumerate() {
                *kv = load_q::<U4>(k.add(j * ldk), c);
                if SUB {
                    *kv = _mm256_sub_ps(*kv, zv[j]);
                }
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let qv = _mm256_loadu_ps(q.add(r * ldq + c));
                for (a, &kv) in acc.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(qv, kv, *a);
                }
            }
        }
        c += 8;
    }
    if c < len {
        let w = len - c;
        // SAFETY: columns `c..len` (fewer than 8) lie inside the R query rows and the K key
        // rows. Padded key lanes hold `-zp` and padded query lanes 0, so they add nothing.
        unsafe {
            let mut kv = [_mm256_setzero_ps(); K];
            for (j, kv) in kv.iter_mut().enumerate() {
                *kv = load_sub::<U4>(k.add(j * ldk), c, w, zv[j]);
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let qv = load_f32(q.add(r * ldq + c), w);
                for (a, &kv) in acc.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(qv, kv, *a);
                }
            }
        }
    }
    let mut v = [_mm256_setzero_ps(); 12];
    for (r, acc) in acc.iter().enumerate() {
        v[r * K..][..K].copy_from_slice(acc);
    }
    let mut out = [0f32; 12];
    for (o, v) in out.chunks_exact_mut(4).zip(v.chunks_exact(4)) {
        // SAFETY: `o` holds 4 floats.
        unsafe { _mm_storeu_ps(o.as_mut_ptr(), hsum4(v[0], v[1], v[2], v[3])) };
    }
    for (r, o) in out.chunks_exact(K).take(R).enumerate() {
        // SAFETY: the caller gives R rows of K writable logits at stride `lds`.
        unsafe { std::ptr::copy_nonoverlapping(o.as_ptr(), s.add(r * lds), K) };
    }
}

/// R accumulator rows held in registers over all `n` keys, 16 columns at a time (two chunks of
/// 8: 2R independent sums, enough to hide the FMA latency) and 8 for the rest, `pf` ticked
/// before each; `SUB`: whether the zero points are subtracted (they are all 0 when not).
#[allow(clippy::type_complexity)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_r<const SUB: bool, const U4: bool, const R: usize>(
    (acc, lda, w, n, v, ldv, zp, len): PvArgs<'_>,
    pf: &mut Pf,
) {
    let args = (acc, lda, w, n, v, ldv, zp);
    let mut c = 0;
    while c < len {
        pf.tick();
        // SAFETY: the caller's bounds cover columns `c..len` of every accumulator and value
        // row and R rows of `n` weights; each call stays inside `c..len`.
        unsafe {
            if len - c >= 16 {
                pv_cols::<SUB, U4, R, 2>(args, c, len - c);
                c += 16;
            } else {
                pv_cols::<SUB, U4, R, 1>(args, c, len - c);
                c += 8;
            }
        }
    }
}

/// Columns `c..c + 8H` (clipped to `c + cw`) of [`pv_r`].
#[allow(clippy::type_complexity)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_cols<const SUB: bool, const U4: bool, const R: usize, const H: usize>(
    (acc, lda, w, n, v, ldv, zp): (*mut f32, usize, *const f32, usize, *const u8, usize, &[f32]),
    c: usize,
    cw: usize,
) {
    // SAFETY: columns `c + 8h..c + 8h + (cw - 8h).min(8)` lie inside every accumulator row and
    // every value row (H = 2 only when `cw >= 16`); `w` holds R rows of `n` weights (the
    // caller's bounds).
    unsafe {
        let mut a = [[_mm256_setzero_ps(); H]; R];
        for (r, a) in a.iter_mut().enumerate() {
            for (h, a) in a.iter_mut().enumerate() {
                *a = load_f32(acc.add(r * lda + c + 8 * h), cw - 8 * h);
            }
        }
        for (t, &z) in zp.iter().enumerate() {
            let zv = _mm256_set1_ps(if SUB { z } else { 0.0 });
            let mut vv = [_mm256_setzero_ps(); H];
            for (h, vv) in vv.iter_mut().enumerate() {
                let x = load_sub::<U4>(v.add(t * ldv), c + 8 * h, cw - 8 * h, zv);
                *vv = x;
            }
            for (r, a) in a.iter_mut().enumerate() {
                let wv = _mm256_set1_ps(*w.add(r * n + t));
                for (a, &vv) in a.iter_mut().zip(&vv) {
                    *a = _mm256_fmadd_ps(wv, vv, *a);
                }
            }
        }
        for (r, a) in a.iter().enumerate() {
            for (h, a) in a.iter().enumerate() {
                store_f32(acc.add(r * lda + c + 8 * h), cw - 8 * h, *a);
            }
        }
    }
}

/// `out[i] = (src[i] - zp[i]) * scale[i]`, or with `zp[0]`, `scale[0]` for every `i` when
/// `uniform` (a subtraction, then a product: the scalar twin's roundings).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dequant(
    src: *const u8,
    zp: *const f32,
    scale: *const f32,
    uniform: bool,
    out: &mut [f32],
) {
    let n = out.len();
    let mut i = 0;
    while i < n {
        let w = n - i;
        // SAFETY: elements `i..i + w.min(8)` lie inside `src`, `out` and (not `uniform`)
        // `zp`/`scale`; uniform parameters are their first elements.
        unsafe {
            let (z, s) = if uniform {
                (_mm256_set1_ps(*zp), _mm256_set1_ps(*scale))
            } else {
                (load_f32(zp.add(i), w), load_f32(scale.add(i), w))
            };
            let x = _mm256_mul_ps(load_sub::<false>(src, i, w, z), s);
            store_f32(out.as_mut_ptr().add(i), w, x);
        }
        i += 8;
    }
}

/// [`QuantMicro::fold`] for `cst.len()` rows, four at a time (then the rest one by one):
/// `out = x * scale`, each row's `cst` in two interleaved sums (even and odd chunks of 8), so
/// a block of four has eight FMA chains in flight and one `hsum4` for its four constants;
/// `scale` and `zp` are loaded once per chunk for the block. (Row by row, one decode step's two
/// folds were latency-bound: 5% of the hot decode loop.)
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fold_rows(
    (x, ldx): (*const f32, usize),
    scale: &[f32],
    zp: *const f32,
    (out, ldo): (*mut f32, usize),
    cst: &mut [f32],
) {
    let mut r = 0;
    while r < cst.len() {
        let take = if cst.len() - r >= 4 { 4 } else { 1 };
        // SAFETY: rows `r..r + take` of `x` and `out` (at their strides), `zp` and `scale` hold
        // what the block reads and writes (the caller's bounds).
        unsafe {
            let (xr, or) = (x.add(r * ldx), out.add(r * ldo));
            let c = &mut cst[r..r + take];
            if take == 4 {
                c.copy_from_slice(&fold_block::<4>((xr, ldx), scale, zp, (or, ldo)));
            } else {
                c.copy_from_slice(&fold_block::<1>((xr, ldx), scale, zp, (or, ldo)));
            }
        }
        r += take;
    }
}

/// R rows of [`fold_rows`]; returns their constants.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fold_block<const R: usize>(
    (x, ldx): (*const f32, usize),
    scale: &[f32],
    zp: *const f32,
    (out, ldo): (*mut f32, usize),
) -> [f32; R] {
    let n = scale.len();
    let sp = scale.as_ptr();
    let mut sum = [[_mm256_setzero_ps(); 2]; R];
    // SAFETY: R rows of `x` and `out` (at their strides), `zp` and `scale` hold `n` elements
    // (the caller's bounds); padded lanes are 0 and add nothing.
    unsafe {
        let mut i = 0;
        while i + 16 <= n {
            for h in 0..2 {
                let j = i + 8 * h;
                let (sv, zv) = (_mm256_loadu_ps(sp.add(j)), _mm256_loadu_ps(zp.add(j)));
                for (r, sum) in sum.iter_mut().enumerate() {
                    let o = _mm256_mul_ps(_mm256_loadu_ps(x.add(r * ldx + j)), sv);
                    _mm256_storeu_ps(out.add(r * ldo + j), o);
                    sum[h] = _mm256_fmadd_ps(o, zv, sum[h]);
                }
            }
            i += 16;
        }
        while i < n {
            let w = n - i;
            let (sv, zv) = (load_f32(sp.add(i), w), load_f32(zp.add(i), w));
            for (r, sum) in sum.iter_mut().enumerate() {
                let o = _mm256_mul_ps(load_f32(x.add(r * ldx + i), w), sv);
                store_f32(out.add(r * ldo + i), w, o);
                sum[0] = _mm256_fmadd_ps(o, zv, sum[0]);
            }
            i += 8;
        }
        let mut v = [_mm256_setzero_ps(); 4];
        for (v, s) in v.iter_mut().zip(&sum) {
            *v = _mm256_add_ps(s[0], s[1]);
        }
        let mut c = [0f32; 4];
        _mm_storeu_ps(c.as_mut_ptr(), hsum4(v[0], v[1], v[2], v[3]));
        let mut o = [0f32; R];
        o.copy_from_slice(&c[..R]);
        o
    }
}

/// [`QuantMicro::max`]: `vmaxps` returns its second operand when either is NaN, so a NaN never
/// replaces the running max (`f32::max`'s rule); padded lanes are `-inf`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn max(s: &[f32]) -> f32 {
    let mut mx = _mm256_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < s.len() {
        let w = s.len() - i;
        // SAFETY: elements `i..i + w.min(8)` lie inside `s`.
        unsafe {
            let x = if w >= 8 {
                _mm256_loadu_ps(s.as_ptr().add(i))
            } else {
                load_partial(s.as_ptr().add(i), w, f32::NEG_INFINITY)
            };
            mx = _mm256_max_ps(x, mx);
        }
        i += 8;
    }
    let mut lanes = [0f32; 8];
    // SAFETY: `lanes` holds 8 floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), mx) };
    lanes.into_iter().fold(f32::NEG_INFINITY, f32::max)
}
