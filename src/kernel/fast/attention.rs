//! Step 3: runs the work items of a [`Partition`] and merges their partial softmaxes.
//!
//! One item = the rows of one query tile (tokens x the G query heads of one KV head) over one
//! key range. Keys are visited a tile at a time, a tile being the keys of one cache block
//! (contiguous `[n, D]` rows), so each block is read once for all rows of the item. Per row:
//! online softmax (running max `m`, sum `l`, accumulator `acc`). An item writes `[m, l, acc]`
//! per row into its own slot; the merge combines the slots of each row in chunk order.

use super::micro::{Micro, TileMicro};
use super::partition::{Item, Partition};
use super::shared::SharedMut;
use crate::dtype::{ElemType, Float};
use crate::kernel::reference::{cache_row, window_start, SoftmaxStats};
use crate::op::{Plan, SeqPlan};
use rayon::prelude::*;
use std::cell::RefCell;

/// What every item reads.
pub(crate) struct Ctx<'a, Q, C> {
    pub plan: &'a Plan,
    pub part: &'a Partition,
    pub query: &'a [Q],
    pub kc: &'a [C],
    pub vc: &'a [C],
    pub block_indices: &'a [i32],
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

/// Keys per step of a tile's QK (a multiple of the AVX2 kernel's 3 keys) and PV.
const QK_STEP: usize = 6;
const PV_STEP: usize = 8;

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

/// Runs every item, then merges. Returns each (token, head)'s softmax statistics and, when
/// the partition asks for it, the stashed logits of the score rows.
pub(crate) fn attention<M: TileMicro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    out: &mut [Q],
) -> (Vec<SoftmaxStats>, Option<Vec<f32>>) {
    let plan = ctx.plan;
    let (h, d) = (plan.h, plan.d);
    let mut partials = vec![0f32; ctx.part.part_len];
    let mut stash = ctx.part.stash_len.map(|n| vec![0f32; n]);
    {
        let pw = SharedMut::new(&mut partials);
        let ow = SharedMut::new(&mut *out);
        let sw = stash.as_mut().map(|s| SharedMut::new(s.as_mut_slice()));
        let wide = super::prefill::prewiden(m, ctx);
        ctx.part.items.par_iter().with_max_len(1).for_each(|it| {
            if ctx.part.seqs[it.seq as usize].prefill {
                super::prefill::run_item(m, ctx, it, &pw, &ow, sw.as_ref(), wide.as_ref())
            } else {
                SCRATCH.with(|s| run_item(m, ctx, it, &pw, sw.as_ref(), &mut s.borrow_mut()))
            }
        });
    }
    let mut stats = vec![SoftmaxStats::default(); plan.t * h];
    if plan.t == 0 {
        return (stats, stash);
    }
    out.par_chunks_mut(h * d)
        .zip(stats.par_chunks_mut(h))
        .enumerate()
        .for_each(|(token, (o, st))| {
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
                return;
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
        });
    (stats, stash)
}

