//! Shape inference on partial shapes: one test per input count (9..16) and per pattern of
//! static / dynamic dimensions and ranks, and the contradictions it reports early.

use paged_attention::op::{
    infer_shapes, infer_shapes_with_past_lens, PartialInput, PartialShape, DYN,
};
use paged_attention::ElemType::{self, BF16, F16, F32, I32};
use paged_attention::PaError;

// A static geometry: T = 7, H = 8, Hkv = 2, D = 16, BS = 32, NB = 10, B = 3.
const T: i64 = 7;
const H: i64 = 8;
const HKV: i64 = 2;
const D: i64 = 16;
const BS: i64 = 32;
const NB: i64 = 10;
const B: i64 = 3;

fn p(ty: ElemType, dims: &[i64]) -> PartialInput {
    PartialInput::new(Some(ty), PartialShape::from_dims(dims))
}

/// All 16 inputs, fully static, query type `q`, cache type `c`.
fn static_inputs(q: ElemType, c: ElemType) -> Vec<PartialInput> {
    vec![
        p(q, &[T, H * D]),
        p(q, &[T, HKV * D]),
        p(q, &[T, HKV * D]),
        p(c, &[NB, HKV, BS, D]),
        p(c, &[NB, HKV, BS, D]),
        p(I32, &[B]),
        p(I32, &[B + 1]),
        p(I32, &[12]),
        p(I32, &[B + 1]),
        p(q, &[]),
        p(I32, &[]),
        p(q, &[H]),
        p(I32, &[4]),
        p(I32, &[4, BS]),
        p(F32, &[5, D]),
        p(I32, &[B]),
    ]
}

fn expect_outputs(inputs: &[PartialInput], ty: Option<ElemType>, out: &[i64], scores: &[i64]) {
    let [o, s] = infer_shapes(inputs).unwrap_or_else(|e| panic!("inference failed: {e}"));
    assert_eq!(o.elem, ty, "output element type");
    assert_eq!(s.elem, ty, "scores element type");
    assert_eq!(o.shape, PartialShape::from_dims(out), "output shape");
    assert_eq!(s.shape, PartialShape::from_dims(scores), "scores shape");
}

fn expect_error(inputs: &[PartialInput], input: &str, found: &str) -> PaError {
    let e = infer_shapes(inputs).expect_err("a contradiction must be reported");
    let msg = e.to_string();
    assert!(
        msg.contains(input) && msg.contains(found),
        "message should name `{input}` and the value `{found}`: {msg}"
    );
    e
}

macro_rules! input_count_tests {
    ($($name:ident: $n:expr;)*) => {$(
        #[test]
        fn $name() {
            for (q, c) in [(F32, F32), (F16, F32), (BF16, F16)] {
                let mut inputs = static_inputs(q, c)[..$n].to_vec();
                if $n == 13 || $n == 14 {
                    // Rotation needs inputs 12..=14 together: an empty input 12 means none.
                    inputs[12].shape = PartialShape::from_dims(&[0]);
                }
                expect_outputs(&inputs, Some(q), &[T, H * D], &[DYN]);
            }
        }
    )*};
}

input_count_tests! {
    nine_inputs_infer_output_and_scores: 9;
    ten_inputs_infer_output_and_scores: 10;
    eleven_inputs_infer_output_and_scores: 11;
    twelve_inputs_infer_output_and_scores: 12;
    thirteen_inputs_infer_output_and_scores: 13;
    fourteen_inputs_infer_output_and_scores: 14;
    fifteen_inputs_infer_output_and_scores: 15;
    sixteen_inputs_infer_output_and_scores: 16;
}

#[test]
fn rotated_block_indices_without_deltas_or_lut_is_reported() {
    for n in [13, 14] {
        let inputs = static_inputs(F32, F32)[..n].to_vec();
        expect_error(&inputs, "rotation", "missing: ");
    }
}

#[test]
fn deltas_and_lut_without_rotated_block_indices_mean_no_rotation() {
    // SPEC: rotation happens only when input 12 is non-empty.
    let mut inputs = static_inputs(F32, F32);
    inputs[12].shape = PartialShape::from_dims(&[0]);
    expect_outputs(&inputs, Some(F32), &[T, H * D], &[DYN]);
}

#[test]
fn fewer_than_9_or_more_than_17_inputs_are_rejected() {
    let all = static_inputs(F32, F32);
    for n in [0, 1, 8] {
        let e = infer_shapes(&all[..n]).unwrap_err();
        assert!(
            matches!(e, PaError::InputCount { found } if found == n),
            "{e}"
        );
        assert!(e.to_string().contains(&n.to_string()));
    }
    let mut more = all.clone();
    more.push(p(F32, &[H]));
    assert!(infer_shapes(&more).is_ok(), "17: sinks");
    more.push(p(I32, &[1]));
    let e = infer_shapes(&more).unwrap_err();
    assert!(matches!(e, PaError::InputCount { found: 18 }), "{e}");
    assert!(e.to_string().contains("18"), "{e}");
}

