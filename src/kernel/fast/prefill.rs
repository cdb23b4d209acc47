//! Step 3 for prefill items (sequences with several query tiles): one query tile of one KV head
//! over all its visible keys, with the logits kept transposed (`st[key][row]`).
//!
//! Per key tile (the keys of one cache block): the K block is widened once to f32 (f32 caches
//! are read in place), `qk_t` fills the logits against the item's `[D][rows]` query panel,
//! masks are applied, `softmax_t` does the online-softmax step for all rows at once (lane-wise,
//! no horizontal sums), and `pv_t` folds the correction factor and the weighted V block into
//! the accumulator. The per-row arithmetic (online softmax over key tiles in key order) is the
//! same as the generic item path's; only the inner loops differ.

use super::micro::TileMicro;
use super::partition::Item;
use super::pool::{Buf, Pooled};
use super::shared::SharedMut;
use super::source::{Ctx, Out, Source};
use super::tile::{finite_outside, grow, mask_tile_strided, prefetch_part};
use crate::dtype::{as_f32, Float};
use crate::kernel::layout::{seen_by_all, seq_row, seq_row_of, tiles, visible_span, window_start};
use crate::kernel::softmax::OnlineSoftmax;
use crate::op::{Plan, SeqPlan};
use crate::threads::Runner;
use std::any::TypeId;
use std::cell::RefCell;

/// Rows per `pv_t` call of kernels that do not prefetch (a multiple of the kernels' 6-row
/// blocks; `qk_t` calls take `TileMicro::QK_ROWS`): their prefetches go between the calls.
const PV_ROWS: usize = 12;

/// Part `i` of `parts` near-equal parts of `x`.
fn slice_part<T>(x: &[T], i: usize, parts: usize) -> &[T] {
    &x[x.len() * i / parts..x.len() * (i + 1) / parts]
}

/// Per-thread buffers of prefill items, grown on demand (no allocation per tile).
#[derive(Default)]
pub(super) struct Scratch {
    pub qr: Vec<f32>,
    pub qt: Vec<f32>,
    pub acc: Vec<f32>,
    pub st: Vec<f32>,
    pub kf: Vec<f32>,
    pub vf: Vec<f32>,
    pub m: Vec<f32>,
    pub l: Vec<f32>,
    pub c: Vec<f32>,
    pub kept: Vec<f32>,
}

/// What a prefill item works in, from its thread's [`Scratch`]: the query panel, fresh row
/// state, and the logit tile and key/value staging buffers `attend` takes.
pub(super) struct ItemBufs<'s> {
    pub qt: &'s [f32],
    pub state: RowState<'s>,
    pub tiles: (&'s mut Vec<f32>, &'s mut Vec<f32>, &'s mut Vec<f32>),
    /// The score rows' logits, for direct scores.
    pub kept: &'s mut Vec<f32>,
}

impl Scratch {
    /// Starts an item: the query panel of rows `t*G + g` (tokens `t0..t0+nt` of `sp`, the
    /// query heads of KV head `kvh`) widened to f32 and transposed to `[D][rows8]` (rows8 =
    /// rows rounded up to 8; padding rows 0; not scaled: the logits are), and fresh state for
    /// its rows.
    #[allow(clippy::too_many_arguments)]
    pub fn start<'s, M: TileMicro, Q: Float>(
        &'s mut self,
        m: M,
        plan: &Plan,
        query: &[Q],
        sp: &SeqPlan,
        kvh: usize,
        (t0, nt): (usize, usize),
    ) -> ItemBufs<'s> {
        let Scratch {
            qr,
            qt,
            acc,
            st,
            kf,
            vf,
            m: mb,
            l: lb,
            c: cb,
            kept,
        } = self;
        let (h, d, g) = (plan.h, plan.d, plan.g);
        let rows = nt * g;
        let rows8 = rows.div_ceil(8) * 8;
        let qt = aligned(qt, d * rows8);
        let qr = aligned(qr, rows8 * d);
        // A token's rows lie H*D elements after the last's (past the hardware prefetcher):
        // each token's rows are requested two tokens ahead.
        let rows_of = |ti: usize| &query[((sp.begin + t0 + ti) * h + kvh * g) * d..][..g * d];
        for ti in 0..nt.min(2) {
            prefetch_part(rows_of(ti), 0, 1);
        }
        for ti in 0..nt {
            if ti + 2 < nt {
                prefetch_part(rows_of(ti + 2), 0, 1);
            }
            m.widen(rows_of(ti), &mut qr[ti * g * d..(ti + 1) * g * d]);
        }
        qr[rows * d..].fill(0.0);
        m.transpose(qr, rows, d, qt, rows8);
        ItemBufs {
            qt,
            state: RowState::new(rows, plan.dv, acc, mb, lb, cb),
            tiles: (st, kf, vf),
            kept,
        }
    }
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// `v[..n]` starting at a 64-byte boundary (the buffer keeps 64 spare bytes for that), so
/// panel rows do not straddle cache lines more than they must.
pub(super) fn aligned<T: Copy + Default>(v: &mut Vec<T>, n: usize) -> &mut [T] {
    let spare = 64 / std::mem::size_of::<T>();
    grow(v, n + spare);
    let off = v.as_ptr().align_offset(64).min(spare);
    &mut v[off..off + n]
}

