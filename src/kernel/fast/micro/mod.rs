//! Micro-kernels: the few inner loops every attention tile is made of, behind one trait so the
//! tile drivers (`decode`, `prefill`, `scores`) are written once and run on every SIMD level.
//! The softmax loops compute maxima, exponentials and sums; the state they update is
//! `kernel::softmax::OnlineSoftmax`'s (per row, or lane-wise through its `Lanes` impls).
//!
//! - `scalar`: plain loops; the fast path's own twin, and what runs without AVX2.
//! - `x86`: the x86_64 tiers (`std::arch`), one file per tier and trait, each chosen only after
//!   runtime detection.
//! - `scalar_decode`: the [`DecodeMicro`] loops of decode tiles (few rows per KV head); the SIMD
//!   twins also keep the next tile's cache lines coming while they compute.
//! - `scalar_tile`: the [`TileMicro`] loops of prefill tiles (transposed logits).
//! - `scalar_u8`: the [`QuantMicro`] loops over u8 cache bytes (OpenVINO's layout; the driver
//!   `fast::quantized` folds scales and zero points around them); `x86/avx2_u8` and `x86/avx512_u8`
//!   are the AVX2 and AVX-512 tiers.
//! - `x86/amx`: AMX-BF16 tile products (QK and PV) for prefill items of a bf16
//!   query; `scalar_amx` is its twin (test oracle).
//!
//! All arithmetic is f32: f16/bf16 cache rows are widened as they are loaded, because summing
//! in half precision would lose the small softmax weights of long contexts. The one exception
//! is `amx`, which multiplies bf16 (exact products, f32 sums) and runs only where the query
//! arrives as bf16: there the rule is 1e-2 of a float64 reference fed the same rounded values.

pub(crate) mod scalar;
#[cfg(all(test, target_arch = "x86_64"))]
mod scalar_amx;
pub(crate) mod scalar_decode;
mod scalar_tile;
mod scalar_u8;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_speed;
#[cfg(test)]
mod tests_u8;

use crate::dtype::Float;
use crate::kernel::softmax::OnlineSoftmax;

#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{amx::Amx, bf16::Bf16, bf16::Bf16Tier};
/// No AMX off x86_64: the token has no values.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum Amx {}
/// No AVX512-BF16 off x86_64: the token has no values.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Clone, Copy, Debug)]
pub(crate) enum Bf16Tier {}

/// The inner loops of a tile. Implementors are zero-sized tokens; holding one proves the CPU
/// supports the instructions it uses.
pub(crate) trait Micro: DecodeMicro + Copy + Send + Sync {
    /// `s[r*lds + j] = cap(scale * <q[r*d..][..d], k[j*d..][..d]>)` for `r < rows`, `j < n`
    /// (logits as the softmax takes them, see `scale_logits`; the scale and cap ride on the
    /// store, no extra pass).
    #[allow(clippy::too_many_arguments)]
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
    );
    /// `dst[j] += exp(s[j] - m) * c`.
    fn add_exp_scaled(self, dst: &mut [f32], s: &[f32], m: f32, c: f32);
    /// `dst[j] += w[j] * c` for `j < dst.len()` (a product, then a sum: every tier gives the
    /// same bits). The default is the scalar twin.
    fn add_scaled(self, dst: &mut [f32], w: &[f32], c: f32) {
        assert!(w.len() >= dst.len(), "add_scaled: weights too short");
        for (o, &x) in dst.iter_mut().zip(w) {
            *o += x * c;
        }
    }
    /// `x[j] *= c`.
    fn scale(self, x: &mut [f32], c: f32);
    /// `s[j] = cap(s[j] * c)` ([`Lanes::cap`](crate::kernel::softmax::Lanes::cap)): logits as
    /// the softmax takes them (the scale multiplies the dot products, never the query, so an
    /// overflow is the logit's own).
    fn scale_logits(self, s: &mut [f32], c: f32);
    /// `dst[j] = src[j]` widened to f32.
    fn widen<C: Float>(self, src: &[C], dst: &mut [f32]);
    /// `dst[j] = C::from_f32(src[j])`, bit for bit (round to nearest even; NaN stays a quiet
    /// NaN of the same sign): how new tokens enter an f16/bf16 cache.
    fn narrow<C: Float>(self, src: &[f32], dst: &mut [C]);
}