#[test]
fn fully_static_inputs_infer_static_output_and_dynamic_scores() {
    expect_outputs(&static_inputs(F32, F16), Some(F32), &[T, H * D], &[DYN]);
}

#[test]
fn dynamic_token_count_gives_dynamic_t() {
    let mut inputs = static_inputs(F16, F16);
    for inp in inputs.iter_mut().take(3) {
        inp.shape.0.as_mut().unwrap()[0] = DYN;
    }
    expect_outputs(&inputs, Some(F16), &[DYN, H * D], &[DYN]);
    // T known from key alone still gives a static T.
    inputs[1].shape.0.as_mut().unwrap()[0] = T;
    expect_outputs(&inputs, Some(F16), &[T, H * D], &[DYN]);
}

#[test]
fn dynamic_rank_on_some_inputs_keeps_what_the_others_say() {
    let mut inputs = static_inputs(BF16, F32);
    for i in [1, 2, 4, 6, 7, 11, 15] {
        inputs[i].shape = PartialShape::dynamic();
    }
    expect_outputs(&inputs, Some(BF16), &[T, H * D], &[DYN]);
    // query of dynamic rank: T comes from key; H*D is unknown... unless key/value say nothing.
    let mut inputs = static_inputs(F32, F32);
    inputs[0].shape = PartialShape::dynamic();
    let [o, _] = infer_shapes(&inputs).unwrap();
    assert_eq!(o.shape.rank(), Some(2));
    assert_eq!(o.shape.dim(0), Some(T));
}

#[test]
fn everything_dynamic_infers_dynamic_outputs() {
    let inputs: Vec<PartialInput> = (0..16)
        .map(|_| PartialInput::new(None, PartialShape::dynamic()))
        .collect();
    expect_outputs(&inputs, None, &[DYN, DYN], &[DYN]);
    // Known ranks, unknown dimensions.
    let mut inputs = static_inputs(F32, F32);
    for inp in &mut inputs {
        for d in inp.shape.0.as_mut().unwrap() {
            *d = DYN;
        }
    }
    expect_outputs(&inputs, Some(F32), &[DYN, DYN], &[DYN]);
}

#[test]
fn query_width_known_but_head_size_unknown_still_gives_the_output_width() {
    let mut inputs = static_inputs(F32, F32);
    inputs[3].shape = PartialShape::dynamic();
    inputs[4].shape = PartialShape::dynamic();
    expect_outputs(&inputs, Some(F32), &[T, H * D], &[DYN]);
}

#[test]
fn known_past_lens_values_make_the_scores_length_static() {
    let inputs = static_inputs(F32, F32);
    let [o, s] = infer_shapes_with_past_lens(&inputs, Some(&[5, 0, 20])).unwrap();
    assert_eq!(o.shape, PartialShape::from_dims(&[T, H * D]));
    assert_eq!(s.shape, PartialShape::from_dims(&[25 + T]));
    assert_eq!(s.elem, Some(F32));
    // T unknown: the length stays dynamic.
    let mut dyn_t = inputs.clone();
    for inp in dyn_t.iter_mut().take(3) {
        inp.shape.0.as_mut().unwrap()[0] = DYN;
    }
    let [_, s] = infer_shapes_with_past_lens(&dyn_t, Some(&[5, 0, 20])).unwrap();
    assert_eq!(s.shape, PartialShape::from_dims(&[DYN]));
}

#[test]
fn empty_optional_inputs_mean_not_provided() {
    let mut inputs = static_inputs(F32, F32);
    for inp in inputs.iter_mut().take(16).skip(9) {
        inp.shape = PartialShape::from_dims(&[0]);
    }
    expect_outputs(&inputs, Some(F32), &[T, H * D], &[DYN]);
    // An empty alibi_slopes is not "the wrong length".
    let mut inputs = static_inputs(F32, F32);
    inputs[11].shape = PartialShape::from_dims(&[0]);
    expect_outputs(&inputs, Some(F32), &[T, H * D], &[DYN]);
}

#[test]
fn key_width_not_hkv_times_d_is_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[1].shape = PartialShape::from_dims(&[T, 48]);
    let e = expect_error(&inputs, "key", "48");
    assert!(matches!(e, PaError::Shape { input: "key", .. }), "{e:?}");
}

#[test]
fn value_width_not_hkv_times_d_is_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[2].shape = PartialShape::from_dims(&[DYN, 31]);
    let e = expect_error(&inputs, "value", "31");
    assert!(matches!(e, PaError::Shape { input: "value", .. }), "{e:?}");
}

