//! Step 4: per sequence, each key's softmax weight summed over heads and over the last
//! `score_tokens` new tokens. The weight of key `j` for (token, head) is
//! `exp(logit - max) / sum` with that row's final statistics, so the logits are either read
//! from the stash the attention items filled (with the attention's statistics), or recomputed
//! tile by tile (with statistics of the recomputed logits, see [`recompute`]); sequences whose
//! items added their score rows' final weights into partial scores of their own
//! (`SeqLayout::direct`) sum those, in a fixed order. A row adds to the keys it sees only.
//!
//! Work is cut into fixed spans of keys per sequence; each span sums its terms in a fixed order
//! (token, then head), independent of the thread count.

use super::micro::{Kernels, Micro};
use super::shared::SharedMut;
use super::source::{Ctx, Source};
use super::tile::{load_q, mask_tile, Scratch, SCRATCH};
use crate::dtype::Float;
use crate::kernel::layout::{tiles, visible_span, window_start};
use crate::kernel::softmax::OnlineSoftmax;

/// Keys per scores task.
const SPAN: usize = 256;

/// (sequence, first key, keys) of every scores task.
fn spans<Q, C: Source>(ctx: &Ctx<'_, Q, C>) -> Vec<(usize, usize, usize)> {
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
/// Sequences whose items summed their scores themselves (`SeqLayout::direct`) take the sum of
/// those partials, in their order, instead.
fn for_spans<Q: Float, C: Source>(
    ctx: &Ctx<'_, Q, C>,
    (direct, scores): (&[f32], &mut [Q]),
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
        let lay = &ctx.part.seqs[s];
        match lay.direct {
            _ if sp.score_tokens == 0 => {}
            Some(base) => {
                for p in 0..plan.hkv * lay.direct_tiles {
                    let part = &direct[base + p * sp.ctx() + j0..][..len];
                    acc.iter_mut().zip(part).for_each(|(a, &x)| *a += x);
                }
            }
            None => f(s, j0, acc),
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
pub(crate) fn from_stash<M: Micro, Q: Float, C: Source>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    (stats, stash, direct): (&[OnlineSoftmax], &[f32], &[f32]),
    scores: &mut [Q],
) {
    let plan = ctx.plan;
    let h = plan.h;
    for_spans(ctx, (direct, scores), |s, j0, acc| {
        let (sp, lay) = (&plan.seqs[s], &ctx.part.seqs[s]);
        let first = sp.n - sp.score_tokens;
        for i in first..sp.n {
            let (lo, hi) = visible_span(plan, sp.past + i, j0, j0 + acc.len());
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
///
/// The weights are normalized by statistics of the recomputed logits themselves (a first pass
/// over the same tiles), not by the attention's: the recomputation runs another kernel, whose
/// logits may differ from the attention's in the last bit, and `exp(s - max)` turns a last-bit
/// difference of a huge logit (say 3e38, whose spacing is 2e31) into 0 or infinity.
pub(crate) fn recompute<M: Kernels, Q: Float, C: Source>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    (direct, scores): (&[f32], &mut [Q]),
) {
    let plan = ctx.plan;
    let (h, g) = (plan.h, plan.g);
    // Pass 1: per score row, the online softmax of its recomputed logits, span by span in key
    // order. One task per (sequence, KV head, query tile of score tokens).
    let mut tasks = Vec::new();
    for (s, sp) in plan.seqs.iter().enumerate() {
        let qtok = ctx.part.seqs[s].qtok;
        if ctx.part.seqs[s].direct.is_some() {
            continue;
        }
        for kvh in 0..plan.hkv {
            for t0 in (sp.n - sp.score_tokens..sp.n).step_by(qtok) {
                tasks.push((s, kvh, t0, qtok.min(sp.n - t0)));
            }
        }
    }
    let mut stats = vec![OnlineSoftmax::EMPTY; plan.t * h];
    {
        let sw = SharedMut::new(&mut stats);
        ctx.runner.for_each(tasks.len(), &|i| {
            let (s, kvh, t0, nt) = tasks[i];
            let sp = &plan.seqs[s];
            let mut st = vec![OnlineSoftmax::EMPTY; nt * g];
            SCRATCH.with(|sc| {
                let sc = &mut *sc.borrow_mut();
                for j0 in (0..sp.ctx()).step_by(SPAN) {
                    let len = (sp.ctx() - j0).min(SPAN);
                    score_logits(m, ctx, sc, s, kvh, t0, nt, j0, len, |r, _, l| {
                        let row = &mut st[r];
                        let step = row.update(l.iter().copied().fold(f32::NEG_INFINITY, f32::max));
                        row.add(l.iter().map(|&x| (x - step.sub).exp()).sum());
                    });
                }
            });
            for (r, row) in st.iter_mut().enumerate() {
                row.finish(plan.sink(kvh * g + r % g));
            }
            for ti in 0..nt {
                // SAFETY: the statistics of (token, heads of kvh) belong to this task only.
                let dst = unsafe { sw.part((sp.begin + t0 + ti) * h + kvh * g, g) };
                dst.copy_from_slice(&st[ti * g..(ti + 1) * g]);
            }
        });
    }
    // Pass 2: the weights, on the same tiles.
    for_spans(ctx, (direct, scores), |s, j0, acc| {
        let (sp, lay) = (&plan.seqs[s], &ctx.part.seqs[s]);
        SCRATCH.with(|sc| {
            let sc = &mut *sc.borrow_mut();
            for kvh in 0..plan.hkv {
                for t0 in (sp.n - sp.score_tokens..sp.n).step_by(lay.qtok) {
                    let nt = lay.qtok.min(sp.n - t0);
                    score_logits(m, ctx, sc, s, kvh, t0, nt, j0, acc.len(), |r, b0, l| {
                        let st = stats[(sp.begin + t0 + r / g) * h + kvh * g + r % g];
                        let dst = &mut acc[b0 - j0..b0 - j0 + l.len()];
                        m.add_exp_scaled(dst, l, st.max, st.norm());
                    });
                }
            }
        });
    });
}

/// Recomputes the logits of rows (query tokens `t0..t0+nt` of sequence `s`) x (query heads of
/// KV head `kvh`) against the keys of `j0..j0+len`, tile by tile, and calls `f(r, b0, l)` with
/// row `r`'s logits `l` of its visible keys `b0..b0 + l.len()` of each tile (never a masked
/// key: a NaN row, or one without a distribution, must not reach the keys it is masked for).
#[allow(clippy::too_many_arguments)]
fn score_logits<M: Kernels, Q: Float, C: Source>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    sc: &mut Scratch,
    s: usize,
    kvh: usize,
    t0: usize,
    nt: usize,
    j0: usize,
    len: usize,
    mut f: impl FnMut(usize, usize, &[f32]),
) {
    let plan = ctx.plan;
    let (d, g, bs) = (plan.d, plan.g, plan.bs);
    let sp = &plan.seqs[s];
    let rows = nt * g;
    let pos0 = sp.past + t0;
    let lo = window_start(plan, pos0).max(j0);
    let hi = (pos0 + nt).min(j0 + len);
    if lo >= hi {
        return;
    }
    sc.ensure(rows, (d, 0), bs);
    super::tile::grow(&mut sc.k, bs * d);
    let Scratch { q, s: st, k, .. } = sc;
    load_q(plan, ctx.query, sp, kvh, t0, nt, q);
    for (a0, a1) in tiles(lo, hi, bs) {
        let n = a1 - a0;
        let keys = C::keys(ctx, (sp, kvh, (a0, a1)), k);
        let t = &mut st[..rows * n];
        Micro::qk(m, &q[..rows * d], rows, keys, n, d, t, n, plan.scale);
        mask_tile(plan, t, rows, n, kvh, pos0, a0);
        for r in 0..rows {
            let (b0, b1) = visible_span(plan, pos0 + r / g, a0, a1);
            if b0 < b1 {
                f(r, b0, &t[r * n + b0 - a0..r * n + b1 - a0]);
            }
        }
    }
}
