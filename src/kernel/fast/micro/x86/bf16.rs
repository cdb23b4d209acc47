//! AVX512-BF16: the bf16 packing of the operands of the QK and PV products of prefill items
//! under bf16 math (rounding, residual cuts, query and weight pair layouts), shared by the AMX
//! tiles (`amx`) and the `vdpbf16ps` products of this file, which run the same products on
//! CPUs with AVX512-BF16 and no AMX (AMD Zen 4 and 5, Intel Cooper Lake, Xeons with AMX off).
//!
//! Layouts are `amx`'s (module doc there): keys `kp[j*ldk + x]`, query pairs
//! `qt[x2*r32 + r]`, logits `st[j*r32 + r]`, values transposed `vt[x*ldv + j]`, weight pairs
//! `pt[j2*r32 + r]`, accumulator `acc[x*r32 + r]`. `vdpbf16ps` multiplies a broadcast bf16
//! pair of the A operand (a key's or a value row's two elements) by 16 pair rows of the B
//! operand (16 query rows, 16 weight rows) and adds both exact products to f32 lanes: the
//! tile product's arithmetic, one 16-lane row at a time. Its twin is `scalar_amx`.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::avx512::{exp16_nonpos, tail, transpose16};
use super::avx512_tile::{row_mask, softmax_end, softmax_step};

/// Proof that this CPU has AVX-512F/BW/VL/DQ and AVX512-BF16 (with AVX2, FMA and F16C).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bf16(());

/// The bf16 products of a call's prefill items: the packers and the `vdpbf16ps` products of
/// [`Bf16`], with AMX tiles for the products when `amx` is set.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Bf16Tier {
    pub(crate) bf: Bf16,
    pub(crate) amx: Option<super::amx::Amx>,
}

/// Keys (QK) or value rows (PV) per register block: 8 A rows x 32 B columns, 16 f32
/// accumulators.
const JB: usize = 8;

/// What a register block does with its output `c` (see [`block`]).
#[derive(Clone, Copy)]
enum Acc {
    /// QK: the sums, times the scale and capped as `TileMicro::scale_logits` leaves logits,
    /// overwrite `c`.
    Scaled(f32),
    /// PV: the sums are added to `c`, first multiplied by the 32 factors at the pointer (one
    /// a column: the softmax step's correction of the rows) when there is one.
    Add(Option<*const f32>),
}

impl Bf16 {
    /// Checks once per process.
    pub(crate) fn detect() -> Option<Bf16> {
        static OK: OnceLock<bool> = OnceLock::new();
        OK.get_or_init(|| {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512dq")
                && is_x86_feature_detected!("avx512bf16")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
        .then_some(Bf16(()))
    }

    /// `rounds` rounds of 16 independent `vdpbf16ps` (16 lanes x 2 multiply-adds each) on
    /// registers (no loads, no stores): the instruction's own limit, what the benchmark calls
    /// the bf16 dot-product peak (64 flops an instruction).
    pub(crate) fn dot_products(self, rounds: usize) -> f32 {
        // SAFETY: `self` proves AVX512-BF16.
        unsafe { dot_products(rounds) }
    }

    /// QK by `vdpbf16ps`, as [`super::amx::Tiles::qk_t`] computes it, then scaled as
    /// `TileMicro::scale_logits` scales it while still in registers: `st[j*r32 + r] =
    /// cap(scale * sum_t sum_x kp_t[j*ldk + x] * q_t[r][x])` for `j < n32`, `r < r32`, `x < dp`.
    /// With `keys`, the columns `32*b..32*b + 32` (row block `b`) get only the logits of keys
    /// `j < keys[b]` (rounded up to a register block of 8 keys; the others keep what they
    /// held): the causal diagonal's rows need no logits of the keys masked for all of them.
    /// `tick` runs after each register block (the caller's prefetches, spread over the loop).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn qk_t(
        self,
        terms: &[(&[u16], &[u32])],
        ldk: usize,
        dp: usize,
        (n32, keys): (usize, Option<&[usize]>),
        r32: usize,
        scale: f32,
        st: &mut [f32],
        tick: &mut impl FnMut(),
    ) {
        assert_qk(terms, ldk, dp, n32, r32, st);
        assert!(keys.is_none_or(|k| k.len() >= r32 / 32));
        for rb in (0..r32).step_by(32) {
            let nk = keys.map_or(n32, |k| k[rb / 32].min(n32).div_ceil(JB) * JB);
            for jb in (0..nk).step_by(JB) {
                // SAFETY: `self` proves AVX512-BF16; rows jb..jb+JB <= n32 of every key panel
                // (pairs 0..dp/2), query-pair rows 0..dp/2 at columns rb..rb+32 <= r32, and
                // logit rows jb..jb+JB at those columns are inside the slices (asserted above).
                unsafe {
                    block(
                        terms,
                        (jb * ldk, ldk),
                        (rb, r32),
                        dp / 2,
                        (st.as_mut_ptr().add(jb * r32 + rb), r32),
                        Acc::Scaled(scale),
                    )
                };
                tick();
            }
        }
    }

    /// PV by `vdpbf16ps`, as [`super::amx::Tiles::pv_t`] computes it, on an accumulator
    /// first corrected as [`Bf16::mul_rows`] corrects it (when `corr` is given) while in
    /// registers: `acc[x*r32 + r] = acc[x*r32 + r] * corr[r] + sum_t sum_j vt_t[x*ldv + j] *
    /// p_t[j][r]` for `x < dp`, `r < r32`, `j < n32`. With `keys`, the columns of row block
    /// `b` (`32*b..32*b + 32`) sum keys `j < keys[b]` only (rounded up to a pair): the
    /// caller's weights of the later keys are 0 for those rows, and the values finite.
    /// `tick` runs after each register block, as in [`Bf16::qk_t`].
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pv_t(
        self,
        terms: &[(&[u16], &[u32])],
        ldv: usize,
        dp: usize,
        (n32, keys): (usize, Option<&[usize]>),
        r32: usize,
        corr: Option<&[f32]>,
        acc: &mut [f32],
        tick: &mut impl FnMut(),
    ) {
        assert_pv(terms, ldv, dp, n32, r32, acc);
        assert!(corr.is_none_or(|c| c.len() >= r32));
        assert!(keys.is_none_or(|k| k.len() >= r32 / 32));
        for xb in (0..dp).step_by(JB) {
            for rb in (0..r32).step_by(32) {
                let kpairs = keys.map_or(n32, |k| k[rb / 32].min(n32)).div_ceil(2);
                // SAFETY: `self` proves AVX512-BF16; value rows xb..xb+JB <= dp (keys
                // 0..2*kpairs <= n32), weight-pair rows 0..kpairs <= n32/2 at columns rb..rb+32 <= r32 and
                // accumulator rows xb..xb+JB at those columns are inside the slices (above).
                unsafe {
                    block(
                        terms,
                        (xb * ldv, ldv),
                        (rb, r32),
                        kpairs,
                        (acc.as_mut_ptr().add(xb * r32 + rb), r32),
                        // SAFETY (the offset): rb + 32 <= r32 <= corr.len() (asserted).
                        Acc::Add(corr.map(|c| c.as_ptr().add(rb))),
                    )
                };
                tick();
            }
        }
    }

    /// `dst[i]` = bf16 bits of `src[i]`, rounded to nearest even (f32 subnormals become
    /// zero, as `vcvtneps2bf16` does; `scalar_amx::round_bf16` is the twin).
    pub(crate) fn round(self, src: &[f32], dst: &mut [u16]) {
        assert!(dst.len() >= src.len());
        // SAFETY: `self` proves AVX-512F/BW/VL/BF16; `src.len()` elements of both are in bounds.
        unsafe { round(src.as_ptr(), dst.as_mut_ptr(), src.len()) }
    }

    /// `x[i] -= round(x[i])`: what is left of `x` after its bf16 part, so that rounding `x`,
    /// then its residual, and so on, cuts it into bf16 parts whose sum is `x` (two parts are
    /// exact for f16 and within 2^-17 relative for f32, three within 2^-26 for f32). An
    /// infinite part leaves a residual of 0, not NaN (`scalar_amx::split_bf16` is the twin).
    pub(crate) fn residual(self, x: &mut [f32]) {
        // SAFETY: `self` proves AVX-512F/BW/VL/BF16; `x.len()` elements are in bounds.
        unsafe { residual(x.as_mut_ptr(), x.len()) }
    }

    /// Weight pairs `pt[b*plane + j2*ldt + r]` = (p[2*j2][r], p[2*j2+1][r]) cut into `parts`
    /// bf16 parts (part `b` the rounding of what parts `0..b` leave, as [`Bf16::round`] and
    /// [`Bf16::residual`] cut a value), from the transposed weights `st[j*ldt + r]`, for
    /// `j2 < n32/2` (keys `n..n32` are 0) and `r < ldt`. One pass over the weights: the
    /// residuals stay in registers. `ldt` is a multiple of 16, `n32` of 32 (a whole PV k-step).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pair_rows(
        self,
        st: &[f32],
        ldt: usize,
        n: usize,
        n32: usize,
        parts: usize,
        pt: &mut [u32],
        plane: usize,
    ) {
        assert!(ldt.is_multiple_of(16) && n32.is_multiple_of(32) && n <= n32 && parts >= 1);
        assert!(st.len() >= n * ldt && plane >= n32 / 2 * ldt);
        assert!(pt.len() >= (parts - 1) * plane + n32 / 2 * ldt);
        // SAFETY: `self` proves AVX-512F/BW/VL/BF16; the asserts bound every access.
        unsafe { pair_rows(st.as_ptr(), ldt, n, n32, parts, pt.as_mut_ptr(), plane) }
    }