#[test]
fn query_width_not_a_multiple_of_head_size_is_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[0].shape = PartialShape::from_dims(&[T, 100]);
    expect_error(&inputs, "query", "100");
}

#[test]
fn heads_not_a_multiple_of_kv_heads_is_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[0].shape = PartialShape::from_dims(&[T, 3 * D]);
    inputs[11].shape = PartialShape::from_dims(&[3]);
    expect_error(&inputs, "num_heads = 3", "num_kv_heads = 2");
}

#[test]
fn caches_of_different_shapes_are_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[4].shape = PartialShape::from_dims(&[NB, HKV, 16, D]);
    let e = expect_error(&inputs, "value_cache", "16");
    assert!(matches!(e, PaError::Shape { .. }), "{e:?}");
}

/// A value head size Dv other than D (value_cache dim 3, value `[T, Hkv*Dv]`) makes the output
/// `[T, H*Dv]`; with a value cache of dynamic shape, value.dim1 gives Dv. u8 caches too: Dv
/// from value.dim1, the value rows `Dv + 8 * Dv / G` bytes.
#[test]
fn a_value_head_size_other_than_d_gives_an_output_h_times_dv_wide() {
    let dv = 2 * D;
    let mut inputs = static_inputs(F32, F32);
    inputs[2].shape = PartialShape::from_dims(&[T, HKV * dv]);
    inputs[4].shape = PartialShape::from_dims(&[NB, HKV, BS, dv]);
    expect_outputs(&inputs, Some(F32), &[T, H * dv], &[DYN]);
    inputs[4].shape = PartialShape::dynamic();
    expect_outputs(&inputs, Some(F32), &[T, H * dv], &[DYN]);
    inputs[2].shape = PartialShape::from_dims(&[T, HKV * D]);
    inputs[4].shape = PartialShape::from_dims(&[NB, HKV, BS, dv]);
    expect_error(&inputs, "value.dim1", "value head size");
    let mut u8s = static_inputs(F32, F32);
    u8s[2].shape = PartialShape::from_dims(&[T, HKV * dv]);
    u8s[3] = p(ElemType::U8, &[NB, HKV, BS + 8, D]);
    u8s[4] = p(ElemType::U8, &[NB, HKV, BS, dv + 8]);
    expect_outputs(&u8s, Some(F32), &[T, H * dv], &[DYN]);
    // A value row that fits D, not Dv: no group size gives it.
    u8s[4] = p(ElemType::U8, &[NB, HKV, BS, D + 8]);
    expect_error(&u8s, "value_cache", "matches no group size");
}

/// A by-channel u8 key cache of 0 channels, with key and value widths unknown, gives a head size
/// of 0: refused, not a division by zero (found by the fuzzer, whose build panicked; the input is
/// in fuzz/regressions/infer_shapes/).
#[test]
fn a_head_size_of_zero_from_a_u8_key_cache_is_refused() {
    let mut u8s = static_inputs(F32, F32);
    u8s[1] = p(F32, &[T, DYN]);
    u8s[2] = p(F32, &[T, DYN]);
    u8s[3] = p(ElemType::U8, &[NB, HKV, BS + 8, 0]);
    u8s[4] = p(ElemType::U8, &[NB, HKV, BS, DYN]);
    expect_error(&u8s, "key_cache", "head_size = 0");
}

#[test]
fn token_counts_that_disagree_are_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[2].shape = PartialShape::from_dims(&[T + 1, HKV * D]);
    expect_error(&inputs, "value", &(T + 1).to_string());
}

#[test]
fn sequence_counts_that_disagree_are_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[6].shape = PartialShape::from_dims(&[B + 2]);
    expect_error(&inputs, "subsequence_begins", &(B + 2).to_string());
    let mut inputs = static_inputs(F32, F32);
    inputs[8].shape = PartialShape::from_dims(&[B]);
    expect_error(&inputs, "block_indices_begins", &B.to_string());
    let mut inputs = static_inputs(F32, F32);
    inputs[15].shape = PartialShape::from_dims(&[B + 1]);
    expect_error(&inputs, "score_aggregation_window", &(B + 1).to_string());
}

#[test]
fn wrong_ranks_are_reported_with_the_rank_found() {
    for (i, name, dims) in [
        (0, "query", vec![T, H, D]),
        (3, "key_cache", vec![NB, HKV, BS * D]),
        (5, "past_lens", vec![B, 1]),
        (11, "alibi_slopes", vec![1, H]),
        (14, "rotation_trig_lut", vec![5 * D]),
        (15, "score_aggregation_window", vec![1, B]),
    ] {
        let mut inputs = static_inputs(F32, F32);
        let rank = dims.len();
        inputs[i].shape = PartialShape::from_dims(&dims);
        let e = infer_shapes(&inputs).unwrap_err();
        assert!(
            matches!(e, PaError::Rank { input, found, .. } if input == name && found == rank),
            "{e:?}"
        );
        assert!(e.to_string().contains(name) && e.to_string().contains(&rank.to_string()));
    }
}

