//! AVX2 + FMA + F16C micro-kernels.
//!
//! Register blocking: `qk` computes 4 query rows x 3 keys per pass (12 accumulators, each key
//! row loaded and widened once per 4 rows, one combined horizontal reduction per row). f16 rows
//! are widened with `vcvtph2ps`, bf16 rows by shifting the 16 bits into the top of an f32.
//! [`F32x8`] runs the online-softmax step on 8 rows at once (the prefill tiles).
//!
//! Every function here is `#[target_feature(enable = "avx2,fma,f16c")]`; they are reached
//! only through [`Avx2`], which can only be built by [`Avx2::detect`] after the CPU reported
//! those features.

use std::arch::x86_64::*;

use super::{bounds, cephes, Micro};
use crate::dtype::{ElemType, Float};
use crate::kernel::softmax::Lanes;

/// Proof that AVX2, FMA and F16C are available (only [`Avx2::detect`] builds one).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Avx2 {
    _private: (),
}

impl Avx2 {
    /// `Some` when this CPU (and OS) supports AVX2, FMA and F16C.
    pub(crate) fn detect() -> Option<Avx2> {
        (is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c"))
        .then_some(Avx2 { _private: () })
    }
}

impl Micro for Avx2 {
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
                scale,
            )
        }
    }

    fn add_exp_scaled(self, dst: &mut [f32], s: &[f32], m: f32, c: f32) {
        assert!(s.len() >= dst.len());
        // SAFETY: `self` proves the features; accesses stay inside `dst` and `s[..dst.len()]`.
        unsafe { add_exp_scaled(dst, s, m, c) }
    }

    fn add_scaled(self, dst: &mut [f32], w: &[f32], c: f32) {
        assert!(w.len() >= dst.len(), "add_scaled: weights too short");
        // SAFETY: `self` proves the features; accesses stay inside `dst` and `w[..dst.len()]`.
        unsafe { add_scaled(dst, w, c) }
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

/// Eight elements of type `C` at `p`, widened to f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load8<C: Float>(p: *const C) -> __m256 {
    // SAFETY (all arms): the caller guarantees 8 readable elements of type `C` at `p`;
    // `C::TYPE` names that type, so the reinterpretation reads exactly those bytes.
    unsafe {
        match C::TYPE {
            ElemType::F32 => _mm256_loadu_ps(p as *const f32),
            ElemType::F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
            // bf16 is the top half of an f32: zero-extend to 32 bits and shift up.
            _ => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(
                _mm_loadu_si128(p as *const __m128i),
            ))),
        }
    }
}

/// `[sum(a), sum(b), sum(c), sum(d)]`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum4(a: __m256, b: __m256, c: __m256, d: __m256) -> __m128 {
    let ab = _mm256_hadd_ps(a, b);
    let cd = _mm256_hadd_ps(c, d);
    let abcd = _mm256_hadd_ps(ab, cd);
    _mm_add_ps(
        _mm256_castps256_ps128(abcd),
        _mm256_extractf128_ps::<1>(abcd),
    )
}

#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
unsafe fn qk<C: Float>(
    q: *const f32,
    rows: usize,
    k: *const C,
    n: usize,
    d: usize,
    s: *mut f32,
    lds: usize,
    scale: f32,
) {
    let mut r = 0;
    while r < rows {
        let rr = (rows - r).min(4);
        let mut j = 0;
        while j < n {
            let kk = (n - j).min(3);
            // SAFETY: rows r..r+rr of q, keys j..j+kk of k and the matching s entries are
            // inside the ranges the caller checked.
            unsafe {
                let (qp, kp, sp) = (q.add(r * d), k.add(j * d), s.add(r * lds + j));
                match (rr, kk) {
                    (4, 3) => qk_block::<C, 4, 3>(qp, kp, d, sp, lds, scale),
                    (4, 2) => qk_block::<C, 4, 2>(qp, kp, d, sp, lds, scale),
                    (4, _) => qk_block::<C, 4, 1>(qp, kp, d, sp, lds, scale),
                    (3, 3) => qk_block::<C, 3, 3>(qp, kp, d, sp, lds, scale),
                    (3, 2) => qk_block::<C, 3, 2>(qp, kp, d, sp, lds, scale),
                    (3, _) => qk_block::<C, 3, 1>(qp, kp, d, sp, lds, scale),
                    (2, 3) => qk_block::<C, 2, 3>(qp, kp, d, sp, lds, scale),
                    (2, 2) => qk_block::<C, 2, 2>(qp, kp, d, sp, lds, scale),
                    (2, _) => qk_block::<C, 2, 1>(qp, kp, d, sp, lds, scale),
                    (_, 3) => qk_block::<C, 1, 3>(qp, kp, d, sp, lds, scale),
                    (_, 2) => qk_block::<C, 1, 2>(qp, kp, d, sp, lds, scale),
                    (_, _) => qk_block::<C, 1, 1>(qp, kp, d, sp, lds, scale),
                }
            }
            j += kk;
        }
        r += rr;
    }
}