/// One KV head's f32 K and V rows `[ctx][D]`, `[ctx][Dv]` (widened or dequantized once per call).
pub(super) type KvRows<'a> = (&'a [f32], &'a [f32]);

/// f32 copies of the K and V rows of the prefill sequences (f16/bf16 caches): each row is
/// widened once per call instead of once per query tile that reads it.
pub(crate) struct Widened {
    k: Buf<f32>,
    v: Buf<f32>,
    /// Per sequence, the offsets of its K and V rows (`[Hkv][ctx][D]`, `[Hkv][ctx][Dv]`),
    /// `None` when not widened.
    base: Vec<Option<(usize, usize)>>,
}

impl Widened {
    /// f32 K and V rows `[Hkv][ctx][D]`, `[Hkv][ctx][Dv]` of the prefill sequences
    /// (`prefill(s)`), made by `fill(s, kvh, k, v)` per (sequence, KV head) in parallel, which
    /// must write every element of its rows (they start unspecified); `None` when there are none
    /// or they would exceed `2*T*H*max(D, Dv)` floats each (memory per call stays O(T*H*D)).
    pub(super) fn build(
        (plan, runner): (&Plan, Runner),
        prefill: impl Fn(usize) -> bool,
        fill: impl Fn(usize, usize, &mut [f32], &mut [f32]) + Sync,
    ) -> Option<Widened> {
        let (d, dv) = (plan.d, plan.dv);
        let budget = 2 * plan.t * plan.h * d.max(dv);
        let region = |sp: &SeqPlan| (sp.ctx() * d, sp.ctx() * dv);
        let sizes = (region, budget, false);
        let (k, v, base) = per_head_regions((plan, runner), prefill, sizes, fill)?;
        Some(Widened { k, v, base })
    }

    /// The widened K and V rows `[ctx][D]`, `[ctx][Dv]` of KV head `kvh` of sequence `s`
    /// (`(nk, nv)` = ctx*D, ctx*Dv elements).
    pub(super) fn rows_kv(
        &self,
        s: usize,
        kvh: usize,
        (nk, nv): (usize, usize),
    ) -> Option<KvRows<'_>> {
        self.base[s].map(|(bk, bv)| {
            let (ok, ov) = (bk + kvh * nk, bv + kvh * nv);
            (&self.k[ok..ok + nk], &self.v[ov..ov + nv])
        })
    }
}

/// K buffer, V buffer, and each sequence's offsets in them (`None`: not a prefill sequence).
pub(super) type Regions<T> = (Buf<T>, Buf<T>, Vec<Option<(usize, usize)>>);

