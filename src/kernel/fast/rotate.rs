//! Step 1: re-rotates the cached keys of the listed blocks by rows of the trig LUT, in place.
//!
//! One task per KV head (rows of different heads never overlap); inside a task the blocks are
//! rotated in list order, so a block listed twice is rotated twice, as in the reference.

use super::shared::SharedMut;
use crate::dtype::Float;
use crate::kernel::layout::cache_row;
use crate::kernel::rope::{lut_row, rope_row};
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
    let w = SharedMut::new(kc);
    runner.for_each(plan.hkv, &|head| {
        for (r, &block) in rbi.iter().enumerate() {
            for slot in 0..bs {
                let lut = lut_row(lut, d, (rd, delta_cols), r, slot);
                // SAFETY: the row includes `head`: tasks touch disjoint rows, one at a time.
                let row = unsafe { w.part(cache_row(plan, block as usize, head, slot), d) };
                rope_row(row, lut);
            }
        }
    });
}
