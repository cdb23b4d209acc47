//! Shape inference on partial shapes, and the shape rules validation reuses for concrete calls.
//!
//! A dimension is an `i64`; [`DYN`] (-1) means unknown. A shape of `None` has a dynamic rank.
//! Every rule checks only what is already known, so a fully dynamic model infers and a fully
//! static one is checked completely: concrete validation runs these same rules on the concrete
//! shapes (one contract, not two).

use super::contract::*;
use super::quant_layout::{group_of_row_bits, param_elems, KeyQuant};
use crate::dtype::ElemType;
use crate::error::{PaError, Result};

/// An unknown dimension.
pub const DYN: i64 = -1;

/// A partial shape: `None` is a dynamic rank; a dimension of [`DYN`] is unknown.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartialShape(pub Option<Vec<i64>>);

impl PartialShape {
    pub fn dynamic() -> Self {
        PartialShape(None)
    }
    pub fn from_dims(dims: &[i64]) -> Self {
        PartialShape(Some(dims.to_vec()))
    }
    pub fn from_static(dims: &[usize]) -> Self {
        PartialShape(Some(dims.iter().map(|&d| d as i64).collect()))
    }
    pub fn rank(&self) -> Option<usize> {
        self.0.as_ref().map(|d| d.len())
    }
    /// Dimension `i` if the rank and that dimension are known.
    pub fn dim(&self, i: usize) -> Option<i64> {
        self.0
            .as_ref()
            .and_then(|d| d.get(i).copied())
            .filter(|&v| v >= 0)
    }
    /// True when some dimension is statically zero: the tensor is empty ("not provided").
    pub fn is_empty(&self) -> bool {
        self.0.as_ref().is_some_and(|d| d.contains(&0))
    }
    pub fn is_static(&self) -> bool {
        self.0.as_ref().is_some_and(|d| d.iter().all(|&v| v >= 0))
    }
}

impl std::fmt::Display for PartialShape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.0 {
            None => f.write_str("[...]"),
            Some(d) => {
                f.write_str("[")?;
                for (i, v) in d.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    if *v < 0 {
                        f.write_str("?")?;
                    } else {
                        write!(f, "{v}")?;
                    }
                }
                f.write_str("]")
            }
        }
    }
}

/// What shape inference knows of one input: element type (`None` = dynamic) and partial shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartialInput {
    pub elem: Option<ElemType>,
    pub shape: PartialShape,
}

impl PartialInput {
    pub fn new(elem: Option<ElemType>, shape: PartialShape) -> Self {
        PartialInput { elem, shape }
    }
}

/// One inferred output.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OutputInfo {
    pub elem: Option<ElemType>,
    pub shape: PartialShape,
}

/// The op's dimensions as far as they are known.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Dims {
    pub t: Option<i64>,
    pub b: Option<i64>,
    pub h: Option<i64>,
    pub hkv: Option<i64>,
    pub d: Option<i64>,
    /// Value head size: value_cache dim 3 with float caches, value.dim1 / Hkv with u8.
    pub dv: Option<i64>,
    pub bs: Option<i64>,
    pub nb: Option<i64>,
    /// Number of rotated blocks, when rotation inputs are present.
    pub r: Option<i64>,
    /// Rows of the trig LUT.
    pub m: Option<i64>,
    pub query_type: Option<ElemType>,
    pub cache_type: Option<ElemType>,
    /// With u8 caches: how keys are quantized (from key_cache's row count).
    pub key_quant: Option<KeyQuant>,
    /// With u8 caches: channels per value group (from value_cache's last dimension).
    pub value_group: Option<usize>,
    /// Which optional inputs are present (given and not statically empty).
    pub present: [bool; MAX_INPUTS],
}

/// Records `value` as the dimension `slot`, or reports it contradicts what is known.
fn unify(
    slot: &mut Option<i64>,
    value: Option<i64>,
    input: &'static str,
    what: impl FnOnce(i64, i64) -> String,
) -> Result<()> {
    if let Some(v) = value {
        match *slot {
            None => *slot = Some(v),
            Some(known) if known != v => return Err(PaError::shape(input, what(v, known))),
            _ => {}
        }
    }
    Ok(())
}

