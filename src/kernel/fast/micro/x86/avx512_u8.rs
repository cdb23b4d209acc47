//! The AVX-512 [`U8Micro`]: 16 bytes at a time zero-extended to i32 and converted to f32
//! (`vpmovzxbd`, `vcvtdq2ps`), the zero point subtracted once per 16 bytes for all rows, masked
//! tails. Reached only through [`Avx512`], which only `Avx512::detect` builds.

use std::arch::x86_64::*;

use super::super::{all_zero, exp_sum_bounds, fold_bounds, pv_bounds, qk_bounds, U8Micro};
use super::avx512::{exp16, reduce16, tail, Avx512};
use super::prefetch::Pf;

impl U8Micro for Avx512 {
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
        pf: &[u8],
    ) {
        let n = zp.len();
        qk_bounds(q.len(), ldq, rows, k.len(), ldk, n, len, s.len(), lds);
        // One group of lines before each tile.
        let pf = Pf::new(pf, rows.div_ceil(4) * (n / 4 + n % 4));
        // By-channel keys come with zero points 0 (folded into the query by the driver): one
        // subtraction fewer per 16 bytes.
        let args = (q, ldq, rows, k, ldk, zp, len, s, lds);
        // SAFETY: `self` proves the features; `qk_bounds` checked the arguments.
        unsafe {
            if all_zero(zp) {
                qk_tiles::<false>(args, pf)
            } else {
                qk_tiles::<true>(args, pf)
            }
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
        pf: &[u8],
    ) {
        let n = zp.len();
        pv_bounds(acc.len(), lda, rows, w.len(), v.len(), ldv, n, len);
        // Zero points all 0 (folded into the weights by the driver): one subtraction fewer.
        let sub = !all_zero(zp);
        // One group of lines before each block of 32 columns.
        let mut pf = Pf::new(pf, rows.div_ceil(4) * len.div_ceil(32));
        let mut r = 0;
        while r < rows {
            let take = (rows - r).min(4);
            // SAFETY: `self` proves the features; `pv_bounds` checked that rows `r..r + take` of
            // `acc` (stride `lda`) hold `len` elements, `w` holds `rows * n` weights and the `n`
            // value rows (stride `ldv`) hold `len` bytes each.
            unsafe {
                let (a, wp) = (acc.as_mut_ptr().add(r * lda), w.as_ptr().add(r * n));
                let (args, pf) = ((a, lda, wp, n, v.as_ptr(), ldv, zp, len), &mut pf);
                match (take, sub) {
                    (4, true) => pv_r::<true, 4>(args, pf),
                    (3, true) => pv_r::<true, 3>(args, pf),
                    (2, true) => pv_r::<true, 2>(args, pf),
                    (_, true) => pv_r::<true, 1>(args, pf),
                    (4, false) => pv_r::<false, 4>(args, pf),
                    (3, false) => pv_r::<false, 3>(args, pf),
                    (2, false) => pv_r::<false, 2>(args, pf),
                    _ => pv_r::<false, 1>(args, pf),
                }
            }
            r += take;
        }
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
        // SAFETY: `self` proves the features; the loop reads only lanes of `s`.
        unsafe { max(s) }
    }

    fn exp_sum(self, s: &mut [f32], lds: usize, n: usize, subs: &[f32], sums: &mut [f32]) {
        exp_sum_bounds(s.len(), lds, n, subs.len(), sums.len());
        for (r, (&sub, out)) in subs.iter().zip(sums.iter_mut()).enumerate() {
            // SAFETY: `self` proves the features; the loop reads and writes only lanes of the
            // row (in bounds, checked above).
            *out = unsafe { exp_sum(&mut s[r * lds..][..n], sub) };
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

/// [`U8Micro::fold`] for `cst.len()` rows: `out = x * scale`, `cst[r] = sum(out * zp)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn fold_rows(
    (x, ldx): (*const f32, usize),
    scale: &[f32],
    zp: *const f32,
    (out, ldo): (*mut f32, usize),
    cst: &mut [f32],
) {
    let n = scale.len();
    for (r, c) in cst.iter_mut().enumerate() {
        let mut sum = _mm512_setzero_ps();
        let mut i = 0;
        while i < n {
            let m = tail((n - i).min(16));
            // SAFETY: lanes of `m` are `i..i + 16` clipped to `n`, inside row `r` of `x` and
            // `out`, and `zp` (the caller's bounds) and `scale`.
            unsafe {
                let o = _mm512_mul_ps(
                    _mm512_maskz_loadu_ps(m, x.add(r * ldx + i)),
                    _mm512_maskz_loadu_ps(m, scale.as_ptr().add(i)),
                );
                _mm512_mask_storeu_ps(out.add(r * ldo + i), m, o);
                sum = _mm512_fmadd_ps(o, _mm512_maskz_loadu_ps(m, zp.add(i)), sum);
            }
            i += 16;
        }
        *c = _mm512_reduce_add_ps(sum);
    }
}

/// `out[i] = (src[i] - zp[i]) * scale[i]`, or with `zp[0]`, `scale[0]` for every `i` when
/// `uniform`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
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
        let m = tail((n - i).min(16));
        // SAFETY: lanes of `m` are `i..i + 16` clipped to `n`: inside `src`, `out` and (not
        // `uniform`) `zp`/`scale`; uniform parameters are their first elements.
        unsafe {
            let (z, s) = if uniform {
                (_mm512_set1_ps(*zp), _mm512_set1_ps(*scale))
            } else {
                (
                    _mm512_maskz_loadu_ps(m, zp.add(i)),
                    _mm512_maskz_loadu_ps(m, scale.add(i)),
                )
            };
            let v = _mm512_mul_ps(load_u8(src.add(i), m, z), s);
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, v);
        }
        i += 16;
    }
}