/// Runs `fill(s, kvh, k, v)` on every (prefill sequence `s`: `prefill(s)`, KV head) in
/// parallel on `runner`, `k` and `v` being that head's `region(seq)` (K, V) elements of two
/// buffers from the pool, zeroed when `zero` (else their contents are unspecified, for fills
/// that write every element); `None` when there is nothing to fill or a buffer would exceed
/// `budget` elements.
pub(super) fn per_head_regions<T>(
    (plan, runner): (&Plan, Runner),
    prefill: impl Fn(usize) -> bool,
    (region, budget, zero): (impl Fn(&SeqPlan) -> (usize, usize) + Sync, usize, bool),
    fill: impl Fn(usize, usize, &mut [T], &mut [T]) + Sync,
) -> Option<Regions<T>>
where
    T: Pooled,
{
    let hkv = plan.hkv;
    let mut base = vec![None; plan.seqs.len()];
    let (mut klen, mut vlen) = (0, 0);
    for (s, sp) in plan.seqs.iter().enumerate() {
        if prefill(s) {
            base[s] = Some((klen, vlen));
            let (kr, vr) = region(sp);
            klen += kr * hkv;
            vlen += vr * hkv;
        }
    }
    if klen == 0 || klen.max(vlen) > budget {
        return None;
    }
    let buf = if zero { Buf::zeroed } else { Buf::any };
    let (mut k, mut v) = (buf(klen), buf(vlen));
    // One task per (prefill sequence, KV head): (s, kvh, K offset, V offset).
    let tasks: Vec<(usize, usize, usize, usize)> = (0..plan.seqs.len())
        .filter_map(|s| base[s].map(|b| (s, b)))
        .flat_map(|(s, (kb, vb))| {
            let (kr, vr) = region(&plan.seqs[s]);
            (0..hkv).map(move |kvh| (s, kvh, kb + kvh * kr, vb + kvh * vr))
        })
        .collect();
    {
        let (kw, vw) = (SharedMut::new(&mut k), SharedMut::new(&mut v));
        runner.for_each(tasks.len(), &|i| {
            let (s, kvh, ko, vo) = tasks[i];
            let (kr, vr) = region(&plan.seqs[s]);
            // SAFETY: the tasks' regions are disjoint (laid out one after another above).
            let (ka, va) = unsafe { (kw.part(ko, kr), vw.part(vo, vr)) };
            fill(s, kvh, ka, va);
        });
    }
    Some((k, v, base))
}

/// Widens the K and V rows the prefill items will read, when the cache is f16/bf16 and the
/// copies stay within `2*T*H*D` floats each (so memory per call stays O(T*H*D)); else `None`
/// and items widen tile by tile.
pub(crate) fn prewiden<M: TileMicro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
) -> Option<Widened> {
    let plan = ctx.plan;
    let (d, dv, bs) = (plan.d, plan.dv, plan.bs);
    if TypeId::of::<C>() == TypeId::of::<f32>() {
        return None;
    }
    Widened::build(
        (plan, ctx.runner),
        |s| ctx.part.seqs[s].prefill,
        |s, kvh, ka, va| {
            let sp = &plan.seqs[s];
            for (j0, j1) in tiles(0, sp.ctx(), bs) {
                let ko = seq_row(plan, ctx.block_indices, sp, kvh, j0);
                let vo = seq_row_of(plan, plan.dv, ctx.block_indices, sp, kvh, j0);
                let (nk, nv) = ((j1 - j0) * d, (j1 - j0) * dv);
                m.widen(&ctx.kc[ko..ko + nk], &mut ka[j0 * d..j1 * d]);
                m.widen(&ctx.vc[vo..vo + nv], &mut va[j0 * dv..j1 * dv]);
            }
        },
    )
}

/// The rows of one prefill item: query tokens `t0..t0+nt` of sequence `si` (`rows` = nt x G,
/// row `ti*G + g`), at positions `pos0..`, seeing keys `lo..hi`.
pub(super) struct ItemRows {
    pub si: usize,
    pub t0: usize,
    pub nt: usize,
    pub rows: usize,
    pub pos0: usize,
    pub lo: usize,
    pub hi: usize,
}

impl ItemRows {
    pub fn new<Q, C: Source>(ctx: &Ctx<'_, Q, C>, it: &Item) -> ItemRows {
        let plan = ctx.plan;
        let si = it.seq as usize;
        let (sp, lay) = (&plan.seqs[si], &ctx.part.seqs[si]);
        debug_assert!(lay.nchunks == 1, "prefill items cover all keys");
        let t0 = it.qt as usize * lay.qtok;
        let nt = lay.qtok.min(sp.n - t0);
        let pos0 = sp.past + t0;
        let pos_max = pos0 + nt - 1;
        ItemRows {
            si,
            t0,
            nt,
            rows: nt * plan.g,
            pos0,
            lo: window_start(plan, pos0),
            hi: sp.ctx().min(pos_max + 1),
        }
    }
}

