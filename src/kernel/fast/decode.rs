//! Step 3 for decode items (a query tile of every KV head of a sequence, over one key chunk):
//! the [`DecodeMicro`] loops, one (cache block, KV head) tile at a time in storage order, so
//! each item streams whole `[Hkv, BS, D]` blocks. While tile `i` computes, the loops request
//! tile `i + 1`'s keys (during QK) and values (during PV) a few cache lines per step: blocks are
//! scattered, so the hardware prefetchers cannot guess them; and the keys and values of tile
//! `i + L2_AHEAD` into L2 at once, so a cache the model's weights have evicted streams in at
//! the memory's pace rather than a tile's latency at a time. Writes one `[max, sum, acc]` slot
//! per row and chunk, which the merge in `attention` combines.

use super::micro::Micro;
use super::partition::Item;
use super::shared::SharedMut;
use super::source::Ctx;
use super::tile::{finite_outside, load_q, mask_tile, Scratch};
use crate::dtype::Float;
use crate::kernel::layout::{seen_by_all, seq_row, seq_row_of, tiles, visible_span, window_start};
use crate::kernel::prefetch::prefetch_l2;
use crate::kernel::softmax::OnlineSoftmax;

/// How many tiles ahead the L2 requests run: 4 tiles (64 KB of f32 keys and values at head size
/// 64) took a 1-token decode over 500 cold keys at SmolLM2's shapes from 0.097 to 0.073 ms a
/// call on one Zen 4 core (over 1000 keys 0.192 to 0.159); 8 to 32 tiles did no better.
const L2_AHEAD: usize = 4;

