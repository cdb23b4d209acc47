//! Cuts one call's attention into work items. The key chunks, which decide the arithmetic,
//! depend only on the plan (never on the number of threads), which is what makes results
//! bit-identical for any thread count; only how many KV heads a decode item takes (no
//! arithmetic changes) depends on the threads.

use super::ScoresMode;
use crate::kernel::layout::window_start;
use crate::op::Plan;

/// Query rows a prefill tile aims for (the `prefill` item path; a multiple of 16, the row
/// block of its QK kernel).
pub(crate) const PREFILL_ROWS: usize = 64;
/// Upper bound of chunks per row, so partial results stay O(T*H*D).
pub(crate) const MAX_CHUNKS: usize = 64;
/// Score logits stashed during attention, at most this many f32 beyond 8*T*H*D (16 MiB).
pub(crate) const STASH_EXTRA: usize = 1 << 22;

/// A cache type's cut of decode work (its decode loops differ in what a chunk and an item
/// cost): one rule, these numbers.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Tuning {
    /// Query rows (tokens x the G query heads of one KV head) of a decode-like sequence's
    /// single tile: a sequence with more tokens than fit in this many rows is a prefill
    /// sequence.
    pub row_target: usize,
    /// Keys a decode chunk aims for (flash-decoding split); `usize::MAX`: no split for length.
    pub chunk_keys: usize,
    /// Fewest keys a decode chunk is cut to (below this, per-chunk start-up and merge costs
    /// win).
    pub min_chunk_keys: usize,
    /// Decode items a call aims for at least, so that many threads find work even when only a
    /// few sequences decode (one long context is split further): (sequence, chunk) pairs, or
    /// (sequence, KV head, chunk) triples when `count_heads`. Like every cut, independent of
    /// the thread count.
    pub min_decode_items: usize,
    pub count_heads: bool,
    /// Decode items per thread a call is cut into at least, by splitting items across KV heads
    /// (which changes no arithmetic: each row's keys and chunks stay the same), so that 16 to
    /// 64 threads end together (the scaling simulation, `examples/scaling_sim.rs`).
    pub items_per_thread: usize,
    /// Keys chunks are aligned to and a multiple of (0: the block size).
    pub chunk_align: usize,
    /// Prefill items, and decode items of sequences not cut into chunks, add their score rows'
    /// final weights into partial scores of their own (the rows' statistics are final when the
    /// item ends), instead of stashing logits for step 4: the stash's round trip through
    /// memory (`score_tokens * H * ctx` floats written, read back, a second `exp` each) costs
    /// where decode is bound by memory, and a prefill's stash is as large as its cache.
    pub direct_scores: bool,
}

impl Tuning {
    /// Float caches: decode items stream whole `[Hkv, BS, D]` blocks (cold caches read them
    /// fastest, so at 2 threads no benchmark workload is split across KV heads), chunks of
    /// about 256 keys, at least 64 items per call.
    pub const FLOAT: Tuning = Tuning {
        row_target: 32,
        chunk_keys: 256,
        min_chunk_keys: 128,
        min_decode_items: 64,
        count_heads: false,
        items_per_thread: 16,
        chunk_align: 0,
        direct_scores: false,
    };
}
/// How one sequence is cut.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeqLayout {
    /// More than one query tile: items run the `prefill` path.
    pub prefill: bool,
    /// Tokens per query tile.
    pub qtok: usize,
    /// Key chunks per query row (1 for prefill sequences).
    pub nchunks: usize,
    /// First key of chunk 0 (block aligned) and keys per chunk (a multiple of BS).
    pub chunk0: usize,
    pub chunk_len: usize,
    /// Offset of this sequence's first partial result (rows `[n][H]`, each `nchunks` x `D+2`;
    /// prefill sequences keep only `[m, l]` per row there and write their output directly).
    pub part_base: usize,
    /// Offset of this sequence's first stashed logit row (rows `[score_tokens][H]` x `ctx`).
    pub stash_base: usize,
    /// Offset of this sequence's partial scores when its items add their score rows' final
    /// weights there themselves ([`Tuning::direct_scores`]; then it has no stash rows): `ctx`
    /// floats per (KV head, query tile with score rows), `[Hkv][direct_tiles][ctx]`, summed in
    /// that order (so the sums do not depend on how items group KV heads).
    pub direct: Option<usize>,
    /// Query tiles with score rows (the last ones), when `direct`.
    pub direct_tiles: usize,
}