/// Copies the masked logits of the item's score rows (`st[jj*ldt + r]`, keys `j0..j0+n`) into
/// the stash.
#[allow(clippy::too_many_arguments)]
pub(super) fn stash_logits<Q, C: Source>(
    ctx: &Ctx<'_, Q, C>,
    ir: &ItemRows,
    kvh: usize,
    st: &[f32],
    ldt: usize,
    j0: usize,
    n: usize,
    sw: &SharedMut<'_, f32>,
) {
    let plan = ctx.plan;
    let (h, g) = (plan.h, plan.g);
    let (sp, lay) = (&plan.seqs[ir.si], &ctx.part.seqs[ir.si]);
    let first_score = sp.n - sp.score_tokens;
    for ti in first_score.max(ir.t0)..ir.t0 + ir.nt {
        for gi in 0..g {
            let r = (ti - ir.t0) * g + gi;
            let row = lay.stash_base + ((ti - first_score) * h + kvh * g + gi) * sp.ctx();
            // SAFETY: stash row (token, head) belongs to this item's KV head and query
            // tile, and keys j0..j0+n to this item: no other item writes there.
            let dst = unsafe { sw.part(row + j0, n) };
            for (jj, o) in dst.iter_mut().enumerate() {
                *o = st[jj * ldt + r];
            }
        }
    }
}

/// Key tiles at the end of an item over which [`prefetch_out`] spreads its requests.
const OUT_AHEAD_TILES: usize = 4;

/// Requests the output rows an item writes at its end, a part per key tile over its last
/// [`OUT_AHEAD_TILES`] tiles (a token's G rows `[G*D]` lie `H*D` elements after the last
/// token's, past the hardware prefetcher, and written cold every store waits on memory).
/// `(token0, nt, kvh)`: the item's first token in the batch, its token count and KV head;
/// `(lo, hi, j0)`: its key range and the current tile's first key.
pub(super) fn prefetch_out<Q>(
    plan: &Plan,
    out: &SharedMut<'_, Q>,
    (token0, nt, kvh): (usize, usize, usize),
    (lo, hi, j0): (usize, usize, usize),
) {
    let (h, dv, g, bs) = (plan.h, plan.dv, plan.g, plan.bs);
    let ntiles = (hi - 1) / bs - lo / bs + 1;
    let last = ntiles.min(OUT_AHEAD_TILES);
    let Some(part) = (j0 / bs - lo / bs).checked_sub(ntiles - last) else {
        return;
    };
    for t in token0 + nt * part / last..token0 + nt * (part + 1) / last {
        out.prefetch((t * h + kvh * g) * dv, g * dv, (0, 1));
    }
}

/// Writes each row's output `acc[r*lda..][..Dv] / l` and its `[m, l]` partial-result slot.
#[allow(clippy::too_many_arguments)]
pub(super) fn write_rows<Q: Float, C: Source>(
    ctx: &Ctx<'_, Q, C>,
    ir: &ItemRows,
    kvh: usize,
    acc: &[f32],
    lda: usize,
    mb: &[f32],
    lb: &[f32],
    pw: &SharedMut<'_, f32>,
    out: &SharedMut<'_, Q>,
) {
    let plan = ctx.plan;
    let (h, dv, g) = (plan.h, plan.dv, plan.g);
    let (sp, lay) = (&plan.seqs[ir.si], &ctx.part.seqs[ir.si]);
    for r in 0..ir.rows {
        let (ti, gi) = (r / g, r % g);
        let row = (ir.t0 + ti) * h + kvh * g + gi;
        // SAFETY: the [m, l] slot and the output row of (token, head) are written by this item
        // only (one item per KV head and query tile).
        let (slot, orow) = unsafe {
            (
                pw.part(lay.part_base + row * 2, 2),
                out.part((sp.begin * h + row) * dv, dv),
            )
        };
        let mut st = OnlineSoftmax {
            max: mb[r],
            sum: lb[r],
        };
        // One reciprocal per row (a multiply per element, not a divide: within 1 ulp of a / l).
        let inv = st.finish(plan.sink(kvh * g + gi));
        slot[0] = st.max;
        slot[1] = st.sum;
        for (o, a) in orow.iter_mut().zip(&acc[r * lda..r * lda + dv]) {
            *o = Q::from_f32(a * inv);
        }
    }
}

