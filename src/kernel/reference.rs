//! Scalar kernels written straight from SPEC.md, one step per function. Slow and plain on
//! purpose: they are the twin the fast paths are held to. Arithmetic is f32 throughout; values
//! are rounded to the storage type once, when stored.

use super::bind::{Bound, BoundRotation, TypedOp};
use super::layout::{cache_row, seq_row, seq_row_of, token_seqs, visible, window_start};
use super::quant::{self, KeyRotation};
use super::rope::{lut_row, rope_row};
use super::softmax::{Lanes, OnlineSoftmax};
use crate::dtype::Float;
use crate::error::{PaError, Result};
use crate::op::quant_layout::QuantLayout;
use crate::op::Plan;
use rayon::prelude::*;

/// The reference kernels as a [`TypedOp`].
pub(crate) struct Reference;

impl TypedOp for Reference {
    fn run<Q: Float, C: Float>(self, plan: &Plan, b: Bound<'_, Q, C>) -> Result<()> {
        if let Some(rot) = &b.rotation {
            rotate(plan, rot, &mut *b.key_cache);
        }
        insert(plan, plan.d, b.key, &mut *b.key_cache, b.block_indices);
        insert(plan, plan.dv, b.value, &mut *b.value_cache, b.block_indices);
        let (kc, vc) = (&*b.key_cache, &*b.value_cache);
        let stats = attention(plan, b.query, kc, vc, b.block_indices, b.output);
        scores_ref(plan, b.query, kc, b.block_indices, &stats, b.scores);
        Ok(())
    }

    fn run_quant<Q: Float>(
        self,
        plan: &Plan,
        layout: &QuantLayout,
        b: Bound<'_, Q, u8>,
    ) -> Result<()> {
        run_reference_u8(
            plan,
            layout,
            b.rotation.as_ref().map(|r| r.keys()).as_ref(),
            b.query,
            b.key,
            b.value,
            b.block_indices,
            b.key_cache,
            b.value_cache,
            b.output,
            b.scores,
        )
    }
}

/// Step 1: rotates the keys of each listed block by its LUT rows, in place.
pub(crate) fn rotate<C: Float>(plan: &Plan, rot: &BoundRotation<'_>, kc: &mut [C]) {
    let d = plan.d;
    for (r, &block) in rot.blocks.iter().enumerate() {
        for slot in 0..plan.bs {
            let lut = lut_row(&rot.lut, d, (rot.deltas, rot.delta_cols), r, slot);
            for head in 0..plan.hkv {
                let row = cache_row(plan, block as usize, head, slot);
                rope_row(&mut kc[row..row + d], lut);
            }
        }
    }
}

/// Step 2: writes each new token's rows (`[T, Hkv*width]`: keys `D`, values `Dv` wide) at its
/// logical position.
pub(crate) fn insert<Q: Float, C: Float>(
    plan: &Plan,
    d: usize,
    src: &[Q],
    cache: &mut [C],
    block_indices: &[i32],
) {
    for sp in &plan.seqs {
        for i in 0..sp.n {
            let (pos, token) = (sp.past + i, sp.begin + i);
            for head in 0..plan.hkv {
                let dst = seq_row_of(plan, d, block_indices, sp, head, pos);
                let s = (token * plan.hkv + head) * d;
                for x in 0..d {
                    cache[dst + x] = C::from_f32(src[s + x].to_f32());
                }
            }
        }
    }
}

/// Score (logit) of query row `q` (f32, D) against key `j` for head `head` at position `pos`,
/// capped where it is made (`Lanes::cap`) as every kernel does.
#[inline(always)]
fn logit<C: Float>(plan: &Plan, q: &[f32], k: &[C], head: usize, pos: usize, j: usize) -> f32 {
    let mut dot = 0f32;
    for x in 0..plan.d {
        dot += q[x] * k[x].to_f32();
    }
    let s = (plan.scale * dot).cap();
    match &plan.alibi {
        Some(al) => (s + al[head] * (j as f32 - pos as f32)).cap(),
        None => s,
    }
}