#[test]
fn wrong_element_types_are_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[1].elem = Some(F16);
    let e = infer_shapes(&inputs).unwrap_err();
    assert!(
        matches!(
            e,
            PaError::ElementType {
                input: "key",
                found: F16,
                ..
            }
        ),
        "{e:?}"
    );
    let mut inputs = static_inputs(F32, F32);
    inputs[5].elem = Some(F32);
    let e = infer_shapes(&inputs).unwrap_err();
    assert!(
        matches!(
            e,
            PaError::ElementType {
                input: "past_lens",
                found: F32,
                ..
            }
        ),
        "{e:?}"
    );
    let mut inputs = static_inputs(F32, F32);
    inputs[0].elem = Some(I32);
    let e = infer_shapes(&inputs).unwrap_err();
    assert!(
        matches!(
            e,
            PaError::ElementType {
                input: "query",
                found: I32,
                ..
            }
        ),
        "{e:?}"
    );
    let mut inputs = static_inputs(F32, BF16);
    inputs[4].elem = Some(F16);
    let e = infer_shapes(&inputs).unwrap_err();
    assert!(
        matches!(
            e,
            PaError::ElementType {
                input: "value_cache",
                found: F16,
                ..
            }
        ),
        "{e:?}"
    );
}

#[test]
fn alibi_of_wrong_length_is_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[11].shape = PartialShape::from_dims(&[HKV]);
    expect_error(&inputs, "alibi_slopes", &HKV.to_string());
}

#[test]
fn rotation_contradictions_are_reported() {
    let mut inputs = static_inputs(F32, F32);
    inputs[13].shape = PartialShape::from_dims(&[4, 7]);
    expect_error(&inputs, "rotation_deltas", "7");
    let mut inputs = static_inputs(F32, F32);
    inputs[13].shape = PartialShape::from_dims(&[5, BS]);
    expect_error(&inputs, "rotation_deltas", "5");
    let mut inputs = static_inputs(F32, F32);
    inputs[14].shape = PartialShape::from_dims(&[5, D + 2]);
    expect_error(&inputs, "rotation_trig_lut", &(D + 2).to_string());
    // Odd head size with rotation.
    let mut inputs = static_inputs(F32, F32);
    for (i, inp) in inputs.iter_mut().take(3).enumerate() {
        let w = if i == 0 { H * 15 } else { HKV * 15 };
        inp.shape = PartialShape::from_dims(&[T, w]);
    }
    for i in [3, 4] {
        inputs[i].shape = PartialShape::from_dims(&[NB, HKV, BS, 15]);
    }
    inputs[14].shape = PartialShape::from_dims(&[5, 15]);
    expect_error(&inputs, "head_size", "15");
}

#[test]
fn scalars_must_hold_one_element() {
    let mut inputs = static_inputs(F32, F32);
    inputs[9].shape = PartialShape::from_dims(&[2]);
    expect_error(&inputs, "scale", "[2]");
    let mut inputs = static_inputs(F32, F32);
    inputs[10].shape = PartialShape::from_dims(&[3]);
    expect_error(&inputs, "sliding_window", "[3]");
}

#[test]
fn zero_cache_dimensions_are_reported() {
    let mut inputs = static_inputs(F32, F32);
    for i in [3, 4] {
        inputs[i].shape = PartialShape::from_dims(&[NB, HKV, 0, D]);
    }
    expect_error(&inputs, "key_cache", "block_size");
}

/// Sinks (input 16): `[H]` or `[1, H, 1, 1]`; another length, or another 4-D shape, is refused
/// naming the input.
#[test]
fn sinks_have_one_logit_per_query_head() {
    let mut inputs = static_inputs(F32, F32);
    inputs.push(p(F32, &[H]));
    expect_outputs(&inputs, Some(F32), &[T, H * D], &[DYN]);
    inputs[16] = p(F16, &[1, H, 1, 1]);
    expect_outputs(&inputs, Some(F32), &[T, H * D], &[DYN]);
    inputs[16] = p(F32, &[H + 1]);
    expect_error(&inputs, "sinks", &format!("{}", H + 1));
    inputs[16] = p(F32, &[H, 1, 1, 1]);
    expect_error(&inputs, "sinks", "[1, H, 1, 1]");
    inputs[16] = p(I32, &[H]);
    expect_error(&inputs, "sinks", "i32");
}
