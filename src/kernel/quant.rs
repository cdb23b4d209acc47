//! u8 and u4 KV caches in the byte layout of OpenVINO 2026.4.1's CPU plugin (one code for
//! both widths: the layout's `bits`; u4 packs two values per byte, the even one high): the layouts, quantization of
//! new tokens on insertion (including the by-channel key block's re-quantization when it grows),
//! rotation of cached keys (dequantize, rotate, re-quantize) and dequantization of one cached
//! row. docs/contract.md ("u8 caches") states the conventions; tests/u8_cache.rs holds this code
//! to bytes written by OpenVINO's own op.
//!
//! The arithmetic follows the plugin's AVX-512 build operation for operation (f32 throughout, a
//! fused multiply-add, round half to even) for the leading multiple of 16 (by token) or 8 (by
//! channel) elements, and its scalar tail (a true division, round half away from zero) for the
//! rest: that split is what makes the bytes equal for head and group sizes that are not multiples
//! of 16.

use crate::dtype::Float;
use crate::error::{PaError, Result};
use crate::kernel::prefetch::prefetch_part;
use crate::kernel::rope::{lut_row, rope_row};
use crate::op::quant_layout::effective_group;
pub use crate::op::quant_layout::{
    token_row_bytes, token_row_bytes_bits, KeyQuant, QuantLayout, PARAM_BYTES,
};
use crate::op::validate::SeqPlan;

/// What OpenVINO substitutes for a zero scale (all values of a group or channel equal).
const ZERO_RANGE_SCALE: f32 = 0.0001;

#[inline(always)]
pub(crate) fn read_f32(bytes: &[u8], i: usize) -> f32 {
    f32::from_le_bytes(bytes[4 * i..4 * i + 4].try_into().expect("4 bytes"))
}

