//! Quantized caches (u8 in OpenVINO's layouts, and u4: read in place by decode items, through
//! its u8 form by prefill items, `fast::u4`) as a [`Source`] of the one pipeline: rotation and
//! insertion quantize with `kernel::quant` (the byte-checked code, one task per KV head);
//! attention reads the cache bytes, never widening a cache. The partition, the merge of key
//! chunks, the prefill loop and the scores are the pipeline's; this file says how a block's
//! bytes meet the rows:
//! - decode items (the rows of a query tile of a run of KV heads, over one key chunk) walk
//!   their key blocks once per tile of up to [`ROWS`] rows per head, (block, KV head) in
//!   storage order, in online-softmax steps of about [`STEP_KEYS`] keys, reading each key and
//!   value element (a byte, or a u4 nibble: `micro::QRows`) once for all G heads through the
//!   [`QuantMicro`] loops (dequantized in registers), and write each row's `[max, sum, acc]` slot
//!   and their score rows' logits, as float decode items do. Per block and head:
//!   - keys by channel: `k = (q8 - zp[c]) * scale[c]` per channel, so `q . k = sum_c (q_c
//!     scale_c) q8_c - sum_c q_c scale_c zp_c`: the query rows are multiplied by the block's
//!     scales once and the second sum is one constant per row and block ([`QuantMicro::fold`]);
//!   - keys by token: per group, `scale_g * sum_c q_c (q8_c - zp_g)`;
//!   - values (by token): `acc += (p * scale_g) * q8` per group, the accumulators held in
//!     registers across a block's keys, and `sum p * scale_g * zp_g` kept per (row, group)
//!     beside them (rescaled with them) and taken off once at the end.
//! - prefill items run the f32 prefill loop (`prefill::attend`) on their sequence's rows
//!   dequantized once per call (as f16/bf16 rows are widened, within the same memory bound),
//!   else on one key block and one value block at a time dequantized into f32 tiles; both as
//!   `kernel::quant` dequantizes, so the values are the reference's.
//!
//! The softmax step is `kernel::softmax::OnlineSoftmax`'s; masks, windows and ALiBi are the
//! reference's (`kernel::layout`), logits capped at the f32 range as every path caps them.

use super::micro::{Kernels, Micro, QRows, QuantMicro};
use super::partition::{Item, Tuning};
use super::prefill::{self, aligned, KvRows, TileSource, Widened};
use super::shared::SharedMut;
use super::source::{Ctx, KeyTile, Out, Source};
use super::tile::{grow, share};
use super::u4::Unpacked;
use crate::dtype::Float;
use crate::error::Result;
use crate::kernel::bind::Bound;
use crate::kernel::layout::{block_of, tiles, visible, visible_span, window_start};
use crate::kernel::quant::{
    self, read_f32, CacheRows, InsertScratch, KeyQuant, QuantLayout, PARAM_BYTES,
};
use crate::kernel::softmax::{Lanes, OnlineSoftmax};
use crate::op::{Plan, SeqPlan};
use crate::threads::Runner;
use std::cell::RefCell;

/// Query rows per tile.
const ROWS: usize = 8;

/// The cache bytes attention reads, and their layout: the call's caches, or u4 blocks unpacked
/// to their u8 form (layout at 8 bits, block table renumbered).
#[derive(Clone, Copy)]
struct View<'a> {
    l: QuantLayout,
    kc: &'a [u8],
    vc: &'a [u8],
    block_indices: &'a [i32],
}