/// Every loop a tier has: what the pipeline runs on.
pub(crate) trait Kernels: TileMicro + QuantMicro {}
impl<T: TileMicro + QuantMicro> Kernels for T {}

/// Rows of quantized cache elements as the [`QuantMicro`] products read them, in place: row `t`
/// starts at byte `t * ld` of `bytes`, and its element `c` is byte `c` (`bits` 8: u8 caches)
/// or nibble `c` (`bits` 4: u4 caches, two elements a byte, the even one in the high nibble,
/// as `kernel::quant::q_at` reads them). u4 rows are widened in registers as they are loaded,
/// never unpacked to bytes in memory first.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QRows<'a> {
    pub bytes: &'a [u8],
    pub ld: usize,
    pub bits: usize,
}

impl<'a> QRows<'a> {
    /// Rows of `bits`-bit elements, `ld` bytes apart, in `bytes`.
    #[inline(always)]
    pub(crate) fn new(bytes: &'a [u8], ld: usize, bits: usize) -> QRows<'a> {
        QRows { bytes, ld, bits }
    }

    /// Whether the elements are u4 nibbles (else bytes); panics on any other width.
    #[inline(always)]
    pub(crate) fn u4(&self) -> bool {
        match self.bits {
            4 => true,
            8 => false,
            b => panic!("quantized rows of {b} bits"),
        }
    }

    /// The bytes of the first `len` elements of a row.
    #[inline(always)]
    pub(crate) fn span(&self, len: usize) -> usize {
        if self.u4() {
            len.div_ceil(2)
        } else {
            len
        }
    }

    /// Element `c` of row `t` (the scalar twin's read).
    #[inline(always)]
    pub(crate) fn at(&self, t: usize, c: usize) -> u8 {
        crate::kernel::quant::q_at(&self.bytes[t * self.ld..], c, self.bits)
    }
}

/// The loops over quantized cache rows ([`QRows`]: u8, or u4 nibbles). Elements are widened to
/// f32 as they are loaded (never a whole row or cache ahead of use); the zero point here is one
/// per call (a by-token group's), the driver folds per-channel parameters into the query rows.
pub(crate) trait QuantMicro: Copy + Send + Sync {
    /// `s[r*lds + t] = sum_c q[r*ldq + c] * (k[t, c] - zp[t])` for `r < rows`,
    /// `t < n = zp.len()`, `c < len`: the logits of `n` keys (one group of `len` channels each;
    /// `k[t, c]` is element `c` of row `t`, a byte or a u4 nibble, [`QRows`]).
    /// `pf`: bytes the caller reads next, whose cache lines the loop requests a few at a time
    /// as it goes (a hint: nothing in `pf` is read, results do not depend on it).
    #[allow(clippy::too_many_arguments)]
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
    );
    /// `acc[r*lda + c] += sum_t w[r*n + t] * (v[t, c] - zp[t])` for `r < rows`, `c < len`,
    /// `t < n = zp.len()`: the values of `n` keys (one group of `len` channels each; elements
    /// as in [`QuantMicro::qk`]) weighted into the rows' accumulators, which stay in registers
    /// across the keys. `pf` as for [`QuantMicro::qk`].
    #[allow(clippy::too_many_arguments)]
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
    );
    /// `out[r*ldo + c] = x[r*ldx + c] * scale[c]` and `cst[r] = sum_c out[r*ldo + c] * zp[c]`
    /// for `r < rows`, `c < len = scale.len()`: folds per-element scales and zero points into
    /// the other operand, so `sum_c x_c * scale_c * (u_c - zp_c)` becomes
    /// `sum_c out_c * u_c - cst` (a query against by-channel keys, or softmax weights against
    /// by-token values). The default is the scalar twin; `cst` sums in order.
    #[allow(clippy::too_many_arguments)]
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
        for r in 0..rows {
            let o = &mut out[r * ldo..][..len];
            let mut sum = 0f32;
            for (((o, &x), &s), &z) in o.iter_mut().zip(&x[r * ldx..][..len]).zip(scale).zip(zp) {
                *o = x * s;
                sum += *o * z;
            }
            cst[r] = sum;
        }
    }
    /// The largest of `s` (`-inf` for none; NaN ignored, as `f32::max` does). The default is
    /// the scalar twin.
    fn max(self, s: &[f32]) -> f32 {
        s.iter().copied().fold(f32::NEG_INFINITY, f32::max)
    }
    /// Rows `r < subs.len()` of `s` (`n` logits each, at stride `lds`): `x = exp(x - subs[r])`
    /// (0 where `x` is `-inf`, `subs[r]` finite), the row's sum into `sums[r]`.
    fn exp_sum(self, s: &mut [f32], lds: usize, n: usize, subs: &[f32], sums: &mut [f32]);
    /// `out[i] = (src[i] - zp[i]) * scale[i]`, rounded as `kernel::quant::dequant` (a
    /// subtraction, then a product: every tier gives the same bits), for `i < out.len()`.
    fn dequant(self, src: &[u8], zp: &[f32], scale: &[f32], out: &mut [f32]);
    /// `out[i] = (src[i] - zp) * scale`, rounded as [`QuantMicro::dequant`].
    fn dequant_uniform(self, src: &[u8], zp: f32, scale: f32, out: &mut [f32]);
}