/// Dot products of `R` query rows with `K` key rows (both of length `d`, row stride `d`), stored
/// as `cap(scale * dot)`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn qk_block<C: Float, const R: usize, const K: usize>(
    q: *const f32,
    k: *const C,
    d: usize,
    s: *mut f32,
    lds: usize,
    scale: f32,
) {
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
        x += 8;
    }
    for (r, a) in acc.iter().enumerate() {
        let g = |i: usize| a.get(i).copied().unwrap_or(z);
        let v = hsum4(g(0), g(1), g(2), z);
        let mut out = [0f32; 4];
        // SAFETY: `out` holds 4 floats.
        unsafe { _mm_storeu_ps(out.as_mut_ptr(), v) };
        for (kk, &o) in out.iter().enumerate().take(K) {
            let mut t = o;
            for xx in d8..d {
                // SAFETY: xx < d, inside row r of q and row kk of k.
                t += unsafe { *q.add(r * d + xx) * (*k.add(kk * d + xx)).to_f32() };
            }
            // SAFETY: entry (r, kk) of the caller's s tile.
            unsafe { *s.add(r * lds + kk) = (scale * t).cap() };
        }
    }
}

/// `exp(x)` for 8 lanes (Cephes polynomial, about 1 ulp); exactly 0 below -87.3 (and for -inf),
/// NaN for NaN.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn exp8(x: __m256) -> __m256 {
    let under = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(cephes::X_MIN));
    // min/max return their second operand when either is NaN: `x` second keeps NaN.
    let x = _mm256_min_ps(_mm256_set1_ps(cephes::X_MAX), x);
    let x = _mm256_max_ps(_mm256_set1_ps(cephes::X_MIN), x);
    // SAFETY: same features as this function.
    let r = unsafe { exp8_clamped(x) };
    _mm256_andnot_ps(under, r)
}

/// `exp(x)` for `x <= 0` or `-inf` (a softmax subtracting its running max): clamped at -88,
/// where the result is exactly 0, so no overflow clamp or underflow mask is needed. NaN stays
/// NaN (the clamp's `max` returns its second operand, `x`, for NaN).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn exp8_nonpos(x: __m256) -> __m256 {
    // SAFETY: same features as this function.
    unsafe { exp8_clamped(_mm256_max_ps(_mm256_set1_ps(-88.0), x)) }
}

/// `exp(x)` for `x` in `[-88, 88.37]` (Cephes polynomial, about 1 ulp); `x` below about
/// -87.68 rounds to the exponent -127, which gives exactly 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn exp8_clamped(x: __m256) -> __m256 {
    let fx = _mm256_round_ps::<_MM_FROUND_TO_NEAREST_INT>(_mm256_mul_ps(
        x,
        _mm256_set1_ps(std::f32::consts::LOG2_E),
    ));
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(cephes::LN2_HI), x);
    let x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(cephes::LN2_LO), x);
    let mut y = _mm256_set1_ps(cephes::P[0]);
    for &c in &cephes::P[1..] {
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(c));
    }
    y = _mm256_fmadd_ps(
        y,
        _mm256_mul_ps(x, x),
        _mm256_add_ps(x, _mm256_set1_ps(1.0)),
    );
    // 2^fx: fx is in -127..=127, a normal exponent or (at -127) the bits of 0.0.
    let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
        _mm256_cvtps_epi32(fx),
        _mm256_set1_epi32(127),
    ));
    _mm256_mul_ps(y, _mm256_castsi256_ps(e))
}

/// Loads `len < 8` floats from `p` into the low lanes, `fill` elsewhere.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn load_partial(p: *const f32, len: usize, fill: f32) -> __m256 {
    let mut buf = [fill; 8];
    // SAFETY: the caller guarantees `len` readable floats at `p`; `buf` holds 8 >= len.
    unsafe {
        std::ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), len);
        _mm256_loadu_ps(buf.as_ptr())
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn hsum(v: __m256) -> f32 {
    let z = _mm256_setzero_ps();
    _mm_cvtss_f32(hsum4(v, z, z, z))
}

/// `s[i] = exp(s[i] - m)` over `s`, returning their sum (one row of [`exp_sub_sum_rows`]).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn exp_sub_sum(s: &mut [f32], m: f32) -> f32 {
    // SAFETY: one row of `s.len()` floats at `s`.
    unsafe { exp_sub_sum_rows::<1>(s.as_mut_ptr(), 0, s.len(), [m])[0] }
}

