//! Step 3 for prefill items on bf16 products: AMX-BF16 tiles (bf16 math, or any query with a
//! bf16 cache), or `vdpbf16ps` on CPUs with AVX512-BF16 and no AMX (bf16 math only): the item
//! of `prefill` (one KV head, one query tile, all visible keys) with its two products, QK and
//! PV, on either ([`Products`]; both read the same packed panels and compute the same sums).
//!
//! Everything else is `prefill`'s: the item geometry, masks and ALiBi (`mask_tile_strided`),
//! the stash of score logits, the online-softmax step (`TileMicro::softmax_t`, f32) and the
//! output writing. Keys are visited in spans of up to `SPAN` keys rather than one block at a
//! time: one softmax step per span means fewer round trips of the accumulator through tiles.
//!
//! Operands are cut into bf16 parts ([`Parts`]): rounding a value, then what is left of it,
//! and so on (part `i` is below `2^(-8i)` of the value). A product of two cut operands is the
//! sum of the products of their parts whose orders add up to at most 2 (the rest are below
//! 2^-24 relative together); each product is one tile pass into the same accumulator (for QK
//! a panel of key parts, `[key][part][dp]`, against a plane of query pairs per part; for PV a
//! panel of value parts against a plane of weight pairs per part).
//! - f32 math (an f32 or f16 query): the query in three parts (f32) or two (f16, exact), the
//!   softmax weights in three, keys and values whole (bf16 cache: exact; the caller only
//!   comes here with a bf16 cache, where this beats the FMA loops). Products of bf16 are exact
//!   and summed in f32, smallest first, so the logits and outputs keep f32 accuracy (2e-6 of
//!   float64 in `tests/amx.rs`, with a sharp softmax).
//! - bf16 math (a bf16 query, or any query under `Precision::Bf16`: that query is rounded to
//!   bf16 first, one part, so the products are those of a bf16 query with the rounded values): the query is exact; a bf16 cache is
//!   exact; an f16 or f32 cache
//!   has each key cut into two parts (exact for f16, 2^-17 relative for f32), because a key
//!   rounded to bf16 moves a logit by up to `scale*sqrt(D)*|q|*2^-9`, which a sharp softmax
//!   turns into more than 1e-2 of output (seen at D=256, scale 0.38, |q| <= 3). Values are
//!   rounded to bf16 once (their error reaches the output unamplified, at most 2^-9 of |v|)
//!   and the softmax weights are rounded to bf16 for PV.
//!
//! In both, the logits are scaled in f32 after the tile product (the scale is not rounded)
//! and all sums are f32.
//!
//! Operands are packed once per call ([`prepack`], when the copies fit the same budget as
//! `prefill::prewiden`), else per span from the cache.

use super::micro::x86::amx::Tiles;
use super::micro::x86::bf16::{Bf16, Bf16Tier};
use super::micro::TileMicro;
use super::partition::Item;
use super::pool::Buf;
use super::prefill::{
    add_direct_scores, aligned, per_head_regions, stash_logits, write_rows, ItemRows,
};
use super::source::{Ctx, Out, Source};
use super::tile::mask_tile_strided;
use crate::dtype::Float;
use crate::kernel::layout::{seen_by_all, seq_row, tiles, visible};
use crate::kernel::prefetch::Spread;
use std::any::TypeId;
use std::cell::RefCell;

/// Keys per softmax step.
const SPAN: usize = 256;

/// Items run on tiles so far (see `amx_items_run`). Feature `test-hooks` only.
#[cfg(feature = "test-hooks")]
pub(crate) static ITEMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// bf16 K and V rows of the prefill sequences in tile layouts, per (sequence, KV head): keys
/// `[ctx + 32][kw]` and values transposed `[dp][ctx + 32]` (the 32 spare keys are zeros, so a
/// span's last k-step may read past the context).
pub(crate) struct Packed {
    k: Buf<u16>,
    v: Buf<u16>,
    base: Vec<Option<(usize, usize)>>,
    /// Per (sequence, KV head): every packed value is finite (so no span needs the check of
    /// the values its masked keys hold).
    finite: Vec<bool>,
}