#[inline(always)]
fn write_f32(bytes: &mut [u8], i: usize, v: f32) {
    bytes[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
}

#[inline(always)]
fn min_max(x: impl Iterator<Item = f32>) -> (f32, f32) {
    x.fold((f32::MAX, -f32::MAX), |(lo, hi), v| (lo.min(v), hi.max(v)))
}

/// The largest quantized value of `bits`-bit elements (255 or 15).
#[inline(always)]
fn levels(bits: usize) -> f32 {
    ((1u32 << bits) - 1) as f32
}

/// The vector path: `cvt_roundps_epi32(fma(x, 1/scale, zp))` (round half to even; out of range
/// or NaN gives INT_MIN), clamped at 0, saturated to `max` (255 or 15).
#[inline(always)]
fn q_vector(x: f32, inv_scale: f32, zp: f32, max: f32) -> u8 {
    let v = x.mul_add(inv_scale, zp).round_ties_even();
    // Branch-free (so the loops over channels vectorize): NaN fails both comparisons.
    let in_range = (-2147483648.0..2147483648.0).contains(&v);
    let c = if in_range { v.clamp(0.0, max) } else { 0.0 };
    // SAFETY: `c` is an integer in 0..=255 (rounded, then clamped, or 0), so it converts exactly.
    unsafe { c.to_int_unchecked::<i32>() as u8 }
}

/// The scalar tail: `std::round(max(x / scale + zp, 0))` (round half away from zero),
/// saturated to `max`.
#[inline(always)]
fn q_scalar(x: f32, scale: f32, zp: f32, max: f32) -> u8 {
    (x / scale + zp).max(0.0).round().min(max) as u8
}

/// `(q - zp) * scale`, two roundings, as OpenVINO dequantizes (also before re-quantizing a block).
#[inline(always)]
pub fn dequant(q: u8, scale: f32, zp: f32) -> f32 {
    (q as f32 - zp) * scale
}

/// Element `i` of quantized data of `bits`-bit elements (u4: the even element in the high
/// nibble).
#[inline(always)]
pub(crate) fn q_at(data: &[u8], i: usize, bits: usize) -> u8 {
    if bits == 8 {
        data[i]
    } else {
        (data[i / 2] >> (4 * (1 - i % 2))) & 15
    }
}

/// Writes quantized values into `dst` (`n * bits / 8` bytes): `q(i)` for element `i`.
#[inline(always)]
fn put_q(dst: &mut [u8], n: usize, bits: usize, q: impl Fn(usize) -> u8) {
    if bits == 8 {
        for (i, o) in dst[..n].iter_mut().enumerate() {
            *o = q(i);
        }
    } else {
        for (i, o) in dst[..n / 2].iter_mut().enumerate() {
            *o = (q(2 * i) << 4) | q(2 * i + 1);
        }
    }
}

/// Quantizes one group of one token: writes `[scale f32][zp f32][x.len() elements]` into `dst`
/// (u8: a byte each; u4: a nibble each, `x.len()` even).
#[inline(always)]
pub fn quantize_group(x: &[f32], dst: &mut [u8], bits: usize) {
    let max = levels(bits);
    let (lo, hi) = min_max(x.iter().copied());
    let mut scale = (hi - lo) / max;
    if scale == 0.0 {
        scale = ZERO_RANGE_SCALE;
    }
    let zp = -lo / scale;
    let inv = 1.0 / scale;
    write_f32(dst, 0, scale);
    write_f32(dst, 1, zp);
    // Both widths: the leading multiple of 16 on the vector path, the rest on the scalar one.
    let vec_len = x.len() - x.len() % 16;
    if bits != 8 {
        let q = |i: usize| {
            if i < vec_len {
                q_vector(x[i], inv, zp, max)
            } else {
                q_scalar(x[i], scale, zp, max)
            }
        };
        put_q(&mut dst[PARAM_BYTES..], x.len(), bits, q);
        return;
    }
    let q = &mut dst[PARAM_BYTES..PARAM_BYTES + x.len()];
    // Two loops, not one with a per-element choice: a choice compiles to both paths (a division
    // per element) and a select.
    let (qv, qs) = q.split_at_mut(vec_len);
    let (xv, xs) = x.split_at(vec_len);
    for (o, &v) in qv.iter_mut().zip(xv) {
        *o = q_vector(v, inv, zp, 255.0);
    }
    for (o, &v) in qs.iter_mut().zip(xs) {
        *o = q_scalar(v, scale, zp, 255.0);
    }
}

/// Bytes of one group of `g` elements of `bits` bits with its parameters.
#[inline(always)]
fn group_bytes(g: usize, bits: usize) -> usize {
    PARAM_BYTES + g * bits / 8
}

/// Quantizes a token row of `x.len()` channels into `dst` (`token_row_bytes_bits` long), by
/// groups.
#[inline(always)]
pub fn quantize_token_row(x: &[f32], group: usize, dst: &mut [u8], bits: usize) {
    let g = effective_group(group, x.len());
    for (xs, ds) in x.chunks(g).zip(dst.chunks_mut(group_bytes(g, bits))) {
        quantize_group(xs, ds, bits);
    }
}

/// Dequantizes a token row (`token_row_bytes_bits(out.len(), group, bits)` bytes) into `out`.
pub fn dequantize_token_row(row: &[u8], group: usize, out: &mut [f32], bits: usize) {
    let g = effective_group(group, out.len());
    for (os, rs) in out.chunks_mut(g).zip(row.chunks(group_bytes(g, bits))) {
        let (scale, zp) = (read_f32(rs, 0), read_f32(rs, 1));
        let data = &rs[PARAM_BYTES..];
        for (i, o) in os.iter_mut().enumerate() {
            *o = dequant(q_at(data, i, bits), scale, zp);
        }
    }
}

/// Quantizes `rows` (`n x d`, row-major, `n >= 1`) as the tokens of one by-channel key block:
/// writes the slab's scales, zero points and its first `n` rows (`d * bits / 8` bytes each);
/// later rows are left alone.
#[inline(always)]
pub fn quantize_channel_block(rows: &[f32], d: usize, slab: &mut [u8], bits: usize) {
    let max = levels(bits);
    // Scales: channels 16 and 8 at a time take the vector paths (the range times the f32
    // reciprocal of 255 or 15), the last d % 8 the scalar one (a true division). Values: u8
    // likewise; u4 has no 8-wide quantizer, so its last d % 16 channels take the scalar path.
    let vec_len = d - d % 8;
    let q_len = if bits == 8 { vec_len } else { d - d % 16 };
    let (params, data) = slab.split_at_mut(PARAM_BYTES * d);
    // Each channel's range is folded in token order, as one channel at a time would, but the
    // loops run across channels (contiguous, so they vectorize).
    let (mut lo, mut hi) = (vec![f32::MAX; d], vec![-f32::MAX; d]);
    for row in rows.chunks_exact(d) {
        for ((lo, hi), &x) in lo.iter_mut().zip(hi.iter_mut()).zip(row) {
            (*lo, *hi) = (lo.min(x), hi.max(x));
        }
    }
    // From here `lo` holds the zero points and `hi` what the quantizer multiplies or divides by.
    for j in 0..d {
        let mut scale = if j < vec_len {
            (hi[j] - lo[j]) * (1.0f32 / max)
        } else {
            (hi[j] - lo[j]) / max
        };
        if scale == 0.0 {
            scale += ZERO_RANGE_SCALE;
        }
        let zp = -lo[j] / scale;
        write_f32(params, j, scale);
        write_f32(params, d + j, zp);
        lo[j] = zp;
        hi[j] = if j < q_len { 1.0 / scale } else { scale };
    }
    let row_bytes = d * bits / 8;
    // u4: a byte per value first (the same two loops), then packed in pairs. A closure choosing
    // the path per element compiled out of line, off the caller's FMA target: a library call to
    // `rintf` per value (7% of a u4 prefill's time, `perf`).
    let mut nibbles = if bits == 8 { Vec::new() } else { vec![0u8; d] };
    for (row, out) in rows.chunks_exact(d).zip(data.chunks_exact_mut(row_bytes)) {
        // Zipped slices, not indices: with bounds checks in the loop it ran one element at a
        // time (6% of a u8 prefill's time, `perf`).
        let q: &mut [u8] = if bits == 8 { out } else { &mut nibbles };
        let (ov, os) = q.split_at_mut(q_len);
        let chans = |a, b| row[a..b].iter().zip(&hi[a..b]).zip(&lo[a..b]);
        for (o, ((&x, &inv), &zp)) in ov.iter_mut().zip(chans(0, q_len)) {
            *o = q_vector(x, inv, zp, max);
        }
        for (o, ((&x, &scale), &zp)) in os.iter_mut().zip(chans(q_len, d)) {
            *o = q_scalar(x, scale, zp, max);
        }
        if bits != 8 {
            for (o, p) in out.iter_mut().zip(nibbles.chunks_exact(2)) {
                *o = (p[0] << 4) | p[1];
            }
        }
    }
}

/// Dequantizes token `slot` of a by-channel key slab into `out` (D values).
#[inline(always)]
pub fn dequantize_channel_row(slab: &[u8], slot: usize, out: &mut [f32], bits: usize) {
    let d = out.len();
    let rb = d * bits / 8;
    let row = &slab[PARAM_BYTES * d + slot * rb..][..rb];
    for (j, o) in out.iter_mut().enumerate() {
        *o = dequant(q_at(row, j, bits), read_f32(slab, j), read_f32(slab, d + j));
    }
}

/// Appends `new_rows` (`n x d`) after the first `prev` tokens of a by-channel key slab. A block
/// that already holds tokens is re-quantized as a whole, as OpenVINO does (u8 and u4 alike):
/// its tokens are dequantized with the old parameters, the range is taken over them and the new
/// keys, and all are quantized again (so earlier keys stay within the block's range, at the
/// cost of a second rounding). `scratch` is reused between calls.
#[inline(always)]
pub fn insert_channel_block(
    slab: &mut [u8],
    d: usize,
    prev: usize,
    new_rows: &[f32],
    scratch: &mut Vec<f32>,
    bits: usize,
) {
    if new_rows.is_empty() {
        return;
    }
    if prev == 0 {
        quantize_channel_block(new_rows, d, slab, bits);
        return;
    }
    scratch.clear();
    scratch.resize(prev * d, 0.0);
    for (t, row) in scratch.chunks_mut(d).enumerate() {
        dequantize_channel_row(slab, t, row, bits);
    }
    scratch.extend_from_slice(new_rows);
    quantize_channel_block(scratch, d, slab, bits);
}

/// Nibbles `src` (two per byte, the even one high) as one byte each into `dst` (twice as long).
#[inline(always)]
fn unpack_nibbles(src: &[u8], dst: &mut [u8]) {
    // 16 bytes at a time through fixed-size arrays, which compile to byte shuffles (a loop over
    // pairs does not vectorize: a decode over u4 caches spent most of its time here).
    let mut outs = dst.chunks_exact_mut(32);
    let mut ins = src.chunks_exact(16);
    for (o, s) in (&mut outs).zip(&mut ins) {
        let s: &[u8; 16] = s.try_into().expect("16 bytes");
        let mut hi = [0u8; 16];
        let mut lo = [0u8; 16];
        for i in 0..16 {
            hi[i] = s[i] >> 4;
            lo[i] = s[i] & 15;
        }
        let mut out = [0u8; 32];
        for i in 0..16 {
            out[2 * i] = hi[i];
            out[2 * i + 1] = lo[i];
        }
        o.copy_from_slice(&out);
    }
    for (pair, &b) in outs
        .into_remainder()
        .chunks_exact_mut(2)
        .zip(ins.remainder())
    {
        pair[0] = b >> 4;
        pair[1] = b & 15;
    }
}

/// A u4 by-channel key slab (`8 * d` parameter bytes, then rows of `d / 2` bytes) as the u8
/// slab that dequantizes to the same keys (the parameters, then rows of `d` bytes).
pub(crate) fn unpack_u4_slab(src: &[u8], d: usize, dst: &mut [u8]) {
    let p = PARAM_BYTES * d;
    dst[..p].copy_from_slice(&src[..p]);
    unpack_nibbles(&src[p..], &mut dst[p..]);
}

/// u4 by-token rows (groups of `group` channels, 0 = `d`) as the u8 rows that dequantize to
/// the same values: per group, the 8 parameter bytes copied and the nibbles widened to bytes.
pub(crate) fn unpack_u4_token_rows(src: &[u8], d: usize, group: usize, dst: &mut [u8]) {
    let g = effective_group(group, d);
    let (g4, g8) = (group_bytes(g, 4), group_bytes(g, 8));
    for (s, o) in src.chunks_exact(g4).zip(dst.chunks_exact_mut(g8)) {
        o[..PARAM_BYTES].copy_from_slice(&s[..PARAM_BYTES]);
        unpack_nibbles(&s[PARAM_BYTES..], &mut o[PARAM_BYTES..]);
    }
}

/// Cache bytes insertion writes to: `rows(at, len)` is bytes `at..at + len` of one cache. The
/// fast kernels give each KV head's task a view of the shared caches (heads never share bytes).
pub(crate) trait CacheRows {
    fn rows(&mut self, at: usize, len: usize) -> &mut [u8];
}

impl CacheRows for [u8] {
    fn rows(&mut self, at: usize, len: usize) -> &mut [u8] {
        &mut self[at..at + len]
    }
}

/// Buffers of one inserting task, reused across its rows and blocks.
#[derive(Default)]
pub(crate) struct InsertScratch {
    row: Vec<f32>,
    new_rows: Vec<f32>,
    block: Vec<f32>,
}

/// Step 2 (insertion) for u8 caches laid out as `layout`: quantizes each new token's key and
/// value rows (`[T, Hkv*D]`) into its block and slot. The plan's sequences and `block_indices`
/// must have been validated against caches of `layout`'s shapes.
pub fn insert_u8<Q: Float>(
    layout: &QuantLayout,
    seqs: &[SeqPlan],
    block_indices: &[i32],
    key: &[Q],
    value: &[Q],
    key_cache: &mut [u8],
    value_cache: &mut [u8],
) {
    let mut buf = InsertScratch::default();
    for head in 0..layout.hkv {
        let new = (key, value);
        insert_u8_head(
            layout,
            seqs,
            block_indices,
            new,
            head,
            key_cache,
            value_cache,
            &mut buf,
        );
    }
}

/// [`insert_u8`] for KV head `head` only: the bytes it writes belong to that head alone, and
/// within the head they are written in the same order as by the whole call (values token by
/// token, then by-channel key blocks sequence by sequence), so aliasing block tables give the
/// same bytes whether heads run one after another or in parallel.
///
/// On x86_64 CPUs with FMA and AVX2 the same code is compiled for them (the fused multiply-add
/// and rounding become instructions instead of library calls, the per-channel loops vectorize);
/// IEEE arithmetic gives the same bytes either way.
#[allow(clippy::too_many_arguments)]
pub(crate) fn insert_u8_head<Q: Float>(
    layout: &QuantLayout,
    seqs: &[SeqPlan],
    block_indices: &[i32],
    new: (&[Q], &[Q]),
    head: usize,
    key_cache: &mut (impl CacheRows + ?Sized),
    value_cache: &mut (impl CacheRows + ?Sized),
    buf: &mut InsertScratch,
) {
    let args = (layout, seqs, block_indices, new, head);
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") && is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has FMA and AVX2 (detected just above), all the function enables.
        return unsafe { insert_head_fma(args, key_cache, value_cache, buf) };
    }
    insert_head(args, key_cache, value_cache, buf)
}