/// Panics unless `rows` rows of `n` elements at stride `lda` fit in `a_len` elements.
#[inline(always)]
pub(crate) fn rows_fit(a_len: usize, lda: usize, rows: usize, n: usize) {
    assert!(
        rows == 0
            || (rows - 1)
                .checked_mul(lda)
                .and_then(|o| o.checked_add(n))
                .is_some_and(|e| e <= a_len),
        "u8 micro-kernel rows out of range"
    );
}

/// Panics unless `qk` with these arguments stays inside its slices.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn qk_bounds(
    q_len: usize,
    ldq: usize,
    rows: usize,
    k: QRows<'_>,
    n: usize,
    len: usize,
    s_len: usize,
    lds: usize,
) {
    rows_fit(q_len, ldq, rows, len);
    rows_fit(k.bytes.len(), k.ld, n, k.span(len));
    rows_fit(s_len, lds, rows, n);
}

/// Panics unless `exp_sum` with these arguments stays inside its slices.
#[inline(always)]
pub(crate) fn exp_sum_bounds(s_len: usize, lds: usize, n: usize, rows: usize, sums_len: usize) {
    assert!(sums_len >= rows, "u8 exp_sum: sums out of range");
    rows_fit(s_len, lds, rows, n);
}

/// Panics unless `fold` with these arguments stays inside its slices.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn fold_bounds(
    x_len: usize,
    ldx: usize,
    rows: usize,
    len: usize,
    zp_len: usize,
    out_len: usize,
    ldo: usize,
    cst_len: usize,
) {
    rows_fit(x_len, ldx, rows, len);
    rows_fit(out_len, ldo, rows, len);
    assert!(
        zp_len >= len && cst_len >= rows,
        "fold: zero points or constants too short"
    );
}

/// Whether every element of `x` is zero (`+0.0` or `-0.0`; NaN is not): one OR over the bits
/// without the sign, which compiles to a few vector instructions (an `== 0.0` per element with
/// an early exit took about 5% of u8 decode in the value products' calls, AMD EPYC avx2).
#[inline]
pub(crate) fn all_zero(x: &[f32]) -> bool {
    x.iter().fold(0u32, |a, &z| a | (z.to_bits() << 1)) == 0
}

/// Panics unless `pv` with these arguments stays inside its slices.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) fn pv_bounds(
    acc_len: usize,
    lda: usize,
    rows: usize,
    w_len: usize,
    v: QRows<'_>,
    n: usize,
    len: usize,
) {
    rows_fit(acc_len, lda, rows, len);
    assert!(
        rows.checked_mul(n).is_some_and(|x| x <= w_len),
        "u8 pv weights too short"
    );
    rows_fit(v.bytes.len(), v.ld, n, v.span(len));
}

