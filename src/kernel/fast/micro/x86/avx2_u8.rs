//! The AVX2 [`U8Micro`]: 8 bytes at a time zero-extended to i32 and converted to f32
//! (`vpmovzxbd`, `vcvtdq2ps`), the zero point subtracted once per 8 bytes for all rows; tails of
//! fewer than 8 elements go through zero-padded copies (AVX2 has no masked byte loads). Reached
//! only through [`Avx2`], which only `Avx2::detect` builds.

use std::arch::x86_64::*;

use super::super::{pv_bounds, qk_bounds, U8Micro};
use super::avx2::{exp_sub_sum, hsum4, load_partial, Avx2};

impl U8Micro for Avx2 {
    fn qk(
        self,
        q: &[f32],
        ldq: usize,
        rows: usize,
        k: &[u8],
        ldk: usize,
        zp: &[f32],
        len: usize,
        s: &mut [f32],
        lds: usize,
    ) {
        let n = zp.len();
        qk_bounds(q.len(), ldq, rows, k.len(), ldk, n, len, s.len(), lds);
        let mut r = 0;
        while r < rows {
            let tr = (rows - r).min(4);
            let mut t = 0;
            while t < n {
                let tk = (n - t).min(4);
                // SAFETY: `self` proves the features; `qk_bounds` checked rows `r..r + tr` of
                // `q` and `s`, and key rows `t..t + tk` of `k` (each `len` long at its stride).
                unsafe {
                    let (qp, kp) = (q.as_ptr().add(r * ldq), k.as_ptr().add(t * ldk));
                    let (zp, sp) = (zp.as_ptr().add(t), s.as_mut_ptr().add(r * lds + t));
                    match tr {
                        4 => qk_r::<4>(qp, ldq, kp, ldk, zp, tk, len, sp, lds),
                        3 => qk_r::<3>(qp, ldq, kp, ldk, zp, tk, len, sp, lds),
                        2 => qk_r::<2>(qp, ldq, kp, ldk, zp, tk, len, sp, lds),
                        _ => qk_r::<1>(qp, ldq, kp, ldk, zp, tk, len, sp, lds),
                    }
                }
                t += tk;
            }
            r += tr;
        }
    }

    fn pv(
        self,
        acc: &mut [f32],
        lda: usize,
        rows: usize,
        w: &[f32],
        v: &[u8],
        ldv: usize,
        zp: &[f32],
        len: usize,
    ) {
        let n = zp.len();
        pv_bounds(acc.len(), lda, rows, w.len(), v.len(), ldv, n, len);
        // Zero points all 0 (folded into the weights by the driver): one subtraction fewer.
        let sub = !zp.iter().all(|&z| z == 0.0);
        let mut r = 0;
        while r < rows {
            let take = (rows - r).min(4);
            // SAFETY: `self` proves the features; `pv_bounds` checked that rows `r..r + take` of
            // `acc` (stride `lda`) hold `len` elements, `w` holds `rows * n` weights and the `n`
            // value rows (stride `ldv`) hold `len` bytes each.
            unsafe {
                let (a, wp, vp) = (
                    acc.as_mut_ptr().add(r * lda),
                    w.as_ptr().add(r * n),
                    v.as_ptr(),
                );
                match (take, sub) {
                    (4, true) => pv_r::<true, 4>(a, lda, wp, n, vp, ldv, zp, len),
                    (3, true) => pv_r::<true, 3>(a, lda, wp, n, vp, ldv, zp, len),
                    (2, true) => pv_r::<true, 2>(a, lda, wp, n, vp, ldv, zp, len),
                    (_, true) => pv_r::<true, 1>(a, lda, wp, n, vp, ldv, zp, len),
                    (4, false) => pv_r::<false, 4>(a, lda, wp, n, vp, ldv, zp, len),
                    (3, false) => pv_r::<false, 3>(a, lda, wp, n, vp, ldv, zp, len),
                    (2, false) => pv_r::<false, 2>(a, lda, wp, n, vp, ldv, zp, len),
                    _ => pv_r::<false, 1>(a, lda, wp, n, vp, ldv, zp, len),
                }
            }
            r += take;
        }
    }