/// Checks the inputs' ranks, types and dimensions against each other and returns what is known.
pub fn check(inputs: &[PartialInput]) -> Result<Dims> {
    if inputs.len() < MIN_INPUTS || inputs.len() > MAX_INPUTS {
        return Err(PaError::InputCount {
            found: inputs.len(),
        });
    }
    let mut k = Dims::default();
    for (i, inp) in inputs.iter().enumerate() {
        k.present[i] = !(INPUTS[i].optional && inp.shape.is_empty());
    }
    let present = k.present;
    let get = |i: usize| -> Option<&PartialInput> { inputs.get(i).filter(|_| present[i]) };
    // An optional input with a dynamic dimension may still be empty ("not provided") at run
    // time, so its dimensions can contradict the others only once they are known: e.g. the
    // seed's example IR declares rotation_trig_lut as [?, 128] with head_size 16 and feeds it
    // empty. Concrete calls have static shapes, so validation checks everything.
    let sure = |i: usize| get(i).filter(|inp| inp.shape.is_static());

    // Ranks and element types, straight from the table.
    for (i, inp) in inputs.iter().enumerate() {
        if !present[i] {
            continue;
        }
        let s = &INPUTS[i];
        if let Some(r) = inp.shape.rank() {
            if !s.ranks.contains(&r) {
                return Err(PaError::Rank {
                    input: s.name,
                    expected: s.ranks_text,
                    found: r,
                });
            }
        }
        if let Some(e) = inp.elem {
            let ok = match s.ty {
                TypeRule::I32 => e == ElemType::I32,
                TypeRule::Cache => e.is_float() || e.is_quantized(),
                _ => e.is_float(),
            };
            if !ok {
                let expected = match s.ty {
                    TypeRule::I32 => "i32",
                    TypeRule::Cache => "f32, f16, bf16, u8 or u4",
                    _ => "f32, f16 or bf16",
                };
                return Err(PaError::ElementType {
                    input: s.name,
                    expected: expected.into(),
                    found: e,
                });
            }
        }
    }
    let q_type = inputs[QUERY]
        .elem
        .or(inputs[KEY].elem)
        .or(inputs[VALUE].elem);
    for i in [KEY, VALUE] {
        if let (Some(e), Some(q)) = (inputs[i].elem, q_type) {
            if e != q {
                return Err(PaError::ElementType {
                    input: INPUTS[i].name,
                    expected: format!("{q} (the query's type)"),
                    found: e,
                });
            }
        }
    }
    if let (Some(kc), Some(vc)) = (inputs[KEY_CACHE].elem, inputs[VALUE_CACHE].elem) {
        if kc != vc {
            return Err(PaError::ElementType {
                input: "value_cache",
                expected: format!("{kc} (key_cache's type)"),
                found: vc,
            });
        }
    }
    k.query_type = q_type;
    k.cache_type = inputs[KEY_CACHE].elem.or(inputs[VALUE_CACHE].elem);

    // One-element scalars given as rank 1.
    for i in [SCALE, SLIDING_WINDOW] {
        if let Some(inp) = get(i) {
            if inp.shape.rank() == Some(1) {
                if let Some(n) = inp.shape.dim(0) {
                    if n != 1 {
                        return Err(PaError::shape(
                            INPUTS[i].name,
                            format!(
                                "`{}` should be a scalar, but its shape is {}",
                                INPUTS[i].name, inp.shape
                            ),
                        ));
                    }
                }
            }
        }
    }

    let kc = &inputs[KEY_CACHE].shape;
    let vc = &inputs[VALUE_CACHE].shape;
    if let Some(ct) = k.cache_type.filter(|c| c.is_quantized()) {
        u8_geometry(inputs, &mut k, ct)?;
    } else {
        // Cache geometry: key [NB, Hkv, BS, D], value [NB, Hkv, BS, Dv]: the same blocks,
        // heads and block size; the value head size may differ from the key's (OpenVINO's
        // v_head_size).
        for (i, slot) in [&mut k.nb, &mut k.hkv, &mut k.bs].into_iter().enumerate() {
            *slot = kc.dim(i);
            unify(slot, vc.dim(i), "value_cache", |v, known| {
                format!("value_cache shape {vc} differs from key_cache shape {kc} (dim {i}: {v} vs {known})")
            })?;
        }
        k.d = kc.dim(3);
        k.dv = vc.dim(3);
        for (name, v) in [
            ("num_kv_heads (cache dim 1)", k.hkv),
            ("block_size (cache dim 2)", k.bs),
            ("head_size (cache dim 3)", k.d),
            ("value head_size (value_cache dim 3)", k.dv),
        ] {
            if v == Some(0) {
                return Err(PaError::shape(
                    "key_cache",
                    format!("key_cache shape {kc} / value_cache shape {vc}: {name} = 0"),
                ));
            }
        }
    }
    // A head size of 0 (a by-channel u8 key cache of 0 channels, say) divides nothing.
    for (name, v) in [("head_size", k.d), ("value head_size", k.dv)] {
        if v == Some(0) {
            return Err(PaError::shape(
                "key_cache",
                format!(
                    "key_cache shape {} / value_cache shape {}: {name} = 0",
                    inputs[KEY_CACHE].shape, inputs[VALUE_CACHE].shape
                ),
            ));
        }
    }
    // Query heads.
    let q = &inputs[QUERY].shape;
    if let (Some(w), Some(d)) = (q.dim(1), k.d) {
        if w % d != 0 {
            return Err(PaError::shape(
                "query",
                format!("query.dim1 = {w} is not a multiple of head_size = {d} (key_cache dim 3; key.dim1 / num_kv_heads with u8 caches)"),
            ));
        }
        k.h = Some(w / d);
    }
    if let (Some(h), Some(hkv)) = (k.h, k.hkv) {
        if h % hkv != 0 {
            return Err(PaError::shape("query", format!("num_heads = {h} (query.dim1 / head_size) is not a multiple of num_kv_heads = {hkv}")));
        }
    }
    // Every product of dimensions is checked: a wrapped product could match a small width
    // (Hkv = 2^61 + 1, D = 8 "gives" 8) and let a call through whose kernels index past it.
    let kv_width = match (k.hkv, k.d) {
        (Some(hkv), Some(d)) => Some(hkv.checked_mul(d).ok_or_else(|| {
            PaError::shape(
                "key_cache",
                format!("key_cache shape {kc}: num_kv_heads * head_size = {hkv} * {d} overflows"),
            )
        })?),
        _ => None,
    };
    if let (Some(w), Some(kvw), Some(hkv), Some(d)) =
        (inputs[KEY].shape.dim(1), kv_width, k.hkv, k.d)
    {
        if w != kvw {
            return Err(PaError::shape(
                "key",
                format!("key.dim1 = {w}, but num_kv_heads * head_size = {hkv} * {d} = {kvw}"),
            ));
        }
    }
    // Values: Dv from the value cache, else from value.dim1 (a cache of dynamic shape).
    if let (Some(w), Some(hkv)) = (inputs[VALUE].shape.dim(1), k.hkv) {
        match k.dv {
            Some(dv) => {
                let vw = hkv.checked_mul(dv).ok_or_else(|| {
                    PaError::shape(
                        "value_cache",
                        format!("value_cache shape {vc}: num_kv_heads * value head_size = {hkv} * {dv} overflows"),
                    )
                })?;
                if w != vw {
                    return Err(PaError::shape(
                        "value",
                        format!("value.dim1 = {w}, but num_kv_heads * value head_size = {hkv} * {dv} = {vw} (value_cache dim 3 is the value head size)"),
                    ));
                }
            }
            None if w % hkv == 0 && w > 0 => k.dv = Some(w / hkv),
            None => {
                return Err(PaError::shape(
                    "value",
                    format!("value.dim1 = {w} is not a positive multiple of num_kv_heads = {hkv}"),
                ))
            }
        }
    }
    for (name, c) in [("key_cache", kc), ("value_cache", vc)] {
        if let Some(cache) = c.0.as_ref().filter(|_| c.is_static()) {
            cache
                .iter()
                .try_fold(1i64, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| {
                    PaError::shape(name, format!("{name} shape {c}: element count overflows"))
                })?;
        }
    }
    // Tokens.
    for i in [QUERY, KEY, VALUE] {
        let name = INPUTS[i].name;
        unify(&mut k.t, inputs[i].shape.dim(0), name, |v, known| {
            format!("{name}.dim0 = {v} tokens, but another of query/key/value has {known}")
        })?;
    }
    // Sequences.
    k.b = inputs[PAST_LENS].shape.dim(0);
    for i in [SUBSEQUENCE_BEGINS, BLOCK_INDICES_BEGINS] {
        let name = INPUTS[i].name;
        let b = inputs[i].shape.dim(0).map(|n| n - 1);
        if b == Some(-1) {
            return Err(PaError::shape(
                name,
                format!("`{name}` must have B + 1 >= 1 elements, but it is empty"),
            ));
        }
        unify(&mut k.b, b, name, |v, known| {
            format!("{name} has {} elements, but past_lens says B = {known} sequences, so B + 1 = {} are needed", v + 1, known.saturating_add(1))
        })?;
    }
    if let Some(inp) = get(SCORE_AGGREGATION_WINDOW) {
        // A one-element window counts as a scalar for any B (README); otherwise one per sequence.
        if inp.shape.rank() == Some(1) && inp.shape.dim(0) != Some(1) {
            unify(
                &mut k.b,
                inp.shape.dim(0),
                "score_aggregation_window",
                |v, known| {
                    format!("score_aggregation_window has {v} elements; it must be a scalar or have one per sequence (B = {known})")
                },
            )?;
        }
    }
    // ALiBi: one slope per query head.
    if let Some(inp) = sure(ALIBI_SLOPES) {
        if let (Some(n), Some(h)) = (inp.shape.dim(0), k.h) {
            if n != h {
                return Err(PaError::shape(
                    "alibi_slopes",
                    format!(
                        "alibi_slopes has {n} elements, but there are num_heads = {h} query heads"
                    ),
                ));
            }
        }
    }
    // Sinks: one logit per query head, as `[H]` or OpenVINO's `[1, H, 1, 1]`.
    if let Some(inp) = sure(SINKS) {
        let dims = inp.shape.0.as_deref().unwrap_or(&[]);
        let n = match dims {
            [n] => Some(*n),
            [1, n, 1, 1] => Some(*n),
            [_, _, _, _] => {
                return Err(PaError::shape(
                    "sinks",
                    format!("sinks shape {}: it must be [H] or [1, H, 1, 1]", inp.shape),
                ))
            }
            _ => None,
        };
        if let (Some(n), Some(h)) = (n, k.h) {
            if n != h {
                return Err(PaError::shape(
                    "sinks",
                    format!("sinks has {n} elements, but there are num_heads = {h} query heads"),
                ));
            }
        }
    }
    // Rotation: only when rotated_block_indices is non-empty (SPEC), and then all three inputs
    // together. Deltas and a LUT next to an empty block list (a model that rotates on some
    // steps only) are not an error: there is nothing to rotate.
    let rot = [ROTATED_BLOCK_INDICES, ROTATION_DELTAS, ROTATION_TRIG_LUT];
    let rot_given = rot.iter().filter(|&&i| sure(i).is_some()).count();
    let rot_absent = rot.iter().filter(|&&i| get(i).is_none()).count();
    if sure(ROTATED_BLOCK_INDICES).is_some() && rot_absent > 0 {
        {
            let missing: Vec<&str> = rot
                .iter()
                .filter(|&&i| get(i).is_none())
                .map(|&i| INPUTS[i].name)
                .collect();
            return Err(PaError::shape("rotated_block_indices", format!("rotation needs rotated_block_indices, rotation_deltas and rotation_trig_lut together; missing: {}", missing.join(", "))));
        }
    }
    if rot_given == 3 {
        k.r = inputs[ROTATED_BLOCK_INDICES].shape.dim(0);
        let rd = &inputs[ROTATION_DELTAS].shape;
        unify(&mut k.r, rd.dim(0), "rotation_deltas", |v, known| {
            format!("rotation_deltas.dim0 = {v}, but rotated_block_indices has {known} blocks")
        })?;
        if let (Some(c), Some(bs)) = (rd.dim(1), k.bs) {
            if c != 1 && c != bs {
                return Err(PaError::shape(
                    "rotation_deltas",
                    format!("rotation_deltas.dim1 = {c}; it must be 1 or block_size = {bs}"),
                ));
            }
        }
        let lut = &inputs[ROTATION_TRIG_LUT].shape;
        if let (Some(w), Some(d)) = (lut.dim(1), k.d) {
            if w != d {
                return Err(PaError::shape(
                    "rotation_trig_lut",
                    format!("rotation_trig_lut.dim1 = {w}, but head_size = {d}"),
                ));
            }
        }
        if let Some(d) = k.d {
            if d % 2 != 0 {
                return Err(PaError::shape(
                    "rotation_trig_lut",
                    format!("rotation needs an even head_size, but head_size = {d}"),
                ));
            }
        }
        k.m = lut.dim(0);
    }
    Ok(k)
}