impl<'a> View<'a> {
    fn of<Q>(ctx: &Ctx<'a, Q, u8>) -> View<'a> {
        View {
            l: ctx.layout,
            kc: ctx.kc,
            vc: ctx.vc,
            block_indices: ctx.block_indices,
        }
    }

    fn unpacked(u: &'a Unpacked) -> View<'a> {
        View {
            l: u.layout,
            kc: &u.kc,
            vc: &u.vc,
            block_indices: &u.block_indices,
        }
    }
}

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

/// The rows of sequence `sp`, KV head `kvh`, for tokens `i0..i1` (in token, then head order;
/// an iterator: decode tiles take theirs without allocating).
fn rows_of<'p>(
    plan: &'p Plan,
    sp: &'p SeqPlan,
    kvh: usize,
    (i0, i1): (usize, usize),
) -> impl Iterator<Item = RowRef> + 'p {
    let g = plan.g;
    (i0..i1).flat_map(move |i| {
        (0..g).map(move |gi| RowRef {
            token: sp.begin + i,
            pos: sp.past + i,
            head: kvh * g + gi,
            scored: i >= sp.n - sp.score_tokens,
        })
    })
}

/// One KV head's part of a decode tile: its rows and their state across the key blocks.
struct HeadState {
    rows: Vec<RowRef>,
    /// The rows' queries (not scaled: the logits are).
    q: Vec<f32>,
    /// The rows whose query has a non-finite element.
    odd: Vec<usize>,
    /// The rows' logits, then weights, over a step's keys (`[ROWS][step_span]`).
    s: Vec<f32>,
    acc: Vec<f32>,
    st: [OnlineSoftmax; ROWS],
    /// Per (row, value group): the value zero points' share of the accumulators, rescaled with
    /// them and taken off the group's columns once, at the end.
    zsum: Vec<f32>,
    /// Direct scores: weights `exp(s - step.sub)` of the score rows over the tile's key range,
    /// as the steps computed them for the values ...
    kept: Vec<f32>,
    /// ... and each row's running max after each step ([`OnlineSoftmax::factor`]).
    kmax: Vec<f32>,
}