/// Padded head size (a whole QK k-step).
fn dp_of(d: usize) -> usize {
    d.div_ceil(32) * 32
}

/// bf16 parts of a value of type `T` that sum to it: 1 for bf16, 2 for f16 (exact), 3 for
/// f32 (within 2^-26 relative). Quantized caches (`u8`, u4 in its u8 form) come here under
/// bf16 math only, and their dequantized values are rounded to bf16 whole: the rounding
/// (2^-9 of the value) is about half a quantization step of u8 and far below one of u4.
fn parts_of<T: 'static>() -> usize {
    if TypeId::of::<T>() == TypeId::of::<half::bf16>() || TypeId::of::<T>() == TypeId::of::<u8>() {
        1
    } else if TypeId::of::<T>() == TypeId::of::<half::f16>() {
        2
    } else {
        3
    }
}

/// How many bf16 parts each operand of an item is cut into (see the module doc).
#[derive(Clone, Copy, Debug)]
struct Parts {
    q: usize,
    k: usize,
    v: usize,
    p: usize,
}

impl Parts {
    /// The parts of an item of query type `Q` and cache type `C`; `bf16_math` (`Ctx::bf16_math`:
    /// a bf16 query, or an f32/f16 query the caller asked to round) takes the query whole as
    /// bf16 (rounded to nearest even when it is not bf16).
    fn of<Q: Float, C: Source>(bf16_math: bool) -> Parts {
        if bf16_math {
            // bf16 math: keys keep two parts (see the module doc), values and weights one.
            Parts {
                q: 1,
                k: parts_of::<C>().min(2),
                v: 1,
                p: 1,
            }
        } else {
            // f32 math: every operand whole.
            Parts {
                q: parts_of::<Q>(),
                k: parts_of::<C>(),
                v: parts_of::<C>(),
                p: 3,
            }
        }
    }

    /// The (key part, query part) products of QK, smallest first: the tiles sum along this
    /// order, so the small products gather in a small sum before the large ones join it (the
    /// rounding error stays that of a plain f32 dot product).
    fn qk(self) -> Vec<(usize, usize)> {
        let mut t = terms(self.k, self.q);
        t.reverse();
        t
    }

    /// The (value part, weight part) products of PV.
    fn pv(self) -> Vec<(usize, usize)> {
        terms(self.v, self.p)
    }

    /// Width of a packed key row: one `dp` segment per key part.
    fn kw(self, d: usize) -> usize {
        self.k * dp_of(d)
    }
}

/// The products `(a, b)` of part `a` of one operand and part `b` of the other that a sum keeps:
/// those with `a + b <= 2`, largest first (part `i` is below `2^(-8i)` of the value, so the
/// dropped ones are below 2^-24 relative together).
fn terms(na: usize, nb: usize) -> Vec<(usize, usize)> {
    (0..=2)
        .flat_map(|s| {
            (0..na)
                .filter(move |&a| a <= s && s - a < nb)
                .map(move |a| (a, s - a))
        })
        .collect()
}

/// Cuts `row` (destroyed) into `n` bf16 parts, part `i` at `parts[i*stride..][..row.len()]`.
fn cut(bf: Bf16, row: &mut [f32], n: usize, parts: &mut [u16], stride: usize) {
    for i in 0..n {
        bf.round(row, &mut parts[i * stride..]);
        if i + 1 < n {
            bf.residual(row);
        }
    }
}

/// Where the packers read f32 K and V rows: `keys(s, kvh, a, b, out)` writes keys `a..b`
/// (inside one block) of KV head `kvh` of sequence `s` into `out` (`(b - a) * D`), `values`
/// likewise. Float caches widen their rows ([`FloatRows`]); quantized caches dequantize them.
pub(crate) trait PanelRows: Sync {
    fn keys(&self, s: usize, kvh: usize, a: usize, b: usize, out: &mut [f32]);
    fn values(&self, s: usize, kvh: usize, a: usize, b: usize, out: &mut [f32]);
}

