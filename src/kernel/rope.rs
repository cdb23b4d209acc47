//! Step 1's arithmetic, written once for every cache type and both kernel families: which row of
//! the trig LUT re-rotates a slot of a listed block, and the rotation of one key row by it.
//! Float caches rotate their rows in place (`reference::rotate`, `fast::rotate`); quantized
//! caches dequantize a row, rotate it here in f32, and quantize it again (`quant`).

use crate::dtype::Float;

/// The LUT row (`[D]`: cos in its first D/2 columns, sin in the last) that rotates slot `slot` of
/// the `r`-th listed block; `deltas` holds `delta_cols` (1: one per block, or BS: one per slot)
/// entries per listed block. The validated plan guarantees every index is in range.
#[inline(always)]
pub(crate) fn lut_row<'l>(
    lut: &'l [f32],
    d: usize,
    (deltas, delta_cols): (&[i32], usize),
    r: usize,
    slot: usize,
) -> &'l [f32] {
    let col = if delta_cols == 1 { 0 } else { slot };
    let delta = deltas[r * delta_cols + col] as usize;
    &lut[delta * d..(delta + 1) * d]
}

/// Rotates one key row (halves `x` and `y`) by a LUT row, in f32: `x' = x cos - y sin`,
/// `y' = x sin + y cos`, each stored back as the row's type stores an f32.
#[inline(always)]
pub(crate) fn rope_row<C: Float>(row: &mut [C], lut_row: &[f32]) {
    let half = row.len() / 2;
    let (cos, sin) = lut_row.split_at(half);
    let (xs, ys) = row.split_at_mut(half);
    for i in 0..half {
        let (x, y) = (xs[i].to_f32(), ys[i].to_f32());
        xs[i] = C::from_f32(x * cos[i] - y * sin[i]);
        ys[i] = C::from_f32(x * sin[i] + y * cos[i]);
    }
}