/// The loops of a decode tile: the few rows of one KV head (tokens x G query heads) against the
/// keys of one cache block. Each also asks the CPU to start loading `pf` (the next tile's keys
/// or values), a few cache lines per inner step, so memory reads overlap the arithmetic without
/// bursts of requests that would fill the miss queues and stall the loads being computed on.
/// `pf` is only a hint: it never changes a result.
pub(crate) trait DecodeMicro: Copy {
    /// `s[r*n + j] = cap(scale * <q[r*d..][..d], k[j*d..][..d]>)` for `r < rows`, `j < n` (as
    /// [`Micro::qk`]).
    #[allow(clippy::too_many_arguments)]
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
    );
    /// One online-softmax step over a tile of `n` keys for rows `r < rows` (logits `s[r*n..][..n]`,
    /// `-inf` = masked; softmax state `st[r]`, accumulator `acc[r*d..][..d]`):
    /// `step = st[r].update(max_j s)`, `s` becomes the weights `exp(s - step.sub)`, their sum (in
    /// a fixed order) goes to `st[r].add`, and `acc = acc * step.rescale + sum_j s[r*n + j] *
    /// v[j*d..][..d]`.
    #[allow(clippy::too_many_arguments)]
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
    );
}

/// The inner loops of a prefill tile, on transposed logits: rows (query rows of the tile) are
/// the fast axis, so row max, exp and row sums are plain vector ops (no horizontal sums), and
/// QK broadcasts key elements against a `[D][rows]` query panel.
///
/// `rows8` below is `rows` rounded up to a multiple of 8; buffers indexed by row have room for
/// `rows8` rows, and query rows `rows..rows8` of the panel are zero (padding the kernels may
/// compute on and the callers ignore).
pub(crate) trait TileMicro: Micro {
    /// Rows per `qk_t` call in a prefill tile (a multiple of 16): as many as the kernel's
    /// register block covers, so each key element it broadcasts feeds that many rows.
    const QK_ROWS: usize = 16;
    /// Whether `qk_t` and `pv_t` start loading their `pf` slices themselves, a line every few
    /// inner steps (so the requests never queue up behind each other); when not, the driver
    /// asks for `pf` in parts between calls.
    const PREFETCHES: bool = false;

    /// `st[j*ldt + r] = cap(scale * sum_x qt[x*ldq + r] * k[j*d + x])` for `r < rows8`,
    /// `j < n`: logits as the softmax takes them (as [`Micro::scale_logits`] would leave them,
    /// bit for bit; the scale and cap ride on the store, no extra pass over the tile).
    /// `pf`: lines to start loading meanwhile (see `PREFETCHES`; a hint, never read).
    #[allow(clippy::too_many_arguments)]
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
        pf: &[C],
    );
    /// One online-softmax step over logits `st[j*ldt + r]` (`j < n`), lane-wise over rows: the
    /// state `OnlineSoftmax { max: m[r], sum: l[r] }` takes `step = update(max_j st)`, `st`
    /// becomes `exp(st - step.sub)` in place, their sum (in key order) is added, and `c[r]` is
    /// `step.rescale` (the factor the old accumulator needs).
    #[allow(clippy::too_many_arguments)]
    fn softmax_t(
        self,
        st: &mut [f32],
        ldt: usize,
        rows: usize,
        n: usize,
        m: &mut [f32],
        l: &mut [f32],
        c: &mut [f32],
    );
    /// `dst[x*ldd + r] = src[r*d + x]` for `r < rows8`, `x < d` (`src` holds `rows8` rows).
    fn transpose(self, src: &[f32], rows: usize, d: usize, dst: &mut [f32], ldd: usize);
    /// `acc[r*d + x] = acc[r*d + x]*c[r] + sum_j pt[j*ldp + r] * v[j*d + x]` for `r < rows`,
    /// `x < d` (keys summed in order). `pf` as in `qk_t`.
    #[allow(clippy::too_many_arguments)]
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
        pf: &[C],
    );
}