/// The rows of a float cache, widened from the cache.
pub(crate) struct FloatRows<'c, 'a, M, Q, C: Source> {
    pub(crate) m: M,
    pub(crate) ctx: &'c Ctx<'a, Q, C>,
}

impl<M: TileMicro, Q: Sync, C: Float> FloatRows<'_, '_, M, Q, C> {
    fn rows(&self, cache: &[C], s: usize, kvh: usize, a: usize, b: usize, out: &mut [f32]) {
        let plan = self.ctx.plan;
        let off = seq_row(plan, self.ctx.block_indices, &plan.seqs[s], kvh, a);
        self.m.widen(&cache[off..off + (b - a) * plan.d], out);
    }
}

impl<M: TileMicro, Q: Sync, C: Float> PanelRows for FloatRows<'_, '_, M, Q, C> {
    fn keys(&self, s: usize, kvh: usize, a: usize, b: usize, out: &mut [f32]) {
        self.rows(self.ctx.kc, s, kvh, a, b, out)
    }
    fn values(&self, s: usize, kvh: usize, a: usize, b: usize, out: &mut [f32]) {
        self.rows(self.ctx.vc, s, kvh, a, b, out)
    }
}

/// Packs the K and V rows of every prefill sequence once per call when the copies stay within
/// `2*T*H*D` elements each (as `prewiden`), else `None` and items pack span by span.
pub(crate) fn prepack<M: TileMicro, Q: Float, C: Source>(
    m: M,
    bf: Bf16,
    ctx: &Ctx<'_, Q, C>,
    src: &impl PanelRows,
) -> Option<Packed> {
    let plan = ctx.plan;
    let parts = Parts::of::<Q, C>(ctx.bf16_math);
    let (dp, kw) = (dp_of(plan.d), parts.kw(plan.d));
    // The copies of `prewiden`, times the parts: memory per call stays O(T*H*D).
    let budget = 2 * plan.t * plan.h * plan.d * parts.qk().len().max(parts.v);
    let (k, v, base) = per_head_regions(
        (plan, ctx.runner),
        |s| ctx.part.seqs[s].prefill,
        // Zeroed: the spare keys and the padding of the packed rows must read as 0.
        (
            |sp: &crate::op::SeqPlan| ((sp.ctx() + 32) * kw, (sp.ctx() + 32) * dp * parts.v),
            budget,
            true,
        ),
        |s, kvh, ka: &mut [u16], va: &mut [u16]| {
            let n = plan.seqs[s].ctx();
            PACK.with(|p| {
                pack_keys(
                    m,
                    bf,
                    ctx,
                    src,
                    s,
                    kvh,
                    0,
                    n,
                    ka,
                    va,
                    n + 32,
                    &mut p.borrow_mut(),
                )
            })
        },
    )?;
    let hkv = plan.hkv;
    let finite = (0..plan.seqs.len() * hkv)
        .map(|i| {
            base[i / hkv].is_none_or(|(_, bv)| {
                let len = (plan.seqs[i / hkv].ctx() + 32) * dp * parts.v;
                let o = bv + (i % hkv) * len;
                all_bf16_finite(&v[o..o + len])
            })
        })
        .collect();
    Some(Packed { k, v, base, finite })
}

/// f32 staging buffers of the packers.
#[derive(Default)]
struct PackScratch {
    rows: Vec<f32>,
    cols: Vec<f32>,
}