/// Runs one prefill item (one KV head, one query tile, all visible keys) of a float cache on
/// the f32 tiles: the cache read in place, or `wide`, the call's f32 copies of half-precision
/// K and V rows, when it made them.
pub(crate) fn run_item<M: TileMicro, Q: Float, C: Float>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    it: &Item,
    o: &Out<'_, Q, C>,
    wide: Option<&Widened>,
) {
    let plan = ctx.plan;
    let sp = &plan.seqs[it.seq as usize];
    let (nk, nv) = (sp.ctx() * plan.d, sp.ctx() * plan.dv);
    run_item_on(m, ctx, it, o, |kvh| CacheTiles {
        m,
        ctx,
        sp,
        kvh,
        wide: wide.and_then(|w| w.rows_kv(it.seq as usize, kvh, (nk, nv))),
    })
}

/// Runs one prefill item on the tiles `tiles(kvh)` gives for each of its KV heads (whatever
/// the cache type): writes its rows' output `acc / l` and their `[m, l]` partial-result slots,
/// and the score rows' logits into the stash, or (`SeqLayout::direct`) their final weights
/// into the partial scores of (KV head, query tile).
pub(super) fn run_item_on<M: TileMicro, Q: Float, C: Source, S: TileSource>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    it: &Item,
    o: &Out<'_, Q, C>,
    tiles: impl Fn(usize) -> S,
) {
    SCRATCH.with(|s| {
        let sc = &mut *s.borrow_mut();
        for kvh in it.kvh0 as usize..it.kvh1 as usize {
            run_head(m, ctx, (it, kvh), o, &tiles(kvh), sc);
        }
    })
}

fn run_head<M: TileMicro, Q: Float, C: Source, S: TileSource>(
    m: M,
    ctx: &Ctx<'_, Q, C>,
    (it, kvh): (&Item, usize),
    o: &Out<'_, Q, C>,
    src: &S,
    sc: &mut Scratch,
) {
    let plan = ctx.plan;
    let g = plan.g;
    let ir = ItemRows::new(ctx, it);
    let (sp, lay) = (&plan.seqs[ir.si], &ctx.part.seqs[ir.si]);
    let rows8 = ir.rows.div_ceil(8) * 8;
    let (out, sw) = (&o.out, o.sw.as_ref());
    // Direct scores: the score rows (a suffix: rows are token-major) keep their logits
    // row-major over the item's keys.
    let direct = lay.direct_part(kvh, (it.qt as usize, sp.n.div_ceil(lay.qtok)), sp.ctx());
    let first_scored = (sp.n - sp.score_tokens).clamp(ir.t0, ir.t0 + ir.nt);
    let (r_sc, keys) = ((first_scored - ir.t0) * g, ir.hi - ir.lo);
    let ItemBufs {
        qt,
        mut state,
        tiles,
        kept,
    } = sc.start(m, plan, ctx.query, sp, kvh, (ir.t0, ir.nt));
    if direct.is_some() {
        kept.clear();
        kept.resize((ir.rows - r_sc) * keys, f32::NEG_INFINITY);
    }
    let span = (ir.pos0, ir.nt, ir.lo, ir.hi);
    attend(
        m,
        plan,
        src,
        kvh,
        span,
        qt,
        &mut state,
        tiles,
        |st, j0, n| {
            if direct.is_some() {
                for r in r_sc..ir.rows {
                    let dst = &mut kept[(r - r_sc) * keys + j0 - ir.lo..][..n];
                    for (jj, o) in dst.iter_mut().enumerate() {
                        *o = st[jj * rows8 + r];
                    }
                }
            } else if let Some(sw) = sw {
                stash_logits(ctx, &ir, kvh, st, rows8, j0, n, sw);
            }
            prefetch_out(
                plan,
                out,
                (sp.begin + ir.t0, ir.nt, kvh),
                (ir.lo, ir.hi, j0),
            );
            // The query rows of the tile before this one (the items of a KV head come in
            // falling query tiles), likely the next this thread packs: a part per key tile.
            let (bs, tile) = (plan.bs, (j0 / plan.bs).saturating_sub(ir.lo / plan.bs));
            let ntiles = (ir.hi - 1) / bs - ir.lo / bs + 1;
            for t in ir.t0.saturating_sub(lay.qtok)..ir.t0 {
                let rows = &ctx.query[((sp.begin + t) * plan.h + kvh * g) * plan.d..];
                prefetch_part(&rows[..g * plan.d], tile, ntiles);
            }
        },
    );
    let RowState {
        acc, m: mb, l: lb, ..
    } = state;
    write_rows(ctx, &ir, kvh, acc, plan.dv, mb, lb, &o.pw, out);
    if let Some(at) = direct {
        // SAFETY: the partial scores of (KV head, query tile) belong to this item.
        let part = unsafe { o.direct.part(at, sp.ctx()) };
        add_direct_scores(m, plan, (&ir, kvh), (kept, r_sc), (mb, lb), part);
    }
}

