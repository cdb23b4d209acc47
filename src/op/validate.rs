//! Concrete validation: the shape rules of [`super::shape::check`] on the actual shapes, then
//! every value rule of SPEC.md. Produces the [`Plan`] the kernels run from; nothing is written
//! before it succeeds.

use super::contract::*;
use super::quant_layout::QuantLayout;
use super::shape::{check, PartialInput, PartialShape};
use super::{PaInputs, PaOutputs};
use crate::dtype::ElemType;
use crate::error::{PaError, Result};
use crate::tensor::{Tensor, TensorMut};

/// One sequence of the batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqPlan {
    /// Tokens already in the cache (`past_lens[s]`).
    pub past: usize,
    /// First row of this sequence in query/key/value/output.
    pub begin: usize,
    /// New tokens in this call.
    pub n: usize,
    /// First entry of this sequence in `block_indices`.
    pub block_begin: usize,
    /// How many of the last new tokens contribute to the scores (0..=n).
    pub score_tokens: usize,
    /// First element of this sequence's block in the scores output.
    pub score_offset: usize,
}

impl SeqPlan {
    /// Keys this sequence's last token attends over.
    pub fn ctx(&self) -> usize {
        self.past + self.n
    }
}

/// Rotation inputs, checked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rotation {
    /// Rotated blocks.
    pub r: usize,
    /// Columns of rotation_deltas per block: 1 (one delta for the block) or BS.
    pub delta_cols: usize,
    /// Rows of the trig LUT.
    pub m: usize,
}

/// A validated call: every dimension resolved and every value checked.
#[derive(Clone, Debug, PartialEq)]
pub struct Plan {
    pub t: usize,
    pub b: usize,
    pub h: usize,
    pub hkv: usize,
    /// Key (and query) head size.
    pub d: usize,
    /// Value head size (the output's per head): `d` unless the value cache says otherwise.
    pub dv: usize,
    pub bs: usize,
    pub nb: usize,
    /// Query heads per KV head.
    pub g: usize,
    pub query_type: ElemType,
    pub cache_type: ElemType,
    /// The layout of u8 or u4 caches (`cache_type` u8 or u4, the layout's `bits`); `bs` and `d`
    /// are then the logical block size and head size, not the caches' last two dimensions.
    pub u8: Option<QuantLayout>,
    /// Effective scale (the default `1/sqrt(D)` substituted for absent or 0).
    pub scale: f32,
    /// Sliding window; 0 means none.
    pub sliding_window: usize,
    /// ALiBi slopes per query head, widened to f32.
    pub alibi: Option<Vec<f32>>,
    /// Attention sinks per query head, widened to f32: a logit that joins each row's softmax
    /// and adds nothing to the output.
    pub sinks: Option<Vec<f32>>,
    pub rotation: Option<Rotation>,
    pub seqs: Vec<SeqPlan>,
    /// Length of the scores output: `sum(past_lens) + T`.
    pub scores_len: usize,
}

impl Plan {
    /// Shapes of the two outputs.
    pub fn output_shapes(&self) -> [Vec<usize>; 2] {
        [vec![self.t, self.h * self.dv], vec![self.scores_len]]
    }

    /// The attention sink of query head `head`, if the call has sinks.
    #[inline]
    pub fn sink(&self, head: usize) -> Option<f32> {
        self.sinks.as_ref().map(|s| s[head])
    }

    /// True when the call has nothing to write: no new tokens, no scores, no rotation. Such a
    /// call may declare head counts its empty buffers never bound (Hkv = 2^62 with zero blocks),
    /// and kernels that loop per head would spin on them, so it must not reach the kernels.
    pub fn writes_nothing(&self) -> bool {
        self.t == 0 && self.scores_len == 0 && self.rotation.is_none_or(|r| r.r == 0)
    }
}

fn check_len(name: &str, shape: &[usize], found: usize) -> Result<()> {
    let expected = crate::tensor::shape_elems(shape).unwrap_or(usize::MAX);
    if found != expected {
        return Err(PaError::BufferSize {
            name: name.to_string(),
            expected,
            found,
        });
    }
    Ok(())
}

fn i32s<'a>(t: &Tensor<'a>) -> &'a [i32] {
    // The type rules of `check` already guaranteed i32.
    t.as_i32().unwrap_or(&[])
}

/// Reads a one-element float tensor as f32.
fn scalar_f32(t: &Tensor<'_>) -> f32 {
    t.data.get_f64(0).unwrap_or(0.0) as f32
}