/// `R` rows of `n` floats at `p` (stride `lds`): row `r`'s `x = exp(x - m[r])`, and their sum
/// per row. The rows go through the loop together (R independent exp chains hide each other's
/// latency), each with the arithmetic and order of a row on its own.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; rows `0..R` of `n` floats at stride `lds` from `p` are
/// readable and writable.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn exp_sub_sum_rows<const R: usize>(
    p: *mut f32,
    lds: usize,
    n: usize,
    m: [f32; R],
) -> [f32; R] {
    let mut mv = [_mm256_setzero_ps(); R];
    for (v, &m) in mv.iter_mut().zip(&m) {
        *v = _mm256_set1_ps(m);
    }
    let mut sum = [_mm256_setzero_ps(); R];
    let mut j = 0;
    while j + 8 <= n {
        for r in 0..R {
            // SAFETY: j + 8 <= n elements of row r.
            unsafe {
                let q = p.add(r * lds + j);
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(q), mv[r]));
                _mm256_storeu_ps(q, e);
                sum[r] = _mm256_add_ps(sum[r], e);
            }
        }
        j += 8;
    }
    if j < n {
        for r in 0..R {
            let mut buf = [0f32; 8];
            // SAFETY: n - j < 8 elements of row r remain; the padding is -inf, whose exp is 0.
            unsafe {
                let q = p.add(r * lds + j);
                let x = load_partial(q, n - j, f32::NEG_INFINITY);
                let e = exp8(_mm256_sub_ps(x, mv[r]));
                _mm256_storeu_ps(buf.as_mut_ptr(), e);
                std::ptr::copy_nonoverlapping(buf.as_ptr(), q, n - j);
                sum[r] = _mm256_add_ps(sum[r], e);
            }
        }
    }
    let mut out = [0f32; R];
    for (o, &v) in out.iter_mut().zip(&sum) {
        // SAFETY: same features as this function.
        *o = unsafe { hsum(v) };
    }
    out
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_exp_scaled(dst: &mut [f32], s: &[f32], m: f32, c: f32) {
    let (mv, cv) = (_mm256_set1_ps(m), _mm256_set1_ps(c));
    let n = dst.len();
    let (dp, sp) = (dst.as_mut_ptr(), s.as_ptr());
    let mut j = 0;
    while j + 8 <= n {
        // SAFETY: j + 8 <= n <= s.len() (checked by the caller).
        unsafe {
            let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp.add(j)), mv));
            _mm256_storeu_ps(
                dp.add(j),
                _mm256_fmadd_ps(e, cv, _mm256_loadu_ps(dp.add(j))),
            );
        }
        j += 8;
    }
    if j < n {
        let mut buf = [0f32; 8];
        // SAFETY: n - j < 8 elements remain in both slices.
        unsafe {
            let e = exp8(_mm256_sub_ps(
                load_partial(sp.add(j), n - j, f32::NEG_INFINITY),
                mv,
            ));
            let r = _mm256_fmadd_ps(e, cv, load_partial(dp.add(j), n - j, 0.0));
            _mm256_storeu_ps(buf.as_mut_ptr(), r);
            std::ptr::copy_nonoverlapping(buf.as_ptr(), dp.add(j), n - j);
        }
    }
}

/// [`Micro::add_scaled`]: a product, then a sum (not one FMA), as the scalar twin rounds.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn add_scaled(dst: &mut [f32], w: &[f32], c: f32) {
    let cv = _mm256_set1_ps(c);
    let n = dst.len();
    let (dp, wp) = (dst.as_mut_ptr(), w.as_ptr());
    let mut j = 0;
    while j + 8 <= n {
        // SAFETY: j + 8 <= n <= w.len() (checked by the caller).
        unsafe {
            let p = _mm256_mul_ps(_mm256_loadu_ps(wp.add(j)), cv);
            _mm256_storeu_ps(dp.add(j), _mm256_add_ps(_mm256_loadu_ps(dp.add(j)), p));
        }
        j += 8;
    }
    for (o, &x) in dst[j..].iter_mut().zip(&w[j..n]) {
        *o += x * c;
    }
}