    /// `TileMicro::softmax_t` of the logits `st[j*ldt + r]` (`j < n`, rows `r < rows`),
    /// with the weights paired as [`Bf16::pair_rows`] pairs them into one part, fused: each
    /// weight goes from its `exp` into `pt[j2*ldt + r]` without a round trip through `st`
    /// (which keeps the logits). `m`, `l` and `c` as `softmax_t` leaves them; pairs of keys
    /// `n..n32` and of lanes `rows.div_ceil(8)*8..ldt` are 0. `ldt` a multiple of 16, `n32`
    /// of 32. With `keys`, lanes `32*b..32*b + 32` read keys `j < keys[b]` only and pair the
    /// later ones as 0: the same results when those logits are -inf (masked for those rows).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn softmax_pairs(
        self,
        st: &[f32],
        ldt: usize,
        (rows, n, n32, keys): (usize, usize, usize, Option<&[usize]>),
        m: &mut [f32],
        l: &mut [f32],
        c: &mut [f32],
        pt: &mut [u32],
    ) {
        let rows8 = rows.div_ceil(8) * 8;
        assert!(ldt.is_multiple_of(16) && n32.is_multiple_of(32) && n <= n32 && rows8 <= ldt);
        assert!(st.len() >= n * ldt && pt.len() >= n32 / 2 * ldt);
        assert!(m.len() >= rows8 && l.len() >= rows8 && c.len() >= rows8);
        assert!(keys.is_none_or(|k| k.len() >= ldt.div_ceil(32)));
        let (sp, pp) = (st.as_ptr(), pt.as_mut_ptr());
        let (mp, lp, cp) = (m.as_mut_ptr(), l.as_mut_ptr(), c.as_mut_ptr());
        let mut r = 0;
        while r < ldt {
            let left = rows8.saturating_sub(r);
            // Steps of 32 lanes from 0 (then 16 at most once): the lanes are in row block r/32.
            let n = keys.map_or(n, |k| k[r / 32].min(n));
            // SAFETY: `self` proves AVX-512F/BW/VL/DQ/BF16, AVX2, FMA; lanes r..r+16*RV <=
            // ldt of st rows j < n and of pt rows j2 < n32/2, and the masked lanes of m, l, c
            // (< rows8) are inside the slices (asserted above).
            unsafe {
                let at = (sp.add(r), pp.add(r), mp.add(r), lp.add(r), cp.add(r));
                if left > 16 {
                    softmax_pairs_rows::<2>(at, ldt, n, n32, tail((left - 16).min(16)));
                    r += 32;
                } else {
                    softmax_pairs_rows::<1>(at, ldt, n, n32, tail(left));
                    r += 16;
                }
            }
        }
    }

    /// Rows `r0..r0 + 16` of the query pairs of QK, cut into `parts` bf16 parts (as
    /// [`Bf16::pair_rows`] cuts weights): `qt[b*plane + x2*ld + r0 + i]` = part `b` of
    /// (q_i[2*x2], q_i[2*x2+1]) for `x2 < d.div_ceil(2)` (an odd `d` pairs the last element
    /// with 0), `q_i` = `rows[i]` (`d` long; rows past `rows.len()` are zeros). One pass over
    /// the rows, transposed in registers into whole 16-row pair lines.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn pair_cols(
        self,
        rows: &[&[f32]],
        d: usize,
        parts: usize,
        qt: &mut [u32],
        ld: usize,
        plane: usize,
        r0: usize,
    ) {
        let n2 = d.div_ceil(2);
        assert!(rows.len() <= 16 && rows.iter().all(|q| q.len() >= d));
        assert!(parts >= 1 && r0 + 16 <= ld && plane >= n2 * ld);
        assert!(n2 == 0 || qt.len() >= (parts - 1) * plane + (n2 - 1) * ld + r0 + 16);
        let mut p = [std::ptr::null::<f32>(); 16];
        for (p, q) in p.iter_mut().zip(rows) {
            *p = q.as_ptr();
        }
        // SAFETY: `self` proves AVX-512F/BW/VL/BF16; the asserts bound every access (the first
        // `rows.len()` pointers address `d` elements each, the rest are not read).
        unsafe { pair_cols(&p, rows.len(), d, parts, qt.as_mut_ptr(), ld, plane, r0) }
    }

    /// `x[i*c.len() + r] *= c[r]`: the rows of `x` scaled by `c` element-wise (the softmax
    /// step's correction of a transposed accumulator).
    pub(crate) fn mul_rows(self, x: &mut [f32], c: &[f32]) {
        assert!(c.len().is_multiple_of(16) && x.len().is_multiple_of(c.len().max(1)));
        // SAFETY: `self` proves AVX-512F; whole 16-lane vectors inside both slices.
        unsafe { mul_rows(x.as_mut_ptr(), x.len(), c.as_ptr(), c.len()) }
    }
}

