//! Step 4: per sequence, each key's softmax weight summed over heads and over the last
//! `score_tokens` new tokens. The weight of key `j` for (token, head) is
//! `exp(logit - max) / sum` with that row's final statistics, so the logits are either read
//! from the stash the attention items filled, or recomputed tile by tile.
//!
//! Work is cut into fixed spans of keys per sequence; each span sums its terms in a fixed order
//! (token, then head), independent of the thread count.

use super::micro::Micro;
use super::shared::SharedMut;
use super::tile::{load_q, mask_tile, Ctx, Scratch, SCRATCH};
use crate::dtype::Float;
use crate::kernel::layout::{seq_row, tiles, window_start};
use crate::kernel::softmax::OnlineSoftmax;

/// Keys per scores task.
const SPAN: usize = 256;

/// (sequence, first key, keys) of every scores task.
fn spans<Q, C>(ctx: &Ctx<'_, Q, C>) -> Vec<(usize, usize, usize)> {
    let mut v = Vec::new();
    for (s, sp) in ctx.plan.seqs.iter().enumerate() {
        for j0 in (0..sp.ctx()).step_by(SPAN) {
            v.push((s, j0, (sp.ctx() - j0).min(SPAN)));
        }
    }
    v
}

/// Runs `f(seq, j0, acc)` for every span and stores `acc` (zeros when a sequence has no score
/// tokens) into the scores output.
fn for_spans<Q: Float, C: Float>(
    ctx: &Ctx<'_, Q, C>,
    scores: &mut [Q],
    f: impl Fn(usize, usize, &mut [f32]) + Sync,
) {
    let plan = ctx.plan;
    let w = SharedMut::new(scores);
    let spans = spans(ctx);
    ctx.runner.for_each(spans.len(), &|i| {
        let (s, j0, len) = spans[i];
        let sp = &plan.seqs[s];
        let mut acc = [0f32; SPAN];
        let acc = &mut acc[..len];
        if sp.score_tokens > 0 {
            f(s, j0, acc);
        }
        // SAFETY: spans partition each sequence's keys, and sequences own disjoint ranges of
        // the scores output.
        let dst = unsafe { w.part(sp.score_offset + j0, len) };
        for (o, a) in dst.iter_mut().zip(acc.iter()) {
            *o = Q::from_f32(*a);
        }
    });
}

/// Scores from the logits stashed during attention.
pub(crate) fn from_stash<M: Micro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    stats: &[OnlineSoftmax],
    stash: &[f32],
    scores: &mut [Q],
) {
    let plan = ctx.plan;
    let h = plan.h;
    for_spans(ctx, scores, |s, j0, acc| {
        let (sp, lay) = (&plan.seqs[s], &ctx.part.seqs[s]);
        let first = sp.n - sp.score_tokens;
        for i in first..sp.n {
            let pos = sp.past + i;
            let lo = window_start(plan, pos).max(j0);
            let hi = (pos + 1).min(j0 + acc.len());
            if lo >= hi {
                continue;
            }
            for head in 0..h {
                let st = stats[(sp.begin + i) * h + head];
                let row = lay.stash_base + ((i - first) * h + head) * sp.ctx();
                m.add_exp_scaled(
                    &mut acc[lo - j0..hi - j0],
                    &stash[row + lo..row + hi],
                    st.max,
                    st.norm(),
                );
            }
        }
    });
}

/// Scores by recomputing the logits of the score rows (used when the stash is over budget).
pub(crate) fn recompute<M: Micro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    stats: &[OnlineSoftmax],
    scores: &mut [Q],
) {
    let plan = ctx.plan;
    let (h, d, g, bs) = (plan.h, plan.d, plan.g, plan.bs);
    for_spans(ctx, scores, |s, j0, acc| {
        let (sp, lay) = (&plan.seqs[s], &ctx.part.seqs[s]);
        let first = sp.n - sp.score_tokens;
        SCRATCH.with(|sc| {
            let mut sc = sc.borrow_mut();
            let qtok = lay.qtok;
            sc.ensure(qtok * g, d, bs);
            let Scratch { q, s: st, .. } = &mut *sc;
            for kvh in 0..plan.hkv {
                for t0 in (first..sp.n).step_by(qtok) {
                    let nt = qtok.min(sp.n - t0);
                    let rows = nt * g;
                    let pos0 = sp.past + t0;
                    let lo = window_start(plan, pos0).max(j0);
                    let hi = (pos0 + nt).min(j0 + acc.len());
                    if lo >= hi {
                        continue;
                    }
                    load_q(plan, ctx.query, sp, kvh, t0, nt, q);
                    for (a0, a1) in tiles(lo, hi, bs) {
                        let n = a1 - a0;
                        let off = seq_row(plan, ctx.block_indices, sp, kvh, a0);
                        let t = &mut st[..rows * n];
                        m.qk(&q[..rows * d], rows, &ctx.kc[off..off + n * d], n, d, t, n);
                        mask_tile(plan, t, rows, n, kvh, pos0, a0);
                        for r in 0..rows {
                            let token = sp.begin + t0 + r / g;
                            let stt = stats[token * h + kvh * g + r % g];
                            m.add_exp_scaled(
                                &mut acc[a0 - j0..a1 - j0],
                                &t[r * n..(r + 1) * n],
                                stt.max,
                                stt.norm(),
                            );
                        }
                    }
                }
            }
        });
    });
}