impl HeadState {
    fn new() -> HeadState {
        HeadState {
            rows: Vec::new(),
            q: Vec::new(),
            odd: Vec::new(),
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
            grow(&mut h.acc, ROWS * plan.dv);
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
fn block_logits<M: QuantMicro + Micro>(
    m: M,
    plan: &Plan,
    l: &QuantLayout,
    kc: &[u8],
    (block, slot0): (usize, usize),
    kvh: usize,
    (j0, j1): (usize, usize),
    (rows, q, odd): (&[RowRef], &[f32], &[usize]),
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
            let rb = d * l.bits / 8;
            let data = &slab[PARAM_BYTES * d + slot0 * rb..];
            let k = QRows::new(data, rb, l.bits);
            let kzp = &sc.zeros[..n];
            QuantMicro::qk(m, &sc.qs, d, nr, k, kzp, d, s, lds, ahead);
            for (r, &c) in sc.cst[..nr].iter().enumerate() {
                for x in &mut s[r * lds..][..n] {
                    *x -= c;
                }
            }
            // A row with a non-finite query element: the fold's two sums would meet as
            // `inf - inf` where the product with the dequantized key stays infinite, so its
            // logits are those products (as the reference makes them; rare, so scalar).
            for &r in odd {
                let qr = &q[r * d..][..d];
                for (t, x) in s[r * lds..][..n].iter_mut().enumerate() {
                    let dot = qr.iter().zip(sc_.iter().zip(zp)).enumerate();
                    *x = dot
                        .map(|(c, (&q, (&sc, &z)))| q * quant::dequant(k.at(t, c), sc, z))
                        .sum();
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
                let g0 = gi * (g * l.bits / 8 + PARAM_BYTES);
                for t in 0..n {
                    sc.kscale[t] = read_f32(&rows_bytes[t * kr + g0..], 0);
                    sc.kzp[t] = read_f32(&rows_bytes[t * kr + g0..], 1);
                }
                let k = QRows::new(&rows_bytes[g0 + PARAM_BYTES..], kr, l.bits);
                QuantMicro::qk(
                    m,
                    &q[gi * g..],
                    d,
                    nr,
                    k,
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

/// Where a decode tile's results go: the call's partial-result slots, and the score stash or
/// the direct partial scores (`partition::SeqLayout::direct`), at the item's sequence layout
/// and key chunk.
struct Slots<'a, 'p, 's, 'd> {
    pw: &'a SharedMut<'p, f32>,
    sw: Option<&'a SharedMut<'s, f32>>,
    direct: &'a SharedMut<'d, f32>,
    lay: &'a super::partition::SeqLayout,
    chunk: usize,
}

/// Attention of one tile of rows over a run of KV heads `kvh0..` (one [`HeadState`] each, the
/// same tokens of one sequence) and the keys `k0..k1` of the item's chunk: writes each row's
/// `[max, sum, acc]` slot, and the score rows' logits into the stash, or (direct scores: the
/// rows' statistics are final here) their final weights into their KV head's partial scores
/// (`ctx` per KV head from the sequence's `direct` offset), from the step weights the values
/// were weighted with and each step's running max (`OnlineSoftmax::factor`: no second `exp`).
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
/// (`QuantMicro::qk`/`pv`'s `pf`). Each head's arithmetic is the same whatever run it is part
/// of, so results do not depend on how heads are grouped.
#[allow(clippy::too_many_arguments)]
fn attend_tile<M: QuantMicro + Micro, Q: Float>(
    m: M,
    plan: &Plan,
    (v, query): (&View<'_>, &[Q]),
    sp: &SeqPlan,
    kvh0: usize,
    heads: &mut [HeadState],
    sc: &mut Scratch,
    (k0, k1): (usize, usize),
    out: &Slots<'_, '_, '_, '_>,
) {
    let (bs, dv, h) = (plan.bs, plan.dv, plan.h);
    let l = &v.l;
    let span = step_span(bs);
    let vg = if l.value_group == 0 {
        dv
    } else {
        l.value_group
    };
    let ngroups = dv / vg;
    let vrow = l.value_row();
    // The rows' keys within the item's chunk (none: the chunk's slots say so).
    let (lo, hi) = key_range(plan, &heads[0].rows);
    let lo = lo.max(k0);
    let hi = hi.min(k1).max(lo);
    let nsteps = tiles(lo, hi, span).count();
    let direct = out.lay.direct.is_some();
    for h in heads.iter_mut() {
        let nr = h.rows.len();
        if direct && h.rows.iter().any(|r| r.scored) {
            // Every weight a score row reads is written by the steps first: no zeroing.
            grow(&mut h.kept, nr * (hi - lo));
            h.kmax.clear();
            h.kmax.resize(nr * nsteps, f32::NEG_INFINITY);
        }
        load_queries(plan, query, &h.rows, &mut h.q);
        let finite = |r: &usize| h.q[r * plan.d..][..plan.d].iter().all(|x| x.is_finite());
        h.odd.clear();
        h.odd.extend((0..nr).filter(|r| !finite(r)));
        h.acc[..nr * dv].fill(0.0);
        h.st = [OnlineSoftmax::EMPTY; ROWS];
        h.zsum.clear();
        h.zsum.resize(nr * ngroups, 0.0);
    }
    let nh = heads.len();
    let block = |j0: usize| block_of(v.block_indices, sp.block_begin, bs, j0);
    // Every read of the tile in order (per step: the key slabs of its (block, head)s, then
    // their value rows), as the bytes the read before it requests.
    let reads = tiles(lo, hi, span).flat_map(move |(s0, s1)| {
        let at =
            move |val: bool| tiles(s0, s1, bs).flat_map(move |t| (0..nh).map(move |i| (val, t, i)));
        at(false).chain(at(true))
    });
    let mut ahead = reads.skip(1).map(|(val, (j0, j1), i)| {
        let at = (block(j0), kvh0 + i);
        if val {
            value_rows(plan, l, v.vc, at, j0, j1)
        } else {
            key_slab(plan, l, v.kc, at)
        }
    });
    let (ctx, first_score) = (sp.ctx(), sp.n - sp.score_tokens);
    for (step, (s0, s1)) in tiles(lo, hi, span).enumerate() {
        let n = s1 - s0;
        for (j0, j1) in tiles(s0, s1, bs) {
            let (blk, slot0) = (block(j0), j0 % bs);
            for (i, hd) in heads.iter_mut().enumerate() {
                let next = ahead.next().unwrap_or(&[]);
                let (rows, q) = (&hd.rows[..], &hd.q[..]);
                let rows = (rows, q, &hd.odd[..]);
                let s = (&mut hd.s[j0 - s0..], span);
                let (keys, kvh) = ((blk, slot0), kvh0 + i);
                block_logits(m, plan, l, v.kc, keys, kvh, (j0, j1), rows, sc, s, next);
            }
        }
        for hd in heads.iter_mut() {
            let nr = hd.rows.len();
            let (mut subs, mut sums) = ([0f32; ROWS], [0f32; ROWS]);
            for (r, st) in hd.st.iter_mut().enumerate().take(nr) {
                let row = hd.rows[r];
                let s = &hd.s[r * span..][..n];
                if let (Some(sw), true, false) = (out.sw, row.scored, direct) {
                    let i = row.token - sp.begin;
                    let at = out.lay.stash_base + ((i - first_score) * h + row.head) * ctx;
                    // SAFETY: stash row (token, head) belongs to this item's KV heads and query
                    // tile, and keys s0..s1 to this item's chunk: no other item writes there.
                    unsafe { sw.part(at + s0, n) }.copy_from_slice(s);
                }
                let step_ = st.update(QuantMicro::max(m, s));
                if row.scored && direct {
                    hd.kmax[r * nsteps + step] = st.max;
                }
                if step_.rescale != 1.0 {
                    m.scale(&mut hd.acc[r * dv..][..dv], step_.rescale);
                    m.scale(&mut hd.zsum[r * ngroups..][..ngroups], step_.rescale);
                }
                subs[r] = step_.sub;
            }
            // The rows' weights in one call (their exp chains overlap).
            m.exp_sum(&mut hd.s, span, n, &subs[..nr], &mut sums[..nr]);
            for (r, (st, &sum)) in hd.st.iter_mut().zip(&sums[..nr]).enumerate() {
                st.add(sum);
                if hd.rows[r].scored && direct {
                    let w = &hd.s[r * span..][..n];
                    hd.kept[r * (hi - lo) + s0 - lo..][..n].copy_from_slice(w);
                }
            }
        }
        // The value products, block by block and group by group, requesting the next read's
        // bytes as they go.
        for (j0, j1) in tiles(s0, s1, bs) {
            let blk = block(j0);
            let nb = j1 - j0;
            for (i, hd) in heads.iter_mut().enumerate() {
                let next = ahead.next().unwrap_or(&[]);
                let vrows = value_rows(plan, l, v.vc, (blk, kvh0 + i), j0, j1);
                let nr = hd.rows.len();
                for gi in 0..ngroups {
                    let g0 = gi * (vg * l.bits / 8 + PARAM_BYTES);
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
                    let w = &hd.s[j0 - s0..];
                    m.fold(w, span, nr, vs, vz, &mut sc.w, nb, &mut sc.cst);
                    let vb = QRows::new(&vrows[g0 + PARAM_BYTES..], vrow, l.bits);
                    let (w, pf) = (&sc.w[..nr * nb], share(next, (gi, ngroups)));
                    let acc = &mut hd.acc[gi * vg..];
                    m.pv(acc, dv, nr, w, vb, &sc.zeros[..nb], vg, pf);
                    for (r, &c) in sc.cst[..nr].iter().enumerate() {
                        hd.zsum[r * ngroups + gi] += c;
                    }
                }
            }
        }
    }
    let (lay, chunk) = (out.lay, out.chunk);
    for (k, hd) in heads.iter().enumerate() {
        for (r, row) in hd.rows.iter().enumerate() {
            let part_at = out.lay.direct_part(kvh0 + k, (0, 1), ctx);
            if let (Some(at), true) = (part_at, row.scored) {
                // Final weight = step weight * factor(step's running max), over the keys the
                // row sees only (a NaN row must not reach a masked key).
                let mut st = hd.st[r];
                st.finish(plan.sink(row.head));
                let kept = &hd.kept[r * (hi - lo)..][..hi - lo];
                // SAFETY: the KV head's partial scores belong to this item (the one item of an
                // uncut decode sequence that holds the head).
                let part = unsafe { out.direct.part(at, ctx) };
                for ((j0, j1), &bm) in tiles(lo, hi, span).zip(&hd.kmax[r * nsteps..]) {
                    let (a, b) = visible_span(plan, row.pos, j0, j1);
                    if a < b {
                        m.add_scaled(&mut part[a..b], &kept[a - lo..b - lo], st.factor(bm));
                    }
                }
            }
            let (st, zsum) = (hd.st[r], &hd.zsum[r * ngroups..][..ngroups]);
            let acc = hd.acc[r * dv..][..dv].chunks_exact(vg);
            let i = row.token - sp.begin;
            let at = lay.part_base + (i * h + row.head) * lay.nchunks * (dv + 2) + chunk * (dv + 2);
            // SAFETY: slot (row, chunk) is written by this item only (one item per query tile,
            // run of KV heads and chunk).
            let slot = unsafe { out.pw.part(at, dv + 2) };
            (slot[0], slot[1]) = (st.max, st.sum);
            for ((o, a), &z) in slot[2..].chunks_exact_mut(vg).zip(acc).zip(zsum) {
                for (o, &a) in o.iter_mut().zip(a) {
                    *o = a - z;
                }
            }
        }
    }
}

thread_local! {
    static DECODE_SCRATCH: RefCell<DecodeScratch> = RefCell::new(DecodeScratch::default());
}

/// Dequantizes the keys of slots `slot0..slot0 + n` of (block, KV head `kvh`) into `out`
/// (`[n][D]`), as `kernel::quant` does (`(q - zp) * scale`, the reference's values exactly).
fn dequant_keys<M: QuantMicro>(
    m: M,
    plan: &Plan,
    v: &View<'_>,
    (block, kvh): (usize, usize),
    (slot0, n): (usize, usize),
    (sc, zp): (&mut [f32], &mut [f32]),
    out: &mut [f32],
) {
    let d = plan.d;
    let slab = key_slab(plan, &v.l, v.kc, (block, kvh));
    let slab_len = slab.len();
    match v.l.key {
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
fn key_slab<'k>(
    plan: &Plan,
    l: &QuantLayout,
    kc: &'k [u8],
    (block, kvh): (usize, usize),
) -> &'k [u8] {
    let len = l.key_slab();
    &kc[(block * plan.hkv + kvh) * len..][..len]
}

/// The value rows of keys `j0..j1` (inside one block) of (block, KV head).
fn value_rows<'v>(
    plan: &Plan,
    l: &QuantLayout,
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
fn dequant_prefill_rows<M: QuantMicro>(
    m: M,
    (plan, runner): (&Plan, Runner),
    v: &View<'_>,
    prefill: impl Fn(usize) -> bool,
) -> Option<Widened> {
    let (d, dv, bs) = (plan.d, plan.dv, plan.bs);
    Widened::build((plan, runner), prefill, |s, kvh, ka, va| {
        let sp = &plan.seqs[s];
        let (mut sc, mut zp) = (vec![0f32; d], vec![0f32; d]);
        for (j0, j1) in tiles(0, sp.ctx(), bs) {
            let block = block_of(v.block_indices, sp.block_begin, bs, j0);
            let (keys, vals) = (&mut ka[j0 * d..j1 * d], &mut va[j0 * dv..j1 * dv]);
            let slots = (j0 % bs, j1 - j0);
            dequant_keys(m, plan, v, (block, kvh), slots, (&mut sc, &mut zp), keys);
            let rows = value_rows(plan, &v.l, v.vc, (block, kvh), j0, j1);
            dequant_token_rows(m, rows, v.l.value_row(), dv, v.l.value_group, vals);
        }
    })
}

/// Dequantizes `n` by-token rows of `ldr` bytes (groups of `group` channels, 0 = D) into `out`.
fn dequant_token_rows<M: QuantMicro>(
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
struct QuantTiles<'c, M> {
    m: M,
    plan: &'c Plan,
    v: View<'c>,
    sp: &'c SeqPlan,
    kvh: usize,
    /// The head's dequantized K and V rows `[ctx][D]`, `[ctx][Dv]`, when the call made them.
    wide: Option<KvRows<'c>>,
    /// Per-channel key scales and zero points of the block being dequantized.
    params: RefCell<(Vec<f32>, Vec<f32>)>,
}

impl<M: QuantMicro> QuantTiles<'_, M> {
    fn block(&self, j0: usize) -> usize {
        block_of(self.v.block_indices, self.sp.block_begin, self.plan.bs, j0)
    }

    /// The cache's value rows of keys `j0..j1` (one block) of this head.
    fn value_bytes(&self, j0: usize, j1: usize) -> &[u8] {
        let at = (self.block(j0), self.kvh);
        value_rows(self.plan, &self.v.l, self.v.vc, at, j0, j1)
    }
}

impl<M: QuantMicro> TileSource for QuantTiles<'_, M> {
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
        let at = (self.block(j0), self.kvh);
        dequant_keys(self.m, plan, &self.v, at, (j0 % plan.bs, n), (sc, zp), out);
        out
    }
    fn values<'s>(&'s self, j0: usize, j1: usize, buf: &'s mut [f32]) -> &'s [f32] {
        let (dv, n) = (self.plan.dv, j1 - j0);
        if let Some((_, v)) = self.wide {
            return &v[j0 * dv..j1 * dv];
        }
        let out = &mut buf[..n * dv];
        let rows = self.value_bytes(j0, j1);
        let l = &self.v.l;
        dequant_token_rows(self.m, rows, l.value_row(), dv, l.value_group, out);
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
        let slab = self.v.l.key_slab();
        let at = (self.block(a) * self.plan.hkv + self.kvh) * slab;
        &self.v.kc[at..at + slab]
    }
}

/// The rows of a quantized cache for the bf16 packers (`prefill_amx`): from the rows the
/// call dequantized once when there are, else dequantized block by block.
#[cfg(target_arch = "x86_64")]
struct QuantRows<'c, M> {
    m: M,
    plan: &'c Plan,
    v: View<'c>,
    wide: Option<&'c Widened>,
}

#[cfg(target_arch = "x86_64")]
impl<M: QuantMicro> super::prefill_amx::PanelRows for QuantRows<'_, M> {
    fn keys(&self, s: usize, kvh: usize, a: usize, b: usize, out: &mut [f32]) {
        let (plan, d) = (self.plan, self.plan.d);
        let sp = &plan.seqs[s];
        let n = (sp.ctx() * d, sp.ctx() * plan.dv);
        if let Some((k, _)) = self.wide.and_then(|w| w.rows_kv(s, kvh, n)) {
            out[..(b - a) * d].copy_from_slice(&k[a * d..b * d]);
            return;
        }
        let (mut sc, mut zp) = (vec![0f32; d], vec![0f32; d]);
        let block = block_of(self.v.block_indices, sp.block_begin, plan.bs, a);
        let slots = (a % plan.bs, b - a);
        dequant_keys(
            self.m,
            plan,
            &self.v,
            (block, kvh),
            slots,
            (&mut sc, &mut zp),
            out,
        );
    }
    fn values(&self, s: usize, kvh: usize, a: usize, b: usize, out: &mut [f32]) {
        let (plan, dv) = (self.plan, self.plan.dv);
        let sp = &plan.seqs[s];
        let n = (sp.ctx() * plan.d, sp.ctx() * dv);
        if let Some((_, v)) = self.wide.and_then(|w| w.rows_kv(s, kvh, n)) {
            out[..(b - a) * dv].copy_from_slice(&v[a * dv..b * dv]);
            return;
        }
        let block = block_of(self.v.block_indices, sp.block_begin, plan.bs, a);
        let rows = value_rows(plan, &self.v.l, self.v.vc, (block, kvh), a, b);
        let l = &self.v.l;
        dequant_token_rows(self.m, rows, l.value_row(), dv, l.value_group, out);
    }
}

/// What a call on quantized caches prepares for its prefill items: u4 blocks unpacked to u8
/// once, and the rows dequantized once (when within budget): into f32 rows, or, when the
/// items run on bf16 products (`Ctx::bf16_tier`), into their packed bf16 panels.
pub(crate) struct Prep {
    unpacked: Option<Unpacked>,
    wide: Option<Widened>,
    #[cfg(target_arch = "x86_64")]
    packed: Option<super::prefill_amx::Packed>,
}

impl Source for u8 {
    /// Decode items cost more per chunk here (the chunks' slots and merge: 4% more instructions
    /// over decode 4 x 4096 and 1 x 16384 cut into 2 and 8 chunks, callgrind), so a long
    /// context is cut only until sequences x KV heads x chunks reaches 32 items, in chunks of
    /// at least 1024 keys (whole online-softmax steps). Items aim at 32 per thread: whichever
    /// thread is free claims the next one, and small items even out threads that run at
    /// different speeds (AMD EPYC AVX2, 2 threads, inside OpenVINO: decode 16 x 1024 in 2-head
    /// items ran 1.94-2.18x the built-in op, 1.74-1.94x with one 8-head item per sequence).
    /// Sequences of more than 16 rows per KV head are prefill sequences.
    const TUNING: Tuning = Tuning {
        row_target: 16,
        chunk_keys: usize::MAX,
        min_chunk_keys: 1024,
        min_decode_items: 32,
        count_heads: true,
        items_per_thread: 32,
        chunk_align: STEP_KEYS,
        direct_scores: true,
    };
    type Layout = QuantLayout;
    type Prep = Prep;

    fn prepare<M: Kernels, Q: Float>(m: M, ctx: &Ctx<'_, Q, u8>) -> Result<Option<Prep>> {
        let plan = ctx.plan;
        let prefill = |s: usize| ctx.part.seqs[s].prefill;
        if !(0..plan.seqs.len()).any(prefill) {
            return Ok(None);
        }
        // u4: the prefill sequences' blocks unpacked to u8 once per call (many query tiles read
        // them); decode items unpack their own.
        let unpacked = match ctx.layout.bits {
            8 => None,
            _ => {
                let packed = (ctx.kc, ctx.vc, ctx.block_indices);
                Some(super::u4::unpack(
                    ctx.runner,
                    plan,
                    &ctx.layout,
                    packed,
                    prefill,
                )?)
            }
        };
        let v = unpacked
            .as_ref()
            .map_or_else(|| View::of(ctx), View::unpacked);
        let wide = dequant_prefill_rows(m, (plan, ctx.runner), &v, prefill);
        #[cfg(target_arch = "x86_64")]
        if let Some(tier) = ctx.bf16_tier {
            // The panels from the f32 rows (or block by block past their budget); the f32 rows
            // are not read again.
            let rows = QuantRows {
                m,
                plan,
                v,
                wide: wide.as_ref(),
            };
            let packed = super::prefill_amx::prepack(m, tier.bf, ctx, &rows);
            return Ok(Some(Prep {
                unpacked,
                wide: if packed.is_some() { None } else { wide },
                packed,
            }));
        }
        Ok(Some(Prep {
            unpacked,
            wide,
            #[cfg(target_arch = "x86_64")]
            packed: None,
        }))
    }

    fn prefill_item<M: Kernels, Q: Float>(
        m: M,
        ctx: &Ctx<'_, Q, u8>,
        it: &Item,
        o: &Out<'_, Q, u8>,
    ) {
        let (plan, prep) = (ctx.plan, o.prep.as_ref());
        let (si, ctx_len) = (it.seq as usize, plan.seqs[it.seq as usize].ctx());
        let n = (ctx_len * plan.d, ctx_len * plan.dv);
        let sp = &plan.seqs[si];
        let v = match prep.and_then(|p| p.unpacked.as_ref()) {
            Some(u) => View::unpacked(u),
            None => View::of(ctx),
        };
        let wide = prep.and_then(|p| p.wide.as_ref());
        #[cfg(target_arch = "x86_64")]
        if let Some(tier) = ctx.bf16_tier {
            let packed = prep.and_then(|p| p.packed.as_ref());
            let rows = QuantRows { m, plan, v, wide };
            return super::prefill_amx::run_item(m, tier, ctx, it, o, (packed, &rows));
        }
        prefill::run_item_on(m, ctx, it, o, |kvh| QuantTiles {
            m,
            plan,
            v,
            sp,
            kvh,
            wide: wide.and_then(|w| w.rows_kv(si, kvh, n)),
            params: RefCell::default(),
        })
    }

    fn decode_item<M: Kernels, Q: Float>(
        m: M,
        ctx: &Ctx<'_, Q, u8>,
        it: &Item,
        o: &Out<'_, Q, u8>,
    ) {
        let plan = ctx.plan;
        let (si, chunk) = (it.seq as usize, it.chunk as usize);
        let (sp, lay) = (&plan.seqs[si], &ctx.part.seqs[si]);
        let (kvh0, kvh1) = (it.kvh0 as usize, it.kvh1 as usize);
        if let Some(at) = lay.direct_part(kvh0, (0, 1), sp.ctx()) {
            // SAFETY: the item's KV heads' partial scores are its own (see `attend_tile`).
            let part = unsafe { o.direct.part(at, (kvh1 - kvh0) * sp.ctx()) };
            part.fill(0.0);
        }
        let t0 = it.qt as usize * lay.qtok;
        let t1 = (t0 + lay.qtok).min(sp.n);
        let keys = lay.chunk_range(chunk, sp.ctx());
        let (pw, sw, direct) = (&o.pw, o.sw.as_ref(), &o.direct);
        let out = Slots {
            pw,
            sw,
            direct,
            lay,
            chunk,
        };
        // u8 and u4 caches alike: the products read the cache's bytes in place (`QRows`).
        let v = View::of(ctx);
        DECODE_SCRATCH.with(|s| {
            let mut s = s.borrow_mut();
            let (sc, heads) = s.fit(plan, kvh1 - kvh0);
            let tokens_per_tile = (ROWS / plan.g).max(1);
            for i0 in (t0..t1).step_by(tokens_per_tile) {
                let i1 = (i0 + tokens_per_tile).min(t1);
                // Rows of a KV head beyond ROWS (G > ROWS) make more tiles, chunk by chunk.
                let per_head = (i1 - i0) * plan.g;
                for c0 in (0..per_head).step_by(ROWS) {
                    for (k, h) in heads.iter_mut().enumerate() {
                        h.rows.clear();
                        let rows = rows_of(plan, sp, kvh0 + k, (i0, i1));
                        h.rows.extend(rows.skip(c0).take(ROWS));
                    }
                    let input = (&v, ctx.query);
                    attend_tile(m, plan, input, sp, kvh0, heads, sc, keys, &out);
                }
            }
        })
    }

    /// Dequantized as the reference does (`kernel::quant::key_row`, u4 included).
    fn keys<'s, Q>(ctx: &'s Ctx<'_, Q, u8>, at: KeyTile, buf: &'s mut [f32]) -> &'s [f32] {
        let ((d, bs), (sp, kvh, (j0, j1))) = ((ctx.plan.d, ctx.plan.bs), at);
        let block = block_of(ctx.block_indices, sp.block_begin, bs, j0);
        let out = &mut buf[..(j1 - j0) * d];
        for (k, o) in out.chunks_exact_mut(d).enumerate() {
            quant::key_row(&ctx.layout, ctx.kc, block, kvh, j0 % bs + k, o);
        }
        out
    }

    fn release(prep: Prep) {
        if let Some(u) = prep.unpacked {
            u.keep();
        }
    }
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

/// Steps 1 and 2 on quantized caches: rotation of the cached keys, then insertion of the new
/// rows, each KV head a task of its own (they touch only its bytes), in the reference's order.
pub(crate) fn write<Q: Float>(
    runner: Runner,
    plan: &Plan,
    l: &QuantLayout,
    b: &mut Bound<'_, Q, u8>,
) {
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