fn run_item<M: Micro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    it: &Item,
    pw: &SharedMut<'_, f32>,
    sw: Option<&SharedMut<'_, f32>>,
    sc: &mut Scratch,
) {
    let plan = ctx.plan;
    let (h, d, g, bs) = (plan.h, plan.d, plan.g, plan.bs);
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
    let pos_max = pos0 + nt - 1;
    let lo = k0.max(window_start(plan, pos0));
    let hi = k1.min(pos_max + 1);
    sc.ensure(all_rows, d, bs);
    let Scratch {
        q: qbuf,
        acc: accbuf,
        s,
        kf,
        m: mbuf,
        l: lbuf,
    } = sc;
    for kvh in kvh0..kvh1 {
        let r0 = (kvh - kvh0) * rows;
        load_q(plan, ctx.query, sp, kvh, t0, nt, &mut qbuf[r0 * d..]);
    }
    accbuf[..all_rows * d].fill(0.0);
    mbuf[..all_rows].fill(f32::NEG_INFINITY);
    lbuf[..all_rows].fill(0.0);
    // Widen f16/bf16 tiles once when many rows reuse them; few rows widen as they load.
    let widen = C::TYPE != ElemType::F32 && rows > 8;
    // Score rows of this item: tokens at or after `first_score` (in-sequence index).
    let first_score = sp.n - sp.score_tokens;
    let tile_at = |j0: usize, j1: usize, kvh: usize| {
        let phys = ctx.block_indices[sp.block_begin + j0 / bs] as usize;
        let off = cache_row(plan, phys, kvh, j0 % bs);
        (
            &ctx.kc[off..off + (j1 - j0) * d],
            &ctx.vc[off..off + (j1 - j0) * d],
        )
    };
    // Cache blocks are scattered, so the hardware prefetcher cannot guess the next one: the
    // next (tile, KV head) lines are requested a slice at a time between the steps of this one,
    // which keeps a steady number of loads in flight (one burst per tile would stall the core).
    let steps =
        || tiles(lo, hi, bs).flat_map(|(j0, j1)| (kvh0..kvh1).map(move |kvh| (j0, j1, kvh)));
    let mut pf = steps();
    pf.next();
    for (j0, j1, kvh) in steps() {
        let n = j1 - j0;
        let r0 = (kvh - kvh0) * rows;
        let q = &qbuf[r0 * d..(r0 + rows) * d];
        let acc = &mut accbuf[r0 * d..(r0 + rows) * d];
        let mrow = &mut mbuf[r0..r0 + rows];
        let lrow = &mut lbuf[r0..r0 + rows];
        let (kt, vt) = tile_at(j0, j1, kvh);
        let (kn, vn) = pf
            .next()
            .map_or((&[][..], &[][..]), |(a, b, hn)| tile_at(a, b, hn));
        let st = &mut s[..rows * n];
        let (kq, vq) = if widen {
            m.widen(kt, &mut kf[..n * d]);
            (None, None)
        } else {
            (Some(kt), Some(vt))
        };
        let nsteps = n.div_ceil(QK_STEP);
        for (i, a) in (0..n).step_by(QK_STEP).enumerate() {
            let b = (a + QK_STEP).min(n);
            match kq {
                Some(kt) => m.qk(q, rows, &kt[a * d..b * d], b - a, d, &mut st[a..], n),
                None => m.qk(q, rows, &kf[a * d..b * d], b - a, d, &mut st[a..], n),
            }
            prefetch_part(kn, i, nsteps);
        }
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
        for r in 0..rows {
            let row = &mut st[r * n..(r + 1) * n];
            let mt = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if mt == f32::NEG_INFINITY {
                row.fill(0.0);
                continue;
            }
            let mo = mrow[r];
            if mt > mo {
                if mo != f32::NEG_INFINITY {
                    let c = (mo - mt).exp();
                    lrow[r] *= c;
                    m.scale(&mut acc[r * d..(r + 1) * d], c);
                }
                mrow[r] = mt;
            }
            lrow[r] += m.exp_sub_sum(row, mrow[r]);
        }
        if widen {
            m.widen(vt, &mut kf[..n * d]);
        }
        let nsteps = n.div_ceil(PV_STEP);
        for (i, a) in (0..n).step_by(PV_STEP).enumerate() {
            let b = (a + PV_STEP).min(n);
            match vq {
                Some(vt) => m.pv(&st[a..], n, rows, &vt[a * d..b * d], b - a, d, acc),
                None => m.pv(&st[a..], n, rows, &kf[a * d..b * d], b - a, d, acc),
            }
            prefetch_part(vn, i, nsteps);
        }
    }
    for kvh in kvh0..kvh1 {
        for r in 0..rows {
            let (ti, gi) = (r / g, r % g);
            let ri = (kvh - kvh0) * rows + r;
            let base = lay.part_base
                + ((t0 + ti) * h + kvh * g + gi) * lay.nchunks * (d + 2)
                + chunk * (d + 2);
            // SAFETY: slot (row, chunk) is written by this item only (one item per KV head,
            // query tile and chunk).
            let slot = unsafe { pw.part(base, d + 2) };
            slot[0] = mbuf[ri];
            slot[1] = lbuf[ri];
            slot[2..].copy_from_slice(&accbuf[ri * d..(ri + 1) * d]);
        }
    }
}
