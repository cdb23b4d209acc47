//! Scalar kernels written straight from SPEC.md, one step per function. Slow and plain on
//! purpose: they are the twin the fast paths are held to. Arithmetic is f32 throughout; values
//! are rounded to the storage type once, when stored.

use crate::dtype::Float;
use crate::error::{PaError, Result};
use crate::op::{PaInputs, PaOutputs, Plan};
use crate::tensor::Tensor;
use rayon::prelude::*;

fn missing(what: &str) -> PaError {
    PaError::InvalidArgument {
        detail: format!("{what} does not have the validated element type"),
    }
}

/// Any float tensor widened to f32 (small inputs: LUT, slopes).
pub(crate) fn widen(t: &Tensor<'_>) -> Vec<f32> {
    (0..t.data.len())
        .map(|i| t.data.get_f64(i).unwrap_or(0.0) as f32)
        .collect()
}

/// Offset of row (block, kv head, slot) in a cache `[NB, Hkv, BS, D]`.
#[inline(always)]
pub(crate) fn cache_row(plan: &Plan, block: usize, head: usize, slot: usize) -> usize {
    ((block * plan.hkv + head) * plan.bs + slot) * plan.d
}

/// Physical block of logical position `pos` of a sequence whose block list starts at `block_begin`.
#[inline(always)]
pub(crate) fn block_of(block_indices: &[i32], block_begin: usize, bs: usize, pos: usize) -> usize {
    block_indices[block_begin + pos / bs] as usize
}

pub(crate) fn run_typed<Q: Float, C: Float>(
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    let block_indices = inputs
        .block_indices
        .as_i32()
        .ok_or_else(|| missing("block_indices"))?;
    if let Some(rot) = &plan.rotation {
        let rbi = inputs
            .rotated_block_indices
            .as_ref()
            .and_then(|t| t.as_i32())
            .ok_or_else(|| missing("rotated_block_indices"))?;
        let rd = inputs
            .rotation_deltas
            .as_ref()
            .and_then(|t| t.as_i32())
            .ok_or_else(|| missing("rotation_deltas"))?;
        let lut = widen(
            inputs
                .rotation_trig_lut
                .as_ref()
                .ok_or_else(|| missing("rotation_trig_lut"))?,
        );
        let kc = inputs
            .key_cache
            .as_float_mut::<C>()
            .ok_or_else(|| missing("key_cache"))?;
        rotate(plan, rot.delta_cols, kc, rbi, rd, &lut);
    }
    let key = inputs.key.as_float::<Q>().ok_or_else(|| missing("key"))?;
    let value = inputs
        .value
        .as_float::<Q>()
        .ok_or_else(|| missing("value"))?;
    insert(
        plan,
        key,
        inputs
            .key_cache
            .as_float_mut::<C>()
            .ok_or_else(|| missing("key_cache"))?,
        block_indices,
    );
    insert(
        plan,
        value,
        inputs
            .value_cache
            .as_float_mut::<C>()
            .ok_or_else(|| missing("value_cache"))?,
        block_indices,
    );

    let query = inputs
        .query
        .as_float::<Q>()
        .ok_or_else(|| missing("query"))?;
    let kc = inputs.key_cache.as_ref();
    let vc = inputs.value_cache.as_ref();
    let kc = kc.as_float::<C>().ok_or_else(|| missing("key_cache"))?;
    let vc = vc.as_float::<C>().ok_or_else(|| missing("value_cache"))?;
    let out = outputs
        .output
        .as_float_mut::<Q>()
        .ok_or_else(|| missing("output"))?;
    let stats = attention(plan, query, kc, vc, block_indices, out);
    let scores = outputs
        .scores
        .as_float_mut::<Q>()
        .ok_or_else(|| missing("scores"))?;
    scores_ref(plan, query, kc, block_indices, &stats, scores);
    Ok(())
}

/// Step 1: rotates the keys of each listed block by its LUT rows, in place.
pub(crate) fn rotate<C: Float>(
    plan: &Plan,
    delta_cols: usize,
    kc: &mut [C],
    rbi: &[i32],
    rd: &[i32],
    lut: &[f32],
) {
    let half = plan.d / 2;
    for (r, &block) in rbi.iter().enumerate() {
        for slot in 0..plan.bs {
            let col = if delta_cols == 1 { 0 } else { slot };
            let delta = rd[r * delta_cols + col] as usize;
            let cos = &lut[delta * plan.d..delta * plan.d + half];
            let sin = &lut[delta * plan.d + half..(delta + 1) * plan.d];
            for head in 0..plan.hkv {
                let row = cache_row(plan, block as usize, head, slot);
                for i in 0..half {
                    let x = kc[row + i].to_f32();
                    let y = kc[row + half + i].to_f32();
                    kc[row + i] = C::from_f32(x * cos[i] - y * sin[i]);
                    kc[row + half + i] = C::from_f32(x * sin[i] + y * cos[i]);
                }
            }
        }
    }
}

