//! Where things are: the index arithmetic of the paged caches, of the token list and of the
//! causal window, shared by the reference and the fast kernels (one definition, so the twins
//! cannot disagree on an address).

use crate::op::{Plan, SeqPlan};

/// Offset of row (block, kv head, slot) in a cache `[NB, Hkv, BS, width]`.
#[inline(always)]
fn row_at(plan: &Plan, width: usize, block: usize, head: usize, slot: usize) -> usize {
    ((block * plan.hkv + head) * plan.bs + slot) * width
}

/// Offset of row (block, kv head, slot) in a key cache `[NB, Hkv, BS, D]`.
#[inline(always)]
pub(crate) fn cache_row(plan: &Plan, block: usize, head: usize, slot: usize) -> usize {
    row_at(plan, plan.d, block, head, slot)
}

/// Offset of the row of KV head `head` at logical position `pos` of sequence `sp` in a cache
/// whose rows are `width` wide (`plan.d` for keys, `plan.dv` for values).
#[inline(always)]
pub(crate) fn seq_row_of(
    plan: &Plan,
    width: usize,
    block_indices: &[i32],
    sp: &SeqPlan,
    head: usize,
    pos: usize,
) -> usize {
    let block = block_of(block_indices, sp.block_begin, plan.bs, pos);
    row_at(plan, width, block, head, pos % plan.bs)
}

/// Physical block of logical position `pos` of a sequence whose block list starts at `block_begin`.
#[inline(always)]
pub(crate) fn block_of(block_indices: &[i32], block_begin: usize, bs: usize, pos: usize) -> usize {
    block_indices[block_begin + pos / bs] as usize
}

/// Offset of the key cache row of KV head `head` at logical position `pos` of sequence `sp`.
#[inline(always)]
pub(crate) fn seq_row(
    plan: &Plan,
    block_indices: &[i32],
    sp: &SeqPlan,
    head: usize,
    pos: usize,
) -> usize {
    seq_row_of(plan, plan.d, block_indices, sp, head, pos)
}

/// Sequence index of every token.
pub(crate) fn token_seqs(plan: &Plan) -> Vec<usize> {
    let mut v = vec![0usize; plan.t];
    for (s, sp) in plan.seqs.iter().enumerate() {
        v[sp.begin..sp.begin + sp.n].fill(s);
    }
    v
}

/// First key a query at position `pos` sees.
#[inline(always)]
pub(crate) fn window_start(plan: &Plan, pos: usize) -> usize {
    if plan.sliding_window > 0 {
        (pos + 1).saturating_sub(plan.sliding_window)
    } else {
        0
    }
}

/// Whether a query at position `pos` sees key `j` (causal, inside the window).
#[inline(always)]
pub(crate) fn visible(plan: &Plan, pos: usize, j: usize) -> bool {
    j <= pos && j >= window_start(plan, pos)
}

/// The keys of `j0..j1` a query at position `pos` sees, as `lo..hi` (empty when none).
#[inline(always)]
pub(crate) fn visible_span(plan: &Plan, pos: usize, j0: usize, j1: usize) -> (usize, usize) {
    let lo = window_start(plan, pos).max(j0);
    (lo, (pos + 1).min(j1).max(lo))
}

/// The keys of `j0..j1` every query at positions `pos0..=pos_max` sees, as `lo..hi`: the
/// others are masked for some of them (window of the last, causal edge of the first).
#[inline(always)]
pub(crate) fn seen_by_all(
    plan: &Plan,
    pos0: usize,
    pos_max: usize,
    j0: usize,
    j1: usize,
) -> (usize, usize) {
    let lo = window_start(plan, pos_max).max(j0).min(j1);
    (lo, (pos0 + 1).min(j1).max(lo))
}

/// Key tiles `[j0, j1)` of `[lo, hi)`, cut at block boundaries (a tile's rows are contiguous in
/// the cache).
pub(crate) fn tiles(lo: usize, hi: usize, bs: usize) -> impl Iterator<Item = (usize, usize)> {
    let mut j0 = lo;
    std::iter::from_fn(move || {
        if j0 >= hi {
            return None;
        }
        let j1 = hi.min((j0 / bs + 1) * bs);
        let t = (j0, j1);
        j0 = j1;
        Some(t)
    })
}
