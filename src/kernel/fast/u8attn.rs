//! Steps 2-4 over u8 caches in OpenVINO's layout: insertion quantizes with `kernel::quant` (the
//! byte-checked code), then attention and scores read the cache bytes directly through the
//! [`U8Micro`] loops, dequantizing on the fly, never widening a cache.
//!
//! Work items are (sequence, KV head); an item walks the sequence's visible key blocks once per
//! tile of up to [`ROWS`] query rows (tokens x the G query heads of the KV head), so a decode
//! item reads each key and value byte once for all G heads. Per block:
//! - keys by channel: `k = (q8 - zp[c]) * scale[c]` per channel, so `q . k = sum_c (q_c
//!   scale_c) q8_c - sum_c q_c scale_c zp_c`: the query rows are multiplied by the block's
//!   scales once and the second sum is one constant per row and block;
//! - keys by token: per group, `scale_g * sum_c q_c (q8_c - zp_g)`;
//! - values (by token): `acc += p * scale_g * (q8 - zp_g)` per group, the accumulators held in
//!   registers across a block's keys.
//!
//! The softmax step is `kernel::softmax::OnlineSoftmax`'s; masks, windows and ALiBi are the
//! reference's (`kernel::layout`). Scores: a tile keeps the logits of its score rows (the last
//! `score_tokens` tokens) and, once its softmax states are final, adds their weights into its
//! item's partial scores; the partials of a sequence's KV heads are summed in head order, so
//! results do not depend on the thread count and no logit is computed twice.

use super::micro::{Micro, U8Micro};
use super::shared::SharedMut;
use crate::alloc::try_vec;
use crate::dtype::Float;
use crate::error::{PaError, Result};
use crate::kernel::bind::Bound;
use crate::kernel::layout::{block_of, tiles, visible, window_start};
use crate::kernel::quant::{self, read_f32, KeyQuant, U8Layout, PARAM_BYTES};
use crate::kernel::softmax::OnlineSoftmax;
use crate::op::{Plan, SeqPlan};
use crate::threads::Runner;

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

/// Per-item scratch.
struct Scratch {
    q: Vec<f32>,
    qs: Vec<f32>,
    cst: Vec<f32>,
    s: Vec<f32>,
    acc: Vec<f32>,
    /// Value weights `[rows, keys]` of a block, times the group's scale.
    w: Vec<f32>,
    /// Value zero points of a block's keys.
    vzp: Vec<f32>,
    /// Per-group logits `[rows, keys]` of by-token keys.
    t2: Vec<f32>,
    /// Zero points and scales of a block's keys (by token; zero points 0 by channel).
    kzp: Vec<f32>,
    kscale: Vec<f32>,
    /// Logits of the tile's score rows over its key range.
    kept: Vec<f32>,
    sc: Vec<f32>,
    zp: Vec<f32>,
}

