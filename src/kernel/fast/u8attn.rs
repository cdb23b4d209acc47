//! Steps 1-4 over u8 caches in OpenVINO's layout: rotation and insertion quantize with
//! `kernel::quant` (the byte-checked code, one task per KV head), then attention and scores read
//! the cache bytes, never widening a cache.
//!
//! Work items are (sequence, KV heads, query tokens); results do not depend on the thread count:
//! - decode-like sequences (at most [`PREFILL_MIN_ROWS`] rows of tokens x the G query heads of
//!   the KV head) get one item per run of KV heads (all of them, unless that leaves threads
//!   idle) and key chunk (one, unless sequences x KV heads are fewer than [`MIN_DECODE_ITEMS`]
//!   and the context is long: see [`Cut`]), which walks its visible key blocks once per tile
//!   of up to [`ROWS`] rows per head,
//!   (block, KV head) in storage order, in online-softmax steps of about [`STEP_KEYS`] keys,
//!   reading each key and value byte once for all G heads through the [`U8Micro`] loops
//!   (dequantized in registers). Per block and head:
//!   - keys by channel: `k = (q8 - zp[c]) * scale[c]` per channel, so `q . k = sum_c (q_c
//!     scale_c) q8_c - sum_c q_c scale_c zp_c`: the query rows are multiplied by the block's
//!     scales once and the second sum is one constant per row and block ([`U8Micro::fold`]);
//!   - keys by token: per group, `scale_g * sum_c q_c (q8_c - zp_g)`;
//!   - values (by token): `acc += (p * scale_g) * q8` per group, the accumulators held in
//!     registers across a block's keys, and `sum p * scale_g * zp_g` kept per (row, group)
//!     beside them (rescaled with them) and taken off once at the end.
//! - longer sequences get items of about [`PREFILL_ROWS`] rows, which run the f32 prefill
//!   loops (`TileMicro`) on their sequence's rows dequantized once per call (as f16/bf16 rows
//!   are widened, within the same memory bound), else on one key block and one value block at
//!   a time dequantized into f32 tiles; both as `kernel::quant` dequantizes, so the values are
//!   the reference's.
//!
//! The softmax step is `kernel::softmax::OnlineSoftmax`'s; masks, windows and ALiBi are the
//! reference's (`kernel::layout`). Scores: an item keeps its score rows' values (the last
//! `score_tokens` tokens) and, once their softmax states are final, adds their weights into its
//! own partial scores; a sequence's partials are summed in item order, so results do not depend
//! on the thread count and no logit is computed twice. Decode items keep the step weights the
//! values were weighted with and each step's running max (`OnlineSoftmax::factor`: no second
//! `exp`); prefill items keep the logits.

use super::attention;
use super::micro::{Micro, TileMicro, U8Micro};
use super::pool::Buf;
use super::prefill::{
    self, aligned, attend, prefetch_out, ItemBufs, KvRows, RowState, TileSource, Widened,
};
use super::shared::SharedMut;
use super::tile::{grow, share};
use crate::alloc::try_vec;
use crate::dtype::Float;
use crate::error::{PaError, Result};
use crate::kernel::bind::Bound;
use crate::kernel::layout::{block_of, tiles, visible, visible_span, window_start};
use crate::kernel::quant::{
    self, read_f32, CacheRows, InsertScratch, KeyQuant, U8Layout, PARAM_BYTES,
};
use crate::kernel::softmax::{Lanes, OnlineSoftmax};
use crate::op::{Plan, SeqPlan};
use crate::threads::Runner;
use std::cell::RefCell;

/// Query rows per tile.
const ROWS: usize = 8;

/// One query row of a tile: a token of the sequence and one query head of the KV head's group.
#[derive(Clone, Copy)]
struct RowRef {
    token: usize,
    pos: usize,
    head: usize,
    /// Whether the row contributes to the scores.
    scored: bool,
}

/// A decode item's scratch (one per thread, reused across items and calls).
#[derive(Default)]
struct Scratch {
    qs: Vec<f32>,
    cst: Vec<f32>,
    /// Value weights `[rows, keys]` of a block, times the group's scale.
    w: Vec<f32>,
    /// Value scales and zero points of a block's keys (one group).
    vscale: Vec<f32>,
    vzp: Vec<f32>,
    /// `bs` zeros: the zero points `qk` and `pv` get once the driver folded them.
    zeros: Vec<f32>,
    /// Per-group logits `[rows, keys]` of by-token keys.
    t2: Vec<f32>,
    /// Zero points and scales of a block's keys (by token; zero points 0 by channel).
    kzp: Vec<f32>,
    kscale: Vec<f32>,
    sc: Vec<f32>,
    zp: Vec<f32>,
}

impl Scratch {
    /// Grows the buffers to the plan's sizes (`zeros` stays all zero).
    fn fit(&mut self, plan: &Plan) {
        let (d, bs) = (plan.d, plan.bs);
        for (v, len) in [
            (&mut self.qs, ROWS * d),
            (&mut self.cst, ROWS),
            (&mut self.w, ROWS * bs),
            (&mut self.vscale, bs),
            (&mut self.vzp, bs),
            (&mut self.zeros, bs),
            (&mut self.t2, ROWS * bs),
            (&mut self.kzp, bs),
            (&mut self.kscale, bs),
            (&mut self.sc, d),
            (&mut self.zp, d),
        ] {
            grow(v, len);
        }
    }
}

/// The D scales and D zero points at the head of a by-channel key slab: read in place when the
/// slab is 4-byte aligned (as the caches of OpenVINO and of most hosts are) on a little-endian
/// CPU, else copied into `sc` and `zp`.
fn key_params<'a>(
    slab: &'a [u8],
    d: usize,
    (sc, zp): (&'a mut [f32], &'a mut [f32]),
) -> (&'a [f32], &'a [f32]) {
    let head = &slab[..PARAM_BYTES * d];
    #[cfg(target_endian = "little")]
    {
        // SAFETY: every bit pattern is a valid f32, and `align_to` hands out only the aligned
        // middle of `head` as floats.
        let (pre, mid, _) = unsafe { head.align_to::<f32>() };
        if pre.is_empty() && mid.len() == 2 * d {
            return mid.split_at(d);
        }
    }
    let (s, z) = head.split_at(4 * d);
    let f = |b: &[u8]| f32::from_le_bytes(b.try_into().expect("4 bytes"));
    for ((o, b), (p, c)) in sc[..d]
        .iter_mut()
        .zip(s.chunks_exact(4))
        .zip(zp[..d].iter_mut().zip(z.chunks_exact(4)))
    {
        (*o, *p) = (f(b), f(c));
    }
    (&sc[..d], &zp[..d])
}

/// The rows of sequence `sp`, KV head `kvh`, for tokens `i0..i1` (in token, then head order).
fn rows_of(plan: &Plan, sp: &SeqPlan, kvh: usize, i0: usize, i1: usize) -> Vec<RowRef> {
    (i0..i1)
        .flat_map(|i| {
            (0..plan.g).map(move |g| RowRef {
                token: sp.begin + i,
                pos: sp.past + i,
                head: kvh * plan.g + g,
                scored: i >= sp.n - sp.score_tokens,
            })
        })
        .collect()
}