thread_local! {
    static PACK: RefCell<PackScratch> = RefCell::new(PackScratch::default());
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// Keys `j0..j1` of KV head `kvh` of sequence `s` cut into bf16 parts ([`Parts`]): key `j`
/// into row `j - j0` of `kp` (`kw` wide: part `a` at `a*dp`) and
/// column `j - j0` of `vt` (`ld` wide; rows `a*dp..a*dp + D` hold value part `a`). Padding
/// columns of `kp` and rows `D..dp` of each part of `vt` are left as they are (zero in the
/// callers' buffers).
#[allow(clippy::too_many_arguments)]
fn pack_keys<M: TileMicro, Q: Float, C: Source>(
    m: M,
    bf: Bf16,
    ctx: &Ctx<'_, Q, C>,
    src: &impl PanelRows,
    s: usize,
    kvh: usize,
    j0: usize,
    j1: usize,
    kp: &mut [u16],
    vt: &mut [u16],
    ld: usize,
    sc: &mut PackScratch,
) {
    let plan = ctx.plan;
    let (d, bs) = (plan.d, plan.bs);
    let parts = Parts::of::<Q, C>(ctx.bf16_math);
    let (dp, kw) = (dp_of(d), parts.kw(d));
    // Values go through an f32 transpose 64 keys at a time (whole 8-row blocks for it).
    const CH: usize = 64;
    let rows = aligned(&mut sc.rows, CH * d);
    let cols = aligned(&mut sc.cols, d * CH);
    let mut c0 = j0;
    while c0 < j1 {
        let c1 = (c0 + CH).min(j1);
        let n = c1 - c0;
        for (a, b) in tiles(c0, c1, bs) {
            let stage = &mut rows[(a - c0) * d..(b - c0) * d];
            src.keys(s, kvh, a, b, stage);
            for (jj, row) in stage.chunks_exact_mut(d).enumerate() {
                cut(bf, row, parts.k, &mut kp[(a - j0 + jj) * kw..][..kw], dp);
            }
            src.values(s, kvh, a, b, stage);
        }
        let n8 = n.div_ceil(8) * 8;
        rows[n * d..n8 * d].fill(0.0);
        m.transpose(rows, n, d, cols, n8);
        for x in 0..d {
            let col = &mut cols[x * n8..x * n8 + n];
            cut(bf, col, parts.v, &mut vt[x * ld + c0 - j0..], dp * ld);
        }
        c0 = c1;
    }
}

/// Where an item's products run: AMX tiles (their configuration loaded while this lives), or
/// `vdpbf16ps` on CPUs without AMX. Both compute the same sums (`Bf16::qk_t`, `Tiles::qk_t`);
/// `vdpbf16ps` scales the logits and corrects the accumulator in registers, tiles in a pass of
/// their own.
enum Products {
    Tiles(Tiles, Bf16),
    Dot(Bf16),
}

impl Products {
    /// `Bf16::qk_t`: the logits of keys `0..n32`, scaled as `TileMicro::scale_logits` scales;
    /// `vdpbf16ps` computes those of keys `0..keys[b]` of row block `b` only (tiles all).
    #[allow(clippy::too_many_arguments)]
    fn qk_t(
        &self,
        m: impl TileMicro,
        t: &[(&[u16], &[u32])],
        (ldk, dp, n32, r32): (usize, usize, usize, usize),
        keys: &[usize],
        scale: f32,
        st: &mut [f32],
        pf: &mut Spread,
    ) {
        match self {
            Products::Tiles(tl, _) => {
                tl.qk_t(t, ldk, dp, n32, r32, st);
                m.scale_logits(&mut st[..n32 * r32], scale);
            }
            Products::Dot(bf) => {
                let keys = (n32, Some(keys));
                bf.qk_t(t, ldk, dp, keys, r32, scale, st, &mut || pf.tick())
            }
        }
    }

    /// `Bf16::pv_t`: the accumulator corrected by `corr` (when given), then the products added
    /// (`vdpbf16ps`: of keys `0..keys[b]` for row block `b`, whose later weights are 0).
    #[allow(clippy::too_many_arguments)]
    fn pv_t(
        &self,
        t: &[(&[u16], &[u32])],
        (ldv, dp, n32, r32): (usize, usize, usize, usize),
        keys: &[usize],
        corr: Option<&[f32]>,
        acc: &mut [f32],
        pf: &mut Spread,
    ) {
        match self {
            Products::Tiles(tl, bf) => {
                if let Some(c) = corr.filter(|c| c.iter().any(|&c| c != 1.0)) {
                    bf.mul_rows(acc, c);
                }
                tl.pv_t(t, ldv, dp, n32, r32, acc)
            }
            Products::Dot(bf) => {
                let keys = (n32, Some(keys));
                bf.pv_t(t, ldv, dp, keys, r32, corr, acc, &mut || pf.tick())
            }
        }
    }
}

/// Per-thread buffers of AMX items, grown on demand.
#[derive(Default)]
struct Scratch {
    qf: Vec<f32>,
    qt: Vec<u32>,
    st: Vec<f32>,
    pt: Vec<u32>,
    acc_t: Vec<f32>,
    acc: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    c: Vec<f32>,
    kp: Vec<u16>,
    vt: Vec<u16>,
    pack: PackScratch,
    kept: Vec<f32>,
    keys: Vec<usize>,
    pf: Spread,
}

/// Whether a bf16 (bits) is finite.
fn bf16_finite(b: u16) -> bool {
    b & 0x7F80 != 0x7F80
}

/// Whether every bf16 (bits) of `s` is finite (a fold without early exit, so it vectorizes).
fn all_bf16_finite(s: &[u16]) -> bool {
    s.iter().fold(true, |a, &b| a & bf16_finite(b))
}

/// Takes the non-finite values of edge keys (outside `lo..hi`, the keys some row is masked
/// for) out of the span's tile product: each such key's value column in `vs` (`[d][ldv]`,
/// key `j0 + jj` in column `jj`, this item's own packing) becomes 0 and its weight in `st` 0
/// for every row, and its weighted value is added to `acc_t` (`[d][r32]`) here, for the rows
/// that see it (f32 products, in place of the bf16 tile's).
#[allow(clippy::too_many_arguments)]
fn masked_non_finite<Q, C: Source>(
    ctx: &Ctx<'_, Q, C>,
    ir: &ItemRows,
    j0: usize,
    (lo, hi): (usize, usize),
    j1: usize,
    st: &mut [f32],
    r32: usize,
    vs: &mut [u16],
    ldv: usize,
    (nparts, dp): (usize, usize),
    acc_t: &mut [f32],
) {
    let plan = ctx.plan;
    let (d, g) = (plan.d, plan.g);
    let bf = |b: u16| f32::from_bits((b as u32) << 16);
    for j in (j0..lo).chain(hi..j1) {
        let jj = j - j0;
        if (0..d).all(|x| bf16_finite(vs[x * ldv + jj])) {
            continue;
        }
        for r in 0..ir.rows {
            let w = std::mem::take(&mut st[jj * r32 + r]);
            if visible(plan, ir.pos0 + r / g, j) {
                for x in 0..d {
                    // The value is the sum of its parts (value part `a` in rows a*dp..).
                    let v: f32 = (0..nparts).map(|a| bf(vs[(a * dp + x) * ldv + jj])).sum();
                    acc_t[x * r32 + r] += w * v;
                }
            }
        }
        for a in 0..nparts {
            for x in 0..d {
                vs[(a * dp + x) * ldv + jj] = 0;
            }
        }
    }
}

/// [`prefill::run_item`](super::prefill::run_item) on tiles.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_item<M: TileMicro, Q: Float, C: Source>(
    m: M,
    tier: Bf16Tier,
    ctx: &Ctx<'_, Q, C>,
    it: &Item,
    o: &Out<'_, Q, C>,
    (packed, src): (Option<&Packed>, &impl PanelRows),
) {
    let tl = match tier.amx {
        Some(a) => Products::Tiles(a.tiles(), tier.bf),
        None => Products::Dot(tier.bf),
    };
    SCRATCH.with(|s| {
        let sc = &mut *s.borrow_mut();
        for kvh in it.kvh0 as usize..it.kvh1 as usize {
            run_head(m, tier.bf, &tl, ctx, (it, kvh), o, (packed, src), sc);
        }
    });
    #[cfg(feature = "test-hooks")]
    ITEMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

#[allow(clippy::too_many_arguments)]
fn run_head<M: TileMicro, Q: Float, C: Source>(
    m: M,
    bf: Bf16,
    tl: &Products,
    ctx: &Ctx<'_, Q, C>,
    (it, kvh): (&Item, usize),
    o: &Out<'_, Q, C>,
    (packed, src): (Option<&Packed>, &impl PanelRows),
    sc: &mut Scratch,
) {
    let (pw, out, sw) = (&o.pw, &o.out, o.sw.as_ref());
    let plan = ctx.plan;
    let (h, d, g) = (plan.h, plan.d, plan.g);
    let parts = Parts::of::<Q, C>(ctx.bf16_math);
    let (dp, kw, qk, pv) = (dp_of(d), parts.kw(d), parts.qk(), parts.pv());
    let ir = ItemRows::new(ctx, it);
    let sp = &plan.seqs[ir.si];
    let (rows, r32) = (ir.rows, ir.rows.div_ceil(32) * 32);
    let Scratch {
        qf,
        qt,
        st,
        pt,
        acc_t,
        acc,
        m: mb,
        l: lb,
        c: cb,
        kp,
        vt,
        pack,
        kept,
        keys,
        pf,
    } = sc;
    // Direct scores (a source that asks for them, `Tuning::direct_scores`): the score rows (a
    // suffix: rows are token-major) keep their logits row-major over the item's keys, as in
    // `prefill::run_head`.
    let lay = &ctx.part.seqs[ir.si];
    let direct = lay.direct_part(kvh, (it.qt as usize, sp.n.div_ceil(lay.qtok)), sp.ctx());
    let first_scored = (sp.n - sp.score_tokens).clamp(ir.t0, ir.t0 + ir.nt);
    let (r_sc, nkeys) = ((first_scored - ir.t0) * g, ir.hi - ir.lo);
    if direct.is_some() {
        kept.clear();
        kept.resize((rows - r_sc) * nkeys, f32::NEG_INFINITY);
    }

    // Query pairs, one plane of [dp/2][r32] per query part. Not scaled: the scale multiplies
    // the f32 logits.
    let qplane = dp / 2 * r32;
    let qt = aligned(qt, parts.q * qplane);
    qt.fill(0);
    // An f32 query is read in place, others widened first.
    let q32 = crate::dtype::as_f32(ctx.query);
    let qf: &[f32] = match q32 {
        Some(_) => &[],
        None => {
            let qf = aligned(qf, rows * d);
            for (ti, dst) in qf.chunks_exact_mut(g * d).enumerate() {
                m.widen(
                    &ctx.query[((sp.begin + ir.t0 + ti) * h + kvh * g) * d..][..g * d],
                    dst,
                );
            }
            qf
        }
    };
    let row = |r: usize| -> &[f32] {
        match q32 {
            Some(q) => &q[((sp.begin + ir.t0 + r / g) * h + kvh * g + r % g) * d..][..d],
            None => &qf[r * d..(r + 1) * d],
        }
    };
    for r0 in (0..rows).step_by(16) {
        let group: Vec<&[f32]> = (r0..rows.min(r0 + 16)).map(row).collect();
        bf.pair_cols(&group, d, parts.q, qt, r32, qplane, r0);
    }

    let acc_t = aligned(acc_t, dp * r32);
    acc_t.fill(0.0);
    let (mb, lb, cb) = (aligned(mb, r32), aligned(lb, r32), aligned(cb, r32));
    mb.fill(f32::NEG_INFINITY);
    lb.fill(0.0);
    // Rows past the softmax's `rows8` keep factor 1.
    cb.fill(1.0);
    let st = aligned(st, SPAN * r32);
    // Weight pairs of each part, one plane of [SPAN/2][r32] per part.
    let plane = SPAN / 2 * r32;
    let pt = aligned(pt, parts.p * plane);
    let ctx_len = sp.ctx();
    let heads = packed
        .and_then(|p| p.base[ir.si].map(|b| (p, b)))
        .map(|(p, (bk, bv))| {
            let vlen = (ctx_len + 32) * dp * parts.v;
            let (ok, ov) = (bk + kvh * (ctx_len + 32) * kw, bv + kvh * vlen);
            (
                &p.k[ok..ok + (ctx_len + 32) * kw],
                &p.v[ov..ov + vlen],
                p.finite[ir.si * plan.hkv + kvh],
            )
        });

    let ldp = ctx_len + 32;
    // The items of a KV head come in falling query tiles (`Partition`), runs of them on one
    // thread: the query rows of the tile before this one are likely the next read from
    // memory, fetched a part per span while this item computes.
    let qtok = ctx.part.seqs[ir.si].qtok;
    let next_q = ir.t0.saturating_sub(qtok)..ir.t0;
    let nspans = (ir.hi - ir.lo).div_ceil(SPAN);
    // The output rows this item writes at its end are requested over its last two spans (a
    // token's rows lie H*D elements after the last's: written cold, each store waits).
    let out_spans = nspans.min(2);
    let mut j0 = ir.lo;
    while j0 < ir.hi {
        // This span's share of those lines, a few after each register block of the products
        // (a burst of them would stall the loads of the products behind it).
        let span = (j0 - ir.lo) / SPAN;
        pf.clear();
        for t in next_q.clone() {
            let rows = &ctx.query[((sp.begin + t) * h + kvh * g) * d..][..g * d];
            pf.push(
                rows.as_ptr() as *const u8,
                size_of_val(rows),
                (span, nspans),
            );
        }
        if let Some(part) = (span + out_spans).checked_sub(nspans) {
            for t in sp.begin + ir.t0..sp.begin + ir.t0 + ir.nt {
                let (p, bytes) = out.hint((t * h + kvh * g) * plan.dv, g * plan.dv);
                pf.push(p, bytes, (part, out_spans));
            }
        }
        let j1 = (j0 + SPAN).min(ir.hi);
        let (n, n32) = (j1 - j0, (j1 - j0).div_ceil(32) * 32);
        // Register blocks of the span's products (8 keys or 8 value rows by 32 query rows).
        pf.start(r32 / 32 * (n32 + dp) / 8);
        // The tile product multiplies every value of keys j0..j0+n32 by a weight, zero where
        // a row is masked (edge keys) and for keys past j1; a non-finite value there would
        // make it NaN (contract: masked keys never contribute). Prepacked values are used
        // only when all of those are finite, else the span is packed here and cleaned. A
        // value is finite when its first part is (later parts of a finite value are finite).
        let (lo, hi) = seen_by_all(plan, ir.pos0, ir.pos0 + ir.nt - 1, j0, j1);
        let pre = heads
            .filter(|&(_, v, finite)| {
                // Keys j0..lo and hi..j0+n32, row by row (contiguous in the transposed layout).
                finite
                    || (0..d).all(|x| {
                        let row = &v[x * ldp..];
                        all_bf16_finite(&row[j0..lo]) && all_bf16_finite(&row[hi..j0 + n32])
                    })
            })
            .map(|(k, v, _)| (k, v));
        if pre.is_none() {
            let kp = aligned(kp, SPAN * kw);
            let vt = aligned(vt, parts.v * dp * SPAN);
            // Zero padding (keys n..n32 meet zero weights; 0 * garbage could be NaN).
            kp.fill(0);
            vt.fill(0);
            pack_keys(m, bf, ctx, src, ir.si, kvh, j0, j1, kp, vt, SPAN, pack);
        }
        let ks: &[u16] = match pre {
            Some((k, _)) => &k[j0 * kw..],
            None => aligned(kp, SPAN * kw),
        };
        let qk_terms: Vec<(&[u16], &[u32])> = qk
            .iter()
            .map(|&(a, b)| (&ks[a * dp..], &qt[b * qplane..]))
            .collect();
        // The keys of the span each 32-row block sees at most: up to its last row's causal
        // edge. The later ones are masked for all of its rows (on the diagonal), so their
        // logits, weights and products are skipped (their logits are set to -inf below).
        keys.clear();
        keys.extend((0..r32 / 32).map(|b| {
            let last = rows.min(32 * b + 32) - 1;
            (ir.pos0 + last / g + 1).saturating_sub(j0).min(n)
        }));
        tl.qk_t(m, &qk_terms, (kw, dp, n32, r32), keys, plan.scale, st, pf);
        // A block's worth of keys at a time, so only the pieces the causal edge or the window
        // cuts take the per-element path (one span may cover the whole diagonal).
        for off in (0..n).step_by(32) {
            let piece = 32.min(n - off);
            let s = &mut st[off * r32..];
            mask_tile_strided(plan, s, (1, r32), rows, piece, kvh, ir.pos0, j0 + off);
        }
        if direct.is_some() {
            for r in r_sc..rows {
                let dst = &mut kept[(r - r_sc) * nkeys + j0 - ir.lo..][..n];
                for (jj, o) in dst.iter_mut().enumerate() {
                    *o = st[jj * r32 + r];
                }
            }
        } else if let Some(sw) = sw {
            stash_logits(ctx, &ir, kvh, st, r32, j0, n, sw);
        }
        // Prepacked spans (no value to clean) correct the accumulator inside the PV product,
        // and with one weight part take the weights from the softmax straight into pairs.
        let corr = if pre.is_some() {
            if parts.p == 1 {
                bf.softmax_pairs(st, r32, (rows, n, n32, Some(&keys[..])), mb, lb, cb, pt);
            } else {
                m.softmax_t(st, r32, rows, n, mb, lb, cb);
                bf.pair_rows(st, r32, n, n32, parts.p, pt, plane);
            }
            Some(&cb[..])
        } else {
            m.softmax_t(st, r32, rows, n, mb, lb, cb);
            if cb.iter().any(|&c| c != 1.0) {
                bf.mul_rows(acc_t, cb);
            }
            let vt = aligned(vt, parts.v * dp * SPAN);
            let vparts = (parts.v, dp);
            masked_non_finite(ctx, &ir, j0, (lo, hi), j1, st, r32, vt, SPAN, vparts, acc_t);
            bf.pair_rows(st, r32, n, n32, parts.p, pt, plane);
            None
        };
        let (vs, ldv): (&[u16], usize) = match pre {
            Some((_, v)) => (&v[j0..], ldp),
            None => (aligned(vt, parts.v * dp * SPAN), SPAN),
        };
        let terms: Vec<(&[u16], &[u32])> = pv
            .iter()
            .map(|&(a, b)| (&vs[a * dp * ldv..], &pt[b * plane..]))
            .collect();
        tl.pv_t(&terms, (ldv, dp, n32, r32), keys, corr, acc_t, pf);
        pf.finish();
        j0 = j1;
    }
    let acc = aligned(acc, r32 * dp);
    m.transpose(acc_t, dp, r32, acc, dp);
    write_rows(ctx, &ir, kvh, acc, dp, mb, lb, pw, out);
    if let Some(at) = direct {
        // SAFETY: the partial scores of (KV head, query tile) belong to this item.
        let part = unsafe { o.direct.part(at, sp.ctx()) };
        add_direct_scores(m, plan, (&ir, kvh), (kept, r_sc), (mb, lb), part);
    }
}