/// What [`insert_u8_head`] inserts: layout, sequences, block table, (key, value), KV head.
type HeadArgs<'a, Q> = (
    &'a QuantLayout,
    &'a [SeqPlan],
    &'a [i32],
    (&'a [Q], &'a [Q]),
    usize,
);

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma,avx2")]
unsafe fn insert_head_fma<Q: Float>(
    args: HeadArgs<'_, Q>,
    key_cache: &mut (impl CacheRows + ?Sized),
    value_cache: &mut (impl CacheRows + ?Sized),
    buf: &mut InsertScratch,
) {
    insert_head(args, key_cache, value_cache, buf)
}

#[inline(always)]
fn insert_head<Q: Float>(
    (layout, seqs, block_indices, (key, value), head): HeadArgs<'_, Q>,
    key_cache: &mut (impl CacheRows + ?Sized),
    value_cache: &mut (impl CacheRows + ?Sized),
    buf: &mut InsertScratch,
) {
    let (d, dv, bs, hkv) = (layout.d, layout.dv, layout.bs, layout.hkv);
    // A head's rows lie `Hkv * D` elements apart, a page or more for common shapes, where the
    // hardware prefetcher stops: each row read also requests the row `AHEAD` tokens on.
    const AHEAD: usize = 4;
    let widen = |(src, d): (&[Q], usize), token: usize, out: &mut Vec<f32>| {
        let row = &src[(token * hkv + head) * d..][..d];
        out.extend(row.iter().map(|v| v.to_f32()));
        if let Some(next) = src.get(((token + AHEAD) * hkv + head) * d..) {
            prefetch_part(&next[..d.min(next.len())], 0, 1);
        }
    };
    let (key, value) = ((key, d), (value, dv));
    let value_row = layout.value_row();
    let key_slab = layout.key_slab();
    let block_of = |sp: &SeqPlan, pos: usize| block_indices[sp.block_begin + pos / bs] as usize;
    for sp in seqs {
        for i in 0..sp.n {
            let pos = sp.past + i;
            let block = block_of(sp, pos);
            let row = ((block * hkv + head) * bs + pos % bs) * value_row;
            buf.row.clear();
            widen(value, sp.begin + i, &mut buf.row);
            let dst = value_cache.rows(row, value_row);
            quantize_token_row(&buf.row, layout.value_group, dst, layout.bits);
            if let KeyQuant::ByToken { group } = layout.key {
                buf.row.clear();
                widen(key, sp.begin + i, &mut buf.row);
                let kr = key_slab / bs;
                let row = ((block * hkv + head) * bs + pos % bs) * kr;
                quantize_token_row(&buf.row, group, key_cache.rows(row, kr), layout.bits);
            }
        }
    }
    if layout.key != KeyQuant::ByChannel {
        return;
    }
    for sp in seqs {
        // Block by block: the part of the new tokens that falls into each block.
        let mut pos = sp.past;
        while pos < sp.past + sp.n {
            let prev = pos % bs;
            let take = (bs - prev).min(sp.past + sp.n - pos);
            let block = block_of(sp, pos);
            buf.new_rows.clear();
            for t in 0..take {
                widen(key, sp.begin + (pos - sp.past) + t, &mut buf.new_rows);
            }
            let slab = key_cache.rows((block * hkv + head) * key_slab, key_slab);
            insert_channel_block(slab, d, prev, &buf.new_rows, &mut buf.block, layout.bits);
            pos += take;
        }
    }
}