/// One KV head's part of a decode tile: its rows and their state across the key blocks.
struct HeadState {
    rows: Vec<RowRef>,
    /// The rows' queries, scaled by the softmax scale.
    q: Vec<f32>,
    /// The rows' logits, then weights, over a step's keys (`[ROWS][step_span]`).
    s: Vec<f32>,
    acc: Vec<f32>,
    st: [OnlineSoftmax; ROWS],
    /// Per (row, value group): the value zero points' share of the accumulators, rescaled with
    /// them and taken off the group's columns once, at the end.
    zsum: Vec<f32>,
    /// Weights `exp(s - step.sub)` of the score rows over the tile's key range, as the steps
    /// computed them for the values ...
    kept: Vec<f32>,
    /// ... and each row's running max after each block ([`OnlineSoftmax::factor`]).
    kmax: Vec<f32>,
}

impl HeadState {
    fn new() -> HeadState {
        HeadState {
            rows: Vec::new(),
            q: Vec::new(),
            s: Vec::new(),
            acc: Vec::new(),
            st: [OnlineSoftmax::EMPTY; ROWS],
            zsum: Vec::new(),
            kept: Vec::new(),
            kmax: Vec::new(),
        }
    }
}

/// Per-thread buffers of decode items: the scratch and one [`HeadState`] per KV head of an
/// item, grown on demand.
#[derive(Default)]
struct DecodeScratch {
    sc: Scratch,
    heads: Vec<HeadState>,
    /// u4 caches: the item's blocks unpacked to u8.
    u4: super::u4::ItemBlocks,
}

impl DecodeScratch {
    /// The scratch and `nkvh` head states, grown to the plan's sizes.
    fn fit(&mut self, plan: &Plan, nkvh: usize) -> (&mut Scratch, &mut [HeadState]) {
        self.sc.fit(plan);
        if self.heads.len() < nkvh {
            self.heads.resize_with(nkvh, HeadState::new);
        }
        let heads = &mut self.heads[..nkvh];
        for h in heads.iter_mut() {
            grow(&mut h.q, ROWS * plan.d);
            grow(&mut h.s, ROWS * step_span(plan.bs));
            grow(&mut h.acc, ROWS * plan.d);
        }
        (&mut self.sc, heads)
    }
}

/// Loads the tile's query rows into `q`, widened to f32. The softmax scale is applied to the
/// products (`scale * <q, k>`, as the contract computes a logit): a query scaled first can
/// overflow where the logit does not.
fn load_queries<Q: Float>(plan: &Plan, query: &[Q], rows: &[RowRef], q: &mut [f32]) {
    let (d, h) = (plan.d, plan.h);
    for (r, row) in rows.iter().enumerate() {
        let src = &query[(row.token * h + row.head) * d..][..d];
        for (o, x) in q[r * d..][..d].iter_mut().zip(src) {
            *o = x.to_f32();
        }
    }
}

/// Logits `s[r * lds + t]` of the tile's rows against keys `j0..j1` (one block, from its slot
/// `slot0`): `scale * <q, k>` capped at the f32 range, masked keys `-inf`, ALiBi added (and
/// capped again), as every other path makes a logit. The key products request the lines of `ahead`
/// (the next read's bytes) as they go (by-token keys: a share per group).
#[allow(clippy::too_many_arguments)]
fn block_logits<M: U8Micro + Micro>(
    m: M,
    plan: &Plan,
    l: &U8Layout,
    kc: &[u8],
    (block, slot0): (usize, usize),
    kvh: usize,
    (j0, j1): (usize, usize),
    (rows, q): (&[RowRef], &[f32]),
    sc: &mut Scratch,
    (s, lds): (&mut [f32], usize),
    ahead: &[u8],
) {
    let (d, bs, nr) = (plan.d, plan.bs, rows.len());
    let slab = key_slab(plan, l, kc, (block, kvh));
    let slab_len = slab.len();
    let n = j1 - j0;
    match l.key {
        KeyQuant::ByChannel => {
            // The query times the block's scales, and the zero points' share of each row's
            // logits.
            let (sc_, zp) = key_params(slab, d, (&mut sc.sc, &mut sc.zp));
            m.fold(q, d, nr, sc_, zp, &mut sc.qs, d, &mut sc.cst);
            let data = &slab[PARAM_BYTES * d + slot0 * d..];
            let kzp = &sc.zeros[..n];
            U8Micro::qk(m, &sc.qs, d, nr, data, d, kzp, d, s, lds, ahead);
            for (r, &c) in sc.cst[..nr].iter().enumerate() {
                for x in &mut s[r * lds..][..n] {
                    *x -= c;
                }
            }
        }
        KeyQuant::ByToken { group } => {
            let g = if group == 0 { d } else { group };
            let kr = slab_len / bs;
            let rows_bytes = &slab[slot0 * kr..];
            for r in 0..nr {
                s[r * lds..][..n].fill(0.0);
            }
            let ngroups = d / g;
            for gi in 0..ngroups {
                let g0 = gi * (g + PARAM_BYTES);
                for t in 0..n {
                    sc.kscale[t] = read_f32(&rows_bytes[t * kr + g0..], 0);
                    sc.kzp[t] = read_f32(&rows_bytes[t * kr + g0..], 1);
                }
                let k = &rows_bytes[g0 + PARAM_BYTES..];
                U8Micro::qk(
                    m,
                    &q[gi * g..],
                    d,
                    nr,
                    k,
                    kr,
                    &sc.kzp[..n],
                    g,
                    &mut sc.t2,
                    bs,
                    share(ahead, (gi, ngroups)),
                );
                for r in 0..nr {
                    for t in 0..n {
                        s[r * lds + t] += sc.kscale[t] * sc.t2[r * bs + t];
                    }
                }
            }
        }
    }
    for (r, row) in rows.iter().enumerate() {
        let s = &mut s[r * lds..][..n];
        for x in s.iter_mut() {
            *x = (plan.scale * *x).cap();
        }
        if plan.alibi.is_none() && visible(plan, row.pos, j0) && visible(plan, row.pos, j1 - 1) {
            continue; // the visible keys of a row are one range
        }
        for (t, x) in s.iter_mut().enumerate() {
            let j = j0 + t;
            if !visible(plan, row.pos, j) {
                *x = f32::NEG_INFINITY;
            } else if let Some(al) = &plan.alibi {
                *x = (*x + al[row.head] * (j as f32 - row.pos as f32)).cap();
            }
        }
    }
}

/// Key positions `[lo, hi)` some row of the tile sees.
fn key_range(plan: &Plan, rows: &[RowRef]) -> (usize, usize) {
    let lo = rows
        .iter()
        .map(|r| window_start(plan, r.pos))
        .min()
        .unwrap_or(0);
    let hi = rows.iter().map(|r| r.pos + 1).max().unwrap_or(0);
    (lo, hi)
}

/// Keys per online-softmax step of decode tiles (whole blocks; at least one).
const STEP_KEYS: usize = 128;

/// The keys of a decode step: whole blocks, about [`STEP_KEYS`].
fn step_span(bs: usize) -> usize {
    (STEP_KEYS / bs).max(1) * bs
}

