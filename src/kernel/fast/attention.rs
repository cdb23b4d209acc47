//! Step 3: runs the work items of a [`Partition`] and merges their partial softmaxes.
//!
//! One item = the rows of one query tile (tokens x the G query heads of one KV head) over one
//! key range. Keys are visited a tile at a time, a tile being the keys of one cache block
//! (contiguous `[n, D]` rows), so each block is read once for all rows of the item. Per row:
//! online softmax (running max `m`, sum `l`, accumulator `acc`). An item writes `[m, l, acc]`
//! per row into its own slot; the merge combines the slots of each row in chunk order.

use super::micro::{Amx, TileMicro};
use super::partition::Partition;
use super::shared::SharedMut;
use crate::dtype::Float;
use crate::kernel::reference::{window_start, SoftmaxStats};
use crate::op::{Plan, SeqPlan};
use std::cell::RefCell;

/// What every item reads.
pub(crate) struct Ctx<'a, Q, C> {
    pub plan: &'a Plan,
    pub part: &'a Partition,
    pub query: &'a [Q],
    pub kc: &'a [C],
    pub vc: &'a [C],
    pub block_indices: &'a [i32],
    /// Where the parallel regions run.
    pub runner: crate::threads::Runner,
    /// Set when prefill items run their products on AMX tiles (bf16 query only).
    pub amx: Option<Amx>,
}

/// Per-thread buffers, grown on demand and reused across items (no allocation per tile).
#[derive(Default)]
pub(crate) struct Scratch {
    pub q: Vec<f32>,
    pub acc: Vec<f32>,
    pub s: Vec<f32>,
    pub kf: Vec<f32>,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
}

impl Scratch {
    pub fn ensure(&mut self, rows: usize, d: usize, bs: usize) {
        let grow = |v: &mut Vec<f32>, n: usize| {
            if v.len() < n {
                v.resize(n, 0.0);
            }
        };
        grow(&mut self.q, rows * d);
        grow(&mut self.acc, rows * d);
        grow(&mut self.s, rows * bs);
        grow(&mut self.kf, bs * d);
        grow(&mut self.m, rows);
        grow(&mut self.l, rows);
    }
}

thread_local! {
    pub(crate) static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Key tiles `[j0, j1)` of `[lo, hi)`, cut at block boundaries.
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

/// Fills `q[..nt*G*D]` with the scaled f32 query rows of tokens `t0..t0+nt` of `sp`, heads of
/// KV head `kvh` (row `ti*G + g`).
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
            *o = v.to_f32() * plan.scale;
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
    let full = j0 + n - 1 <= pos0 && j0 >= window_start(plan, pos_max);
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
                *v += sl * (j as f32 - pos as f32);
            }
        }
    }
}

/// Asks the CPU to start loading the cache lines of part `i` of `parts` equal parts of `x`
/// (a hint; no effect on results).
#[inline]
pub(crate) fn prefetch_part<T>(x: &[T], i: usize, parts: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(x);
        let lines = bytes.div_ceil(64);
        let (l0, l1) = (lines * i / parts, lines * (i + 1) / parts);
        let p = x.as_ptr() as *const i8;
        for l in l0..l1 {
            // SAFETY: prefetch never faults, and line l < lines starts inside `x`; SSE is part
            // of the x86_64 baseline.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(l * 64)) };
        }
    }
}

/// Tokens per merge task (the merge of one token is a few microseconds).
const MERGE_TOKENS: usize = 8;