/// The bounds a QK product over `terms` relies on (tiles and `vdpbf16ps` alike): whole
/// k-steps and 32-blocks, every key panel `n32` rows of stride `ldk`, every query-pair panel
/// `dp/2` rows of `r32`, `st` `n32` rows of `r32`.
pub(crate) fn assert_qk(
    terms: &[(&[u16], &[u32])],
    ldk: usize,
    dp: usize,
    n32: usize,
    r32: usize,
    st: &[f32],
) {
    assert!(dp.is_multiple_of(32) && dp > 0 && n32.is_multiple_of(32) && r32.is_multiple_of(32));
    assert!(ldk >= dp && st.len() >= n32 * r32);
    for (kp, qt) in terms {
        assert!(kp.len() >= n32.saturating_sub(1) * ldk + dp && qt.len() >= dp / 2 * r32);
    }
}

/// The bounds a PV product over `terms` relies on: every value panel `dp` rows of stride
/// `ldv` (keys `0..n32`), every weight-pair panel `n32/2` rows of `r32`, `acc` `dp` rows of
/// `r32`.
pub(crate) fn assert_pv(
    terms: &[(&[u16], &[u32])],
    ldv: usize,
    dp: usize,
    n32: usize,
    r32: usize,
    acc: &[f32],
) {
    assert!(dp.is_multiple_of(32) && n32.is_multiple_of(32) && n32 > 0 && r32.is_multiple_of(32));
    assert!(ldv >= n32 && acc.len() >= dp * r32);
    for (vt, pt) in terms {
        assert!(vt.len() >= (dp - 1) * ldv + n32 && pt.len() >= n32 / 2 * r32);
    }
}

/// One register block of a product: `c[i*ldc + r] (+)= sum_t sum_k A_t[i][k] * B_t[k][r]` for
/// `i < JB`, `r < 32`, `k < kpairs`: A row `i`'s pair `k` is the two bf16 at `t.0[ao + i*lda +
/// 2k..]` (read unaligned and broadcast), B's pair row `k` the 32 pairs at `t.1[bo + k*ldb..]`.
/// Terms in order, pairs in order, f32; `acc` says whether the sums overwrite `c` scaled
/// (QK) or are added to it (PV, `c` first corrected).
///
/// # Safety
/// AVX512-BF16; for every term, A rows `i < JB` hold `2*kpairs` elements from `ao + i*lda`,
/// B pair rows `k < kpairs` hold 32 pairs from `bo + k*ldb`, the `JB` rows of 32 f32 at
/// `c` (stride `ldc`) are inside one live allocation, and so are the 32 factors of
/// `Acc::Add(Some(_))`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn block(
    terms: &[(&[u16], &[u32])],
    (ao, lda): (usize, usize),
    (bo, ldb): (usize, usize),
    kpairs: usize,
    (c, ldc): (*mut f32, usize),
    acc: Acc,
) {
    let mut lo = [_mm512_setzero_ps(); JB];
    let mut hi = [_mm512_setzero_ps(); JB];
    if let Acc::Add(corr) = acc {
        // SAFETY: the caller's contract.
        let (cl, ch) = unsafe {
            corr.map_or((_mm512_set1_ps(1.0), _mm512_set1_ps(1.0)), |f| {
                (_mm512_loadu_ps(f), _mm512_loadu_ps(f.add(16)))
            })
        };
        for i in 0..JB {
            // SAFETY: the caller's contract.
            unsafe {
                lo[i] = _mm512_mul_ps(_mm512_loadu_ps(c.add(i * ldc)), cl);
                hi[i] = _mm512_mul_ps(_mm512_loadu_ps(c.add(i * ldc + 16)), ch);
            }
        }
    }
    for (at, bt) in terms {
        // SAFETY: the caller's contract (offsets inside the term's slices).
        let (a0, b0) = unsafe { (at.as_ptr().add(ao), bt.as_ptr().add(bo)) };
        for k in 0..kpairs {
            // SAFETY: the caller's contract (pair k of A rows 0..JB, B pair row k).
            unsafe {
                let bl: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(b0.add(k * ldb) as *const _));
                let bh: __m512bh =
                    std::mem::transmute(_mm512_loadu_si512(b0.add(k * ldb + 16) as *const _));
                for i in 0..JB {
                    let pair = (a0.add(i * lda + 2 * k) as *const i32).read_unaligned();
                    let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
                    lo[i] = _mm512_dpbf16_ps(lo[i], av, bl);
                    hi[i] = _mm512_dpbf16_ps(hi[i], av, bh);
                }
            }
        }
    }
    if let Acc::Scaled(s) = acc {
        let (s, max) = (_mm512_set1_ps(s), _mm512_set1_ps(f32::MAX));
        // `cap`: +inf becomes f32::MAX; `min` returns its second operand, the sum, for NaN.
        let cap = |v: __m512| _mm512_min_ps(max, _mm512_mul_ps(v, s));
        for i in 0..JB {
            (lo[i], hi[i]) = (cap(lo[i]), cap(hi[i]));
        }
    }
    for i in 0..JB {
        // SAFETY: the caller's contract.
        unsafe {
            _mm512_storeu_ps(c.add(i * ldc), lo[i]);
            _mm512_storeu_ps(c.add(i * ldc + 16), hi[i]);
        }
    }
}

/// The loop of [`Bf16::dot_products`]; returns a lane of the sums (so the work is not dropped).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn dot_products(rounds: usize) -> f32 {
    let one: __m512bh = std::mem::transmute(_mm512_set1_epi16(0x3F80));
    let mut acc = [_mm512_setzero_ps(); 16];
    for _ in 0..rounds {
        for a in acc.iter_mut() {
            *a = _mm512_dpbf16_ps(*a, one, one);
        }
    }
    let mut s = _mm512_setzero_ps();
    for a in acc {
        s = _mm512_add_ps(s, a);
    }
    _mm512_reduce_add_ps(s)
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn round(src: *const f32, dst: *mut u16, n: usize) {
    let mut i = 0;
    while i < n {
        let k = (n - i).min(16);
        let mask: __mmask16 = if k == 16 { !0 } else { (1u16 << k) - 1 };
        // SAFETY: elements i..i+k < n of both, masked.
        unsafe {
            let v = _mm512_maskz_loadu_ps(mask, src.add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm256_mask_storeu_epi16(dst.add(i) as *mut i16, mask, h);
        }
        i += k;
    }
}

/// What is left of `v` after its bf16 rounding `h` (`v - h`, 0 where `h` is infinite): the
/// one residual step of [`Bf16::residual`], [`Bf16::pair_rows`] and [`Bf16::pair_cols`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
fn rest(v: __m512, h: __m256i) -> __m512 {
    let hf = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)));
    let inf_part =
        _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_abs_ps(hf), _mm512_set1_ps(f32::INFINITY));
    _mm512_mask_mov_ps(_mm512_sub_ps(v, hf), inf_part, _mm512_setzero_ps())
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn residual(x: *mut f32, n: usize) {
    let mut i = 0;
    while i < n {
        let k = (n - i).min(16);
        let mask: __mmask16 = if k == 16 { !0 } else { (1u16 << k) - 1 };
        // SAFETY: elements i..i+k < n, masked.
        unsafe {
            let v = _mm512_maskz_loadu_ps(mask, x.add(i));
            let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
            _mm512_mask_storeu_ps(x.add(i), mask, rest(v, h));
        }
        i += k;
    }
}