/// The geometry of u8 caches (docs/contract.md, "u8 caches"): `NB`, `Hkv` from dims 0 and 1 of
/// both caches, `BS` from the value cache's rows, `D` from the key/value width over `Hkv` (and
/// from a by-channel key cache's last dimension); the key mode from the key cache's rows (`BS + 8`
/// by channel, `BS` by token) and each by-token group size from its cache's last dimension
/// (`D + 8 * D / G`).
fn u8_geometry(inputs: &[PartialInput], k: &mut Dims, ct: ElemType) -> Result<()> {
    let p = param_elems(ct.bits());
    let kc = &inputs[KEY_CACHE].shape;
    let vc = &inputs[VALUE_CACHE].shape;
    for (i, slot) in [(0, &mut k.nb), (1, &mut k.hkv)] {
        *slot = kc.dim(i);
        unify(slot, vc.dim(i), "value_cache", |v, known| {
            format!("value_cache shape {vc} differs from key_cache shape {kc} (dim {i}: {v} vs {known})")
        })?;
    }
    k.bs = vc.dim(2);
    for (name, v) in [
        ("num_kv_heads (cache dim 1)", k.hkv),
        ("block_size (value_cache dim 2)", k.bs),
    ] {
        if v == Some(0) {
            return Err(PaError::shape(
                "value_cache",
                format!("value_cache shape {vc} has {name} = 0"),
            ));
        }
    }
    // A u8 cache's last dimension is bytes, not channels: the head sizes come from key and
    // value.
    for i in [KEY, VALUE] {
        let name = INPUTS[i].name;
        if let (Some(w), Some(hkv)) = (inputs[i].shape.dim(1), k.hkv) {
            if w % hkv != 0 || w == 0 {
                return Err(PaError::shape(
                    name,
                    format!("{name}.dim1 = {w} is not a positive multiple of num_kv_heads = {hkv} (cache dim 1); with {ct} caches it gives head_size"),
                ));
            }
            let slot = if i == KEY { &mut k.d } else { &mut k.dv };
            *slot = Some(w / hkv);
        }
    }
    if ct == ElemType::U4 {
        for (i, v) in [(KEY, k.d), (VALUE, k.dv)] {
            let name = INPUTS[i].name;
            if let Some(v) = v.filter(|v| v % 2 != 0) {
                return Err(PaError::shape(
                    name,
                    format!("with u4 caches the head size ({name}.dim1 / num_kv_heads = {v}) must be even: u4 rows pack two values per byte"),
                ));
            }
        }
    }
    k.d = k.d.or(k.dv);
    k.dv = k.dv.or(k.d);
    if let (Some(rows), Some(bs)) = (kc.dim(2), k.bs) {
        // Checked: a declared block size near i64::MAX must be refused, not wrap.
        let with_params = bs.checked_add(p as i64);
        if Some(rows) == with_params {
            k.key_quant = Some(KeyQuant::ByChannel);
            unify(&mut k.d, kc.dim(3), "key_cache", |v, known| {
                format!("key_cache ({ct}, by channel) has head_size {v} (dim 3), but key/value give {known}")
            })?;
        } else if rows == bs {
            if let (Some(cols), Some(d)) = (kc.dim(3), k.d) {
                let group = u8_group("key_cache", cols, d, ct)?;
                k.key_quant = Some(KeyQuant::ByToken { group });
            }
        } else {
            return Err(PaError::shape(
                "key_cache",
                format!("{ct} key_cache has {rows} rows per block (dim 2); it must be block_size + {p}{} (keys by channel, {p} rows of f32 scales and zero points) or block_size = {bs} (keys by token), with block_size = {bs} from value_cache dim 2", with_params.map(|v| format!(" = {v}")).unwrap_or_default()),
            ));
        }
    }
    if let (Some(cols), Some(dv)) = (vc.dim(3), k.dv) {
        k.value_group = Some(u8_group("value_cache", cols, dv, ct)?);
    }
    Ok(())
}