/// Validates a call and resolves everything the kernels need.
pub fn validate(inputs: &PaInputs<'_>) -> Result<Plan> {
    let n = inputs.count();
    let metas: Vec<_> = (0..n).map(|i| inputs.meta(i)).collect();
    let parts: Vec<PartialInput> = metas
        .iter()
        .map(|m| match m {
            Some((elem, shape, _)) => {
                PartialInput::new(Some(*elem), PartialShape::from_static(shape))
            }
            None => PartialInput::new(None, PartialShape::from_static(&[0])),
        })
        .collect();
    let k = check(&parts)?;
    for (i, m) in metas.iter().enumerate() {
        if let Some((_, shape, len)) = m {
            check_len(INPUTS[i].name, shape, *len)?;
        }
    }
    let get = |i: usize| inputs.read_only(i).filter(|_| k.present[i]);
    let dim = |v: Option<i64>| v.unwrap_or(0) as usize;
    let (t, b, h, hkv, d, bs, nb) = (
        dim(k.t),
        dim(k.b),
        dim(k.h),
        dim(k.hkv),
        dim(k.d),
        dim(k.bs),
        dim(k.nb),
    );
    let dv = k.dv.map_or(d, |v| v as usize);

    let past_lens = i32s(&inputs.past_lens);
    let begins = i32s(&inputs.subsequence_begins);
    let block_indices = i32s(&inputs.block_indices);
    let block_begins = i32s(&inputs.block_indices_begins);

    // Token offsets: start at 0, non-decreasing, end at T.
    if begins[0] != 0 {
        return Err(PaError::value(
            "subsequence_begins",
            format!("subsequence_begins[0] = {} but it must be 0", begins[0]),
        ));
    }
    for s in 0..b {
        if begins[s + 1] < begins[s] {
            return Err(PaError::value(
                "subsequence_begins",
                format!(
                    "subsequence_begins is decreasing: [{}] = {} < [{}] = {}",
                    s + 1,
                    begins[s + 1],
                    s,
                    begins[s]
                ),
            ));
        }
    }
    if begins[b] as i64 != t as i64 {
        return Err(PaError::value(
            "subsequence_begins",
            format!(
                "subsequence_begins[{b}] = {} but it must equal the token count T = {t}",
                begins[b]
            ),
        ));
    }
    // Block offsets: non-decreasing, within block_indices.
    if block_begins[0] < 0 {
        return Err(PaError::value(
            "block_indices_begins",
            format!("block_indices_begins[0] = {} is negative", block_begins[0]),
        ));
    }
    for s in 0..b {
        if block_begins[s + 1] < block_begins[s] {
            return Err(PaError::value(
                "block_indices_begins",
                format!(
                    "block_indices_begins is decreasing: [{}] = {} < [{}] = {}",
                    s + 1,
                    block_begins[s + 1],
                    s,
                    block_begins[s]
                ),
            ));
        }
    }
    if block_begins[b] as i64 > block_indices.len() as i64 {
        return Err(PaError::value(
            "block_indices_begins",
            format!(
                "block_indices_begins[{b}] = {} is past the end of block_indices ({} entries)",
                block_begins[b],
                block_indices.len()
            ),
        ));
    }

    let mut seqs = Vec::with_capacity(b);
    let mut score_offset = 0usize;
    for s in 0..b {
        let past = past_lens[s];
        if past < 0 {
            return Err(PaError::value(
                "past_lens",
                format!("past_lens[{s}] = {past} is negative"),
            ));
        }
        let past = past as usize;
        let n_s = (begins[s + 1] - begins[s]) as usize;
        let len = past + n_s;
        let need = len.div_ceil(bs);
        let have = (block_begins[s + 1] - block_begins[s]) as usize;
        if have < need {
            return Err(PaError::value(
                "block_indices_begins",
                format!("sequence {s} holds past_lens[{s}] + new tokens = {past} + {n_s} = {len} tokens, which need {need} blocks of {bs}, but block_indices_begins gives it {have}"),
            ));
        }
        let bb = block_begins[s] as usize;
        for (j, &id) in block_indices.iter().enumerate().skip(bb).take(need) {
            if id < 0 || id as usize >= nb {
                return Err(PaError::value(
                    "block_indices",
                    format!("block_indices[{j}] = {id} is outside 0..{nb} (key_cache has {nb} blocks); sequence {s} reaches it"),
                ));
            }
        }
        seqs.push(SeqPlan {
            past,
            begin: begins[s] as usize,
            n: n_s,
            block_begin: bb,
            score_tokens: 0,
            score_offset,
        });
        score_offset = score_offset
            .checked_add(len)
            .ok_or_else(|| PaError::value("past_lens", "sum(past_lens) + T overflows"))?;
    }

    // Scores window: scalar for all, or one per sequence; absent means 1.
    if let Some(w) = get(SCORE_AGGREGATION_WINDOW) {
        let w = i32s(w);
        for (s, sp) in seqs.iter_mut().enumerate() {
            let ws = if w.len() == 1 && b != 1 { w[0] } else { w[s] };
            sp.score_tokens = if ws < 0 {
                sp.n
            } else {
                (ws as usize).min(sp.n)
            };
        }
    } else {
        for sp in seqs.iter_mut() {
            sp.score_tokens = sp.n.min(1);
        }
    }

    let scale = get(SCALE)
        .map(scalar_f32)
        .filter(|&s| s != 0.0)
        .unwrap_or(1.0 / (d as f32).sqrt());
    let sliding_window = get(SLIDING_WINDOW).map_or(0, |w| i32s(w)[0].max(0) as usize);
    let alibi = get(ALIBI_SLOPES).map(|a| {
        (0..h)
            .map(|i| a.data.get_f64(i).unwrap_or(0.0) as f32)
            .collect()
    });
    let sinks = get(SINKS).map(|a| {
        (0..h)
            .map(|i| a.data.get_f64(i).unwrap_or(0.0) as f32)
            .collect()
    });

    let rotation = match (
        get(ROTATED_BLOCK_INDICES),
        get(ROTATION_DELTAS),
        get(ROTATION_TRIG_LUT),
    ) {
        (Some(rbi), Some(rd), Some(lut)) => {
            let r = rbi.shape[0];
            let m = lut.shape[0];
            for (i, &id) in i32s(rbi).iter().enumerate() {
                if id < 0 || id as usize >= nb {
                    return Err(PaError::value(
                        "rotated_block_indices",
                        format!("rotated_block_indices[{i}] = {id} is outside 0..{nb} (key_cache has {nb} blocks)"),
                    ));
                }
            }
            let delta_cols = if rd.rank() == 2 { rd.shape[1] } else { 1 };
            for (i, &v) in i32s(rd).iter().enumerate() {
                if v < 0 || v as usize >= m {
                    return Err(PaError::value(
                        "rotation_deltas",
                        format!("rotation_deltas[{}, {}] = {v} is outside 0..{m} (rotation_trig_lut has {m} rows)", i / delta_cols, i % delta_cols),
                    ));
                }
            }
            Some(Rotation { r, delta_cols, m })
        }
        _ => None,
    };

    let cache_type = k.cache_type.unwrap_or(ElemType::F32);
    let u8 = match (cache_type.is_quantized(), k.key_quant, k.value_group) {
        (true, Some(key), Some(value_group)) => Some(QuantLayout {
            hkv,
            d,
            dv,
            bs,
            key,
            value_group,
            bits: cache_type.bits(),
        }),
        (true, ..) => {
            // Static shapes always resolve both (or `check` reported why not).
            return Err(PaError::shape(
                "key_cache",
                format!("the {cache_type} cache layout could not be resolved from the shapes"),
            ));
        }
        _ => None,
    };
    Ok(Plan {
        t,
        b,
        h,
        hkv,
        d,
        dv,
        bs,
        nb,
        g: h.checked_div(hkv).unwrap_or(0),
        query_type: k.query_type.unwrap_or(ElemType::F32),
        cache_type,
        u8,
        scale,
        sliding_window,
        alibi,
        sinks,
        rotation,
        seqs,
        scores_len: score_offset,
    })
}

fn check_output(
    name: &'static str,
    o: &TensorMut<'_>,
    shape: &[usize],
    ty: ElemType,
) -> Result<()> {
    if o.elem_type() != ty {
        return Err(PaError::ElementType {
            input: name,
            expected: format!("{ty} (the query's type)"),
            found: o.elem_type(),
        });
    }
    let expected = crate::tensor::shape_elems(shape).unwrap_or(usize::MAX);
    if o.data.len() != expected || o.numel() != expected {
        return Err(PaError::BufferSize {
            name: name.to_string(),
            expected,
            found: o.data.len(),
        });
    }
    if o.shape != shape {
        let detail = format!(
            "`{name}` has shape {:?}, but the call produces {shape:?}",
            o.shape
        );
        return Err(PaError::shape(name, detail));
    }
    Ok(())
}

/// Checks the output buffers against the plan: element type of the query, exact shapes.
pub fn check_outputs(plan: &Plan, outputs: &PaOutputs<'_>) -> Result<()> {
    let [o, s] = plan.output_shapes();
    check_output("output", &outputs.output, &o, plan.query_type)?;
    check_output("scores", &outputs.scores, &s, plan.query_type)
}