/// The direct partial scores of an item's score rows `r_sc..rows` (`SeqLayout::direct`):
/// `part` (the item's slice, one value per key of the sequence) becomes the sum over those rows
/// of their final softmax weights, from their logits `kept` (row-major over keys `lo..hi`) and
/// their statistics `mb`, `lb` as `write_rows` ends them (with the sink).
pub(super) fn add_direct_scores<M: TileMicro>(
    m: M,
    plan: &Plan,
    (ir, kvh): (&ItemRows, usize),
    (kept, r_sc): (&[f32], usize),
    (mb, lb): (&[f32], &[f32]),
    part: &mut [f32],
) {
    let (g, keys) = (plan.g, ir.hi - ir.lo);
    part.fill(0.0);
    for r in r_sc..ir.rows {
        let mut st = OnlineSoftmax {
            max: mb[r],
            sum: lb[r],
        };
        st.finish(plan.sink(kvh * g + r % g));
        // The keys the row sees only: a NaN row must not reach a masked key.
        let (a, b) = visible_span(plan, ir.pos0 + r / g, ir.lo, ir.hi);
        if a < b {
            let kept = &kept[(r - r_sc) * keys + a - ir.lo..][..b - a];
            m.add_exp_scaled(&mut part[a..b], kept, st.max, st.norm());
        }
    }
}

/// The running state of a prefill item's rows: accumulators `[rows][Dv]` and the lane-wise
/// softmax state (`m`, `l`, and `c`, the last step's rescale factors).
pub(super) struct RowState<'a> {
    pub acc: &'a mut [f32],
    pub m: &'a mut [f32],
    pub l: &'a mut [f32],
    pub c: &'a mut [f32],
    rows: usize,
}

impl<'a> RowState<'a> {
    /// Fresh state for `rows` rows (accumulators `dv` wide), in the given per-thread buffers.
    pub fn new(
        rows: usize,
        dv: usize,
        acc: &'a mut Vec<f32>,
        m: &'a mut Vec<f32>,
        l: &'a mut Vec<f32>,
        c: &'a mut Vec<f32>,
    ) -> RowState<'a> {
        let rows8 = rows.div_ceil(8) * 8;
        let acc = aligned(acc, rows * dv);
        let (m, l, c) = (aligned(m, rows8), aligned(l, rows8), aligned(c, rows8));
        acc.fill(0.0);
        m.fill(f32::NEG_INFINITY);
        l.fill(0.0);
        RowState { acc, m, l, c, rows }
    }
}

