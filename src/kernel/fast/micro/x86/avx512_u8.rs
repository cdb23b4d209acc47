//! The AVX-512 [`QuantMicro`]: 16 elements at a time zero-extended to i32 and converted to f32
//! (`vpmovzxbd`, `vcvtdq2ps`), the zero point subtracted once per 16 elements for all rows,
//! masked tails. u4 rows are read in place: 8 bytes (16 nibbles) split into high and low
//! nibbles and interleaved back into element order in a register ([`load_q`]), so the products
//! are the u8 loops' on the same values. Reached only through [`Avx512`], which only
//! `Avx512::detect` builds.

use std::arch::x86_64::*;

use super::super::{
    all_zero, exp_sum_bounds, fold_bounds, pv_bounds, qk_bounds, QRows, QuantMicro,
};
use super::avx512::{exp16, reduce16, tail, Avx512};
use super::prefetch::Pf;
use super::u8_loops::{self, PvArgs, QkArgs, QuantLoops};

u8_loops::u8_loops_by!(Avx512);

impl QuantMicro for Avx512 {
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
        let pf = Pf::new(pf, rows.div_ceil(4) * (n / 4 + n % 4));
        // By-channel keys come with zero points 0 (folded into the query by the driver): one
        // subtraction fewer per 16 elements.
        let args = (q, ldq, rows, k.bytes, k.ld, zp, len, s, lds);
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
        // One group of lines before each block of 32 columns.
        let pf = Pf::new(pf, rows.div_ceil(4) * len.div_ceil(32));
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

/// [`QuantMicro::fold`] for `cst.len()` rows: `out = x * scale`, `cst[r] = sum(out * zp)`.
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
            let [x] = load_q::<false, 1>(src, i, n - i);
            let v = _mm512_mul_ps(_mm512_maskz_sub_ps(m, x, z), s);
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, v);
        }
        i += 16;
    }
}

/// [`QuantMicro::qk`] in tiles of up to 4 rows x 4 keys, `pf` ticked before each; `SUB`: whether
/// the zero points are subtracted (they are all 0 when not); `U4`: whether the elements are
/// nibbles (else bytes).
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ (an [`Avx512`] exists) and the arguments pass `qk_bounds`.
#[allow(clippy::type_complexity)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
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
            let tk = if n - t >= 4 { 4 } else { 1 };
            pf.tick();
            // SAFETY: the caller guarantees the features and that `qk_bounds` checked rows `r..r + tr` of
            // `q` and `s`, and key rows `t..t + tk` of `k` (each `len` long at its stride).
            unsafe {
                let (qp, kp) = (q.as_ptr().add(r * ldq), k.as_ptr().add(t * ldk));
                let (zp, sp) = (zp.as_ptr().add(t), s.as_mut_ptr().add(r * lds + t));
                match (tr, tk) {
                    (4, 4) => qk_rk::<SUB, U4, 4, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (3, 4) => qk_rk::<SUB, U4, 3, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (2, 4) => qk_rk::<SUB, U4, 2, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (1, 4) => qk_rk::<SUB, U4, 1, 4>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (4, _) => qk_rk::<SUB, U4, 4, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (3, _) => qk_rk::<SUB, U4, 3, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    (2, _) => qk_rk::<SUB, U4, 2, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                    _ => qk_rk::<SUB, U4, 1, 1>(qp, ldq, kp, ldk, zp, len, sp, lds),
                }
            }
            t += tk;
        }
        r += tr;
    }
}

/// Elements `c..c + 16 * H` of the row at `row`, clipped to the `cnt` from `c` (lanes past it
/// 0), as f32 in `H` vectors of 16: bytes (`vpmovzxbd`), or (`U4`) nibbles, the even element
/// high: one load of `8 * H` bytes split into high and low nibbles and interleaved back into
/// element order (`vpunpcklbw`/`vpunpckhbw`), then widened as bytes are.
///
/// # Safety
/// The CPU has AVX-512 F/BW/VL/DQ; the row's bytes of elements `c..c + cnt.min(16 * H)` are
/// readable (`(c + cnt.min(16 * H)).div_ceil(2)` bytes from `row` for u4, `c` even).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn load_q<const U4: bool, const H: usize>(
    row: *const u8,
    c: usize,
    cnt: usize,
) -> [__m512; H] {
    let mut b = [_mm_setzero_si128(); H];
    if U4 {
        debug_assert!(c.is_multiple_of(2) && H <= 2);
        // SAFETY: the lanes of the mask are the bytes of elements `c..c + cnt.min(16 H)`:
        // readable (the caller's guarantee).
        let x = unsafe {
            let bytes = tail(cnt.min(16 * H).div_ceil(2));
            _mm_maskz_loadu_epi8(bytes, row.add(c / 2) as *const i8)
        };
        let low = _mm_set1_epi8(15);
        let (hi, lo) = (
            _mm_and_si128(_mm_srli_epi16::<4>(x), low),
            _mm_and_si128(x, low),
        );
        b[0] = _mm_unpacklo_epi8(hi, lo);
        if H > 1 {
            b[1] = _mm_unpackhi_epi8(hi, lo);
        }
    } else {
        for (h, b) in b.iter_mut().enumerate() {
            let m = tail(cnt.saturating_sub(16 * h).min(16));
            // SAFETY: lanes of `m` are elements `c + 16h..` clipped to `cnt`: readable bytes.
            *b = unsafe { _mm_maskz_loadu_epi8(m, row.add(c + 16 * h) as *const i8) };
        }
    }
    // Element lanes past `cnt` (with u4, an odd count's last low nibble) are zeroed.
    let mut out = [_mm512_setzero_ps(); H];
    for (h, (o, &b)) in out.iter_mut().zip(&b).enumerate() {
        let m = tail(cnt.saturating_sub(16 * h).min(16));
        *o = _mm512_cvtepi32_ps(_mm512_maskz_cvtepu8_epi32(m, b));
    }
    out
}

/// R query rows x K keys in R*K accumulators: each query chunk loaded once for K keys, each key
/// chunk converted once for R rows.
#[allow(clippy::too_many_arguments)]
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c")]
unsafe fn qk_rk<const SUB: bool, const U4: bool, const R: usize, const K: usize>(
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
                let [x] = load_q::<U4, 1>(k.add(j * ldk), c, len - c);
                *kv = if SUB {
                    _mm512_maskz_sub_ps(m, x, _mm512_set1_ps(*zp.add(j)))
                } else {
                    x
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
unsafe fn pv_r<const SUB: bool, const U4: bool, const R: usize>(
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
                let mut vv = load_q::<U4, 2>(v.add(t * ldv), c, len - c);
                if SUB {
                    for (h, vv) in vv.iter_mut().enumerate() {
                        *vv = _mm512_maskz_sub_ps(m[h], *vv, _mm512_set1_ps(z));
                    }
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