/// Step 2: writes each new token's rows (`[T, Hkv*D]`) at its logical position.
pub(crate) fn insert<Q: Float, C: Float>(
    plan: &Plan,
    src: &[Q],
    cache: &mut [C],
    block_indices: &[i32],
) {
    let d = plan.d;
    for sp in &plan.seqs {
        for i in 0..sp.n {
            let pos = sp.past + i;
            let block = block_of(block_indices, sp.block_begin, plan.bs, pos);
            let token = sp.begin + i;
            for head in 0..plan.hkv {
                let dst = cache_row(plan, block, head, pos % plan.bs);
                let s = (token * plan.hkv + head) * d;
                for x in 0..d {
                    cache[dst + x] = C::from_f32(src[s + x].to_f32());
                }
            }
        }
    }
}

/// Sequence index of every token.
pub(crate) fn token_seqs(plan: &Plan) -> Vec<usize> {
    let mut v = vec![0usize; plan.t];
    for (s, sp) in plan.seqs.iter().enumerate() {
        v[sp.begin..sp.begin + sp.n].fill(s);
    }
    v
}

/// First key a query at position `pos` sees.
#[inline(always)]
pub(crate) fn window_start(plan: &Plan, pos: usize) -> usize {
    if plan.sliding_window > 0 {
        (pos + 1).saturating_sub(plan.sliding_window)
    } else {
        0
    }
}

/// Score (logit) of query row `q` (f32, D) against key `j` for head `head` at position `pos`.
#[inline(always)]
fn logit<C: Float>(plan: &Plan, q: &[f32], k: &[C], head: usize, pos: usize, j: usize) -> f32 {
    let mut dot = 0f32;
    for x in 0..plan.d {
        dot += q[x] * k[x].to_f32();
    }
    let mut s = plan.scale * dot;
    if let Some(al) = &plan.alibi {
        s += al[head] * (j as f32 - pos as f32);
    }
    s
}

/// Final softmax statistics of one (token, head): running max and sum of exponentials.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct SoftmaxStats {
    pub max: f32,
    pub sum: f32,
}

/// Step 3: causal attention, one (token, head) per task, online softmax over every visible key.
/// Returns each task's softmax statistics for the scores step.
pub(crate) fn attention<Q: Float, C: Float>(
    plan: &Plan,
    query: &[Q],
    kc: &[C],
    vc: &[C],
    block_indices: &[i32],
    out: &mut [Q],
) -> Vec<SoftmaxStats> {
    let (h, d) = (plan.h, plan.d);
    let seq_of = token_seqs(plan);
    let mut stats = vec![SoftmaxStats::default(); plan.t * h];
    if d == 0 || plan.t == 0 {
        return stats;
    }
    out.par_chunks_mut(d)
        .zip(stats.par_iter_mut())
        .enumerate()
        .for_each(|(idx, (o, st))| {
            let (token, head) = (idx / h, idx % h);
            let sp = &plan.seqs[seq_of[token]];
            let pos = sp.past + (token - sp.begin);
            let kvh = head / plan.g;
            let q: Vec<f32> = query[(token * h + head) * d..][..d]
                .iter()
                .map(|v| v.to_f32())
                .collect();
            let mut acc = vec![0f32; d];
            let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
            for j in window_start(plan, pos)..=pos {
                let row = cache_row(
                    plan,
                    block_of(block_indices, sp.block_begin, plan.bs, j),
                    kvh,
                    j % plan.bs,
                );
                let s = logit(plan, &q, &kc[row..row + d], head, pos, j);
                if s > m {
                    let c = (m - s).exp();
                    l *= c;
                    acc.iter_mut().for_each(|a| *a *= c);
                    m = s;
                }
                let e = (s - m).exp();
                l += e;
                for x in 0..d {
                    acc[x] += e * vc[row + x].to_f32();
                }
            }
            for x in 0..d {
                o[x] = Q::from_f32(acc[x] / l);
            }
            *st = SoftmaxStats { max: m, sum: l };
        });
    stats
}

/// Step 4: for each sequence, each key's softmax weight summed over heads and over the last
/// `score_tokens` new tokens. Each score element is one task, so the sums do not depend on the
/// thread count.
pub(crate) fn scores_ref<Q: Float, C: Float>(
    plan: &Plan,
    query: &[Q],
    kc: &[C],
    block_indices: &[i32],
    stats: &[SoftmaxStats],
    scores: &mut [Q],
) {
    let (h, d) = (plan.h, plan.d);
    for sp in &plan.seqs {
        let dst = &mut scores[sp.score_offset..sp.score_offset + sp.ctx()];
        dst.par_iter_mut().enumerate().for_each(|(j, out)| {
            let mut total = 0f32;
            if sp.score_tokens > 0 {
                let row_of = |head: usize| {
                    cache_row(
                        plan,
                        block_of(block_indices, sp.block_begin, plan.bs, j),
                        head / plan.g,
                        j % plan.bs,
                    )
                };
                for i in sp.n - sp.score_tokens..sp.n {
                    let token = sp.begin + i;
                    let pos = sp.past + i;
                    if j > pos || j < window_start(plan, pos) {
                        continue;
                    }
                    for head in 0..h {
                        let q: Vec<f32> = query[(token * h + head) * d..][..d]
                            .iter()
                            .map(|v| v.to_f32())
                            .collect();
                        let row = row_of(head);
                        let s = logit(plan, &q, &kc[row..row + d], head, pos, j);
                        let st = stats[token * h + head];
                        total += (s - st.max).exp() / st.sum;
                    }
                }
            }
            *out = Q::from_f32(total);
        });
    }
}