impl Scratch {
    fn new(plan: &Plan) -> Scratch {
        let d = plan.d;
        Scratch {
            q: vec![0.0; ROWS * d],
            qs: vec![0.0; ROWS * d],
            cst: vec![0.0; ROWS],
            s: vec![0.0; ROWS * plan.bs],
            acc: vec![0.0; ROWS * d],
            w: vec![0.0; ROWS * plan.bs],
            vzp: vec![0.0; plan.bs],
            t2: vec![0.0; ROWS * plan.bs],
            kzp: vec![0.0; plan.bs],
            kscale: vec![0.0; plan.bs],
            kept: Vec::new(),
            sc: vec![0.0; d],
            zp: vec![0.0; d],
        }
    }
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

/// Loads the tile's query rows, scaled by the softmax scale, into `sc.q`.
fn load_queries<Q: Float>(plan: &Plan, query: &[Q], rows: &[RowRef], sc: &mut Scratch) {
    let (d, h) = (plan.d, plan.h);
    for (r, row) in rows.iter().enumerate() {
        let src = &query[(row.token * h + row.head) * d..][..d];
        for (o, x) in sc.q[r * d..][..d].iter_mut().zip(src) {
            *o = x.to_f32() * plan.scale;
        }
    }
}

/// Logits `sc.s[r * bs + t]` of the tile's rows against keys `j0..j1` (one block): masked keys
/// `-inf`, ALiBi added.
#[allow(clippy::too_many_arguments)]
fn block_logits<M: U8Micro>(
    m: M,
    plan: &Plan,
    l: &U8Layout,
    kc: &[u8],
    block: usize,
    kvh: usize,
    (j0, j1): (usize, usize),
    rows: &[RowRef],
    sc: &mut Scratch,
) {
    let (d, bs, nr) = (plan.d, plan.bs, rows.len());
    let slab_len = l.key_slab();
    let slab = &kc[(block * plan.hkv + kvh) * slab_len..][..slab_len];
    let slot0 = j0 % bs;
    let n = j1 - j0;
    match l.key {
        KeyQuant::ByChannel => {
            for c in 0..d {
                sc.sc[c] = read_f32(slab, c);
                sc.zp[c] = read_f32(slab, d + c);
            }
            for r in 0..nr {
                let (q, qs) = (&sc.q[r * d..][..d], &mut sc.qs[r * d..][..d]);
                let mut cst = 0.0;
                for c in 0..d {
                    qs[c] = q[c] * sc.sc[c];
                    cst += qs[c] * sc.zp[c];
                }
                sc.cst[r] = cst;
            }
            let data = &slab[PARAM_BYTES * d + slot0 * d..];
            sc.kzp[..n].fill(0.0);
            m.qk(&sc.qs, d, nr, data, d, &sc.kzp[..n], d, &mut sc.s, bs);
            for r in 0..nr {
                for x in &mut sc.s[r * bs..][..n] {
                    *x -= sc.cst[r];
                }
            }
        }
        KeyQuant::ByToken { group } => {
            let g = if group == 0 { d } else { group };
            let kr = slab_len / bs;
            let rows_bytes = &slab[slot0 * kr..];
            for r in 0..nr {
                sc.s[r * bs..][..n].fill(0.0);
            }
            for gi in 0..d / g {
                let g0 = gi * (g + PARAM_BYTES);
                for t in 0..n {
                    sc.kscale[t] = read_f32(&rows_bytes[t * kr + g0..], 0);
                    sc.kzp[t] = read_f32(&rows_bytes[t * kr + g0..], 1);
                }
                let k = &rows_bytes[g0 + PARAM_BYTES..];
                m.qk(
                    &sc.q[gi * g..],
                    d,
                    nr,
                    k,
                    kr,
                    &sc.kzp[..n],
                    g,
                    &mut sc.t2,
                    bs,
                );
                for r in 0..nr {
                    for t in 0..n {
                        sc.s[r * bs + t] += sc.kscale[t] * sc.t2[r * bs + t];
                    }
                }
            }
        }
    }
    for (r, row) in rows.iter().enumerate() {
        if plan.alibi.is_none() && visible(plan, row.pos, j0) && visible(plan, row.pos, j1 - 1) {
            continue; // the visible keys of a row are one range
        }
        let s = &mut sc.s[r * bs..][..n];
        for (t, x) in s.iter_mut().enumerate() {
            let j = j0 + t;
            if !visible(plan, row.pos, j) {
                *x = f32::NEG_INFINITY;
            } else if let Some(al) = &plan.alibi {
                *x += al[row.head] * (j as f32 - row.pos as f32);
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

/// Attention of one tile of rows (all of one sequence and KV head): writes their outputs and
/// softmax states.
#[allow(clippy::too_many_arguments)]
fn attend_tile<M: U8Micro + Micro, Q: Float>(
    m: M,
    plan: &Plan,
    l: &U8Layout,
    b: &Inputs<'_, Q>,
    sp: &SeqPlan,
    kvh: usize,
    rows: &[RowRef],
    sc: &mut Scratch,
    out: &SharedMut<'_, Q>,
    part: &mut [f32],
) {
    let (d, bs, nr) = (plan.d, plan.bs, rows.len());
    load_queries(plan, b.query, rows, sc);
    sc.acc[..nr * d].fill(0.0);
    let mut st = [OnlineSoftmax::EMPTY; ROWS];
    let vrow = l.value_row();
    let vg = if l.value_group == 0 { d } else { l.value_group };
    let (lo, hi) = key_range(plan, rows);
    let keep = rows.iter().any(|r| r.scored);
    if keep {
        sc.kept.clear();
        sc.kept.resize(nr * (hi - lo), f32::NEG_INFINITY);
    }
    for (j0, j1) in tiles(lo, hi, bs) {
        let block = block_of(b.block_indices, sp.block_begin, bs, j0);
        block_logits(m, plan, l, b.kc, block, kvh, (j0, j1), rows, sc);
        let n = j1 - j0;
        for (r, st) in st.iter_mut().enumerate().take(nr) {
            let s = &mut sc.s[r * bs..][..n];
            if rows[r].scored {
                sc.kept[r * (hi - lo) + j0 - lo..][..n].copy_from_slice(s);
            }
            let step = st.update(s.iter().copied().fold(f32::NEG_INFINITY, f32::max));
            if step.rescale != 1.0 {
                m.scale(&mut sc.acc[r * d..][..d], step.rescale);
            }
            st.add(m.exp_sum(s, step.sub));
        }
        let vbase = ((block * plan.hkv + kvh) * bs + j0 % bs) * vrow;
        let vrows = &b.vc[vbase..vbase + n * vrow];
        for gi in 0..d / vg {
            let g0 = gi * (vg + PARAM_BYTES);
            for t in 0..n {
                let params = &vrows[t * vrow + g0..];
                let scale = read_f32(params, 0);
                sc.vzp[t] = read_f32(params, 1);
                for r in 0..nr {
                    sc.w[r * n + t] = sc.s[r * bs + t] * scale;
                }
            }
            let v = &vrows[g0 + PARAM_BYTES..];
            let acc = &mut sc.acc[gi * vg..];
            m.pv(acc, d, nr, &sc.w[..nr * n], v, vrow, &sc.vzp[..n], vg);
        }
    }
    for (r, row) in rows.iter().enumerate() {
        let at = row.token * plan.h + row.head;
        // SAFETY: (token, head) pairs are distinct across rows of all items (an item owns its
        // sequence's tokens and its KV head's query heads), so these parts never overlap.
        let o = unsafe { out.part(at * d, d) };
        let norm = st[r].norm();
        for (o, &a) in o.iter_mut().zip(&sc.acc[r * d..][..d]) {
            *o = Q::from_f32(a * norm);
        }
        if row.scored {
            let kept = &sc.kept[r * (hi - lo)..][..hi - lo];
            for (p, &x) in part[lo..hi].iter_mut().zip(kept) {
                if x != f32::NEG_INFINITY {
                    *p += st[r].weight(x);
                }
            }
        }
    }
}

/// The read-only side of the bound call.
struct Inputs<'a, Q> {
    query: &'a [Q],
    kc: &'a [u8],
    vc: &'a [u8],
    block_indices: &'a [i32],
}

/// Runs insertion, attention and scores of a validated call on u8 caches of layout `l`.
pub(crate) fn run<M: U8Micro + Micro, Q: Float>(
    m: M,
    runner: Runner,
    plan: &Plan,
    l: &U8Layout,
    b: Bound<'_, Q, u8>,
) -> Result<()> {
    let hkv = plan.hkv;
    // One partial score vector per (sequence, KV head), laid out like the scores times Hkv.
    let parts_len = plan
        .scores_len
        .checked_mul(hkv)
        .ok_or_else(|| PaError::OutOfMemory {
            what: "u8 partial scores".into(),
            bytes: usize::MAX,
        })?;
    let mut parts = try_vec(parts_len, 0f32, "u8 partial scores")?;
    quant::insert_u8(
        l,
        &plan.seqs,
        b.block_indices,
        b.key,
        b.value,
        b.key_cache,
        b.value_cache,
    );
    let inputs = Inputs {
        query: b.query,
        kc: b.key_cache,
        vc: b.value_cache,
        block_indices: b.block_indices,
    };
    {
        let out = SharedMut::new(b.output);
        let parts = SharedMut::new(&mut parts);
        runner.for_each(plan.seqs.len() * hkv, &|item| {
            let (sp, kvh) = (&plan.seqs[item / hkv], item % hkv);
            // SAFETY: item (s, kvh) owns `ctx` partials at `score_offset * hkv + kvh * ctx`;
            // sequences' score ranges are disjoint, so these parts are too.
            let part = unsafe { parts.part(sp.score_offset * hkv + kvh * sp.ctx(), sp.ctx()) };
            let mut sc = Scratch::new(plan);
            let tokens_per_tile = (ROWS / plan.g).max(1);
            for i0 in (0..sp.n).step_by(tokens_per_tile) {
                let rows = rows_of(plan, sp, kvh, i0, (i0 + tokens_per_tile).min(sp.n));
                for tile in rows.chunks(ROWS) {
                    attend_tile(m, plan, l, &inputs, sp, kvh, tile, &mut sc, &out, part);
                }
            }
        });
    }
    for sp in &plan.seqs {
        let (ctx, at) = (sp.ctx(), sp.score_offset);
        let dst = &mut b.scores[at..at + ctx];
        let mine = &parts[at * hkv..(at + ctx) * hkv];
        for (j, o) in dst.iter_mut().enumerate() {
            *o = Q::from_f32((0..hkv).map(|h| mine[h * ctx + j]).sum());
        }
    }
    Ok(())
}