/// `x[j] *= c`, then [`Lanes::cap`] when `CAP` (logits).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scale<const CAP: bool>(x: &mut [f32], c: f32) {
    let cv = _mm256_set1_ps(c);
    let n = x.len();
    let p = x.as_mut_ptr();
    let mut j = 0;
    while j + 8 <= n {
        // SAFETY: j + 8 <= n.
        unsafe {
            let v = F32x8(_mm256_mul_ps(_mm256_loadu_ps(p.add(j)), cv));
            _mm256_storeu_ps(p.add(j), if CAP { v.cap().0 } else { v.0 });
        }
        j += 8;
    }
    for v in &mut x[j..] {
        *v *= c;
        if CAP {
            *v = v.cap();
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn narrow<C: Float>(src: *const f32, dst: *mut C, n: usize) {
    let mut j = 0;
    while j + 8 <= n {
        // SAFETY: j + 8 <= n elements in both buffers; `C::TYPE` names the element type of
        // `dst`, so each arm writes exactly its 8 elements.
        unsafe {
            let x = _mm256_loadu_ps(src.add(j));
            let p = dst.add(j);
            match C::TYPE {
                ElemType::F32 => _mm256_storeu_ps(p as *mut f32, x),
                // `vcvtps2ph`: what `half` itself uses on F16C CPUs.
                ElemType::F16 => _mm_storeu_si128(
                    p as *mut __m128i,
                    _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x),
                ),
                _ => _mm_storeu_si128(p as *mut __m128i, bf16_bits8(x)),
            }
        }
        j += 8;
    }
    while j < n {
        // SAFETY: j < n.
        unsafe { *dst.add(j) = C::from_f32(*src.add(j)) };
        j += 1;
    }
}

/// The bf16 bits of 8 f32 lanes, packed, as `half`'s `bf16::from_f32` (see the AVX-512 tier's
/// `bf16_bits16`: round to nearest even, NaN kept quiet).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bf16_bits8(x: __m256) -> __m128i {
    let b = _mm256_castps_si256(x);
    let lsb = _mm256_and_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(1));
    let bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(b, bias));
    // |x| > inf as signed compare: both sides are below 2^31 once the sign is cleared.
    let nan = _mm256_cmpgt_epi32(
        _mm256_and_si256(b, _mm256_set1_epi32(0x7fff_ffff)),
        _mm256_set1_epi32(0x7f80_0000),
    );
    let quiet = _mm256_or_si256(_mm256_srli_epi32::<16>(b), _mm256_set1_epi32(0x40));
    let bits = _mm256_blendv_epi8(rounded, quiet, nan);
    // Every lane is below 2^16, so the unsigned-saturating pack keeps it; the pack works per
    // 128-bit half, so the two halves are joined from lanes 0 and 2 of the 64-bit view.
    let packed = _mm256_packus_epi32(bits, bits);
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen<C: Float>(src: *const C, dst: *mut f32, n: usize) {
    let mut j = 0;
    while j + 8 <= n {
        // SAFETY: j + 8 <= n elements in both buffers.
        unsafe { _mm256_storeu_ps(dst.add(j), load8(src.add(j))) };
        j += 8;
    }
    while j < n {
        // SAFETY: j < n.
        unsafe { *dst.add(j) = (*src.add(j)).to_f32() };
        j += 1;
    }
}

/// Eight rows' softmax state, one per lane (see [`Lanes`]). Built only from vectors the AVX2
/// loops loaded, i.e. inside `#[target_feature(enable = "avx2,fma,f16c")]` functions reached
/// through [`Avx2`] (so the CPU has the features), and only used there; the methods are
/// inlined into those functions.
#[derive(Clone, Copy)]
pub(super) struct F32x8(pub __m256);

impl Lanes for F32x8 {
    #[inline(always)]
    fn max(self, o: Self) -> Self {
        // SAFETY: an F32x8 exists only inside the AVX2 functions (see the type).
        F32x8(unsafe { _mm256_max_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn sub(self, o: Self) -> Self {
        // SAFETY: an F32x8 exists only inside the AVX2 functions (see the type).
        F32x8(unsafe { _mm256_sub_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn mul(self, o: Self) -> Self {
        // SAFETY: an F32x8 exists only inside the AVX2 functions (see the type).
        F32x8(unsafe { _mm256_mul_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn add(self, o: Self) -> Self {
        // SAFETY: an F32x8 exists only inside the AVX2 functions (see the type).
        F32x8(unsafe { _mm256_add_ps(self.0, o.0) })
    }
    #[inline(always)]
    fn zero_if_neg_inf(self) -> Self {
        // SAFETY: an F32x8 exists only inside the AVX2 functions (see the type).
        F32x8(unsafe {
            let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
            let is = _mm256_cmp_ps::<_CMP_EQ_OQ>(self.0, ninf);
            _mm256_blendv_ps(self.0, _mm256_setzero_ps(), is)
        })
    }
    #[inline(always)]
    fn exp_nonpos(self) -> Self {
        // SAFETY: an F32x8 exists only inside the AVX2 functions (see the type).
        F32x8(unsafe { exp8_nonpos(self.0) })
    }
    #[inline(always)]
    fn cap(self) -> Self {
        // SAFETY: an F32x8 exists only inside the AVX2 functions (see the type). `min`
        // returns its second operand, `self`, for NaN.
        F32x8(unsafe { _mm256_min_ps(_mm256_set1_ps(f32::MAX), self.0) })
    }
}
