//! Step 1: re-rotates the cached keys of the listed blocks by rows of the trig LUT, in place.
//!
//! One task per KV head (rows of different heads never overlap); inside a task the blocks are
//! rotated in list order, so a block listed twice is rotated twice, as in the reference.

use super::shared::SharedMut;
use crate::dtype::Float;
use crate::kernel::layout::cache_row;
use crate::op::Plan;
use crate::threads::Runner;

/// Safe for any plan: rows are disjoint by construction and every slice access is checked.
pub fn rotate<C: Float>(
    runner: Runner,
    plan: &Plan,
    delta_cols: usize,
    kc: &mut [C],
    rbi: &[i32],
    rd: &[i32],
    lut: &[f32],
) {
    let (d, bs) = (plan.d, plan.bs);
    let half = d / 2;
    let w = SharedMut::new(kc);
    runner.for_each(plan.hkv, &|head| {
        for (r, &block) in rbi.iter().enumerate() {
            for slot in 0..bs {
                let col = if delta_cols == 1 { 0 } else { slot };
                let delta = rd[r * delta_cols + col] as usize;
                let (cos, sin) = lut[delta * d..(delta + 1) * d].split_at(half);
                // SAFETY: the row includes `head`: tasks touch disjoint rows, one at a time.
                let row = unsafe { w.part(cache_row(plan, block as usize, head, slot), d) };
                let (xs, ys) = row.split_at_mut(half);
                for i in 0..half {
                    let (x, y) = (xs[i].to_f32(), ys[i].to_f32());
                    xs[i] = C::from_f32(x * cos[i] - y * sin[i]);
                    ys[i] = C::from_f32(x * sin[i] + y * cos[i]);
                }
            }
        }
    });
}
