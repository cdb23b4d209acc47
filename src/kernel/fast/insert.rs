//! Step 2: writes the new tokens' key/value rows (`[T, Hkv*D]`) into a cache.
//!
//! One task per (cache, KV head): rows of different KV heads never overlap, and inside a task tokens are
//! written in the reference's order, so block tables that alias give the reference's result.

use super::shared::SharedMut;
use crate::dtype::Float;
use crate::kernel::layout::seq_row;
use crate::op::Plan;
use crate::threads::Runner;

/// Writes `src` into `cache`. Safe for any plan: rows are disjoint by construction and every
/// slice access is checked.
pub fn insert<Q: Float, C: Float>(
    runner: Runner,
    plan: &Plan,
    src: &[Q],
    cache: &mut [C],
    block_indices: &[i32],
) {
    insert_all(runner, plan, &mut [(src, cache)], block_indices)
}

/// Writes every `(src, cache)` pair (the keys and the values of a call) in one parallel region,
/// one task per (pair, KV head): a region less for the threads to meet at.
pub fn insert_all<Q: Float, C: Float>(
    runner: Runner,
    plan: &Plan,
    pairs: &mut [(&[Q], &mut [C])],
    block_indices: &[i32],
) {
    let (d, hkv) = (plan.d, plan.hkv);
    let jobs: Vec<(&[Q], SharedMut<'_, C>)> = pairs
        .iter_mut()
        .map(|(src, cache)| (*src, SharedMut::new(cache)))
        .collect();
    runner.for_each(jobs.len() * hkv, &|task| {
        let ((src, w), head) = (&jobs[task / hkv.max(1)], task % hkv.max(1));
        for sp in &plan.seqs {
            for i in 0..sp.n {
                let pos = sp.past + i;
                let dst = seq_row(plan, block_indices, sp, head, pos);
                // SAFETY: each pair has its own cache, and the row includes `head`, so rows
                // written by different tasks are disjoint; this task holds one row at a time.
                let row = unsafe { w.part(dst, d) };
                let s = &src[((sp.begin + i) * hkv + head) * d..][..d];
                copy_row(s, row);
            }
        }
    });
}

/// `dst = src` converted to the cache type (a plain copy when the types match).
fn copy_row<Q: Float, C: Float>(src: &[Q], dst: &mut [C]) {
    if Q::TYPE == C::TYPE {
        // SAFETY: one Float impl per element type, so equal TYPEs mean Q and C are the same
        // type; both slices hold dst.len() elements.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr() as *const C, dst.as_mut_ptr(), dst.len())
        };
    } else {
        for (o, v) in dst.iter_mut().zip(src) {
            *o = C::from_f32(v.to_f32());
        }
    }
}
