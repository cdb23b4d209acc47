//! Step 2: writes the new tokens' key/value rows (`[T, Hkv*D]`, `[T, Hkv*Dv]`) into a cache.
//!
//! One task per (cache, KV head): rows of different KV heads never overlap, and inside a task tokens are
//! written in the reference's order, so block tables that alias give the reference's result.

use super::micro::{Micro, QuantMicro, TileMicro};
use super::shared::SharedMut;
use super::{on_level, OnMicro, SimdLevel};
use crate::dtype::{as_f32, Float};
use crate::kernel::layout::seq_row_of;
use crate::op::Plan;
use crate::threads::Runner;

/// Writes key rows `src` (`[T, Hkv*D]`) into key cache `cache`, on the micro-kernels of the
/// process's SIMD level. Safe for any plan: rows are disjoint by construction and every slice
/// access is checked.
pub fn insert<Q: Float, C: Float>(
    runner: Runner,
    plan: &Plan,
    src: &[Q],
    cache: &mut [C],
    block_indices: &[i32],
) {
    struct One<'p, 'a, Q, C> {
        runner: Runner,
        plan: &'p Plan,
        pair: (&'a [Q], &'p mut [C]),
        block_indices: &'p [i32],
    }
    impl<Q: Float, C: Float> OnMicro for One<'_, '_, Q, C> {
        type Out = ();
        fn on<M: TileMicro + QuantMicro>(self, m: M) {
            let (src, cache) = self.pair;
            insert_all(
                m,
                self.runner,
                self.plan,
                &mut [(src, cache, self.plan.d)],
                self.block_indices,
            )
        }
    }
    let pair = (src, cache);
    on_level(
        SimdLevel::detected(),
        One {
            runner,
            plan,
            pair,
            block_indices,
        },
    )
}

/// Writes every `(src, cache, width)` triple (the keys, `D` wide, and the values, `Dv` wide, of
/// a call) in one parallel region, one task per (triple, KV head): a region less for the
/// threads to meet at.
pub(crate) fn insert_all<M: Micro, Q: Float, C: Float>(
    m: M,
    runner: Runner,
    plan: &Plan,
    pairs: &mut [(&[Q], &mut [C], usize)],
    block_indices: &[i32],
) {
    let hkv = plan.hkv;
    let jobs: Vec<(&[Q], SharedMut<'_, C>, usize)> = pairs
        .iter_mut()
        .map(|(src, cache, width)| (*src, SharedMut::new(cache), *width))
        .collect();
    runner.for_each(jobs.len() * hkv, &|task| {
        let ((src, w, width), head) = (&jobs[task / hkv.max(1)], task % hkv.max(1));
        let d = *width;
        for sp in &plan.seqs {
            for i in 0..sp.n {
                let pos = sp.past + i;
                let dst = seq_row_of(plan, d, block_indices, sp, head, pos);
                // SAFETY: each pair has its own cache, and the row includes `head`, so rows
                // written by different tasks are disjoint; this task holds one row at a time.
                let row = unsafe { w.part(dst, d) };
                let s = &src[((sp.begin + i) * hkv + head) * d..][..d];
                copy_row(m, s, row);
            }
        }
    });
}

/// `dst = src` converted to the cache type as `C::from_f32(src.to_f32())` does it (a plain
/// copy when the types match; a half-precision source goes through f32 a chunk at a time).
fn copy_row<M: Micro, Q: Float, C: Float>(m: M, src: &[Q], dst: &mut [C]) {
    if Q::TYPE == C::TYPE {
        // SAFETY: one Float impl per element type, so equal TYPEs mean Q and C are the same
        // type; both slices hold dst.len() elements.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr() as *const C, dst.as_mut_ptr(), dst.len())
        };
    } else if let Some(src) = as_f32(src) {
        m.narrow(src, dst);
    } else {
        let mut buf = [0f32; 64];
        for (s, o) in src.chunks(buf.len()).zip(dst.chunks_mut(buf.len())) {
            let b = &mut buf[..s.len()];
            m.widen(s, b);
            m.narrow(b, o);
        }
    }
}