/// [`U8Micro::qk`] in tiles of up to 4 rows x 4 keys, `pf` ticked before each; `SUB`: whether
/// the zero points are subtracted (they are all 0 when not).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ (an [`Avx512`] exists) and the arguments pass `qk_bounds`.
#[allow(clippy::type_complexity)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn qk_tiles<const SUB: bool>(
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
            let tk = if n - t >= 4 { 4 } else { 1 };
            pf.tick();
            // SAFETY: the caller guarantees the features and that `qk_bounds` checked rows `r..r + tr` of
            // `q` and `s`, and key rows `t..t + tk` of `k` (each `len` long at its stride).
            unsafe {
                let (qp, kp) = (q.as_ptr().add(r * ldq), k.as_ptr().add(t * ldk));
                let (zp, sp) = (zp.as_ptr().add(t), s.as_mut_ptr().add(r * lds + t));
                match (tr, tk) {
                    (4, 4) => qk_rk::<SUB, 4, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (3, 4) => qk_rk::<SUB, 3, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (2, 4) => qk_rk::<SUB, 2, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (1, 4) => qk_rk::<SUB, 1, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (4, _) => qk_rk::<SUB, 4, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (3, _) => qk_rk::<SUB, 3, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (2, _) => qk_rk::<SUB, 2, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    _ => qk_rk::<SUB, 1, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                }
            }
            t += tk;
        }
        r += tr;
    }
}

/// 16 bytes at `p` (the lanes of `m`) as f32 minus `zp`; other lanes 0.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn load_u8(p: *const u8, m: __mmask16, zp: __m512) -> __m512 {
    // SAFETY: the caller guarantees the bytes of the lanes of `m` at `p` are readable; masked
    // lanes are not accessed.
    let b = unsafe { _mm_maskz_loadu_epi8(m, p as *const i8) };
    _mm512_maskz_sub_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), zp)
}

/// R query rows x K keys in R*K accumulators: each query chunk loaded once for K keys, each key
/// chunk converted once for R rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn qk_rk<const SUB: bool, const R: usize, const K: usize>(
    q: *const f32,
    ldq: usize,
    k: *const u8,
    ldk: usize,
    zp: *const f32,
    len: usize,
    s: *mut f32,
    lds: usize,
) {
    let mut acc = [[_mm512_setzero_ps(); K]; R];
    let mut c = 0;
    while c < len {
        let m = tail((len - c).min(16));
        // SAFETY: lanes of `m` are columns `c..c + 16` clipped to `len`, inside the R query rows
        // and the K key rows; `zp` holds K entries (the caller's bounds).
        unsafe {
            let mut kv = [_mm512_setzero_ps(); K];
            for (j, kv) in kv.iter_mut().enumerate() {
                *kv = if SUB {
                    load_u8(k.add(j * ldk + c), m, _mm512_set1_ps(*zp.add(j)))
                } else {
                    let b = _mm_maskz_loadu_epi8(m, k.add(j * ldk + c) as *const i8);
                    _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
                };
            }
            for (r, acc) in acc.iter_mut().enumerate() {
                let qv = _mm512_maskz_loadu_ps(m, q.add(r * ldq + c));
                for (a, &kv) in acc.iter_mut().zip(&kv) {
                    *a = _mm512_fmadd_ps(qv, kv, *a);
                }
            }
        }
        c += 16;
    }
    if R * K == 16 {
        // One transposing tree for all 16 sums instead of 16 horizontal reductions.
        let mut v = [_mm512_setzero_ps(); 16];
        for (r, acc) in acc.iter().enumerate() {
            v[r * K..][..K].copy_from_slice(acc);
        }
        let mut sums = [0f32; 16];
        // SAFETY: `sums` holds 16 floats.
        unsafe { _mm512_storeu_ps(sums.as_mut_ptr(), reduce16(&v)) };
        for r in 0..R {
            // SAFETY: the caller gives R rows of K writable logits at stride `lds`.
            unsafe { std::ptr::copy_nonoverlapping(sums.as_ptr().add(r * K), s.add(r * lds), K) };
        }
        return;
    }
    for (r, acc) in acc.iter().enumerate() {
        for (j, a) in acc.iter().enumerate() {
            // SAFETY: the caller gives R rows of K writable logits at stride `lds`.
            unsafe { *s.add(r * lds + j) = _mm512_reduce_add_ps(*a) };
        }
    }
}