/// The group size of a by-token u8 or u4 cache whose rows are `cols` elements, for head size `d`.
fn u8_group(name: &'static str, cols: i64, d: i64, ct: ElemType) -> Result<usize> {
    let (bits, p) = (ct.bits(), param_elems(ct.bits()));
    let even = if bits == 4 {
        " and even (whole bytes)"
    } else {
        ""
    };
    let unit = if bits == 8 { "bytes" } else { "elements" };
    group_of_row_bits(cols as usize, d as usize, bits).ok_or_else(|| {
        PaError::shape(
            name,
            format!("{name} ({ct}, by token) has {cols} {unit} per token (dim 3), which matches no group size for head_size {d}: a row holds D + {p} * D / G {unit} for a group size G dividing D{even} ({} for one group of D)", d.checked_add(p as i64).map_or(format!("D + {p}"), |v| v.to_string())),
        )
    })
}

/// Infers the two outputs from partial input shapes: `output` `[T, H*D]` and `scores`
/// `[sum(past_lens) + T]` (dynamic, since past_lens values are not known from shapes alone).
pub fn infer_shapes(inputs: &[PartialInput]) -> Result<[OutputInfo; 2]> {
    infer_shapes_with_past_lens(inputs, None)
}

/// As [`infer_shapes`], with the values of `past_lens` when they are constant, which makes the
/// scores length static once T is.
pub fn infer_shapes_with_past_lens(
    inputs: &[PartialInput],
    past_lens: Option<&[i32]>,
) -> Result<[OutputInfo; 2]> {
    let k = check(inputs)?;
    // The output is [T, H * Dv]; with Dv unknown, H * D (the query's width) is all there is.
    let hd = match (k.h, k.dv.or(k.d)) {
        (Some(h), Some(dv)) => Some(h.checked_mul(dv).ok_or_else(|| {
            PaError::shape(
                "value_cache",
                format!("num_heads * value head_size = {h} * {dv} overflows"),
            )
        })?),
        _ => inputs[QUERY].shape.dim(1),
    };
    let t = k.t.unwrap_or(DYN);
    let scores_len = match (k.t, past_lens) {
        (Some(t), Some(p))
            if p.iter().all(|&v| v >= 0) && k.b.is_none_or(|b| b as usize == p.len()) =>
        {
            p.iter()
                .try_fold(t, |acc, &v| acc.checked_add(v as i64))
                .unwrap_or(DYN)
        }
        _ => DYN,
    };
    Ok([
        OutputInfo {
            elem: k.query_type,
            shape: PartialShape(Some(vec![t, hd.unwrap_or(DYN)])),
        },
        OutputInfo {
            elem: k.query_type,
            shape: PartialShape(Some(vec![scores_len])),
        },
    ])
}