/// The permutation (`permutexvar_epi16`) that interleaves the 16 low (even key) and 16 high
/// (odd key) bf16 of `cvtne2ps` into 16 pairs.
#[inline]
#[target_feature(enable = "avx512f,avx512bw")]
fn pair_index() -> __m512i {
    _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4,
        19, 3, 18, 2, 17, 1, 16, 0,
    )
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pair_rows(
    st: *const f32,
    ldt: usize,
    n: usize,
    n32: usize,
    parts: usize,
    pt: *mut u32,
    plane: usize,
) {
    let idx = pair_index();
    let z = _mm512_setzero_ps();
    for j2 in 0..n32 / 2 {
        let (j0, j1) = (2 * j2, 2 * j2 + 1);
        for r in (0..ldt).step_by(16) {
            // SAFETY: weight rows j < n (else zeros), and pair row j2 < n32/2 of parts
            // b < parts, lanes r..r+16 <= ldt, as the caller asserted.
            unsafe {
                let mut e = if j0 < n {
                    _mm512_loadu_ps(st.add(j0 * ldt + r))
                } else {
                    z
                };
                let mut o = if j1 < n {
                    _mm512_loadu_ps(st.add(j1 * ldt + r))
                } else {
                    z
                };
                for b in 0..parts {
                    // Rounds as `cvtneps` does (the same conversion, two registers at once).
                    let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(o, e));
                    let p = _mm512_permutexvar_epi16(idx, h);
                    _mm512_storeu_si512(pt.add(b * plane + j2 * ldt + r) as *mut _, p);
                    if b + 1 < parts {
                        e = rest(e, _mm512_castsi512_si256(h));
                        o = rest(o, _mm512_extracti64x4_epi64::<1>(h));
                    }
                }
            }
        }
    }
}