/// Runs one decode item.
pub(crate) fn run_decode_item<M: Micro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    it: &Item,
    pw: &SharedMut<'_, f32>,
    sw: Option<&SharedMut<'_, f32>>,
    sc: &mut Scratch,
) {
    let plan = ctx.plan;
    let (h, d, dv, g, bs) = (plan.h, plan.d, plan.dv, plan.g, plan.bs);
    let (si, chunk) = (it.seq as usize, it.chunk as usize);
    let (kvh0, kvh1) = (it.kvh0 as usize, it.kvh1 as usize);
    let (sp, lay) = (&plan.seqs[si], &ctx.part.seqs[si]);
    let t0 = it.qt as usize * lay.qtok;
    let nt = lay.qtok.min(sp.n - t0);
    // Rows of one KV head (tokens x G); the item's rows are those of kvh0..kvh1 in order.
    let rows = nt * g;
    let all_rows = rows * (kvh1 - kvh0);
    let (k0, k1) = lay.chunk_range(chunk, sp.ctx());
    let pos0 = sp.past + t0;
    let lo = k0.max(window_start(plan, pos0));
    let hi = k1.min(pos0 + nt);
    sc.ensure(all_rows, (d, dv), bs);
    let Scratch {
        q: qbuf,
        acc: accbuf,
        s,
        st: stbuf,
        ..
    } = sc;
    for kvh in kvh0..kvh1 {
        let r0 = (kvh - kvh0) * rows;
        load_q(plan, ctx.query, sp, kvh, t0, nt, &mut qbuf[r0 * d..]);
    }
    accbuf[..all_rows * dv].fill(0.0);
    stbuf[..all_rows].fill(OnlineSoftmax::EMPTY);
    let first_score = sp.n - sp.score_tokens;
    let tile_at = |j0: usize, j1: usize, kvh: usize| {
        let ko = seq_row(plan, ctx.block_indices, sp, kvh, j0);
        let vo = seq_row_of(plan, plan.dv, ctx.block_indices, sp, kvh, j0);
        (
            &ctx.kc[ko..ko + (j1 - j0) * d],
            &ctx.vc[vo..vo + (j1 - j0) * dv],
        )
    };
    let steps =
        || tiles(lo, hi, bs).flat_map(|(j0, j1)| (kvh0..kvh1).map(move |kvh| (j0, j1, kvh)));
    let mut ahead = steps();
    ahead.next();
    let mut far = steps();
    for (j0, j1, kvh) in far.by_ref().take(L2_AHEAD) {
        let (kf, vf) = tile_at(j0, j1, kvh);
        prefetch_l2(kf);
        prefetch_l2(vf);
    }
    for (j0, j1, kvh) in steps() {
        let n = j1 - j0;
        let r0 = (kvh - kvh0) * rows;
        let (kt, vt) = tile_at(j0, j1, kvh);
        let (kn, vn) = ahead
            .next()
            .map_or((&[][..], &[][..]), |(a, b, hn)| tile_at(a, b, hn));
        if let Some((a, b, hn)) = far.next() {
            let (kf, vf) = tile_at(a, b, hn);
            prefetch_l2(kf);
            prefetch_l2(vf);
        }
        let st = &mut s[..rows * n];
        m.dec_qk(
            &qbuf[r0 * d..(r0 + rows) * d],
            rows,
            kt,
            n,
            d,
            st,
            kn,
            plan.scale,
        );
        mask_tile(plan, st, rows, n, kvh, pos0, j0);
        if let Some(sw) = sw {
            for ti in first_score.max(t0)..t0 + nt {
                for gi in 0..g {
                    let r = (ti - t0) * g + gi;
                    let row = lay.stash_base + ((ti - first_score) * h + kvh * g + gi) * sp.ctx();
                    // SAFETY: stash row (token, head) belongs to this item's KV heads and query
                    // tile, and keys j0..j1 to this item's chunk: no other item writes there.
                    let dst = unsafe { sw.part(row + j0, n) };
                    dst.copy_from_slice(&st[r * n..(r + 1) * n]);
                }
            }
        }
        let (a, b) = seen_by_all(plan, pos0, pos0 + nt - 1, j0, j1);
        if finite_outside(vt, n, dv, (a - j0, b - j0)) {
            m.dec_softmax_pv(
                st,
                rows,
                n,
                vt,
                dv,
                &mut stbuf[r0..r0 + rows],
                &mut accbuf[r0 * dv..(r0 + rows) * dv],
                vn,
            );
        } else {
            per_row(
                m,
                plan,
                (st, n),
                vt,
                (pos0, j0, j1),
                &mut stbuf[r0..r0 + rows],
                &mut accbuf[r0 * dv..(r0 + rows) * dv],
            );
        }
    }
    for kvh in kvh0..kvh1 {
        for r in 0..rows {
            let (ti, gi) = (r / g, r % g);
            let ri = (kvh - kvh0) * rows + r;
            let base = lay.part_base
                + ((t0 + ti) * h + kvh * g + gi) * lay.nchunks * (dv + 2)
                + chunk * (dv + 2);
            // SAFETY: slot (row, chunk) is written by this item only (one item per query tile
            // and chunk, covering every KV head).
            let slot = unsafe { pw.part(base, dv + 2) };
            slot[0] = stbuf[ri].max;
            slot[1] = stbuf[ri].sum;
            slot[2..].copy_from_slice(&accbuf[ri * dv..(ri + 1) * dv]);
        }
    }
}

/// The softmax step of a tile whose rows must not all read every value (a non-finite value
/// some row is masked for): each row over its own keys only. Rare, so kept out of line.
#[cold]
#[inline(never)]
fn per_row<M: Micro, C: Float>(
    m: M,
    plan: &crate::op::Plan,
    (s, n): (&mut [f32], usize),
    v: &[C],
    (pos0, j0, j1): (usize, usize, usize),
    st: &mut [OnlineSoftmax],
    acc: &mut [f32],
) {
    let (dv, g) = (plan.dv, plan.g);
    for r in 0..st.len() {
        let (a, b) = visible_span(plan, pos0 + r / g, j0, j1);
        let (a, b) = (a - j0, b - j0);
        if a < b {
            let w = &mut s[r * n + a..r * n + b];
            let (row_st, row_acc) = (&mut st[r..r + 1], &mut acc[r * dv..(r + 1) * dv]);
            m.dec_softmax_pv(w, 1, b - a, &v[a * dv..b * dv], dv, row_st, row_acc, &[]);
        }
    }
}