/// Attention of one tile of rows over a run of KV heads `kvh0..` (one [`HeadState`] each, the
/// same tokens of one sequence): writes their outputs and adds the score rows' weights into
/// `parts` (`ctx` per head, when the tile has score rows).
///
/// The keys go in steps of whole blocks, about [`STEP_KEYS`] (the online softmax's step):
/// the logits of the step's blocks, block by block and within a block KV head by KV head
/// (the cache's storage order, so the hardware prefetcher streams a block's heads), then each
/// head's softmax step over all of them, then the values in the same order. Steps of one
/// block (32 keys) spent about a third of the hot loop on what is done once per step (the
/// softmax bookkeeping, the exponentials' and sums' calls, the product calls around them);
/// steps of 128 keys took 17% fewer instructions (callgrind, hot decode probe, AMD EPYC
/// avx2). Blocks themselves are scattered, so each product call also requests the next
/// read's bytes (the next key slab or value rows) a few lines before each of its tiles
/// (`U8Micro::qk`/`pv`'s `pf`). Each head's arithmetic is the same whatever run it is part
/// of, so results do not depend on how heads are grouped.
#[allow(clippy::too_many_arguments)]
fn attend_tile<M: U8Micro + Micro, Q: Float>(
    m: M,
    plan: &Plan,
    l: &U8Layout,
    b: &Inputs<'_, Q>,
    sp: &SeqPlan,
    kvh0: usize,
    heads: &mut [HeadState],
    sc: &mut Scratch,
    (k0, k1): (usize, usize),
    mut sink: Sink<'_, '_, Q>,
) {
    let (d, bs) = (plan.d, plan.bs);
    let span = step_span(bs);
    let vg = if l.value_group == 0 { d } else { l.value_group };
    let ngroups = d / vg;
    let vrow = l.value_row();
    // The rows' keys within the item's chunk (none: the chunk's slots say so).
    let (lo, hi) = key_range(plan, &heads[0].rows);
    let lo = lo.max(k0);
    let hi = hi.min(k1).max(lo);
    let nsteps = tiles(lo, hi, span).count();
    for h in heads.iter_mut() {
        let nr = h.rows.len();
        load_queries(plan, b.query, &h.rows, &mut h.q);
        h.acc[..nr * d].fill(0.0);
        h.st = [OnlineSoftmax::EMPTY; ROWS];
        h.zsum.clear();
        h.zsum.resize(nr * ngroups, 0.0);
        if h.rows.iter().any(|r| r.scored) {
            // Every weight a score row reads is written by the steps first: no zeroing.
            grow(&mut h.kept, nr * (hi - lo));
            h.kmax.clear();
            h.kmax.resize(nr * nsteps, f32::NEG_INFINITY);
        }
    }
    let nh = heads.len();
    let block = |j0: usize| block_of(b.block_indices, sp.block_begin, bs, j0);
    // Every read of the tile in order (per step: the key slabs of its (block, head)s, then
    // their value rows), as the bytes the read before it requests.
    let reads = tiles(lo, hi, span).flat_map(move |(s0, s1)| {
        let at =
            move |v: bool| tiles(s0, s1, bs).flat_map(move |t| (0..nh).map(move |i| (v, t, i)));
        at(false).chain(at(true))
    });
    let mut ahead = reads.skip(1).map(|(v, (j0, j1), i)| {
        let at = (block(j0), kvh0 + i);
        if v {
            value_rows(plan, l, b.vc, at, j0, j1)
        } else {
            key_slab(plan, l, b.kc, at)
        }
    });
    for (step, (s0, s1)) in tiles(lo, hi, span).enumerate() {
        let n = s1 - s0;
        for (j0, j1) in tiles(s0, s1, bs) {
            let (blk, slot0) = (block(j0), j0 % bs);
            for (i, h) in heads.iter_mut().enumerate() {
                let next = ahead.next().unwrap_or(&[]);
                let (rows, q) = (&h.rows[..], &h.q[..]);
                let s = (&mut h.s[j0 - s0..], span);
                let (keys, kvh) = ((blk, slot0), kvh0 + i);
                block_logits(
                    m,
                    plan,
                    l,
                    b.kc,
                    keys,
                    kvh,
                    (j0, j1),
                    (rows, q),
                    sc,
                    s,
                    next,
                );
            }
        }
        for h in heads.iter_mut() {
            let nr = h.rows.len();
            let (mut subs, mut sums) = ([0f32; ROWS], [0f32; ROWS]);
            for (r, st) in h.st.iter_mut().enumerate().take(nr) {
                let s = &h.s[r * span..][..n];
                let step_ = st.update(U8Micro::max(m, s));
                if h.rows[r].scored {
                    h.kmax[r * nsteps + step] = st.max;
                }
                if step_.rescale != 1.0 {
                    m.scale(&mut h.acc[r * d..][..d], step_.rescale);
                    m.scale(&mut h.zsum[r * ngroups..][..ngroups], step_.rescale);
                }
                subs[r] = step_.sub;
            }
            // The rows' weights in one call (their exp chains overlap).
            m.exp_sum(&mut h.s, span, n, &subs[..nr], &mut sums[..nr]);
            for (r, (st, &sum)) in h.st.iter_mut().zip(&sums[..nr]).enumerate() {
                st.add(sum);
                if h.rows[r].scored {
                    let w = &h.s[r * span..][..n];
                    h.kept[r * (hi - lo) + s0 - lo..][..n].copy_from_slice(w);
                }
            }
        }
        // The value products, block by block and group by group, requesting the next read's
        // bytes as they go.
        for (j0, j1) in tiles(s0, s1, bs) {
            let blk = block(j0);
            let nb = j1 - j0;
            for (i, h) in heads.iter_mut().enumerate() {
                let next = ahead.next().unwrap_or(&[]);
                let vrows = value_rows(plan, l, b.vc, (blk, kvh0 + i), j0, j1);
                let nr = h.rows.len();
                for gi in 0..ngroups {
                    let g0 = gi * (vg + PARAM_BYTES);
                    for ((row, s), z) in vrows
                        .chunks_exact(vrow)
                        .zip(&mut sc.vscale[..nb])
                        .zip(&mut sc.vzp[..nb])
                    {
                        (*s, *z) = (read_f32(&row[g0..], 0), read_f32(&row[g0..], 1));
                    }
                    // Weights times the tokens' scales; the zero points' share of each row,
                    // taken off the group's columns once rather than off every value.
                    let (vs, vz) = (&sc.vscale[..nb], &sc.vzp[..nb]);
                    let w = &h.s[j0 - s0..];
                    m.fold(w, span, nr, vs, vz, &mut sc.w, nb, &mut sc.cst);
                    let (v, acc) = (&vrows[g0 + PARAM_BYTES..], &mut h.acc[gi * vg..]);
                    let (w, pf) = (&sc.w[..nr * nb], share(next, (gi, ngroups)));
                    m.pv(acc, d, nr, w, v, vrow, &sc.zeros[..nb], vg, pf);
                    for (r, &c) in sc.cst[..nr].iter().enumerate() {
                        h.zsum[r * ngroups + gi] += c;
                    }
                }
            }
        }
    }
    let ctx = sp.ctx();
    for (i, h) in heads.iter().enumerate() {
        for (r, row) in h.rows.iter().enumerate() {
            let st = h.st[r];
            let acc = h.acc[r * d..][..d].chunks_exact(vg);
            let zsum = &h.zsum[r * ngroups..][..ngroups];
            // The score rows' step weights and each step's running max.
            let kept = || &h.kept[r * (hi - lo)..][..hi - lo];
            let kmax = || &h.kmax[r * nsteps..][..nsteps];
            match &mut sink {
                Sink::Out { out, parts } => {
                    let at = row.token * plan.h + row.head;
                    // SAFETY: (token, head) pairs are distinct across rows of all items (an
                    // item owns its sequence's tokens and its KV heads' query heads), so these
                    // parts never overlap.
                    let o = unsafe { out.part(at * d, d) };
                    let mut st = st;
                    let norm = st.finish(plan.sink(row.head));
                    for ((o, a), &z) in o.chunks_exact_mut(vg).zip(acc).zip(zsum) {
                        for (o, &a) in o.iter_mut().zip(a) {
                            *o = Q::from_f32((a - z) * norm);
                        }
                    }
                    if row.scored {
                        // Final weight = step weight * factor(step's running max), over the
                        // keys the row sees only (a NaN row must not reach a masked key).
                        let part = &mut parts[i * ctx..][..ctx];
                        for ((j0, j1), &bm) in tiles(lo, hi, span).zip(kmax()) {
                            let (a, b) = visible_span(plan, row.pos, j0, j1);
                            if a < b {
                                let w = &kept()[a - lo..b - lo];
                                m.add_scaled(&mut part[a..b], w, st.factor(bm));
                            }
                        }
                    }
                }
                Sink::Chunk {
                    slots,
                    stash,
                    cut,
                    c,
                } => {
                    let c = *c;
                    let (i0, nt) = (row.token - sp.begin, sp.n);
                    let at = cut.slots + ((i0 * plan.h + row.head) * cut.nchunks + c) * (d + 2);
                    // SAFETY: one slot per (token, head, chunk), written by the one item of
                    // that chunk whose run of KV heads holds the head.
                    let slot = unsafe { slots.part(at, d + 2) };
                    (slot[0], slot[1]) = (st.max, st.sum);
                    for ((o, a), &z) in slot[2..].chunks_exact_mut(vg).zip(acc).zip(zsum) {
                        for (o, &a) in o.iter_mut().zip(a) {
                            *o = a - z;
                        }
                    }
                    if row.scored {
                        // Weights relative to the chunk's own max; the merge scales each chunk.
                        let (c0, c1) = cut.range(c, ctx);
                        let srow = (i0 - (nt - sp.score_tokens)) * plan.h + row.head;
                        // SAFETY: the chunk's keys of one stash row (score token, head),
                        // written by this item only.
                        let dst = unsafe { stash.part(cut.stash + srow * ctx + c0, c1 - c0) };
                        dst.fill(0.0);
                        if st.sum > 0.0 {
                            for ((j0, j1), &bm) in tiles(lo, hi, span).zip(kmax()) {
                                let (a, b) = visible_span(plan, row.pos, j0, j1);
                                if a < b {
                                    let w = &kept()[a - lo..b - lo];
                                    let f = (bm - st.max).exp();
                                    m.add_scaled(&mut dst[a - c0..b - c0], w, f);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Where a decode tile's results go.
enum Sink<'a, 'b, Q> {
    /// The sequence is not cut: the outputs, and the score rows' final weights added into the
    /// item's partial scores (`ctx` per KV head of the run).
    Out {
        out: &'a SharedMut<'b, Q>,
        parts: &'a mut [f32],
    },
    /// Chunk `c` of a cut sequence: see [`Cut`].
    Chunk {
        slots: &'a SharedMut<'b, f32>,
        stash: &'a SharedMut<'b, f32>,
        cut: Cut,
        c: usize,
    },
}

/// Query rows above which a sequence's tiles take the prefill path (per KV head: tokens x G).
const PREFILL_MIN_ROWS: usize = 16;

/// Whether sequence `sp`'s tiles take the prefill path.
fn is_prefill(plan: &Plan, sp: &SeqPlan) -> bool {
    sp.n * plan.g > PREFILL_MIN_ROWS
}

/// Query rows of a prefill item (about, as the f32 prefill tiles: a multiple of G).
const PREFILL_ROWS: usize = 64;

/// Per-thread buffers of prefill items, grown on demand: the float prefill items' buffers,
/// plus the block's key parameters and the score rows' logits.
#[derive(Default)]
struct PrefillScratch {
    tile: prefill::Scratch,
    /// Per-channel key scales and zero points (see `U8Tiles`).
    params: (Vec<f32>, Vec<f32>),
    kept: Vec<f32>,
}

thread_local! {
    static PREFILL_SCRATCH: RefCell<PrefillScratch> = RefCell::new(PrefillScratch::default());
    static DECODE_SCRATCH: RefCell<DecodeScratch> = RefCell::new(DecodeScratch::default());
}

/// Dequantizes the keys of slots `slot0..slot0 + n` of (block, KV head `kvh`) into `out`
/// (`[n][D]`), as `kernel::quant` does (`(q - zp) * scale`, the reference's values exactly).
#[allow(clippy::too_many_arguments)]
fn dequant_keys<M: U8Micro>(
    m: M,
    plan: &Plan,
    l: &U8Layout,
    kc: &[u8],
    block: usize,
    kvh: usize,
    (slot0, n): (usize, usize),
    (sc, zp): (&mut [f32], &mut [f32]),
    out: &mut [f32],
) {
    let d = plan.d;
    let slab = key_slab(plan, l, kc, (block, kvh));
    let slab_len = slab.len();
    match l.key {
        KeyQuant::ByChannel => {
            let (sc, zp) = key_params(slab, d, (sc, zp));
            let data = &slab[PARAM_BYTES * d + slot0 * d..][..n * d];
            for (o, q) in out[..n * d].chunks_exact_mut(d).zip(data.chunks_exact(d)) {
                m.dequant(q, &zp[..d], &sc[..d], o);
            }
        }
        KeyQuant::ByToken { group } => {
            let kr = slab_len / plan.bs;
            dequant_token_rows(m, &slab[slot0 * kr..][..n * kr], kr, d, group, out);
        }
    }
}

/// The key slab (scales and zero points, then the keys) of (block, KV head).
fn key_slab<'k>(plan: &Plan, l: &U8Layout, kc: &'k [u8], (block, kvh): (usize, usize)) -> &'k [u8] {
    let len = l.key_slab();
    &kc[(block * plan.hkv + kvh) * len..][..len]
}

/// The value rows of keys `j0..j1` (inside one block) of (block, KV head).
fn value_rows<'v>(
    plan: &Plan,
    l: &U8Layout,
    vc: &'v [u8],
    (block, kvh): (usize, usize),
    j0: usize,
    j1: usize,
) -> &'v [u8] {
    let vrow = l.value_row();
    let base = ((block * plan.hkv + kvh) * plan.bs + j0 % plan.bs) * vrow;
    &vc[base..base + (j1 - j0) * vrow]
}

/// The K and V rows of the prefill sequences (`prefill(s)`), dequantized once per call into
/// f32 `[Hkv][ctx][D]` (as `fast::prefill` widens f16/bf16 rows): otherwise every query tile
/// of a sequence dequantizes all the keys it sees again (on average half the sequence, 32
/// times over for 1024 tokens). `None` past the same memory bound as widening (`2*T*H*D`
/// floats each), and items then dequantize block by block.
fn dequant_prefill_rows<M: U8Micro, Q>(
    m: M,
    (plan, runner): (&Plan, Runner),
    l: &U8Layout,
    b: &Inputs<'_, Q>,
    prefill: impl Fn(usize) -> bool,
) -> Option<Widened> {
    let (d, bs) = (plan.d, plan.bs);
    Widened::build((plan, runner), prefill, |s, kvh, ka, va| {
        let sp = &plan.seqs[s];
        let (mut sc, mut zp) = (vec![0f32; d], vec![0f32; d]);
        for (j0, j1) in tiles(0, sp.ctx(), bs) {
            let block = block_of(b.block_indices, sp.block_begin, bs, j0);
            let (keys, vals) = (&mut ka[j0 * d..j1 * d], &mut va[j0 * d..j1 * d]);
            let slots = (j0 % bs, j1 - j0);
            dequant_keys(
                m,
                plan,
                l,
                b.kc,
                block,
                kvh,
                slots,
                (&mut sc, &mut zp),
                keys,
            );
            let rows = value_rows(plan, l, b.vc, (block, kvh), j0, j1);
            dequant_token_rows(m, rows, l.value_row(), d, l.value_group, vals);
        }
    })
}

/// Dequantizes `n` by-token rows of `ldr` bytes (groups of `group` channels, 0 = D) into `out`.
fn dequant_token_rows<M: U8Micro>(
    m: M,
    rows: &[u8],
    ldr: usize,
    d: usize,
    group: usize,
    out: &mut [f32],
) {
    let g = if group == 0 { d } else { group };
    for (o, r) in out.chunks_exact_mut(d).zip(rows.chunks_exact(ldr)) {
        for (og, rg) in o.chunks_exact_mut(g).zip(r.chunks_exact(g + PARAM_BYTES)) {
            let (scale, zp) = (read_f32(rg, 0), read_f32(rg, 1));
            m.dequant_uniform(&rg[PARAM_BYTES..], zp, scale, og);
        }
    }
}

/// A u8 cache's tiles for the shared prefill loop (`fast::prefill::attend`): the head's rows
/// the call dequantized once ([`dequant_prefill_rows`]) when there are, else each key or value
/// block dequantized into the loop's f32 staging tile when it is reached; both with the same
/// arithmetic as `kernel::quant` (the reference's values exactly). The hints are the next
/// block's key slab and this block's value rows (none for the contiguous dequantized rows).
struct U8Tiles<'a, 'c, M, Q> {
    m: M,
    plan: &'c Plan,
    l: &'c U8Layout,
    b: &'c Inputs<'a, Q>,
    sp: &'c SeqPlan,
    kvh: usize,
    /// The head's dequantized K and V rows `[ctx][D]`, when the call made them.
    wide: Option<KvRows<'c>>,
    /// Per-channel key scales and zero points of the block being dequantized.
    params: RefCell<(Vec<f32>, Vec<f32>)>,
}

impl<M: U8Micro, Q> U8Tiles<'_, '_, M, Q> {
    fn block(&self, j0: usize) -> usize {
        block_of(self.b.block_indices, self.sp.block_begin, self.plan.bs, j0)
    }

    /// The cache's value rows of keys `j0..j1` (one block) of this head.
    fn value_bytes(&self, j0: usize, j1: usize) -> &[u8] {
        let at = (self.block(j0), self.kvh);
        value_rows(self.plan, self.l, self.b.vc, at, j0, j1)
    }
}

impl<M: U8Micro, Q> TileSource for U8Tiles<'_, '_, M, Q> {
    type Pf = u8;
    fn keys<'s>(&'s self, j0: usize, j1: usize, buf: &'s mut [f32]) -> &'s [f32] {
        let (plan, d) = (self.plan, self.plan.d);
        if let Some((k, _)) = self.wide {
            return &k[j0 * d..j1 * d];
        }
        let n = j1 - j0;
        let out = &mut buf[..n * d];
        let (sc, zp) = &mut *self.params.borrow_mut();
        let (sc, zp) = (aligned(sc, d), aligned(zp, d));
        let slots = (j0 % plan.bs, n);
        dequant_keys(
            self.m,
            plan,
            self.l,
            self.b.kc,
            self.block(j0),
            self.kvh,
            slots,
            (sc, zp),
            out,
        );
        out
    }
    fn values<'s>(&'s self, j0: usize, j1: usize, buf: &'s mut [f32]) -> &'s [f32] {
        let (d, n) = (self.plan.d, j1 - j0);
        if let Some((_, v)) = self.wide {
            return &v[j0 * d..j1 * d];
        }
        let out = &mut buf[..n * d];
        let rows = self.value_bytes(j0, j1);
        dequant_token_rows(self.m, rows, self.l.value_row(), d, self.l.value_group, out);
        out
    }
    fn values_ahead(&self, j0: usize, j1: usize) -> &[u8] {
        if self.wide.is_some() {
            return &[];
        }
        self.value_bytes(j0, j1)
    }
    fn keys_ahead(&self, next: Option<(usize, usize)>) -> &[u8] {
        let (Some((a, _)), None) = (next, self.wide) else {
            return &[];
        };
        let slab = self.l.key_slab();
        let at = (self.block(a) * self.plan.hkv + self.kvh) * slab;
        &self.b.kc[at..at + slab]
    }
}

/// One prefill item: query tokens `i0..i1` of sequence `sp`, KV head `kvh`, over all their
/// visible keys, through the f32 prefill loop (`fast::prefill::attend`: transposed logits,
/// lane-wise softmax) on u8 tiles dequantized block by block. Writes the rows' outputs; adds
/// the final softmax weights of its score rows into `part` (when it has score rows).
#[allow(clippy::too_many_arguments)]
fn prefill_item<M: U8Micro + TileMicro, Q: Float>(
    m: M,
    plan: &Plan,
    l: &U8Layout,
    b: &Inputs<'_, Q>,
    sp: &SeqPlan,
    kvh: usize,
    (i0, i1): (usize, usize),
    (sc, wide): (&mut PrefillScratch, Option<KvRows<'_>>),
    out: &SharedMut<'_, Q>,
    part: Option<&mut [f32]>,
) {
    let (h, d, g) = (plan.h, plan.d, plan.g);
    let nt = i1 - i0;
    let rows = nt * g;
    let rows8 = rows.div_ceil(8) * 8;
    let pos0 = sp.past + i0;
    let (lo, hi) = (window_start(plan, pos0), sp.ctx().min(pos0 + nt));
    let PrefillScratch { tile, params, kept } = sc;
    let ItemBufs {
        qt,
        mut state,
        tiles,
    } = tile.start(m, plan, b.query, sp, kvh, (i0, nt));
    // Score rows are a suffix of the rows (token-major): their logits are kept row-major.
    let first_scored = (sp.n - sp.score_tokens).max(i0).min(i1);
    let r_sc = (first_scored - i0) * g;
    let span = hi - lo;
    if part.is_some() {
        kept.clear();
        kept.resize((rows - r_sc) * span, f32::NEG_INFINITY);
    }
    let src = U8Tiles {
        m,
        plan,
        l,
        b,
        sp,
        kvh,
        wide,
        params: RefCell::new(std::mem::take(params)),
    };
    let keep = part.is_some();
    attend(
        m,
        plan,
        &src,
        kvh,
        (pos0, nt, lo, hi),
        qt,
        &mut state,
        tiles,
        |st, j0, n| {
            prefetch_out(plan, out, (sp.begin + i0, nt, kvh), (lo, hi, j0));
            if keep {
                for r in r_sc..rows {
                    let dst = &mut kept[(r - r_sc) * span + j0 - lo..][..n];
                    for (jj, o) in dst.iter_mut().enumerate() {
                        *o = st[jj * rows8 + r];
                    }
                }
            }
        },
    );
    *params = src.params.into_inner();
    let RowState {
        acc, m: mb, l: lb, ..
    } = state;
    // Row r's final statistics (with its sink), for the output and the scores.
    let stats = |r: usize| {
        let mut st = OnlineSoftmax {
            max: mb[r],
            sum: lb[r],
        };
        let norm = st.finish(plan.sink(kvh * g + r % g));
        (st, norm)
    };
    for r in 0..rows {
        let (ti, gi) = (r / g, r % g);
        let at = ((sp.begin + i0 + ti) * h + kvh * g + gi) * d;
        // SAFETY: (token, head) pairs are distinct across rows of all items (an item owns its
        // tokens and its KV head's query heads), so these parts never overlap.
        let o = unsafe { out.part(at, d) };
        // One reciprocal per row, as `fast::prefill` writes its rows.
        let inv = stats(r).1;
        for (o, &a) in o.iter_mut().zip(&acc[r * d..][..d]) {
            *o = Q::from_f32(a * inv);
        }
    }
    if let Some(part) = part {
        for r in r_sc..rows {
            let st = stats(r).0;
            let kept = &kept[(r - r_sc) * span..][..span];
            // The keys the row sees only: a NaN row must not reach a masked key.
            let (a, b) = visible_span(plan, pos0 + r / g, lo, hi);
            if a < b {
                m.add_exp_scaled(&mut part[a..b], &kept[a - lo..b - lo], st.max, st.norm());
            }
        }
    }
}

/// One work item: tokens `i0..i1` of sequence `seq`, KV heads `kvh..kvh + nkvh` (one KV head
/// for prefill items).
struct Work {
    seq: usize,
    kvh: usize,
    nkvh: usize,
    i0: usize,
    i1: usize,
    prefill: bool,
    /// Offset of the item's partial scores (`ctx` floats per KV head) when it has score rows
    /// and its sequence is not cut into key chunks.
    part: Option<usize>,
    /// The item's key chunk (0 when its sequence is not cut, see [`Cut`]).
    chunk: usize,
}

/// Decode items a call aims for at least, so that many threads find work even when few
/// sequences decode: a long context is cut into key chunks (flash-decoding) until sequences x
/// KV heads x chunks reaches it. Like the rest of the cut, it does not depend on the threads.
/// Cutting costs where threads had enough work without it (the chunks' slots, stashed score
/// weights and merge: 4% more instructions over decode 4 x 4096 and 1 x 16384 cut into 2 and
/// 8 chunks, callgrind), so the aim is 32 (the float path's is 64): 4 x 4096 with 8 KV heads
/// stays whole, a single sequence of 8 KV heads is cut in 4, one of 1 KV head (MQA) in 32.
const MIN_DECODE_ITEMS: usize = 32;
/// Fewest keys of a chunk (below this, the merge and the chunks' start-up costs win).
const MIN_CHUNK_KEYS: usize = 1024;
/// Most chunks per sequence.
const MAX_CHUNKS: usize = 64;
/// Floats of score weights the chunked sequences of a call may stash beyond `8*T*H*D` (16 MiB);
/// past that, sequences are not cut.
const STASH_EXTRA: usize = 1 << 22;

/// How a decode-like sequence's keys are cut: `nchunks` chunks of `len` keys from `first`
/// (whole online-softmax steps). Cut sequences (`nchunks > 1`) write per row and chunk a
/// `[max, sum, acc]` slot (at `slots` in the call's partial buffer, rows `[n][H]` of `nchunks`
/// slots of `D + 2`), merged in chunk order once every item ran, and their score rows' weights
/// relative to the chunk's max (at `stash`, rows `[score_tokens][H]` of `ctx`).
#[derive(Clone, Copy, Debug, Default)]
struct Cut {
    nchunks: usize,
    first: usize,
    len: usize,
    slots: usize,
    stash: usize,
}

impl Cut {
    /// Keys `[k0, k1)` of chunk `c` of a sequence of `ctx` keys (all of them when not cut).
    fn range(&self, c: usize, ctx: usize) -> (usize, usize) {
        if self.nchunks <= 1 {
            return (0, ctx);
        }
        let k0 = self.first + c * self.len;
        (k0.min(ctx), (k0 + self.len).min(ctx))
    }
}

/// The call's work items, sequence by sequence, KV head by KV head, in token order (the order
/// partial scores are summed in), and the length of the partial-score buffer. A decode-like
/// sequence is one item per run of `decode_heads` KV heads (a run streams its blocks in
/// storage order) and key chunk of its [`Cut`]; results do not depend on that grouping (each
/// KV head's arithmetic and partial scores are its own), the rest of the cut depends only on
/// the plan.
fn work_items(plan: &Plan, cuts: &[Cut], decode_heads: usize) -> Result<(Vec<Work>, usize)> {
    let mut items = Vec::new();
    let mut parts = 0usize;
    let too_big = || PaError::OutOfMemory {
        what: "u8 partial scores".into(),
        bytes: usize::MAX,
    };
    for (seq, sp) in plan.seqs.iter().enumerate() {
        let prefill = is_prefill(plan, sp);
        let step = if prefill {
            (PREFILL_ROWS / plan.g).max(1)
        } else {
            sp.n.max(1)
        };
        let run = if prefill {
            1
        } else {
            decode_heads.clamp(1, plan.hkv)
        };
        let cut = cuts[seq];
        for kvh in (0..plan.hkv).step_by(run) {
            let nkvh = run.min(plan.hkv - kvh);
            for i0 in (0..sp.n).step_by(step) {
                let i1 = (i0 + step).min(sp.n);
                for chunk in 0..cut.nchunks.max(1) {
                    let scored = i1 > sp.n - sp.score_tokens;
                    let part = (scored && cut.nchunks <= 1).then_some(parts);
                    if part.is_some() {
                        let len = sp.ctx().checked_mul(nkvh).ok_or_else(too_big)?;
                        parts = parts.checked_add(len).ok_or_else(too_big)?;
                    }
                    items.push(Work {
                        seq,
                        kvh,
                        nkvh,
                        i0,
                        i1,
                        prefill,
                        part,
                        chunk,
                    });
                }
            }
        }
    }
    Ok((items, parts))
}

/// Each sequence's key chunks (see [`MIN_DECODE_ITEMS`]): decode-like sequences of at least
/// two chunks of [`MIN_CHUNK_KEYS`] keys past the window's start, while the call's stash of
/// score weights stays within `8*T*H*D + STASH_EXTRA` floats; `nchunks` 1 (not cut) for the
/// rest. Also the lengths of the chunk slots and the score stash the cut sequences take.
fn cut_keys(plan: &Plan) -> (Vec<Cut>, usize, usize) {
    let span = step_span(plan.bs);
    let decoding = plan
        .seqs
        .iter()
        .filter(|sp| sp.n > 0 && !is_prefill(plan, sp))
        .count()
        .max(1);
    let per_seq = MIN_DECODE_ITEMS.div_ceil(decoding * plan.hkv.max(1));
    let budget = (8 * plan.t * plan.h * plan.d).saturating_add(STASH_EXTRA);
    let (mut stashed, mut slots) = (0usize, 0usize);
    let cuts = plan
        .seqs
        .iter()
        .map(|sp| {
            let one = Cut {
                nchunks: 1,
                ..Cut::default()
            };
            if sp.n == 0 || is_prefill(plan, sp) {
                return one;
            }
            let first = window_start(plan, sp.past) / span * span;
            let keys = sp.ctx().saturating_sub(first);
            let want = per_seq.min(keys / MIN_CHUNK_KEYS).min(MAX_CHUNKS);
            let stash = sp.score_tokens * plan.h * sp.ctx();
            if want < 2 || stashed.saturating_add(stash) > budget {
                return one;
            }
            let len = keys.div_ceil(want).div_ceil(span) * span;
            let cut = Cut {
                nchunks: keys.div_ceil(len),
                first,
                len,
                slots,
                stash: stashed,
            };
            stashed += stash;
            slots += sp.n * plan.h * cut.nchunks * (plan.d + 2);
            cut
        })
        .collect();
    (cuts, slots, stashed)
}

/// The read-only side of the bound call.
struct Inputs<'a, Q> {
    query: &'a [Q],
    kc: &'a [u8],
    vc: &'a [u8],
    block_indices: &'a [i32],
}

/// A KV head's view of a shared cache for insertion.
struct HeadRows<'a, 'b>(&'a SharedMut<'b, u8>);

impl CacheRows for HeadRows<'_, '_> {
    fn rows(&mut self, at: usize, len: usize) -> &mut [u8] {
        // SAFETY: a HeadRows is used by one KV head's task only, and every byte rotation and
        // insertion write for a head lies in that head's (block, head) slabs or rows, which no
        // other head's task touches; `&mut self` keeps one slice of it alive at a time.
        unsafe { self.0.part(at, len) }
    }
}

/// Runs insertion, attention and scores of a validated call on u8 caches of layout `l`.
pub(crate) fn run<M: U8Micro + TileMicro, Q: Float>(
    m: M,
    runner: Runner,
    plan: &Plan,
    l: &U8Layout,
    b: Bound<'_, Q, u8>,
) -> Result<()> {
    // Decode items take runs of a sequence's KV heads (whole blocks in storage order), aiming at
    // 32 items per thread: whichever thread is free claims the next item, and small items even
    // out threads that run at different speeds (a VM's vCPUs, a host's other work). AMD EPYC
    // AVX2, 2 threads, inside OpenVINO: decode 16 x 1024 (2-head items) ran 1.94-2.18x the
    // built-in op against 1.74-1.94x with one 8-head item per sequence (8 per thread), and one
    // head per item (64 per thread) 1.82-1.96x; the two threads' busy time differed by up to
    // 0.5 ms of 6 with 8 per thread. Decode 4 x 4096 (1-head items) was unchanged, 1 thread too.
    // Fewer than 8 per thread also cost 5-13% on 4 x 4096 (one thread waiting on the other).
    // Cut sequences count once per key chunk.
    let (cuts, slots_len, stash_len) = cut_keys(plan);
    let decode_items: usize = (plan.seqs.iter().zip(&cuts))
        .filter(|(sp, _)| !is_prefill(plan, sp))
        .map(|(_, c)| c.nchunks.max(1))
        .sum();
    let splits = (32 * runner.max_threads()).div_ceil(decode_items.max(1));
    let (items, parts_len) = work_items(plan, &cuts, plan.hkv.div_ceil(splits))?;
    let mut parts = try_vec(parts_len, 0f32, "u8 partial scores")?;
    // Every slot and stashed weight the merge reads is written by an item first; the buffers
    // come back from earlier calls (a fresh mapping would fault in and zero its pages).
    let mut slots = Buf::<f32>::any(slots_len);
    let mut stash = Buf::<f32>::any(stash_len);
    {
        let rot = b.rotation.as_ref().map(|r| r.keys());
        let fills = match &rot {
            Some(r) => quant::rotated_fills(plan.bs, &plan.seqs, b.block_indices, r),
            None => Vec::new(),
        };
        let (kc, vc) = (SharedMut::new(b.key_cache), SharedMut::new(b.value_cache));
        runner.for_each(plan.hkv, &|head| {
            let mut buf = InsertScratch::default();
            let (mut kr, mut vr) = (HeadRows(&kc), HeadRows(&vc));
            // Rotation before insertion (SPEC order); both touch only this head's bytes.
            if let Some(r) = &rot {
                quant::rotate_u8_head(l, r, &fills, head, &mut kr, &mut buf);
            }
            let new = (b.key, b.value);
            let (seqs, bi) = (&plan.seqs, b.block_indices);
            quant::insert_u8_head(l, seqs, bi, new, head, &mut kr, &mut vr, &mut buf);
        });
    }
    // u4 caches: attention reads blocks unpacked to u8 (`fast::u4`): the prefill sequences'
    // once per call here, a decode item's own ones when it runs.
    let packed = (&*b.key_cache, &*b.value_cache, b.block_indices);
    let l4 = l;
    let unpacked = match l.bits {
        8 => None,
        _ => Some(super::u4::unpack(runner, plan, l, packed, |s| {
            is_prefill(plan, &plan.seqs[s])
        })?),
    };
    let (l, inputs) = match &unpacked {
        None => (
            l,
            Inputs {
                query: b.query,
                kc: &*b.key_cache,
                vc: &*b.value_cache,
                block_indices: b.block_indices,
            },
        ),
        Some(u) => (
            &u.layout,
            Inputs {
                query: b.query,
                kc: &u.kc[..],
                vc: &u.vc[..],
                block_indices: &u.block_indices[..],
            },
        ),
    };
    let prefill = |s: usize| is_prefill(plan, &plan.seqs[s]);
    let wide = dequant_prefill_rows(m, (plan, runner), l, &inputs, prefill);
    {
        let out = SharedMut::new(&mut *b.output);
        let parts = SharedMut::new(&mut parts);
        let (slots, stash) = (SharedMut::new(&mut slots), SharedMut::new(&mut stash));
        runner.for_each(items.len(), &|i| {
            let w = &items[i];
            let sp = &plan.seqs[w.seq];
            let part = w.part.map(|at| {
                // SAFETY: every item with score rows owns its own `ctx` partials per KV head
                // (offsets laid out one after another by `work_items`).
                unsafe { parts.part(at, sp.ctx() * w.nkvh) }
            });
            if w.prefill {
                let rows = wide
                    .as_ref()
                    .and_then(|x| x.rows(w.seq, w.kvh, sp.ctx() * plan.d));
                PREFILL_SCRATCH.with(|s| {
                    let sc = (&mut *s.borrow_mut(), rows);
                    let span = (w.i0, w.i1);
                    prefill_item(m, plan, l, &inputs, sp, w.kvh, span, sc, &out, part);
                });
                return;
            }
            DECODE_SCRATCH.with(|s| {
                let mut s = s.borrow_mut();
                let mut item_blocks = std::mem::take(&mut s.u4);
                let cut = cuts[w.seq];
                let keys = cut.range(w.chunk, sp.ctx());
                // u4: this item's blocks and heads, unpacked (a sequence whose blocks start at 0)
                let u4_sp = SeqPlan {
                    block_begin: 0,
                    ..*sp
                };
                let (sp, item_inputs) = if l4.bits == 8 {
                    (sp, None)
                } else {
                    let heads = (w.kvh, w.kvh + w.nkvh);
                    let (kc, vc, bi) =
                        item_blocks.unpack(plan, l4, packed, sp.block_begin, keys, heads);
                    let inputs = Inputs {
                        query: b.query,
                        kc,
                        vc,
                        block_indices: bi,
                    };
                    (&u4_sp, Some(inputs))
                };
                let inputs = item_inputs.as_ref().unwrap_or(&inputs);
                let (sc, heads) = s.fit(plan, w.nkvh);
                let mut none = [];
                let part: &mut [f32] = part.unwrap_or(&mut none);
                let tokens_per_tile = (ROWS / plan.g).max(1);
                for i0 in (w.i0..w.i1).step_by(tokens_per_tile) {
                    let i1 = (i0 + tokens_per_tile).min(w.i1);
                    // Rows of a KV head beyond ROWS (G > ROWS) make more tiles, chunk by chunk.
                    let per_head = (i1 - i0) * plan.g;
                    for c0 in (0..per_head).step_by(ROWS) {
                        for (k, h) in heads.iter_mut().enumerate() {
                            let rows = rows_of(plan, sp, w.kvh + k, i0, i1);
                            h.rows.clear();
                            h.rows
                                .extend_from_slice(&rows[c0..(c0 + ROWS).min(per_head)]);
                        }
                        let hs = &mut heads[..];
                        let sink = if cut.nchunks > 1 {
                            let (slots, stash, c) = (&slots, &stash, w.chunk);
                            Sink::Chunk {
                                slots,
                                stash,
                                cut,
                                c,
                            }
                        } else {
                            Sink::Out {
                                out: &out,
                                parts: &mut *part,
                            }
                        };
                        attend_tile(m, plan, l, inputs, sp, w.kvh, hs, sc, keys, sink);
                    }
                }
                s.u4 = item_blocks;
            });
        });
    }
    let (d, h) = (plan.d, plan.h);
    // Cut sequences: each row's chunks merged in chunk order into its output (a task per
    // sequence), and their score rows' stashed weights times each chunk's share, head by head
    // and token by token (a task per sequence and chunk: its keys; each merges the score rows'
    // statistics itself, as the output's merge does). One parallel step, or none when small.
    let cut: Vec<usize> = (0..plan.seqs.len())
        .filter(|&s| cuts[s].nchunks > 1)
        .collect();
    let mut coff = vec![0; plan.seqs.len()];
    let (mut clen, mut work) = (0usize, 0usize);
    for &s in &cut {
        let sp = &plan.seqs[s];
        coff[s] = clen;
        clen += sp.ctx();
        work += (sp.score_tokens * sp.ctx() + sp.n * cuts[s].nchunks * d) * h;
    }
    let mut csum = try_vec(clen, 0f32, "u8 decode chunk scores")?;
    {
        let tasks: Vec<(usize, Option<usize>)> = (cut.iter())
            .flat_map(|&s| {
                let chunks = (0..cuts[s].nchunks).map(move |c| (s, Some(c)));
                std::iter::once((s, None)).chain(chunks)
            })
            .collect();
        let (out, cw) = (SharedMut::new(&mut *b.output), SharedMut::new(&mut csum));
        let task = |k: usize| {
            let (s, chunk) = tasks[k];
            let (sp, cut) = (&plan.seqs[s], cuts[s]);
            let row_slots = |i: usize, head: usize| {
                let base = cut.slots + (i * h + head) * cut.nchunks * (d + 2);
                &slots[base..base + cut.nchunks * (d + 2)]
            };
            let Some(c) = chunk else {
                for i in 0..sp.n {
                    let at = (sp.begin + i) * h;
                    // SAFETY: the sequence's output rows, written by this task only.
                    let o = unsafe { out.part(at * d, h * d) };
                    for (head, o) in o.chunks_exact_mut(d).enumerate() {
                        attention::merge(row_slots(i, head), d, plan.sink(head), o);
                    }
                }
                return;
            };
            let ctx = sp.ctx();
            let (c0, c1) = cut.range(c, ctx);
            // SAFETY: the chunk's keys of the sequence's sums, written by this task only.
            let sum = unsafe { cw.part(coff[s] + c0, c1 - c0) };
            let first = sp.n - sp.score_tokens;
            for head in 0..h {
                for i in first..sp.n {
                    let row = row_slots(i, head);
                    // A chunk whose keys all have weight 0 (stashed as 0) still takes the
                    // row's factor: NaN when the row has no distribution (a NaN logit in
                    // another chunk), so every key the row sees gets NaN, as in the reference.
                    let max = row[c * (d + 2)];
                    let st = attention::merged_stats(row, d, plan.sink(head));
                    let srow = cut.stash + ((i - first) * h + head) * ctx;
                    let (a, b) = visible_span(plan, sp.past + i, c0, c1);
                    if a < b {
                        let f = st.factor(max);
                        m.add_scaled(&mut sum[a - c0..b - c0], &stash[srow + a..srow + b], f);
                    }
                }
            }
        };
        if work < 1 << 18 {
            (0..tasks.len()).for_each(task);
        } else {
            runner.for_each(tasks.len(), &task);
        }
    }
    let mut item = 0;
    for (s, sp) in plan.seqs.iter().enumerate() {
        let (ctx, at) = (sp.ctx(), sp.score_offset);
        let mut sum = vec![0f32; ctx];
        while item < items.len() && items[item].seq == s {
            if let (Some(p), true) = (items[item].part, ctx > 0) {
                // KV head by KV head, in order, whatever the runs of the items.
                for head in parts[p..p + ctx * items[item].nkvh].chunks_exact(ctx) {
                    for (o, &x) in sum.iter_mut().zip(head) {
                        *o += x;
                    }
                }
            }
            item += 1;
        }
        if cuts[s].nchunks > 1 {
            sum.copy_from_slice(&csum[coff[s]..coff[s] + ctx]);
        }
        for (o, &x) in b.scores[at..at + ctx].iter_mut().zip(&sum) {
            *o = Q::from_f32(x);
        }
    }
    if let Some(u) = unpacked {
        u.keep();
    }
    Ok(())
}