/// R accumulator rows x 32 columns (two chunks of 16: 2R independent sums, enough to hide the
/// FMA latency) held in registers over all `n` keys, `pf` ticked before each 32; `SUB`: whether
/// the zero points are subtracted (they are all 0 when not).
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
#[allow(clippy::type_complexity)]
unsafe fn pv_r<const SUB: bool, const R: usize>(
    (acc, lda, w, n, v, ldv, zp, len): (
        *mut f32,
        usize,
        *const f32,
        usize,
        *const u8,
        usize,
        &[f32],
        usize,
    ),
    pf: &mut Pf,
) {
    let mut c = 0;
    while c < len {
        pf.tick();
        // The second chunk's mask is empty past `len`: its lanes are neither read nor written.
        let m = [
            tail((len - c).min(16)),
            tail((len - c).saturating_sub(16).min(16)),
        ];
        // SAFETY: lanes of `m[h]` are columns `c + 16h..c + 16h + 16` clipped to `len`: inside
        // every accumulator row and every value row; `w` holds R rows of `n` weights (the
        // caller's bounds). Loads and stores of the accumulators are one per chunk, not per key.
        unsafe {
            let mut a = [[_mm512_setzero_ps(); 2]; R];
            for (r, a) in a.iter_mut().enumerate() {
                for (h, a) in a.iter_mut().enumerate() {
                    *a = _mm512_maskz_loadu_ps(m[h], acc.add(r * lda + c + 16 * h));
                }
            }
            for (t, &z) in zp.iter().enumerate() {
                let mut vv = [_mm512_setzero_ps(); 2];
                for (h, vv) in vv.iter_mut().enumerate() {
                    let p = v.add(t * ldv + c + 16 * h);
                    *vv = if SUB {
                        load_u8(p, m[h], _mm512_set1_ps(z))
                    } else {
                        let b = _mm_maskz_loadu_epi8(m[h], p as *const i8);
                        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b))
                    };
                }
                for (r, a) in a.iter_mut().enumerate() {
                    let wv = _mm512_set1_ps(*w.add(r * n + t));
                    for (a, &vv) in a.iter_mut().zip(&vv) {
                        *a = _mm512_fmadd_ps(wv, vv, *a);
                    }
                }
            }
            for (r, a) in a.iter().enumerate() {
                for (h, a) in a.iter().enumerate() {
                    _mm512_mask_storeu_ps(acc.add(r * lda + c + 16 * h), m[h], *a);
                }
            }
        }
        c += 32;
    }
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn max(s: &[f32]) -> f32 {
    let mut mx = _mm512_set1_ps(f32::NEG_INFINITY);
    let mut i = 0;
    while i < s.len() {
        let m = tail((s.len() - i).min(16));
        // SAFETY: lanes of `m` are `i..i + 16` clipped to `s.len()`. `vmaxps` returns its
        // second operand when either is NaN, so a NaN logit never replaces the running max
        // (`f32::max`'s rule).
        unsafe {
            let x = _mm512_mask_loadu_ps(mx, m, s.as_ptr().add(i));
            mx = _mm512_max_ps(x, mx);
        }
        i += 16;
    }
    _mm512_reduce_max_ps(mx)
}

#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn exp_sum(s: &mut [f32], sub: f32) -> f32 {
    let subv = _mm512_set1_ps(sub);
    let mut sum = _mm512_setzero_ps();
    let mut i = 0;
    while i < s.len() {
        let m = tail((s.len() - i).min(16));
        // SAFETY: lanes of `m` are `i..i + 16` clipped to `s.len()`.
        unsafe {
            let p = s.as_mut_ptr().add(i);
            let e = _mm512_maskz_mov_ps(m, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p), subv)));
            _mm512_mask_storeu_ps(p, m, e);
            sum = _mm512_add_ps(sum, e);
        }
        i += 16;
    }
    _mm512_reduce_add_ps(sum)
}