/// Where a prefill item's key and value tiles come from (a cache read in place, the call's
/// widened copies, u8 blocks dequantized tile by tile) and what to start loading meanwhile.
pub(super) trait TileSource {
    /// Element type of the prefetch hints.
    type Pf;
    /// The f32 keys `j0..j1` (`[n][D]`, inside one cache block); `buf` (`n*D` floats) holds
    /// them when they are not f32 in memory.
    fn keys<'s>(&'s self, j0: usize, j1: usize, buf: &'s mut [f32]) -> &'s [f32];
    /// The f32 values `j0..j1` (`[n][Dv]`), as `keys` (`buf`: `n*Dv` floats).
    fn values<'s>(&'s self, j0: usize, j1: usize, buf: &'s mut [f32]) -> &'s [f32];
    /// What to load while tile `j0..j1`'s logits are computed (its values), if anything.
    fn values_ahead(&self, j0: usize, j1: usize) -> &[Self::Pf];
    /// What to load while tile `j0..j1`'s values are summed (the keys of the next tile).
    fn keys_ahead(&self, next: Option<(usize, usize)>) -> &[Self::Pf];
}

/// A float cache's tiles: the call's widened copies of the head when there are, else the cache
/// read in place (f32) or widened tile by tile.
struct CacheTiles<'c, 'a, M, Q, C: Float> {
    m: M,
    ctx: &'c Ctx<'a, Q, C>,
    sp: &'c SeqPlan,
    kvh: usize,
    wide: Option<KvRows<'c>>,
}

impl<M: TileMicro, Q, C: Float> CacheTiles<'_, '_, M, Q, C> {
    fn tile(&self, j0: usize, j1: usize) -> (&[C], &[C]) {
        let (plan, n) = (self.ctx.plan, j1 - j0);
        let ko = seq_row(plan, self.ctx.block_indices, self.sp, self.kvh, j0);
        let vo = seq_row_of(plan, plan.dv, self.ctx.block_indices, self.sp, self.kvh, j0);
        (
            &self.ctx.kc[ko..ko + n * plan.d],
            &self.ctx.vc[vo..vo + n * plan.dv],
        )
    }

    fn rows<'s>(&'s self, x: &'s [C], buf: &'s mut [f32]) -> &'s [f32] {
        match as_f32(x) {
            Some(x) => x,
            None => {
                let buf = &mut buf[..x.len()];
                self.m.widen(x, buf);
                buf
            }
        }
    }
}

impl<M: TileMicro, Q, C: Float> TileSource for CacheTiles<'_, '_, M, Q, C> {
    type Pf = C;
    fn keys<'s>(&'s self, j0: usize, j1: usize, buf: &'s mut [f32]) -> &'s [f32] {
        let d = self.ctx.plan.d;
        match self.wide {
            Some((k, _)) => &k[j0 * d..j1 * d],
            None => self.rows(self.tile(j0, j1).0, buf),
        }
    }
    fn values<'s>(&'s self, j0: usize, j1: usize, buf: &'s mut [f32]) -> &'s [f32] {
        let dv = self.ctx.plan.dv;
        match self.wide {
            Some((_, v)) => &v[j0 * dv..j1 * dv],
            None => self.rows(self.tile(j0, j1).1, buf),
        }
    }
    // Widened rows are contiguous per head (the hardware prefetcher follows them): hints are
    // for scattered cache blocks only.
    fn values_ahead(&self, j0: usize, j1: usize) -> &[C] {
        match self.wide {
            Some(_) => &[],
            None => self.tile(j0, j1).1,
        }
    }
    fn keys_ahead(&self, next: Option<(usize, usize)>) -> &[C] {
        match (self.wide, next) {
            (None, Some((a, b))) => self.tile(a, b).0,
            _ => &[],
        }
    }
}

