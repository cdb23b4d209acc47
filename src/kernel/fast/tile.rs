//! What the work items of one call share: per-thread scratch buffers, and the steps every tile takes around its softmax (query rows, ALiBi and masks, the
//! check that keeps masked non-finite values out of the value product, prefetch hints).

use crate::dtype::Float;
use crate::kernel::layout::{seen_by_all, window_start};
pub(crate) use crate::kernel::prefetch::prefetch_part;
use crate::kernel::softmax::{Lanes, OnlineSoftmax};
use crate::op::{Plan, SeqPlan};
use std::cell::RefCell;

/// Per-thread buffers, grown on demand and reused across items (no allocation per tile).
#[derive(Default)]
pub(crate) struct Scratch {
    pub q: Vec<f32>,
    pub acc: Vec<f32>,
    pub s: Vec<f32>,
    pub st: Vec<OnlineSoftmax>,
    /// f32 keys of a tile whose cache is not f32 (the scores' recomputation).
    pub k: Vec<f32>,
}

/// Grows `v` to at least `n` elements (new ones default; never shrinks: per-thread buffers keep
/// their largest size across items and calls).
pub(crate) fn grow<T: Copy + Default>(v: &mut Vec<T>, n: usize) {
    if v.len() < n {
        v.resize(n, T::default());
    }
}

impl Scratch {
    /// Room for `rows` query rows `d` wide, their accumulators `dv` wide and logits of `bs` keys.
    pub fn ensure(&mut self, rows: usize, (d, dv): (usize, usize), bs: usize) {
        grow(&mut self.q, rows * d);
        grow(&mut self.acc, rows * dv);
        grow(&mut self.s, rows * bs);
        grow(&mut self.st, rows);
    }
}

thread_local! {
    pub(crate) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Fills `q[..nt*G*D]` with the f32 query rows of tokens `t0..t0+nt` of `sp`, heads of KV head
/// `kvh` (row `ti*G + g`). Not scaled: the scale multiplies the logits (`Micro::scale_logits`).
pub(crate) fn load_q<Q: Float>(
    plan: &Plan,
    query: &[Q],
    sp: &SeqPlan,
    kvh: usize,
    t0: usize,
    nt: usize,
    q: &mut [f32],
) {
    let (h, d, g) = (plan.h, plan.d, plan.g);
    for ti in 0..nt {
        let src = &query[((sp.begin + t0 + ti) * h + kvh * g) * d..][..g * d];
        let dst = &mut q[ti * g * d..(ti + 1) * g * d];
        for (o, v) in dst.iter_mut().zip(src) {
            *o = v.to_f32();
        }
    }
}

/// Adds ALiBi and masks (causal, window) to the logit tile `s` (`rows x n`, row `r` at
/// position `pos0 + r/G`, query head `kvh*G + r%G`), for keys `j0..j0+n`.
pub(crate) fn mask_tile(
    plan: &Plan,
    s: &mut [f32],
    rows: usize,
    n: usize,
    kvh: usize,
    pos0: usize,
    j0: usize,
) {
    mask_tile_strided(plan, s, (n, 1), rows, n, kvh, pos0, j0)
}

/// [`mask_tile`] for a tile whose logit (row `r`, key `jj`) is `s[r*stride.0 + jj*stride.1]`
/// (`(n, 1)` row-major, `(1, ld)` transposed).
#[allow(clippy::too_many_arguments)]
pub(crate) fn mask_tile_strided(
    plan: &Plan,
    s: &mut [f32],
    stride: (usize, usize),
    rows: usize,
    n: usize,
    kvh: usize,
    pos0: usize,
    j0: usize,
) {
    let g = plan.g;
    let pos_max = pos0 + (rows - 1) / g;
    let full = seen_by_all(plan, pos0, pos_max, j0, j0 + n) == (j0, j0 + n);
    if full && plan.alibi.is_none() {
        return;
    }
    for r in 0..rows {
        let pos = pos0 + r / g;
        let wlo = window_start(plan, pos);
        let slope = plan.alibi.as_ref().map(|a| a[kvh * g + r % g]);
        for jj in 0..n {
            let j = j0 + jj;
            let v = &mut s[r * stride.0 + jj * stride.1];
            if j > pos || j < wlo {
                *v = f32::NEG_INFINITY;
            } else if let Some(sl) = slope {
                *v = (*v + sl * (j as f32 - pos as f32)).cap();
            }
        }
    }
}

/// Whether the value rows `v` (`[n][d]`) of the tile's keys outside `lo..hi` (tile offsets of
/// [`seen_by_all`]: the keys some row is masked for) are all finite. Then the value product
/// may run over every row at once: a masked (row, key) pair has weight 0, and 0 times a
/// finite value adds nothing; `0 * inf` would be NaN (contract: masked keys never contribute),
/// so otherwise each row takes only its own keys. Only edge tiles have such keys.
pub(crate) fn finite_outside<C: Float>(
    v: &[C],
    n: usize,
    d: usize,
    (lo, hi): (usize, usize),
) -> bool {
    let finite = |x: &C| x.to_f32().is_finite();
    v[..lo * d].iter().all(finite) && v[hi * d..n * d].iter().all(finite)
}

/// Part `i` of `parts` nearly equal parts of `x` (what a loop over `parts` groups of the
/// current work is given of the next work's bytes to request).
#[inline]
pub(crate) fn share<T>(x: &[T], (i, parts): (usize, usize)) -> &[T] {
    &x[x.len() * i / parts..x.len() * (i + 1) / parts]
}