    fn exp_sum(self, s: &mut [f32], sub: f32) -> f32 {
        // SAFETY: `self` proves the features; the loop reads and writes only elements of `s`.
        unsafe { exp_sub_sum(s, sub) }
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

/// `len` bytes at `p` (8 when `len >= 8`) as f32 minus `zp`; lanes past `len` hold `-zp`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn load_u8(p: *const u8, len: usize, zp: __m256) -> __m256 {
    let mut buf = [0u8; 16];
    // SAFETY: the caller guarantees `len.min(8)` readable bytes at `p`; `buf` holds 16.
    let b = unsafe {
        if len >= 8 {
            _mm_loadl_epi64(p as *const __m128i)
        } else {
            std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), len);
            _mm_loadu_si128(buf.as_ptr() as *const __m128i)
        }
    };
    _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), zp)
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

/// R query rows x `tk <= 4` keys: each query chunk loaded once for the keys, each key chunk
/// converted once for the R rows; one `hsum4` per row at the end.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_r<const R: usize>(
    q: *const f32,
    ldq: usize,
    k: *const u8,
    ldk: usize,
    zp: *const f32,
    tk: usize,
    len: usize,
    s: *mut f32,
    lds: usize,
) {
    let mut acc = [[_mm256_setzero_ps(); 4]; R];
    let mut c = 0;
    while c < len {
        let w = len - c;
        // SAFETY: columns `c..c + w.min(8)` lie inside the R query rows and the `tk` key rows,
        // and `zp` holds `tk` entries (the caller's bounds). Keys past `tk` stay 0, and padded
        // query lanes are 0, so neither adds to a logit.
        unsafe {
            let mut kv = [_mm256_setzero_ps(); 4];
            for (j, kv) in kv.iter_mut().enumerate().take(tk) {
                *kv = load_u8(k.add(j * ldk + c), w, _mm256_set1_ps(*zp.add(j)));
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let qv = load_f32(q.add(r * ldq + c), w);
                for (a, &kv) in acc.iter_mut().zip(&kv) {
                    *a = _mm256_fmadd_ps(qv, kv, *a);
                }
            }
        }
        c += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        let mut out = [0f32; 4];
        // SAFETY: `out` holds 4 floats; the caller gives R rows of `tk` writable logits at
        // stride `lds`.
        unsafe {
            _mm_storeu_ps(out.as_mut_ptr(), hsum4(a[0], a[1], a[2], a[3]));
            std::ptr::copy_nonoverlapping(out.as_ptr(), s.add(r * lds), tk);
        }
    }
}

/// R accumulator rows held in registers over all `n` keys, 16 columns at a time (two chunks of
/// 8: 2R independent sums, enough to hide the FMA latency) and 8 for the rest; `SUB`: whether
/// the zero points are subtracted (they are all 0 when not).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_r<const SUB: bool, const R: usize>(
    acc: *mut f32,
    lda: usize,
    w: *const f32,
    n: usize,
    v: *const u8,
    ldv: usize,
    zp: &[f32],
    len: usize,
) {
    let mut c = 0;
    while c < len {
        // SAFETY: the caller's bounds cover columns `c..len` of every accumulator and value
        // row and R rows of `n` weights; each call stays inside `c..len`.
        unsafe {
            if len - c >= 16 {
                pv_cols::<SUB, R, 2>((acc, lda, w, n, v, ldv, zp), c, len - c);
                c += 16;
            } else {
                pv_cols::<SUB, R, 1>((acc, lda, w, n, v, ldv, zp), c, len - c);
                c += 8;
            }
        }
    }
}

/// Columns `c..c + 8H` (clipped to `c + cw`) of [`pv_r`].
#[allow(clippy::type_complexity)]
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn pv_cols<const SUB: bool, const R: usize, const H: usize>(
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
                let x = load_u8(v.add(t * ldv + c + 8 * h), cw - 8 * h, zv);
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
            let x = _mm256_mul_ps(load_u8(src.add(i), w, z), s);
            store_f32(out.as_mut_ptr().add(i), w, x);
        }
        i += 8;
    }
}
