//! Step 3, the driver: runs the work items of a [`Partition`](super::partition::Partition)
//! (decode or prefill items, on whatever cache type: a [`Source`]) and merges their partial
//! softmaxes.
//!
//! One item = the rows of one query tile (tokens x the G query heads of one KV head) over one
//! key range. Keys are visited a tile at a time, a tile being the keys of one cache block, so
//! each block is read once for all rows of the item. Per row: online softmax
//! ([`OnlineSoftmax`] and an accumulator `acc`). A decode item writes `[max, sum, acc]` per row
//! into its own slot, and the merge folds the slots of each row in chunk order
//! ([`OnlineSoftmax::merge`]) into the output, ending the row with its sink; a prefill item
//! sees all keys of its rows and writes their output itself, leaving `[max, sum]`. Either kind
//! stashes the masked logits of the score rows (when the partition asks for it) for step 4.

use super::micro::Kernels;
use super::shared::SharedMut;
use super::source::Ctx;
use super::source::{Out, Source};
use crate::dtype::Float;
use crate::error::Result;
use crate::kernel::softmax::OnlineSoftmax;

/// (token, head) rows per merge task at least: a decode row's merge takes a fraction of a
/// microsecond to a few, and a call of few decoding tokens must still give many threads work.
const MERGE_ROWS: usize = 4;
/// Merge tasks a call aims for at most (a prefill row's merge is a copy of two floats).
const MERGE_TASKS: usize = 256;

/// What the attention leaves for the scores: each (token, head)'s softmax statistics, the
/// stashed logits of the score rows (when the partition asks for them), and the direct partial
/// scores of the sequences whose decode items summed them.
pub(crate) struct ForScores {
    pub stats: Vec<OnlineSoftmax>,
    pub stash: Option<Vec<f32>>,
    pub direct: Vec<f32>,
}

/// Runs every item, then merges.
pub(crate) fn attention<M: Kernels, Q: Float, C: Source>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    out: &mut [Q],
) -> Result<ForScores> {
    let plan = ctx.plan;
    let (h, dv) = (plan.h, plan.dv);
    let prep = C::prepare(m, ctx)?;
    // Every slot and every stash entry a later step reads is written by an item first.
    let mut partials = super::pool::take(ctx.part.part_len);
    let mut stash = ctx.part.stash_len.map(super::pool::take);
    // Each sequence's direct partial scores are written (not added) first by its one item
    // per KV head.
    let mut direct = super::pool::take(ctx.part.direct_len);
    let io = Out {
        direct: SharedMut::new(&mut direct),
        pw: SharedMut::new(&mut partials),
        out: SharedMut::new(&mut *out),
        sw: stash.as_mut().map(|s| SharedMut::new(s.as_mut_slice())),
        prep,
    };
    ctx.runner.for_each(ctx.part.items.len(), &|i| {
        let it = &ctx.part.items[i];
        if ctx.part.seqs[it.seq as usize].prefill {
            C::prefill_item(m, ctx, it, &io)
        } else {
            C::decode_item(m, ctx, it, &io)
        }
    });
    if let Some(p) = io.prep {
        C::release(p);
    }
    let mut stats = vec![OnlineSoftmax::EMPTY; plan.t * h];
    if plan.t == 0 {
        super::pool::give(partials);
        return Ok(ForScores {
            stats,
            stash,
            direct,
        });
    }
    {
        let ow = SharedMut::new(out);
        let stw = SharedMut::new(&mut stats);
        let rows = plan.t * h;
        let per = MERGE_ROWS.max(rows.div_ceil(MERGE_TASKS));
        ctx.runner.for_each(rows.div_ceil(per), &|gi| {
            for row in gi * per..rows.min((gi + 1) * per) {
                let (token, head) = (row / h, row % h);
                let si = ctx.part.seq_of_token[token] as usize;
                let (sp, lay) = (&plan.seqs[si], &ctx.part.seqs[si]);
                // SAFETY: each (token, head) row's statistics and output belong to one task.
                let st = unsafe { &mut stw.part(row, 1)[0] };
                if lay.prefill {
                    // The item wrote the output row; only its statistics are here.
                    let base = lay.part_base + ((token - sp.begin) * h + head) * 2;
                    let (max, sum) = (partials[base], partials[base + 1]);
                    *st = OnlineSoftmax { max, sum };
                    continue;
                }
                let base = lay.part_base + ((token - sp.begin) * h + head) * lay.nchunks * (dv + 2);
                let slots = &partials[base..base + lay.nchunks * (dv + 2)];
                // SAFETY: as above.
                let o = unsafe { ow.part(row * dv, dv) };
                *st = merge(slots, dv, plan.sink(head), o);
            }
        });
    }
    super::pool::give(partials);
    Ok(ForScores {
        stats,
        stash,
        direct,
    })
}

/// The `[max, sum]` of chunk `c`'s slot.
fn slot(slots: &[f32], d: usize, c: usize) -> OnlineSoftmax {
    OnlineSoftmax {
        max: slots[c * (d + 2)],
        sum: slots[c * (d + 2) + 1],
    }
}

/// The number of chunk slots, and the largest chunk max (a merge raises its running max to it
/// first).
fn slots_max(slots: &[f32], d: usize) -> (usize, f32) {
    let nc = slots.len() / (d + 2);
    let mx = (0..nc)
        .map(|c| slot(slots, d, c).max)
        .fold(f32::NEG_INFINITY, f32::max);
    (nc, mx)
}

/// Merges the `[max, sum, acc]` slots of one row's key chunks into its output: the running
/// max is raised to the largest chunk max first, so every chunk's accumulator is scaled once.
/// Columns go 256 at a time through a stack accumulator. The row ends with its `sink`.
pub(super) fn merge<Q: Float>(
    slots: &[f32],
    d: usize,
    sink: Option<f32>,
    orow: &mut [Q],
) -> OnlineSoftmax {
    let (nc, mx) = slots_max(slots, d);
    let mut st = OnlineSoftmax::EMPTY;
    let mut acc = [0f32; 256];
    for x0 in (0..d).step_by(256) {
        let w = (d - x0).min(256);
        acc[..w].fill(0.0);
        st = OnlineSoftmax::EMPTY;
        st.update(mx);
        for c in 0..nc {
            let Some((rescale, f)) = st.merge(slot(slots, d, c)) else {
                continue;
            };
            let v = &slots[c * (d + 2) + 2 + x0..][..w];
            if rescale != 1.0 {
                acc[..w].iter_mut().for_each(|a| *a *= rescale);
            }
            for (a, v) in acc[..w].iter_mut().zip(v) {
                *a += v * f;
            }
        }
        let norm = st.finish(sink);
        for (x, a) in orow[x0..x0 + w].iter_mut().zip(&acc[..w]) {
            *x = Q::from_f32(a * norm);
        }
    }
    st
}