/// Runs every item, then merges. Returns each (token, head)'s softmax statistics and, when
/// the partition asks for it, the stashed logits of the score rows.
pub(crate) fn attention<M: TileMicro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    out: &mut [Q],
) -> (Vec<SoftmaxStats>, Option<Vec<f32>>) {
    let plan = ctx.plan;
    let (h, d) = (plan.h, plan.d);
    // Every slot and every stash entry a later step reads is written by an item first.
    let mut partials = super::pool::take(ctx.part.part_len);
    let mut stash = ctx.part.stash_len.map(super::pool::take);
    {
        let pw = SharedMut::new(&mut partials);
        let ow = SharedMut::new(&mut *out);
        let sw = stash.as_mut().map(|s| SharedMut::new(s.as_mut_slice()));
        let wide = super::prefill::prepare(m, ctx);
        ctx.runner.for_each(ctx.part.items.len(), &|i| {
            let it = &ctx.part.items[i];
            if ctx.part.seqs[it.seq as usize].prefill {
                super::prefill::run_item(m, ctx, it, &pw, &ow, sw.as_ref(), wide.as_ref())
            } else {
                SCRATCH.with(|s| {
                    super::decode::run_decode_item(
                        m,
                        ctx,
                        it,
                        &pw,
                        sw.as_ref(),
                        &mut s.borrow_mut(),
                    )
                })
            }
        });
    }
    let mut stats = vec![SoftmaxStats::default(); plan.t * h];
    if plan.t == 0 {
        super::pool::give(partials);
        return (stats, stash);
    }
    {
        let ow = SharedMut::new(out);
        let stw = SharedMut::new(&mut stats);
        let groups = plan.t.div_ceil(MERGE_TOKENS);
        ctx.runner.for_each(groups, &|gi| {
            for token in gi * MERGE_TOKENS..plan.t.min((gi + 1) * MERGE_TOKENS) {
                // SAFETY: each token's output row and statistics belong to one group only.
                let (o, st) = unsafe { (ow.part(token * h * d, h * d), stw.part(token * h, h)) };
                let si = ctx.part.seq_of_token[token] as usize;
                let (sp, lay) = (&plan.seqs[si], &ctx.part.seqs[si]);
                let nc = lay.nchunks;
                if lay.prefill {
                    // The item wrote the output row; only its statistics are here.
                    let base = lay.part_base + (token - sp.begin) * h * 2;
                    for (head, s) in st.iter_mut().enumerate() {
                        let (max, sum) = (partials[base + 2 * head], partials[base + 2 * head + 1]);
                        *s = SoftmaxStats { max, sum };
                    }
                    continue;
                }
                for head in 0..h {
                    let base = lay.part_base + ((token - sp.begin) * h + head) * nc * (d + 2);
                    let slots = &partials[base..base + nc * (d + 2)];
                    let mx = (0..nc)
                        .map(|c| slots[c * (d + 2)])
                        .fold(f32::NEG_INFINITY, f32::max);
                    let orow = &mut o[head * d..(head + 1) * d];
                    if nc == 1 {
                        let l = slots[1];
                        for (x, a) in orow.iter_mut().zip(&slots[2..]) {
                            *x = Q::from_f32(a / l);
                        }
                        st[head] = SoftmaxStats { max: mx, sum: l };
                        continue;
                    }
                    let mut l = 0f32;
                    let mut acc = [0f32; 256];
                    for x0 in (0..d).step_by(256) {
                        let w = (d - x0).min(256);
                        acc[..w].fill(0.0);
                        l = 0.0;
                        for c in 0..nc {
                            let slot = &slots[c * (d + 2)..(c + 1) * (d + 2)];
                            if slot[1] == 0.0 {
                                continue;
                            }
                            let f = (slot[0] - mx).exp();
                            l += slot[1] * f;
                            for (a, v) in acc[..w].iter_mut().zip(&slot[2 + x0..2 + x0 + w]) {
                                *a += v * f;
                            }
                        }
                        for (x, a) in orow[x0..x0 + w].iter_mut().zip(&acc[..w]) {
                            *x = Q::from_f32(a / l);
                        }
                    }
                    st[head] = SoftmaxStats { max: mx, sum: l };
                }
            }
        });
    }
    super::pool::give(partials);
    (stats, stash)
}