/// The rotation inputs of a call (step 1), as u8 key rotation reads them: `rotated_block_indices`,
/// `rotation_deltas` (`delta_cols` per block: 1 or BS) and `rotation_trig_lut` widened to f32.
pub struct KeyRotation<'a> {
    pub blocks: &'a [i32],
    pub deltas: &'a [i32],
    pub delta_cols: usize,
    pub lut: &'a [f32],
}

impl KeyRotation<'_> {
    /// Whether the inputs fit caches of `nb` blocks of `bs` slots and head size `d` (what
    /// validation established for the op's own calls).
    pub(crate) fn fits(&self, nb: usize, bs: usize, d: usize) -> bool {
        let rows = self.lut.len().checked_div(d).unwrap_or(0);
        d.is_multiple_of(2)
            && self.lut.len() == rows * d
            && (self.delta_cols == 1 || self.delta_cols == bs)
            && Some(self.deltas.len()) == self.blocks.len().checked_mul(self.delta_cols)
            && self
                .blocks
                .iter()
                .all(|&b| (0..nb as i64).contains(&(b as i64)))
            && self
                .deltas
                .iter()
                .all(|&r| (0..rows as i64).contains(&(r as i64)))
    }
}

/// How many leading slots of each rotated block (`rot.blocks[r]`) hold keys before this call's
/// insertion: `past - k * BS` (at most BS) for the k-th block a sequence reaches, the most over
/// the sequences that reach it; BS for a block no sequence of the call reaches (it may belong to
/// one outside the batch). Only those slots are rotated: a by-channel block's range is taken over
/// the keys it holds, not over stale bytes in its free slots (insertion does the same).
pub fn rotated_fills(
    bs: usize,
    seqs: &[SeqPlan],
    block_indices: &[i32],
    rot: &KeyRotation,
) -> Vec<usize> {
    let mut held: std::collections::HashMap<usize, usize> = std::collections::HashMap::new();
    let rotated: std::collections::HashSet<usize> =
        rot.blocks.iter().map(|&b| b as usize).collect();
    for sp in seqs {
        for k in 0..(sp.past + sp.n).div_ceil(bs) {
            let block = block_indices[sp.block_begin + k] as usize;
            if rotated.contains(&block) {
                let n = sp.past.saturating_sub(k * bs).min(bs);
                let e = held.entry(block).or_insert(0);
                *e = (*e).max(n);
            }
        }
    }
    rot.blocks
        .iter()
        .map(|&b| held.get(&(b as usize)).copied().unwrap_or(bs))
        .collect()
}