/// Step 3: causal attention, one (token, head) per task, online softmax over every visible key
/// (each key a block of its own). Returns each task's softmax state for the scores step.
pub(crate) fn attention<Q: Float, C: Float>(
    plan: &Plan,
    query: &[Q],
    kc: &[C],
    vc: &[C],
    block_indices: &[i32],
    out: &mut [Q],
) -> Vec<OnlineSoftmax> {
    let (h, d, dv) = (plan.h, plan.d, plan.dv);
    let seq_of = token_seqs(plan);
    let mut stats = vec![OnlineSoftmax::EMPTY; plan.t * h];
    if d == 0 || dv == 0 || plan.t == 0 {
        return stats;
    }
    out.par_chunks_mut(dv)
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
            let mut acc = vec![0f32; dv];
            for j in window_start(plan, pos)..=pos {
                let row = seq_row(plan, block_indices, sp, kvh, j);
                let s = logit(plan, &q, &kc[row..row + d], head, pos, j);
                let step = st.update(s);
                let e = (s - step.sub).exp();
                st.add(e);
                let vrow = seq_row_of(plan, dv, block_indices, sp, kvh, j);
                for x in 0..dv {
                    acc[x] = acc[x] * step.rescale + e * vc[vrow + x].to_f32();
                }
            }
            let norm = st.finish(plan.sink(head));
            for x in 0..dv {
                o[x] = Q::from_f32(acc[x] * norm);
            }
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
    stats: &[OnlineSoftmax],
    scores: &mut [Q],
) {
    let (h, d) = (plan.h, plan.d);
    for sp in &plan.seqs {
        let dst = &mut scores[sp.score_offset..sp.score_offset + sp.ctx()];
        dst.par_iter_mut().enumerate().for_each(|(j, out)| {
            let mut total = 0f32;
            for i in sp.n - sp.score_tokens..sp.n {
                let (token, pos) = (sp.begin + i, sp.past + i);
                if !visible(plan, pos, j) {
                    continue;
                }
                for head in 0..h {
                    let q: Vec<f32> = query[(token * h + head) * d..][..d]
                        .iter()
                        .map(|v| v.to_f32())
                        .collect();
                    let row = seq_row(plan, block_indices, sp, head / plan.g, j);
                    let s = logit(plan, &q, &kc[row..row + d], head, pos, j);
                    total += stats[token * h + head].weight(s);
                }
            }
            *out = Q::from_f32(total);
        });
    }
}

/// Steps 1-4 on u8 caches with the scalar reference kernels: rotates the listed key blocks
/// (`rotation`, when the plan has rotation inputs), quantizes the new tokens into the caches, then
/// runs the reference attention and scores over the dequantized caches. `plan` is the call
/// validated with the caches' logical shape `[NB, Hkv, BS, D]`. Reachable from outside the
/// crate only with the feature `test-hooks` (the module is private otherwise).
#[allow(clippy::too_many_arguments)]
pub fn run_reference_u8<Q: Float>(
    plan: &Plan,
    layout: &QuantLayout,
    rotation: Option<&KeyRotation>,
    query: &[Q],
    key: &[Q],
    value: &[Q],
    block_indices: &[i32],
    key_cache: &mut [u8],
    value_cache: &mut [u8],
    output: &mut [Q],
    scores: &mut [Q],
) -> Result<()> {
    if plan.rotation.is_some() != rotation.is_some()
        || rotation.is_some_and(|r| !r.fits(plan.nb, plan.bs, plan.d))
    {
        return Err(PaError::InvalidArgument {
            detail: "the rotation inputs do not match the plan".into(),
        });
    }
    // The layouts' shapes count elements: u4 packs two per byte.
    let expect = |what: &str, got: usize, want: Option<[usize; 4]>| match want {
        Some(dims) if dims.iter().product::<usize>() * layout.bits / 8 == got => Ok(()),
        _ => Err(PaError::InvalidArgument {
            detail: format!("{what}: {got} bytes do not match the quantized layout {want:?}"),
        }),
    };
    let shapes = (layout.d, layout.dv, layout.bs, layout.hkv);
    if !layout.is_valid() || shapes != (plan.d, plan.dv, plan.bs, plan.hkv) {
        return Err(PaError::InvalidArgument {
            detail: format!("quantized cache layout {layout:?} does not match the call"),
        });
    }
    expect("key_cache", key_cache.len(), layout.key_cache_dims(plan.nb))?;
    expect(
        "value_cache",
        value_cache.len(),
        layout.value_cache_dims(plan.nb),
    )?;
    if let Some(rot) = rotation {
        quant::rotate_u8(layout, &plan.seqs, block_indices, rot, key_cache);
    }
    quant::insert_u8(
        layout,
        &plan.seqs,
        block_indices,
        key,
        value,
        key_cache,
        value_cache,
    );
    let (kc, vc) = quant::dequantize_caches(layout, plan.nb, key_cache, value_cache)?;
    let stats = attention(plan, query, &kc, &vc, block_indices, output);
    scores_ref(plan, query, &kc, block_indices, &stats, scores);
    Ok(())
}