/// [`Bf16::softmax_pairs`] for lanes `0..16*RV` of `(st, pt, m, l, c)` (the last vector
/// masked by `last`; a lane outside the mask pairs 0 and its m, l, c are neither read nor
/// written): `softmax_step`, the weights of each key pair into a pair row, `softmax_end`.
///
/// # Safety
/// AVX-512F/BW/VL/DQ/BF16, AVX2, FMA; lanes `0..16*RV` of st rows `j < n` and of pt rows
/// `j2 < n32/2` (stride `ldt`), and the masked lanes of m, l, c are inside live allocations.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")]
unsafe fn softmax_pairs_rows<const RV: usize>(
    (st, pt, m, l, c): (*const f32, *mut u32, *mut f32, *mut f32, *mut f32),
    ldt: usize,
    n: usize,
    n32: usize,
    last: __mmask16,
) {
    let z = _mm512_setzero_ps();
    let idx = pair_index();
    // SAFETY (whole block): the caller's contract.
    unsafe {
        let (rows, sub) = if last == 0 {
            // No lane to compute (only padding lanes): nothing is read, the pairs are 0.
            (None, [z; RV])
        } else {
            let (rows, sub) = softmax_step::<RV>(st, ldt, n, m, l, c, last);
            (Some(rows), sub)
        };
        let mut sum = [z; RV];
        // The weight of key j in row vector i (0 past n and outside the mask), summed in key
        // order as `softmax_t` sums it.
        let mut weight = |j: usize, i: usize| {
            let mask = row_mask::<RV>(i, last);
            if j >= n || mask == 0 {
                return z;
            }
            let x = _mm512_maskz_loadu_ps(mask, st.add(j * ldt + 16 * i));
            let e = exp16_nonpos(_mm512_sub_ps(x, sub[i]));
            sum[i] = _mm512_add_ps(sum[i], e);
            _mm512_maskz_mov_ps(mask, e)
        };
        for j2 in 0..n32 / 2 {
            for i in 0..RV {
                let e = weight(2 * j2, i);
                let o = weight(2 * j2 + 1, i);
                // Rounds as `pair_rows` does.
                let h: __m512i = std::mem::transmute(_mm512_cvtne2ps_pbh(o, e));
                let p = _mm512_permutexvar_epi16(idx, h);
                _mm512_storeu_si512(pt.add(j2 * ldt + 16 * i) as *mut _, p);
            }
        }
        if let Some(rows) = rows {
            softmax_end::<RV>(rows, sum, m, l, last);
        }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn mul_rows(x: *mut f32, n: usize, c: *const f32, w: usize) {
    for i in (0..n).step_by(w) {
        for r in (0..w).step_by(16) {
            // SAFETY: i + r + 16 <= n and r + 16 <= w, as the caller asserted.
            unsafe {
                let v = _mm512_loadu_ps(x.add(i + r));
                _mm512_storeu_ps(x.add(i + r), _mm512_mul_ps(v, _mm512_loadu_ps(c.add(r))));
            }
        }
    }
}

#[allow(clippy::too_many_arguments)]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512bf16")]
unsafe fn pair_cols(
    rows: &[*const f32; 16],
    nr: usize,
    d: usize,
    parts: usize,
    qt: *mut u32,
    ld: usize,
    plane: usize,
    r0: usize,
) {
    let n2 = d.div_ceil(2);
    let mask = |x: usize| -> __mmask16 {
        let k = d.saturating_sub(x).min(16);
        if k == 16 {
            !0
        } else {
            (1u16 << k) - 1
        }
    };
    let z = _mm512_setzero_ps();
    // 32 elements (16 pairs) of every row at a time.
    for x in (0..d).step_by(32) {
        let (ml, mh) = (mask(x), mask(x + 16));
        let mut lo = [z; 16];
        let mut hi = [z; 16];
        for i in 0..nr {
            // SAFETY: elements x..x+32 of row i < nr, masked to d, as the caller asserted.
            unsafe {
                lo[i] = _mm512_maskz_loadu_ps(ml, rows[i].add(x));
                hi[i] = _mm512_maskz_loadu_ps(mh, rows[i].add(x + 16));
            }
        }
        for b in 0..parts {
            let mut t = [_mm512_setzero_si512(); 16];
            for i in 0..16 {
                // Pairs of row i in order: `cvtne2ps` puts `lo`'s 16 bf16 below `hi`'s.
                // SAFETY: the bf16 vector is 64 bytes, as __m512i.
                t[i] = unsafe {
                    std::mem::transmute::<__m512bh, __m512i>(_mm512_cvtne2ps_pbh(hi[i], lo[i]))
                };
                if b + 1 < parts {
                    lo[i] = rest(lo[i], _mm512_castsi512_si256(t[i]));
                    hi[i] = rest(hi[i], _mm512_extracti64x4_epi64::<1>(t[i]));
                }
            }
            transpose16(&mut t);
            for (j, &col) in t.iter().enumerate().take(n2 - x / 2) {
                // SAFETY: pair row x/2 + j < n2 of part b < parts, columns r0..r0+16, as the
                // caller asserted.
                unsafe {
                    _mm512_storeu_si512(qt.add(b * plane + (x / 2 + j) * ld + r0) as *mut _, col)
                };
            }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    //! The packers and the `vdpbf16ps` products against their scalar twin (`scalar_amx`); the
    //! product checks serve the AMX tiles' tests too (`amx`).
    use super::*;
    use crate::kernel::fast::micro::scalar_amx::{pv_t_bf16, qk_t_bf16, round_bf16, split_bf16};
    use crate::kernel::fast::micro::{Micro, TileMicro};

    struct Rng(u64);
    impl Rng {
        fn f(&mut self) -> f32 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
        fn v(&mut self, n: usize) -> Vec<f32> {
            (0..n).map(|_| self.f()).collect()
        }
    }

    fn abs(x: &[f32]) -> Vec<f32> {
        x.iter().map(|v| v.abs()).collect()
    }

    /// `vdpbf16ps` adds two exact products to the f32 lane in one step, the tiles sum in an
    /// undocumented order (neither is the twin's order). Any f32 summation of `n` terms is within `n * 2^-24 *
    /// sum|terms|` of the exact sum, so the two are within twice that. A wrong element, pair or
    /// layout errs by a whole term, far above this.
    fn order_bound(n: usize, mag: f32) -> f32 {
        2.0 * n as f32 * f32::EPSILON * mag
    }

    fn bf16() -> Option<Bf16> {
        super::super::detected(Bf16::detect(), "AVX512-BF16", "bf16")
    }

    #[test]
    fn rounding_matches_the_scalar_twin() {
        let Some(a) = bf16() else { return };
        let mut rng = Rng(7);
        let mut x = rng.v(1000);
        // Ties, subnormals, extremes, infinities.
        x.extend([
            f32::from_bits(0x3F80_8000),
            f32::from_bits(0x3F81_8000),
            f32::from_bits(0x0000_0001),
            f32::from_bits(0x8040_0000),
            f32::MAX,
            f32::MIN_POSITIVE,
            f32::INFINITY,
            f32::NEG_INFINITY,
            -0.0,
            1e-39,
        ]);
        for len in [0, 1, 15, 16, 17, x.len()] {
            let mut got = vec![0xFFFFu16; len];
            a.round(&x[..len], &mut got);
            for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
                assert_eq!(g, round_bf16(v), "element {i} = {v:e} (len {len})");
            }
        }
    }

    /// Rounding, then rounding the residual, cuts a value into the parts of the twin: two are
    /// exact for f16, three within 2^-26 relative for f32; infinities keep zero residuals.
    #[test]
    fn split_rounding_matches_the_scalar_twin_and_is_exact_for_f16() {
        let Some(a) = bf16() else { return };
        let mut rng = Rng(8);
        let mut x: Vec<f32> = rng.v(999).iter().map(|v| v * 7.0).collect();
        x.extend([f32::INFINITY, f32::NEG_INFINITY, f32::MAX, 1e-39, -0.0]);
        let f16s: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        for src in [&x, &f16s] {
            let mut r = src.clone();
            let mut parts = vec![vec![0u16; src.len()]; 3];
            for p in parts.iter_mut() {
                a.round(&r, p);
                a.residual(&mut r);
            }
            for (i, &v) in src.iter().enumerate() {
                let got = [parts[0][i], parts[1][i], parts[2][i]];
                assert_eq!(got, split_bf16(v), "element {i} = {v:e}");
                let bf = |b: u16| f32::from_bits((b as u32) << 16) as f64;
                let sum = bf(got[0]) + bf(got[1]) + bf(got[2]);
                if v.is_finite() && v.abs() < 1e30 && (v == 0.0 || v.abs() > 1e-30) {
                    let two = bf(got[0]) + bf(got[1]);
                    assert!(
                        (sum - v as f64).abs() <= v.abs() as f64 * 2f64.powi(-26),
                        "{v:e}"
                    );
                    if src == &f16s {
                        assert_eq!(two, v as f64, "f16 value {v:e} is not hi + lo");
                    }
                }
            }
        }
    }

    /// The fused cuts of weights (`pair_rows`) and query rows (`pair_cols`) into three parts
    /// give exactly the twin's parts (`split_bf16`), in the pair layouts.
    #[test]
    fn fused_cuts_match_the_scalar_twin() {
        let Some(a) = bf16() else { return };
        let mut rng = Rng(13);
        let bf = |b: u32| b as u16;
        for (n, ldt) in [(1usize, 16usize), (17, 32), (32, 64), (45, 48)] {
            let n32 = n.div_ceil(32) * 32;
            let mut st: Vec<f32> = rng.v(n * ldt).iter().map(|x| x.abs() * 3.0).collect();
            st[0] = f32::INFINITY;
            let last = st.len() - 1;
            st[ldt.min(last)] = 1e-39;
            let plane = n32 / 2 * ldt + 16;
            let mut pt = vec![0xDEAD_BEEFu32; 3 * plane];
            a.pair_rows(&st, ldt, n, n32, 3, &mut pt, plane);
            for j in 0..n32 {
                for r in 0..ldt {
                    let want = if j < n {
                        split_bf16(st[j * ldt + r])
                    } else {
                        [0; 3]
                    };
                    for (b, &w) in want.iter().enumerate() {
                        let pair = pt[b * plane + j / 2 * ldt + r];
                        let got = bf(if j % 2 == 0 {
                            pair & 0xFFFF
                        } else {
                            pair >> 16
                        });
                        assert_eq!(got, w, "weight {j} row {r} part {b} (n={n}, ldt={ldt})");
                    }
                }
            }
        }
        for d in [1usize, 7, 16, 33, 48, 128] {
            // Groups of rows at r0: 16, a partial 5, 1; columns 48..64 never written.
            let (ld, groups) = (64, [(0usize, 16usize), (16, 5), (32, 1)]);
            let q: Vec<f32> = rng.v(22 * d).iter().map(|x| x * 5.0).collect();
            let row = |c: usize| -> Option<usize> {
                let (r0, nr) = groups.iter().find(|g| (g.0..g.0 + 16).contains(&c))?;
                (c - r0 < *nr).then(|| {
                    groups
                        .iter()
                        .take_while(|g| g.0 < *r0)
                        .map(|g| g.1)
                        .sum::<usize>()
                        + c
                        - r0
                })
            };
            let n2 = d.div_ceil(2);
            let plane = n2 * ld + 3;
            let mut qt = vec![0xDEAD_BEEFu32; 3 * plane];
            for (b, x2, c) in
                (0..3).flat_map(|b| (0..n2).flat_map(move |x2| (0..48).map(move |c| (b, x2, c))))
            {
                qt[b * plane + x2 * ld + c] = 0x1234_5678;
            }
            let mut next = 0;
            for &(r0, nr) in &groups {
                let rows: Vec<&[f32]> = (next..next + nr).map(|r| &q[r * d..(r + 1) * d]).collect();
                a.pair_cols(&rows, d, 3, &mut qt, ld, plane, r0);
                next += nr;
            }
            for (i, &p) in qt.iter().enumerate() {
                let (b, x2, c) = (i / plane, i % plane / ld, i % plane % ld);
                let want = if i % plane >= n2 * ld || c >= 48 {
                    0xDEAD_BEEF
                } else if let Some(r) = row(c) {
                    let part = |x: usize| {
                        if x < d {
                            split_bf16(q[r * d + x])[b] as u32
                        } else {
                            0
                        }
                    };
                    part(2 * x2) | part(2 * x2 + 1) << 16
                } else {
                    0
                };
                assert_eq!(p, want, "D={d}: part {b}, pair {x2}, column {c}");
            }
        }
    }

    /// A QK or PV product over terms (`Bf16::qk_t` / `Tiles::qk_t`, `pv_t` likewise): `(terms,
    /// ld, dp, n32, r32, out)`.
    pub(crate) type Product<'p> =
        &'p dyn Fn(&[(&[u16], &[u32])], usize, usize, usize, usize, &mut [f32]);

    const HEAD_SIZES: [usize; 10] = [16, 64, 80, 96, 128, 256, 1, 7, 33, 100];
    const ROWS: [usize; 6] = [1, 15, 16, 17, 33, 64];
    const KEYS: [usize; 10] = [1, 2, 15, 16, 17, 31, 32, 33, 47, 48];

    /// The operands of a QK product as the prefill items pack them: the keys `k` (`d` each)
    /// rounded into a panel of `n32` rows of stride `ldk`, the query rows `q` (`d` each)
    /// paired by `pair_cols` into `dp/2` rows of `r32`.
    fn pack_qk(
        a: Bf16,
        (q, k, d): (&[f32], &[f32], usize),
        (ldk, dp, n32, r32): (usize, usize, usize, usize),
    ) -> (Vec<u16>, Vec<u32>) {
        let mut kp = vec![0u16; n32 * ldk];
        for (j, key) in k.chunks_exact(d).enumerate() {
            a.round(key, &mut kp[j * ldk..]);
        }
        let mut qt = vec![0u32; dp / 2 * r32];
        let qrows: Vec<&[f32]> = q.chunks_exact(d).collect();
        for (r0, group) in (0..).step_by(16).zip(qrows.chunks(16)) {
            a.pair_cols(group, d, 1, &mut qt, r32, dp / 2 * r32, r0);
        }
        (kp, qt)
    }

    /// The values `v` (`n` rows of `d`) rounded and transposed as PV reads them: `dp` rows of
    /// `ld` keys (`d <= dp`, `n <= ld`): rows `d..dp` 0 for the first `n` keys, and the keys
    /// `n..ld` of every row the bf16 bits `pad` (garbage that zero weights must cancel).
    fn transposed_values(
        a: Bf16,
        v: &[f32],
        (n, d): (usize, usize),
        (dp, ld): (usize, usize),
        pad: u16,
    ) -> Vec<u16> {
        let mut vt = vec![pad; dp * ld];
        let mut col = vec![0f32; n];
        for x in 0..dp {
            for j in 0..n {
                col[j] = if x < d { v[j * d + x] } else { 0.0 };
            }
            a.round(&col, &mut vt[x * ld..]);
        }
        vt
    }

    /// One product's packed operands and shape, fixed within a test, so that each call states
    /// only what differs: the key limits, the scale or the correction.
    struct Packed<'t> {
        a: Bf16,
        terms: &'t [(&'t [u16], &'t [u32])],
        /// The key panel's stride (QK) or the transposed values' stride (PV).
        ld: usize,
        dp: usize,
        n32: usize,
        r32: usize,
    }

    impl<'t> Packed<'t> {
        fn new(
            a: Bf16,
            terms: &'t [(&'t [u16], &'t [u32])],
            ld: usize,
            (dp, n32, r32): (usize, usize, usize),
        ) -> Self {
            Packed {
                a,
                terms,
                ld,
                dp,
                n32,
                r32,
            }
        }

        /// QK's logits on a canvas of NaN, so what it does not write stays NaN (with no key
        /// limits it must write every one: the operands of these tests are finite).
        fn qk(&self, keys: Option<&[usize]>, scale: f32) -> Vec<f32> {
            let mut st = vec![f32::NAN; self.n32 * self.r32];
            let (ld, dp, r32) = (self.ld, self.dp, self.r32);
            let limits = (self.n32, keys);
            self.a
                .qk_t(self.terms, ld, dp, limits, r32, scale, &mut st, &mut || {});
            if keys.is_none() {
                let unwritten = st.iter().position(|x| x.is_nan());
                assert_eq!(unwritten, None, "QK without key limits writes every logit");
            }
            st
        }

        /// PV added to a copy of `acc`, corrected by `corr` first when it is given.
        fn pv(&self, keys: Option<&[usize]>, corr: Option<&[f32]>, acc: &[f32]) -> Vec<f32> {
            let mut out = acc.to_vec();
            let (ld, dp, r32) = (self.ld, self.dp, self.r32);
            let limits = (self.n32, keys);
            self.a
                .pv_t(self.terms, ld, dp, limits, r32, corr, &mut out, &mut || {});
            out
        }
    }

    /// `got` equals `want` bit for bit; a failure names the element as `what[row][column]` of
    /// rows `r32` wide.
    fn assert_same_bits(got: &[f32], want: &[f32], r32: usize, what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: lengths");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let (row, col) = (i / r32, i % r32);
            assert_eq!(
                g.to_bits(),
                w.to_bits(),
                "{what}[{row}][{col}]: {g:e}, want {w:e}"
            );
        }
    }

    /// `qk` (keys rounded into a panel of stride wider than dp, query rows paired by
    /// `pair_cols`, both as the prefill items pack them) against the twin on edge shapes, summed
    /// over two equal terms for odd key counts.
    pub(crate) fn check_qk(a: Bf16, seed: u64, qk: Product<'_>) {
        let mut rng = Rng(seed);
        for d in HEAD_SIZES {
            for rows in ROWS {
                for n in KEYS {
                    let q = rng.v(rows * d).iter().map(|x| x * 3.0).collect::<Vec<_>>();
                    let k = rng.v(n * d);
                    let (dp, r32, n32) = (
                        d.div_ceil(32) * 32,
                        rows.div_ceil(32) * 32,
                        n.div_ceil(32) * 32,
                    );
                    let ldk = dp + 32;
                    let (kp, qt) = pack_qk(a, (&q, &k, d), (ldk, dp, n32, r32));
                    let reps = 1 + n % 2;
                    let mut got = vec![f32::NAN; n32 * r32];
                    qk(&vec![(&kp[..], &qt[..]); reps], ldk, dp, n32, r32, &mut got);
                    let mut want = vec![0f32; n * r32];
                    qk_t_bf16(&q, rows, &k, n, d, &mut want, r32);
                    let mut mag = vec![0f32; n * r32];
                    qk_t_bf16(&abs(&q), rows, &abs(&k), n, d, &mut mag, r32);
                    for j in 0..n {
                        for r in 0..rows {
                            let i = j * r32 + r;
                            let (w, m) = (want[i] * reps as f32, mag[i] * reps as f32);
                            assert!(
                                (got[i] - w).abs() <= order_bound(reps * d, m),
                                "D={d} rows={rows} n={n}: st[{j}][{r}] = {:e}, twin {w:e}",
                                got[i]
                            );
                        }
                    }
                }
            }
        }
    }

    /// `pv` (values transposed and rounded at an odd stride, keys padded with finite garbage
    /// the zero weights must cancel, weights paired by `pair_rows`) against the twin on edge
    /// shapes, added to a random accumulator, over two equal terms for odd key counts.
    pub(crate) fn check_pv(a: Bf16, seed: u64, pv: Product<'_>) {
        let mut rng = Rng(seed);
        for d in HEAD_SIZES {
            for rows in ROWS {
                for n in KEYS {
                    let (dp, r32, n32) = (
                        d.div_ceil(32) * 32,
                        rows.div_ceil(32) * 32,
                        n.div_ceil(32) * 32,
                    );
                    let p: Vec<f32> = rng.v(n * r32).iter().map(|x| x.abs()).collect();
                    let v = rng.v(n * d);
                    let acc0 = rng.v(dp * r32);
                    let ldv = n32 + 5;
                    let vt = transposed_values(a, &v, (n, d), (dp, ldv), 0x3F80);
                    let mut pt = vec![0u32; n32 / 2 * r32];
                    a.pair_rows(&p, r32, n, n32, 1, &mut pt, n32 / 2 * r32);
                    let reps = 1 + n % 2;
                    let mut got = acc0.clone();
                    pv(&vec![(&vt[..], &pt[..]); reps], ldv, dp, n32, r32, &mut got);
                    let (mut want, mut mag) = (acc0.clone(), abs(&acc0));
                    for _ in 0..reps {
                        pv_t_bf16(&p, r32, rows, &v, n, d, &mut want, r32);
                        pv_t_bf16(&p, r32, rows, &abs(&v), n, d, &mut mag, r32);
                    }
                    for x in 0..d {
                        for r in 0..rows {
                            let i = x * r32 + r;
                            assert!(
                                (got[i] - want[i]).abs() <= order_bound(reps * n + 1, mag[i]),
                                "D={d} rows={rows} n={n}: acc[{x}][{r}] = {:e}, twin {:e}",
                                got[i],
                                want[i]
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn qk_dot_products_match_the_scalar_twin_on_edge_shapes() {
        let Some(a) = bf16() else { return };
        check_qk(a, 21, &|t, ld, dp, n32, r32, out| {
            a.qk_t(t, ld, dp, (n32, None), r32, 1.0, out, &mut || {})
        });
    }

    #[test]
    fn pv_dot_products_match_the_scalar_twin_on_edge_shapes() {
        let Some(a) = bf16() else { return };
        check_pv(a, 22, &|t, ld, dp, n32, r32, out| {
            a.pv_t(t, ld, dp, (n32, None), r32, None, out, &mut || {})
        });
    }

    /// The fused softmax-and-pairing equals the softmax step (`softmax_t`) followed by
    /// `pair_rows` bit for bit (running max, sum, correction and the weight pairs of every
    /// computed row; 0 pairs for padding keys and lanes), and its weights are those of a
    /// float64 softmax within a bf16 rounding: on masked keys, rows masked in full, a second
    /// step on the state the first left, and row counts that are not whole vectors.
    #[test]
    fn fused_softmax_pairs_match_the_two_passes_and_float64() {
        let Some(a) = bf16() else { return };
        let m = super::super::avx512::Avx512::detect().expect("AVX512-BF16 implies AVX-512");
        let mut rng = Rng(31);
        for (rows, ldt) in [
            (1usize, 16usize),
            (5, 32),
            (16, 32),
            (17, 32),
            (33, 64),
            (64, 64),
        ] {
            for n in [1usize, 2, 17, 32, 45, 64] {
                let n32 = n.div_ceil(32) * 32;
                let rows8 = rows.div_ceil(8) * 8;
                let (mut m1, mut l1, mut c1) = (vec![0f32; ldt], vec![0f32; ldt], vec![1f32; ldt]);
                m1.fill(f32::NEG_INFINITY);
                l1.fill(0.0);
                let (mut m2, mut l2, mut c2) = (m1.clone(), l1.clone(), c1.clone());
                for step in 0..2 {
                    let mut st: Vec<f32> = rng.v(n * ldt).iter().map(|x| x * 9.0).collect();
                    for (i, x) in st.iter_mut().enumerate() {
                        // Row 2 masked in full in the first step; scattered masked keys.
                        if (i % ldt == 2 && step == 0) || i % 7 == 3 {
                            *x = f32::NEG_INFINITY;
                        }
                    }
                    let mut pt1 = vec![0xDEAD_BEEFu32; n32 / 2 * ldt];
                    let mut pt2 = pt1.clone();
                    let mut st1 = st.clone();
                    m.softmax_t(&mut st1, ldt, rows, n, &mut m1, &mut l1, &mut c1);
                    a.pair_rows(&st1, ldt, n, n32, 1, &mut pt1, n32 / 2 * ldt);
                    let before = (m2.clone(), l2.clone());
                    a.softmax_pairs(
                        &st,
                        ldt,
                        (rows, n, n32, None),
                        &mut m2,
                        &mut l2,
                        &mut c2,
                        &mut pt2,
                    );
                    let what = format!("rows={rows} ldt={ldt} n={n} step={step}");
                    for r in 0..ldt {
                        let bits = |v: &[f32]| v[r].to_bits();
                        assert_eq!(bits(&m1), bits(&m2), "{what}: max of row {r}");
                        assert_eq!(bits(&l1), bits(&l2), "{what}: sum of row {r}");
                        assert_eq!(bits(&c1), bits(&c2), "{what}: correction of row {r}");
                    }
                    for (i, (&p1, &p2)) in pt1.iter().zip(&pt2).enumerate() {
                        let want = if i % ldt < rows8 { p1 } else { 0 };
                        assert_eq!(p2, want, "{what}: pair {} lane {}", i / ldt, i % ldt);
                    }
                    // float64: exp(s - max) of the step's max (the old max when larger).
                    for r in 0..rows {
                        let mx = (0..n)
                            .map(|j| st[j * ldt + r] as f64)
                            .fold(before.0[r] as f64, f64::max);
                        for j in 0..n {
                            let w = if mx == f64::NEG_INFINITY {
                                0.0
                            } else {
                                (st[j * ldt + r] as f64 - mx).exp()
                            };
                            let pair = pt2[j / 2 * ldt + r];
                            let half = if j % 2 == 0 {
                                pair & 0xFFFF
                            } else {
                                pair >> 16
                            };
                            let got = f32::from_bits(half << 16) as f64;
                            assert!(
                                (got - w).abs() <= w * 2f64.powi(-8) + 1e-30,
                                "{what}: weight of key {j} row {r}: {got:e}, float64 {w:e}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The scale QK applies in registers is `scale_logits`'s, bit for bit (a scaled logit that
    /// overflows to +inf capped).
    #[test]
    fn qk_scaled_in_registers_equals_the_scaling_pass() {
        let Some(a) = bf16() else { return };
        let m = super::super::avx512::Avx512::detect().expect("AVX512-BF16 implies AVX-512");
        let mut rng = Rng(41);
        let (d, rows, n) = (64usize, 20usize, 40usize);
        let (dp, r32, n32) = (64usize, 32usize, 64usize);
        let q: Vec<f32> = rng.v(rows * d).iter().map(|x| x * 3.0).collect();
        let mut k = rng.v(n * d);
        // Key 3 against row 0 is about 1e38, finite, and overflows to +inf when scaled by 4.
        k[3 * d..4 * d].fill(1.25e18);
        let mut q = q;
        q[..d].fill(1.25e18);
        let (kp, qt) = pack_qk(a, (&q, &k, d), (dp, dp, n32, r32));
        let terms = [(&kp[..], &qt[..])];
        let qk = Packed::new(a, &terms, dp, (dp, n32, r32));
        let mut want = qk.qk(None, 1.0);
        let big = want[3 * r32];
        assert!(
            big.is_finite() && big as f64 * 4.0 > f32::MAX as f64,
            "{big:e}"
        );
        m.scale_logits(&mut want, 4.0);
        let got = qk.qk(None, 4.0);
        assert_same_bits(&got, &want, r32, "logits");
        assert_eq!(got[3 * r32], f32::MAX);
    }

    /// Key limits per 32-row block (the causal diagonal's skipped work): QK writes the logits
    /// of each block's keys `j < keys[b]` (rounded up to 8) exactly as without limits and
    /// leaves the later ones as they were; PV over weights that are 0 past each block's limit
    /// (rounded up to a pair) sums exactly what the whole product sums; the fused softmax
    /// gives the same state and pairs as without limits when the logits past them are -inf.
    #[test]
    fn key_limits_per_row_block_skip_only_what_is_masked() {
        let Some(a) = bf16() else { return };
        let mut rng = Rng(47);
        let (d, rows, n) = (96usize, 96usize, 61usize);
        let (dp, r32, n32) = (96usize, 96usize, 64usize);
        for lim in [[0usize, 17, 61], [3, 40, 64], [64, 1, 9], [8, 16, 33]] {
            let keys = Some(&lim[..]);
            let q: Vec<f32> = rng.v(rows * d).iter().map(|x| x * 3.0).collect();
            let k = rng.v(n * d);
            let (kp, qt) = pack_qk(a, (&q, &k, d), (dp + 32, dp, n32, r32));
            let terms = [(&kp[..], &qt[..])];
            let qk = Packed::new(a, &terms, dp + 32, (dp, n32, r32));
            let (full, got) = (qk.qk(None, 0.3), qk.qk(keys, 0.3));
            for (i, (g, f)) in got.iter().zip(&full).enumerate() {
                let (j, r) = (i / r32, i % r32);
                if j < lim[r / 32] {
                    assert_eq!(g.to_bits(), f.to_bits(), "{lim:?}: logit {j} row {r}");
                } else if j >= lim[r / 32].div_ceil(8) * 8 {
                    assert!(g.is_nan(), "{lim:?}: logit {j} row {r} written");
                }
            }
            // Weights 0 past each block's limit (for PV), logits -inf there (for the softmax).
            let mut st: Vec<f32> = rng.v(n * r32).iter().map(|x| x * 4.0).collect();
            for (i, x) in st.iter_mut().enumerate() {
                if i / r32 >= lim[i % r32 / 32] {
                    *x = f32::NEG_INFINITY;
                }
            }
            let softmax = |keys| {
                let (mut m, mut l, mut c) = (vec![0.5f32; r32], vec![2f32; r32], vec![1f32; r32]);
                let mut p = vec![7u32; n32 / 2 * r32];
                let shape = (rows, n, n32, keys);
                a.softmax_pairs(&st, r32, shape, &mut m, &mut l, &mut c, &mut p);
                (m, l, c, p)
            };
            let (whole, limited) = (softmax(None), softmax(keys));
            assert_eq!(whole, limited, "{lim:?}: softmax");
            let vt = transposed_values(a, &rng.v(n * d), (n, d), (dp, n32), 0);
            let acc0 = rng.v(dp * r32);
            let corr: Vec<f32> = rng.v(r32).iter().map(|x| x.abs()).collect();
            let terms = [(&vt[..], &whole.3[..])];
            let pv = Packed::new(a, &terms, n32, (dp, n32, r32));
            let want = pv.pv(None, Some(&corr), &acc0);
            let got = pv.pv(keys, Some(&corr), &acc0);
            assert_same_bits(&got, &want, r32, &format!("{lim:?}: acc"));
        }
    }

    /// The correction PV applies in registers is `mul_rows`'s, bit for bit.
    #[test]
    fn pv_corrected_in_registers_equals_the_correction_pass() {
        let Some(a) = bf16() else { return };
        let mut rng = Rng(43);
        let (d, n, r32) = (96usize, 50usize, 64usize);
        let (dp, n32) = (96usize, 64usize);
        let p: Vec<f32> = rng.v(n * r32).iter().map(|x| x.abs()).collect();
        let vt = transposed_values(a, &rng.v(n * d), (n, d), (dp, n32), 0);
        let mut pt = vec![0u32; n32 / 2 * r32];
        a.pair_rows(&p, r32, n, n32, 1, &mut pt, n32 / 2 * r32);
        let corr: Vec<f32> = rng.v(r32).iter().map(|x| x.abs()).collect();
        let acc0 = rng.v(dp * r32);
        let terms = [(&vt[..], &pt[..])];
        let pv = Packed::new(a, &terms, n32, (dp, n32, r32));
        let mut corrected = acc0.clone();
        a.mul_rows(&mut corrected, &corr);
        let want = pv.pv(None, None, &corrected);
        let got = pv.pv(None, Some(&corr), &acc0);
        assert_same_bits(&got, &want, r32, "acc");
        assert_ne!(
            got,
            pv.pv(None, None, &acc0),
            "the correction changed nothing"
        );
    }

    /// The peak probe computes what it says: 16 accumulators, each `rounds` x 2 x 1 x 1 per lane.
    #[test]
    fn dot_product_probe_sums_its_products() {
        let Some(a) = bf16() else { return };
        assert_eq!(a.dot_products(10), (16 * 16 * 10 * 2) as f32);
    }
}