/// Step 1 (rotation) on a u8 key cache for KV head `head`: for each rotated block in list order
/// (a block listed twice is rotated twice), its first `fills[r]` keys (see [`rotated_fills`])
/// are dequantized, rotated in f32 by the LUT rows of their deltas and quantized again as
/// insertion quantizes them: a by-channel block over the rotated keys' per-channel range, a
/// by-token key row by row. Each rotation adds one rounding (at most half a step of the new
/// parameters). The validated plan guarantees blocks, deltas and LUT rows are in range.
pub(crate) fn rotate_u8_head(
    layout: &QuantLayout,
    rot: &KeyRotation,
    fills: &[usize],
    head: usize,
    key_cache: &mut (impl CacheRows + ?Sized),
    buf: &mut InsertScratch,
) {
    let (d, bs, hkv, bits) = (layout.d, layout.bs, layout.hkv, layout.bits);
    let key_slab = layout.key_slab();
    let buf = &mut buf.block;
    for (r, (&block, &fill)) in rot.blocks.iter().zip(fills).enumerate() {
        if fill == 0 {
            continue;
        }
        let lut_of = |slot: usize| lut_row(rot.lut, d, (rot.deltas, rot.delta_cols), r, slot);
        let slab = key_cache.rows((block as usize * hkv + head) * key_slab, key_slab);
        buf.clear();
        buf.resize(fill * d, 0.0);
        match layout.key {
            KeyQuant::ByChannel => {
                for (slot, row) in buf.chunks_exact_mut(d).enumerate() {
                    dequantize_channel_row(slab, slot, row, bits);
                    rope_row(row, lut_of(slot));
                }
                quantize_channel_block(buf, d, slab, bits);
            }
            KeyQuant::ByToken { group } => {
                let kr = key_slab / bs;
                for (slot, (row, bytes)) in buf
                    .chunks_exact_mut(d)
                    .zip(slab.chunks_exact_mut(kr))
                    .enumerate()
                {
                    dequantize_token_row(bytes, group, row, bits);
                    rope_row(row, lut_of(slot));
                    quantize_token_row(row, group, bytes, bits);
                }
            }
        }
    }
}