/// One prefill item's attention over keys `lo..hi`, one cache block per tile: `qk_t` fills the
/// transposed logits against the query panel `qt`, masks are applied, `on_logits(st, j0, n)`
/// sees them (the score rows' stash), `softmax_t` takes the online-softmax step for all rows,
/// and `pv_t` folds the rescale factor and the weighted values into the accumulators.
/// `(pos0, nt, lo, hi)`: the item's first position, token count and key range; `bufs`: the
/// logit tile and the key/value staging buffers (per thread).
#[allow(clippy::too_many_arguments)]
pub(super) fn attend<M: TileMicro, S: TileSource>(
    m: M,
    plan: &Plan,
    src: &S,
    kvh: usize,
    (pos0, nt, lo, hi): (usize, usize, usize, usize),
    qt: &[f32],
    state: &mut RowState<'_>,
    (st, kf, vf): (&mut Vec<f32>, &mut Vec<f32>, &mut Vec<f32>),
    mut on_logits: impl FnMut(&[f32], usize, usize),
) {
    let (d, dv, g, bs) = (plan.d, plan.dv, plan.g, plan.bs);
    let rows = state.rows;
    let rows8 = rows.div_ceil(8) * 8;
    let st = aligned(st, bs * rows8);
    let (kf, vf) = (aligned(kf, bs * d), aligned(vf, bs * dv));
    let RowState {
        acc,
        m: mb,
        l: lb,
        c: cb,
        ..
    } = state;
    // Cache blocks are scattered, so the hardware prefetcher cannot guess the next one: this
    // tile's V block is requested during the QK calls and the next tile's K block during the
    // PV calls, by the kernels themselves a line every few inner steps where they can
    // (`TileMicro::PREFETCHES`: a whole block requested at once stalls on the line fill
    // buffers), else a slice after each call.
    let mut next = tiles(lo, hi, bs);
    next.next();
    for (j0, j1) in tiles(lo, hi, bs) {
        let n = j1 - j0;
        let kn = src.keys_ahead(next.next());
        let vp = src.values_ahead(j0, j1);
        let kx = src.keys(j0, j1, kf);
        // The keys of the tile rows `..r_end` see at most: up to the last one's causal edge.
        // On the diagonal (the first row does not see them all) rows go in blocks that each
        // take only those keys: the later ones are masked for all of the block's rows, so their
        // logits (set to -inf by the mask) and products (weight 0, finite value) are skipped.
        let edge = |r_end: usize| {
            (pos0 + (r_end.min(rows) - 1) / g + 1)
                .saturating_sub(j0)
                .min(n)
        };
        let diagonal = edge(1) < n;
        let qkr = if diagonal {
            M::QK_ROWS.min(32)
        } else {
            M::QK_ROWS
        };
        let parts = rows8.div_ceil(qkr);
        for (i, r) in (0..rows8).step_by(qkr).enumerate() {
            let rr = qkr.min(rows8 - r);
            let pf = slice_part(vp, i, parts);
            let s = &mut st[r..];
            let nk = edge(r + rr);
            if nk > 0 {
                m.qk_t(&qt[r..], rows8, rr, kx, nk, d, s, rows8, plan.scale, pf);
            }
            if !M::PREFETCHES || nk == 0 {
                prefetch_part(pf, 0, 1);
            }
        }
        mask_tile_strided(plan, st, (1, rows8), rows, n, kvh, pos0, j0);
        on_logits(st, j0, n);
        m.softmax_t(st, rows8, rows, n, mb, lb, cb);
        let vx = src.values(j0, j1, vf);
        let (a, b) = seen_by_all(plan, pos0, pos0 + nt - 1, j0, j1);
        if finite_outside(vx, n, dv, (a - j0, b - j0)) {
            // Kernels that prefetch take all rows in one call (their requests spread over it),
            // except on the diagonal, where each block of rows sums its own keys only (at
            // least one: a block that sees none still takes its correction, and the first
            // key's value is finite, being masked for some row).
            let pvr = if M::PREFETCHES && !diagonal {
                rows
            } else {
                PV_ROWS
            };
            let parts = rows.div_ceil(pvr);
            for (i, r) in (0..rows).step_by(pvr).enumerate() {
                let rr = pvr.min(rows - r);
                let pf = slice_part(kn, i, parts);
                let (p, a) = (&st[r..], &mut acc[r * dv..]);
                let nk = edge(r + rr).max(1);
                m.pv_t(p, rows8, rr, vx, nk, dv, &cb[r..], a, pf);
                if !M::PREFETCHES {
                    prefetch_part(pf, 0, 1);
                }
            }
        } else {
            // A non-finite value some row is masked for: each row over its own keys.
            for r in 0..rows {
                let (a, b) = visible_span(plan, pos0 + r / g, j0, j1);
                let (a, b) = (a - j0, b - j0);
                if a < b {
                    let (p, v) = (&st[a * rows8 + r..], &vx[a * dv..b * dv]);
                    let (cr, ar) = (&cb[r..], &mut acc[r * dv..]);
                    m.pv_t(p, rows8, 1, v, b - a, dv, cr, ar, &kn[..0]);
                }
            }
        }
    }
}