impl SeqLayout {
    /// Offset of the direct partial scores of (KV head `kvh`, query tile `qt`) of a sequence of
    /// `ctx` keys and `nqt` query tiles, when the tile has score rows.
    pub fn direct_part(&self, kvh: usize, (qt, nqt): (usize, usize), ctx: usize) -> Option<usize> {
        let first = nqt - self.direct_tiles;
        let base = self.direct?;
        (qt >= first).then(|| base + (kvh * self.direct_tiles + qt - first) * ctx)
    }

    /// Keys `[k0, k1)` of chunk `c`, for a sequence of `ctx` keys.
    pub fn chunk_range(&self, c: usize, ctx: usize) -> (usize, usize) {
        if self.nchunks == 1 {
            return (0, ctx);
        }
        let k0 = self.chunk0 + c * self.chunk_len;
        (k0, (k0 + self.chunk_len).min(ctx))
    }
}

/// One work item: one query tile of KV heads `kvh0..kvh1` of one sequence, over one key chunk.
/// Decode-like items take every KV head unless there are too few for the threads: a cache
/// block holds its heads contiguously (`[Hkv, BS, D]`), so visiting them in order streams the
/// whole block from memory.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Item {
    pub seq: u32,
    pub kvh0: u32,
    pub kvh1: u32,
    pub qt: u32,
    pub chunk: u32,
}

#[derive(Debug)]
pub(crate) struct Partition {
    pub seqs: Vec<SeqLayout>,
    pub items: Vec<Item>,
    /// f32 elements of the partial-results buffer.
    pub part_len: usize,
    /// f32 elements of the score-logit stash, `None` when the scores are recomputed.
    pub stash_len: Option<usize>,
    /// f32 elements of the direct partial scores ([`SeqLayout::direct`]).
    pub direct_len: usize,
    pub seq_of_token: Vec<u32>,
}