/// [`rotate_u8_head`] for every KV head, one after another.
pub fn rotate_u8(
    layout: &QuantLayout,
    seqs: &[SeqPlan],
    block_indices: &[i32],
    rot: &KeyRotation,
    key_cache: &mut [u8],
) {
    let fills = rotated_fills(layout.bs, seqs, block_indices, rot);
    let mut buf = InsertScratch::default();
    for head in 0..layout.hkv {
        rotate_u8_head(layout, rot, &fills, head, key_cache, &mut buf);
    }
}

/// Dequantizes the key of (block, head, slot) into `out` (D values).
pub fn key_row(
    layout: &QuantLayout,
    kc: &[u8],
    block: usize,
    head: usize,
    slot: usize,
    out: &mut [f32],
) {
    let hkv = layout.hkv;
    let slab_len = layout.key_slab();
    let slab = &kc[(block * hkv + head) * slab_len..][..slab_len];
    match layout.key {
        KeyQuant::ByChannel => dequantize_channel_row(slab, slot, out, layout.bits),
        KeyQuant::ByToken { group } => {
            let r = slab_len / layout.bs;
            dequantize_token_row(&slab[slot * r..(slot + 1) * r], group, out, layout.bits)
        }
    }
}

/// Dequantizes the value of (block, head, slot) into `out` (Dv values).
pub fn value_row(
    layout: &QuantLayout,
    vc: &[u8],
    block: usize,
    head: usize,
    slot: usize,
    out: &mut [f32],
) {
    let r = layout.value_row();
    let at = ((block * layout.hkv + head) * layout.bs + slot) * r;
    dequantize_token_row(&vc[at..at + r], layout.value_group, out, layout.bits);
}