impl Partition {
    pub fn new(plan: &Plan, mode: ScoresMode, threads: usize, tune: &Tuning) -> Partition {
        let (h, d, g, bs) = (plan.h, plan.d, plan.g, plan.bs);
        let decode_qtok = (tune.row_target / g.max(1)).max(1);
        let align = if tune.chunk_align == 0 {
            bs
        } else {
            tune.chunk_align
        };
        let prefill_qtok = (PREFILL_ROWS / g.max(1)).max(1);
        let mut seqs = Vec::with_capacity(plan.seqs.len());
        let (mut part_len, mut stash_len, mut direct_len) = (0usize, 0usize, 0usize);
        let mut seq_of_token = vec![0u32; plan.t];
        let decoding = plan
            .seqs
            .iter()
            .filter(|sp| sp.n > 0 && sp.n <= decode_qtok)
            .count()
            .max(1);
        for (s, sp) in plan.seqs.iter().enumerate() {
            seq_of_token[sp.begin..sp.begin + sp.n].fill(s as u32);
            let prefill = sp.n > decode_qtok;
            let qtok = if prefill { prefill_qtok } else { decode_qtok };
            let (mut nchunks, mut chunk0, mut chunk_len) = (1, 0, sp.ctx().max(1));
            if !prefill && sp.n > 0 {
                // Decode-like: split the visible keys of the tile into block-aligned chunks.
                chunk0 = window_start(plan, sp.past) / align * align;
                let span = sp.ctx() - chunk0;
                let per = decoding * if tune.count_heads { plan.hkv.max(1) } else { 1 };
                let want = span
                    .div_ceil(tune.chunk_keys)
                    .max(tune.min_decode_items.div_ceil(per))
                    .min(span.div_ceil(tune.min_chunk_keys))
                    .clamp(1, MAX_CHUNKS);
                chunk_len = span.div_ceil(want).div_ceil(align) * align;
                nchunks = span.div_ceil(chunk_len).max(1);
            }
            let direct =
                (tune.direct_scores && nchunks == 1 && sp.score_tokens > 0).then_some(direct_len);
            // The query tiles holding the last `score_tokens` tokens.
            let nqt = sp.n.div_ceil(qtok);
            let direct_tiles = nqt - (sp.n - sp.score_tokens) / qtok;
            seqs.push(SeqLayout {
                prefill,
                qtok,
                nchunks,
                chunk0,
                chunk_len,
                part_base: part_len,
                stash_base: stash_len,
                direct,
                direct_tiles,
            });
            part_len += sp.n * h * if prefill { 2 } else { nchunks * (plan.dv + 2) };
            if direct.is_some() {
                direct_len += plan.hkv * direct_tiles * sp.ctx();
            } else {
                stash_len += sp.score_tokens * h * sp.ctx();
            }
        }
        // Decode items take every KV head of their query tile and chunk (whole blocks), unless
        // that leaves fewer than `items_per_thread` per thread: then they take a divisor
        // of Hkv heads each.
        let decode_items: usize = seqs
            .iter()
            .zip(&plan.seqs)
            .filter(|(l, sp)| !l.prefill && sp.n > 0)
            .map(|(l, sp)| sp.n.div_ceil(l.qtok) * l.nchunks)
            .sum();
        let split = (tune.items_per_thread * threads.max(1)).div_ceil(decode_items.max(1));
        let decode_heads = (1..=plan.hkv.max(1))
            .rev()
            .find(|&k| plan.hkv.is_multiple_of(k) && plan.hkv / k >= split.min(plan.hkv))
            .unwrap_or(1);
        // Largest items first (an estimate of their work: query rows x keys), so that threads
        // claiming them in order end on small ones (the longest-processing-time-first rule);
        // the order changes no result. The items of one (sequence, query tile, chunk) have the
        // same work whatever their KV heads, so those units are sorted (stable: equal ones keep
        // the order below), not the items (a decode call cut for 32 threads: a partition that
        // sorted every item, its key computed per comparison, took 26-75 us, all of it serial;
        // about 9 us now).
        // With no more threads than KV heads, prefill items stay grouped by KV head (largest
        // first within each; decode items go with head 0's): the threads then share one head's
        // K and V rows at a time, which stay in their caches across its query tiles (u8
        // prefill 1 x 1024 at 2 threads: 8-10% slower in a global largest-first order, which
        // walks the heads' rows in turn).
        let heads_per_item = |s: usize| if seqs[s].prefill { 1 } else { decode_heads };
        let (mut units, mut count) = (Vec::new(), 0);
        for (s, (sp, lay)) in plan.seqs.iter().zip(&seqs).enumerate() {
            let nqt = sp.n.div_ceil(lay.qtok);
            count += plan.hkv.div_ceil(heads_per_item(s)) * nqt * lay.nchunks;
            // Last query tiles first: under causal masks they see the most keys, so the
            // threads end on small items (work stealing then balances them).
            for qt in (0..nqt).rev() {
                let t0 = qt * lay.qtok;
                let tokens = lay.qtok.min(sp.n - t0);
                for chunk in 0..lay.nchunks {
                    let keys = if lay.prefill {
                        (sp.past + t0 + tokens).saturating_sub(window_start(plan, sp.past + t0))
                    } else {
                        let (k0, k1) = lay.chunk_range(chunk, sp.ctx());
                        k1.saturating_sub(k0)
                    };
                    let work = tokens * keys * heads_per_item(s);
                    units.push((std::cmp::Reverse(work), s, qt, chunk));
                }
            }
        }
        units.sort_by_key(|u| u.0);
        let by_head = threads.max(1) <= plan.hkv;
        let mut items = Vec::with_capacity(count);
        for group in 0..if by_head { plan.hkv } else { 1 } {
            for &(_, s, qt, chunk) in &units {
                let heads = match (by_head && seqs[s].prefill, group) {
                    (true, _) => group..group + 1,
                    (false, 0) => 0..plan.hkv,
                    (false, _) => continue,
                };
                let n = heads_per_item(s);
                items.extend(heads.step_by(n).map(|kvh0| Item {
                    seq: s as u32,
                    kvh0: kvh0 as u32,
                    kvh1: (kvh0 + n) as u32,
                    qt: qt as u32,
                    chunk: chunk as u32,
                }));
            }
        }
        let budget = 8 * plan.t * h * d + STASH_EXTRA;
        let stash_len = (mode == ScoresMode::Auto && stash_len <= budget).then_some(stash_len);
        Partition {
            seqs,
            items,
            part_len,
            stash_len,
            direct_len,
            seq_of_token,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::ElemType;
    use crate::op::SeqPlan;
    use std::collections::BTreeSet;

    /// A plan of H=32, Hkv=8, D=128, BS=32 and the given (past, new) per sequence.
    fn plan(seqs: &[(usize, usize)], sliding_window: usize) -> Plan {
        let (mut begin, mut block_begin, mut score_offset) = (0, 0, 0);
        let seqs: Vec<SeqPlan> = seqs
            .iter()
            .map(|&(past, n)| {
                let sp = SeqPlan {
                    past,
                    begin,
                    n,
                    block_begin,
                    score_tokens: n.min(1),
                    score_offset,
                };
                begin += n;
                block_begin += (past + n).div_ceil(32);
                score_offset += past + n;
                sp
            })
            .collect();
        Plan {
            t: begin,
            b: seqs.len(),
            h: 32,
            hkv: 8,
            d: 128,
            dv: 128,
            bs: 32,
            nb: block_begin,
            g: 4,
            query_type: ElemType::F32,
            cache_type: ElemType::F32,
            u8: None,
            scale: 1.0,
            sliding_window,
            alibi: None,
            sinks: None,
            rotation: None,
            seqs,
            scores_len: score_offset,
        }
    }

    /// Every (sequence, KV head, query tile, chunk) is in exactly one item, and items come
    /// largest first (query rows x visible keys x heads), within groups of one KV head each
    /// for prefill items when there are no more threads than KV heads.
    #[test]
    fn items_cover_each_tile_once_largest_first() {
        let mut mixed = vec![(768, 256)];
        mixed.extend([(1024, 1); 15]);
        let calls = [
            (vec![(1024, 1); 16], 0),
            (vec![(4096, 1); 4], 0),
            (vec![(0, 1024)], 0),
            (vec![(0, 1000)], 300),
            (mixed, 0),
            (vec![(100, 3), (0, 70), (5000, 1), (40, 33)], 0),
        ];
        for (seqs, window) in calls {
            let plan = plan(&seqs, window);
            for threads in [1, 2, 8, 9, 32, 64] {
                let part = Partition::new(&plan, ScoresMode::Auto, threads, &Tuning::FLOAT);
                let mut want = BTreeSet::new();
                for (s, (sp, lay)) in plan.seqs.iter().zip(&part.seqs).enumerate() {
                    for kvh in 0..plan.hkv {
                        for qt in 0..sp.n.div_ceil(lay.qtok) {
                            for c in 0..lay.nchunks {
                                want.insert((s, kvh, qt, c));
                            }
                        }
                    }
                }
                let mut got = BTreeSet::new();
                let mut last = (0, usize::MAX);
                for it in &part.items {
                    let (s, qt, c) = (it.seq as usize, it.qt as usize, it.chunk as usize);
                    let (sp, lay) = (&plan.seqs[s], &part.seqs[s]);
                    for kvh in it.kvh0..it.kvh1 {
                        assert!(got.insert((s, kvh as usize, qt, c)), "{it:?} twice");
                    }
                    let t0 = qt * lay.qtok;
                    let rows = lay.qtok.min(sp.n - t0);
                    // A prefill tile's visible keys, a decode item's chunk.
                    let keys = if lay.prefill {
                        (sp.past + t0 + rows).saturating_sub(window_start(&plan, sp.past + t0))
                    } else {
                        let (k0, k1) = lay.chunk_range(c, sp.ctx());
                        k1 - k0
                    };
                    let work = rows * keys * (it.kvh1 - it.kvh0) as usize;
                    let group = if lay.prefill && threads <= plan.hkv {
                        it.kvh0
                    } else {
                        0
                    };
                    assert!(
                        (group, std::cmp::Reverse(work)) >= (last.0, std::cmp::Reverse(last.1)),
                        "{threads} threads: {it:?} (work {work}) after work {}",
                        last.1
                    );
                    last = (group, work);
                }
                assert_eq!(got, want, "{threads} threads");
            }
        }
    }
}