/// The caches dequantized to f32 `[NB, Hkv, BS, D]` and `[NB, Hkv, BS, Dv]`, for the reference
/// twin only: a fast kernel dequantizes the rows it reads, never the whole cache.
pub(crate) fn dequantize_caches(
    layout: &QuantLayout,
    nb: usize,
    kc: &[u8],
    vc: &[u8],
) -> Result<(Vec<f32>, Vec<f32>)> {
    let (d, dv, bs, hkv) = (layout.d, layout.dv, layout.bs, layout.hkv);
    let len = |w: usize| {
        [nb, hkv, bs, w, std::mem::size_of::<f32>()]
            .iter()
            .try_fold(1usize, |a, &x| a.checked_mul(x))
            .ok_or_else(|| PaError::InvalidArgument {
                detail: format!("u8 caches of {nb} blocks are too large to widen"),
            })
    };
    let mut k = vec![0f32; len(d)? / 4];
    let mut v = vec![0f32; len(dv)? / 4];
    for (i, (kr, vr)) in k.chunks_mut(d).zip(v.chunks_mut(dv)).enumerate() {
        let (block, head, slot) = (i / (hkv * bs), i / bs % hkv, i % bs);
        key_row(layout, kc, block, head, slot, kr);
        value_row(layout, vc, block, head, slot, vr);
    }
    Ok((k, v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_row_sizes_match_the_plugin_ports() {
        // as the plugin reports its ports for D = 64 (tools/ov_u8_cache.py check)
        assert_eq!(token_row_bytes(64, 0), Some(72));
        assert_eq!(token_row_bytes(64, 16), Some(96));
        assert_eq!(token_row_bytes(64, 32), Some(80));
        assert_eq!(token_row_bytes(64, 12), None);
        assert_eq!(token_row_bytes(64, 128), None);
        let l = QuantLayout {
            hkv: 2,
            d: 64,
            dv: 64,
            bs: 32,
            key: KeyQuant::ByChannel,
            value_group: 0,
            bits: 8,
        };
        assert_eq!(l.key_cache_dims(3), Some([3, 2, 40, 64]));
        assert_eq!(l.value_cache_dims(3), Some([3, 2, 32, 72]));
    }

    #[test]
    fn rounding_of_the_two_paths_differs_on_ties() {
        // scale 1, zp 0: x = 2.5 is a tie; vector path -> even (2), scalar tail -> away (3)
        assert_eq!(q_vector(2.5, 1.0, 0.0, 255.0), 2);
        assert_eq!(q_scalar(2.5, 1.0, 0.0, 255.0), 3);
        assert_eq!(q_vector(-3.0, 1.0, 0.0, 255.0), 0);
        assert_eq!(q_vector(300.0, 1.0, 0.0, 255.0), 255);
        assert_eq!(q_vector(f32::NAN, 1.0, 0.0, 255.0), 0);
        assert_eq!(q_vector(16.0, 1.0, 0.0, 15.0), 15);
        assert_eq!(q_scalar(16.0, 1.0, 0.0, 15.0), 15);
    }

    #[test]
    fn vector_path_is_the_plugins_instruction_sequence() {
        // What the plugin's AVX-512 code does, written from the instructions' definitions:
        // vcvtps2dq rounds half to even and gives 0x80000000 for NaN and for results outside
        // the i32 range; then max with 0 and a saturating pack to u8.
        let model = |x: f32, inv: f32, zp: f32| -> u8 {
            let v = x.mul_add(inv, zp);
            let i = if v.is_nan() || !(-2147483648.0..2147483648.0).contains(&v) {
                i32::MIN
            } else {
                v.round_ties_even() as i32
            };
            i.clamp(0, 255) as u8
        };
        let xs = [
            0.0,
            -0.0,
            0.5,
            1.5,
            2.5,
            -0.5,
            -1.5,
            127.5,
            254.5,
            255.0,
            255.5,
            256.0,
            -1e-30,
            1e-30,
            3e9,
            -3e9,
            2147483520.0,
            2147483648.0,
            -2147483648.0,
            -2147483904.0,
            1e38,
            -1e38,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
        ];
        for &x in &xs {
            for (inv, zp) in [
                (1.0, 0.0),
                (1.0, 0.5),
                (0.5, 128.0),
                (3.0e7, -7.0),
                (-1.0, 3.0),
            ] {
                assert_eq!(
                    q_vector(x, inv, zp, 255.0),
                    model(x, inv, zp),
                    "x={x} inv={inv} zp={zp}"
                );
            }
        }
    }

    #[test]
    fn constant_group_uses_the_substitute_scale() {
        let x = [1.5f32; 16];
        let mut dst = [0u8; 24];
        quantize_group(&x, &mut dst, 8);
        assert_eq!(read_f32(&dst, 0), ZERO_RANGE_SCALE);
        let mut back = [0f32; 16];
        dequantize_token_row(&dst, 0, &mut back, 8);
        assert!(back.iter().all(|&v| (v - 1.5).abs() < 1e-4), "{back:?}");
    }

    #[test]
    fn unpacking_nibbles_keeps_their_order() {
        for n in [0usize, 1, 7, 16, 17, 40, 64, 100] {
            let src: Vec<u8> = (0..n).map(|i| (i * 37 + 11) as u8).collect();
            let mut dst = vec![0u8; 2 * n];
            unpack_nibbles(&src, &mut dst);
            for (i, &x) in dst.iter().enumerate() {
                assert_eq!(x, q_at(&src, i, 4), "n {n} i {i}");
            }
        }
    }

    #[test]
    fn u4_nibbles_pack_the_even_element_high() {
        // 0..15 in one group: scale 1, zero point 0, bytes 0x01 0x23 ... as OpenVINO writes
        // them (tools/ov_u4_cache.py)
        let x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let mut dst = [0u8; 16];
        quantize_group(&x, &mut dst, 4);
        assert_eq!(read_f32(&dst, 0), 1.0);
        assert_eq!(&dst[8..], &[0x01, 0x23, 0x45, 0x67, 0x89, 0xab, 0xcd, 0xef]);
        let mut back = [0f32; 16];
        dequantize_token_row(&dst, 0, &mut back, 4);
        assert_eq!(&back[..], &x[..]);
    }
}
