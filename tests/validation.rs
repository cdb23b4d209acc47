//! Every rejection of SPEC.md ("What must be rejected"): the error variant, a message naming
//! the input and the value found, and not one byte of any cache or output changed.

mod common;

use common::call::{idx::*, Call, Data, Owned, RUNNERS};
use common::ref64::{gen_case, Case, DeltaForm, Features, Geometry, ScoreWindow, SeqKind};
use paged_attention::ElemType::{self, BF16, F16, F32, I32};
use paged_attention::PaError;

/// A valid call with all 16 inputs: rotation, ALiBi, window, scale, per-sequence score window,
/// a mixed batch. H = 4, Hkv = 2, D = 8, BS = 4.
fn base_case() -> Case {
    let mut c = gen_case(
        77,
        &Geometry::new(F32, F16, 2, 2, 8, 4),
        &Features {
            rotation: Some(true),
            delta_form: Some(DeltaForm::PerSlot),
            alibi: Some(true),
            sliding_window: Some(true),
            scale: Some(Some(0.25)),
            score_window: Some(Some(ScoreWindow::PerSeq(vec![1, 2, -1]))),
            seqs: Some(vec![
                SeqKind::ChunkedPrefill,
                SeqKind::Decode,
                SeqKind::Prefill,
            ]),
            ..Features::default()
        },
    );
    c.all_16 = true;
    c.rank1_scalars = false;
    c
}

fn base() -> Call {
    let mut call = base_case().to_call();
    call.run(common::call::Runner::Execute)
        .expect("the base call is valid");
    // Fresh outputs with a recognisable pattern, so "unchanged" is meaningful.
    for o in &mut call.outputs {
        let n = o.data.len();
        o.data = Data::poison(o.data.elem_type(), n);
    }
    call
}

/// Asserts that `call` is rejected by validate, execute and execute_reference with an error
/// matching `variant`, whose message contains every needle, and that nothing was written.
#[track_caller]
fn assert_rejected(mut call: Call, variant: impl Fn(&PaError) -> bool, needles: &[&str]) {
    let check = |e: &PaError, how: &str| {
        assert!(variant(e), "{how}: unexpected error variant {e:?}");
        let msg = e.to_string();
        for n in needles {
            assert!(
                msg.contains(n),
                "{how}: message should contain `{n}`: {msg}"
            );
        }
    };
    // validate only needs the inputs; skip it when the fault is in an output buffer.
    if let Err(e) = call.validate() {
        check(&e, "validate");
    }
    let before = call.snapshot();
    for runner in RUNNERS {
        match call.run(runner) {
            Ok(()) => panic!("{runner:?} accepted a call that must be rejected ({needles:?})"),
            Err(e) => check(&e, &format!("{runner:?}")),
        }
        assert!(
            call.snapshot() == before,
            "{runner:?} wrote into a cache or output although the call was rejected"
        );
    }
}

fn is_shape(e: &PaError) -> bool {
    matches!(e, PaError::Shape { .. })
}
fn is_value(e: &PaError) -> bool {
    matches!(e, PaError::Value { .. })
}
fn is_type(e: &PaError) -> bool {
    matches!(e, PaError::ElementType { .. })
}

/// Gives input `i` a new shape (data resized with zeros, same type).
fn reshape(call: &mut Call, i: usize, dims: &[usize]) {
    let n: usize = dims.iter().product();
    let ty = call.inputs[i].data.elem_type();
    call.inputs[i] = Owned::new(dims, Data::zeros(ty, n));
}

/// Gives input `i` another element type (same shape, zeros).
fn retype(call: &mut Call, i: usize, ty: ElemType) {
    let n = call.inputs[i].data.len();
    call.inputs[i].data = Data::zeros(ty, n);
}

fn i32s(call: &mut Call, i: usize) -> &mut Vec<i32> {
    call.inputs[i].data.i32s_mut()
}

#[test]
fn base_call_is_valid() {
    let mut call = base();
    let plan = call.validate().unwrap();
    assert_eq!((plan.h, plan.hkv, plan.d, plan.bs), (4, 2, 8, 4));
    assert!(plan.rotation.is_some() && plan.alibi.is_some());
}

#[test]
fn fewer_than_9_inputs_are_rejected() {
    for n in [0, 3, 8] {
        let mut call = base();
        call.inputs.truncate(n);
        assert_rejected(
            call,
            |e| matches!(e, PaError::InputCount { found } if *found == n),
            &["9 to 17", &n.to_string()],
        );
    }
}

#[test]
fn more_than_17_inputs_are_rejected() {
    let mut call = base();
    let h = call.inputs[QUERY].shape[1] / call.inputs[KEY_CACHE].shape[3];
    call.inputs.push(Owned::new(
        &[h],
        Data::from_f64(ElemType::F32, &vec![0.5; h]),
    ));
    call.inputs.push(Owned::i32s(&[1], vec![0]));
    assert_rejected(
        call,
        |e| matches!(e, PaError::InputCount { found: 18 }),
        &["18"],
    );
}

/// Sinks (input 16) of the wrong length, another 4-D shape or an integer type are refused,
/// naming the input, with nothing written.
#[test]
fn sinks_of_the_wrong_shape_or_type_are_rejected() {
    let h = base().inputs[QUERY].shape[1] / base().inputs[KEY_CACHE].shape[3];
    let f32s = |n: usize| Data::from_f64(ElemType::F32, &vec![0.5; n]);
    for (sinks, needles) in [
        (
            Owned::new(&[h + 1], f32s(h + 1)),
            vec!["sinks", "num_heads"],
        ),
        (
            Owned::new(&[h, 1, 1, 1], f32s(h)),
            vec!["sinks", "[1, H, 1, 1]"],
        ),
        (Owned::new(&[1, h], f32s(h)), vec!["sinks", "rank"]),
    ] {
        let mut call = base();
        call.inputs.push(sinks);
        assert_rejected(call, |_| true, &needles);
    }
    let mut call = base();
    call.inputs.push(Owned::i32s(&[h], vec![1; h]));
    assert_rejected(
        call,
        |e| matches!(e, PaError::ElementType { .. }),
        &["sinks"],
    );
}

#[test]
fn wrong_ranks_are_rejected() {
    let b = base_case();
    let t = b.t();
    for (i, name, dims) in [
        (QUERY, "query", vec![t, 4, 8]),
        (KEY, "key", vec![t * 16]),
        (KEY_CACHE, "key_cache", vec![b.nb, 2, 32]),
        (VALUE_CACHE, "value_cache", vec![b.nb, 2, 4, 8, 1]),
        (PAST_LENS, "past_lens", vec![3, 1]),
        (SUBSEQUENCE_BEGINS, "subsequence_begins", vec![]),
        (
            BLOCK_INDICES,
            "block_indices",
            vec![1, b.block_indices.len()],
        ),
        (BLOCK_INDICES_BEGINS, "block_indices_begins", vec![4, 1]),
        (SCALE, "scale", vec![1, 1]),
        (SLIDING_WINDOW, "sliding_window", vec![1, 1]),
        (ALIBI_SLOPES, "alibi_slopes", vec![4, 1]),
        (ROTATED_BLOCK_INDICES, "rotated_block_indices", vec![]),
        (ROTATION_DELTAS, "rotation_deltas", vec![1, 1, 1]),
        (ROTATION_TRIG_LUT, "rotation_trig_lut", vec![8]),
        (
            SCORE_AGGREGATION_WINDOW,
            "score_aggregation_window",
            vec![3, 1],
        ),
    ] {
        let mut call = base();
        let rank = dims.len();
        reshape(&mut call, i, &dims);
        assert_rejected(
            call,
            |e| matches!(e, PaError::Rank { input, found, .. } if *input == name && *found == rank),
            &[name, &format!("it is {rank}")],
        );
    }
}

#[test]
fn wrong_element_types_are_rejected() {
    for (i, name, ty) in [
        (QUERY, "query", I32),
        (KEY, "key", F16),
        (VALUE, "value", BF16),
        (KEY_CACHE, "key_cache", I32),
        (VALUE_CACHE, "value_cache", F32),
        (PAST_LENS, "past_lens", F32),
        (SUBSEQUENCE_BEGINS, "subsequence_begins", F16),
        (BLOCK_INDICES, "block_indices", F32),
        (BLOCK_INDICES_BEGINS, "block_indices_begins", BF16),
        (SCALE, "scale", I32),
        (SLIDING_WINDOW, "sliding_window", F32),
        (ALIBI_SLOPES, "alibi_slopes", I32),
        (ROTATED_BLOCK_INDICES, "rotated_block_indices", F32),
        (ROTATION_DELTAS, "rotation_deltas", F16),
        (ROTATION_TRIG_LUT, "rotation_trig_lut", I32),
        (SCORE_AGGREGATION_WINDOW, "score_aggregation_window", F32),
    ] {
        let mut call = base();
        retype(&mut call, i, ty);
        assert_rejected(
            call,
            |e| matches!(e, PaError::ElementType { input, found, .. } if *input == name && *found == ty),
            &[name, ty.name()],
        );
    }
}

#[test]
fn query_width_not_a_multiple_of_head_size_is_rejected() {
    let mut call = base();
    let t = call.inputs[QUERY].shape[0];
    reshape(&mut call, QUERY, &[t, 30]);
    assert_rejected(call, is_shape, &["query", "30", "head_size = 8"]);
}

#[test]
fn heads_not_a_multiple_of_kv_heads_are_rejected() {
    let mut call = base();
    let t = call.inputs[QUERY].shape[0];
    reshape(&mut call, QUERY, &[t, 3 * 8]);
    reshape(&mut call, ALIBI_SLOPES, &[3]);
    assert_rejected(call, is_shape, &["num_heads = 3", "num_kv_heads = 2"]);
}

#[test]
fn key_and_value_widths_other_than_hkv_times_d_are_rejected() {
    for (i, name) in [(KEY, "key"), (VALUE, "value")] {
        let mut call = base();
        let t = call.inputs[i].shape[0];
        reshape(&mut call, i, &[t, 24]);
        assert_rejected(call, is_shape, &[name, "24", "2 * 8 = 16"]);
    }
}

#[test]
fn value_cache_shape_different_from_key_cache_is_rejected() {
    let b = base_case();
    for dims in [[b.nb + 1, 2, 4, 8], [b.nb, 1, 4, 8], [b.nb, 2, 2, 8]] {
        let mut call = base();
        reshape(&mut call, VALUE_CACHE, &dims);
        assert_rejected(call, is_shape, &["value_cache", "key_cache"]);
    }
    // Dim 3 is the value head size, which may differ from the key's, but then the values must
    // be that wide.
    let mut call = base();
    reshape(&mut call, VALUE_CACHE, &[b.nb, 2, 4, 16]);
    assert_rejected(
        call,
        is_shape,
        &["value.dim1 = 16", "2 * 16 = 32", "value_cache dim 3"],
    );
}

#[test]
fn sequence_count_mismatches_between_inputs_5_6_8_are_rejected() {
    // past_lens says B = 3.
    let mut call = base();
    reshape(&mut call, PAST_LENS, &[2]);
    assert_rejected(call, is_shape, &["subsequence_begins", "4 elements"]);
    let mut call = base();
    i32s(&mut call, SUBSEQUENCE_BEGINS).pop();
    call.inputs[SUBSEQUENCE_BEGINS].shape = vec![3];
    assert_rejected(
        call,
        is_shape,
        &["subsequence_begins", "3 elements", "B = 3"],
    );
    let mut call = base();
    i32s(&mut call, BLOCK_INDICES_BEGINS).push(99);
    call.inputs[BLOCK_INDICES_BEGINS].shape = vec![5];
    assert_rejected(
        call,
        is_shape,
        &["block_indices_begins", "5 elements", "B = 3"],
    );
    let mut call = base();
    reshape(&mut call, SCORE_AGGREGATION_WINDOW, &[2]);
    assert_rejected(call, is_shape, &["score_aggregation_window", "2 elements"]);
}

#[test]
fn subsequence_begins_not_starting_at_zero_is_rejected() {
    let mut call = base();
    i32s(&mut call, SUBSEQUENCE_BEGINS)[0] = 1;
    assert_rejected(call, is_value, &["subsequence_begins[0] = 1"]);
}

#[test]
fn decreasing_subsequence_begins_is_rejected() {
    let mut call = base();
    let v = i32s(&mut call, SUBSEQUENCE_BEGINS);
    v[1] = v[2] + 1;
    let (a, b) = (v[1], v[2]);
    assert_rejected(
        call,
        is_value,
        &[
            "subsequence_begins",
            &format!("[2] = {b}"),
            &format!("[1] = {a}"),
        ],
    );
}

#[test]
fn subsequence_begins_not_ending_at_t_is_rejected() {
    for delta in [-1, 1, 1000] {
        let mut call = base();
        let t = call.inputs[QUERY].shape[0] as i32;
        *i32s(&mut call, SUBSEQUENCE_BEGINS).last_mut().unwrap() = t + delta;
        assert_rejected(
            call,
            is_value,
            &[
                &format!("subsequence_begins[3] = {}", t + delta),
                &format!("T = {t}"),
            ],
        );
    }
}

#[test]
fn decreasing_or_out_of_range_block_indices_begins_are_rejected() {
    let mut call = base();
    let v = i32s(&mut call, BLOCK_INDICES_BEGINS);
    v[2] = v[1] - 1;
    let found = v[2];
    assert_rejected(
        call,
        is_value,
        &["block_indices_begins", &format!("[2] = {found}")],
    );
    let mut call = base();
    i32s(&mut call, BLOCK_INDICES_BEGINS)[0] = -1;
    assert_rejected(call, is_value, &["block_indices_begins[0] = -1"]);
    let mut call = base();
    let n = call.inputs[BLOCK_INDICES].data.len() as i32;
    *i32s(&mut call, BLOCK_INDICES_BEGINS).last_mut().unwrap() = n + 1;
    assert_rejected(
        call,
        is_value,
        &[
            &format!("block_indices_begins[3] = {}", n + 1),
            &format!("{n} entries"),
        ],
    );
}

#[test]
fn negative_past_lens_is_rejected() {
    let mut call = base();
    i32s(&mut call, PAST_LENS)[1] = -5;
    assert_rejected(call, is_value, &["past_lens[1] = -5"]);
}

#[test]
fn block_list_too_short_for_the_tokens_is_rejected() {
    // Sequence 0 is a chunked prefill: one more past token than its blocks can hold.
    let case = base_case();
    let mut call = base();
    let have = (case.block_indices_begins[1] - case.block_indices_begins[0]) as usize;
    let n0 = case.seqs[0].n;
    let past = (have * case.bs - n0 + 1) as i32;
    i32s(&mut call, PAST_LENS)[0] = past;
    // The scores buffer grows with past_lens: keep it the right size so the block rule fires.
    let len = call.outputs[1].data.len() + (past as usize - case.seqs[0].past);
    call.outputs[1] = Owned::new(&[len], Data::poison(F32, len));
    assert_rejected(
        call,
        is_value,
        &[
            "sequence 0",
            &format!("past_lens[0] + new tokens = {past} + {n0}"),
            &format!("gives it {have}"),
        ],
    );
}

#[test]
fn block_id_outside_the_cache_is_rejected() {
    let case = base_case();
    for bad in [case.nb as i32, 1000, -7] {
        let mut call = base();
        let j = case.block_indices_begins[2] as usize; // the decode sequence's first block
        i32s(&mut call, BLOCK_INDICES)[j] = bad;
        assert_rejected(
            call,
            is_value,
            &[
                &format!("block_indices[{j}] = {bad}"),
                &format!("0..{}", case.nb),
                &format!("key_cache has {} blocks", case.nb),
            ],
        );
    }
}

#[test]
fn minus_one_in_a_slot_a_token_reaches_is_rejected() {
    let case = base_case();
    let mut call = base();
    // The last block a sequence reaches (the new tokens go there).
    let s = 0;
    let len = case.seqs[s].past + case.seqs[s].n;
    let j = case.block_indices_begins[s] as usize + (len - 1) / case.bs;
    i32s(&mut call, BLOCK_INDICES)[j] = -1;
    assert_rejected(
        call,
        is_value,
        &[&format!("block_indices[{j}] = -1"), "sequence 0"],
    );
}

#[test]
fn minus_one_past_the_reached_slots_is_accepted() {
    let mut call = base();
    // Every entry past what sequences reach becomes -1: still valid.
    let case = base_case();
    for (s, sq) in case.seqs.iter().enumerate() {
        let need = (sq.past + sq.n).div_ceil(case.bs);
        let (b0, b1) = (
            case.block_indices_begins[s] as usize,
            case.block_indices_begins[s + 1] as usize,
        );
        for j in b0 + need..b1 {
            i32s(&mut call, BLOCK_INDICES)[j] = -1;
        }
    }
    call.validate().expect("-1 in unreached slots is valid");
}

#[test]
fn rotation_delta_outside_the_lut_is_rejected() {
    let case = base_case();
    let m = case.rotation.as_ref().unwrap().m as i32;
    for bad in [m, m + 100, -1] {
        let mut call = base();
        i32s(&mut call, ROTATION_DELTAS)[case.bs + 2] = bad;
        assert_rejected(
            call,
            is_value,
            &[
                &format!("rotation_deltas[1, 2] = {bad}"),
                &format!("0..{m}"),
            ],
        );
    }
}

#[test]
fn rotated_block_id_outside_the_cache_is_rejected() {
    let case = base_case();
    for bad in [case.nb as i32, -1, i32::MAX] {
        let mut call = base();
        i32s(&mut call, ROTATED_BLOCK_INDICES)[0] = bad;
        assert_rejected(
            call,
            is_value,
            &[
                &format!("rotated_block_indices[0] = {bad}"),
                &format!("0..{}", case.nb),
            ],
        );
    }
}

#[test]
fn odd_head_size_with_rotation_is_rejected() {
    // D = 7: a valid call without rotation, then rotation added.
    let mut case = gen_case(
        78,
        &Geometry::new(F32, F32, 1, 2, 7, 4),
        &Features {
            rotation: Some(false),
            seqs: Some(vec![SeqKind::ChunkedPrefill]),
            ..Features::default()
        },
    );
    case.all_16 = true;
    let mut call = case.to_call();
    call.validate().expect("odd D without rotation is valid");
    let blk = case.block_indices[0];
    call.inputs[ROTATED_BLOCK_INDICES] = Owned::i32s(&[1], vec![blk]);
    call.inputs[ROTATION_DELTAS] = Owned::i32s(&[1], vec![0]);
    call.inputs[ROTATION_TRIG_LUT] = Owned::new(&[1, 7], Data::zeros(F32, 7));
    assert_rejected(call, is_shape, &["head_size = 7", "even"]);
}

#[test]
fn alibi_of_the_wrong_length_is_rejected() {
    for n in [2, 3, 5, 8] {
        let mut call = base();
        reshape(&mut call, ALIBI_SLOPES, &[n]);
        assert_rejected(
            call,
            is_shape,
            &["alibi_slopes", &format!("{n} elements"), "num_heads = 4"],
        );
    }
}

#[test]
fn rotation_deltas_of_the_wrong_shape_are_rejected() {
    let mut call = base();
    let r = call.inputs[ROTATED_BLOCK_INDICES].shape[0];
    reshape(&mut call, ROTATION_DELTAS, &[r, 3]);
    assert_rejected(
        call,
        is_shape,
        &["rotation_deltas.dim1 = 3", "block_size = 4"],
    );
    let mut call = base();
    reshape(&mut call, ROTATION_DELTAS, &[r + 1, 4]);
    assert_rejected(call, is_shape, &["rotation_deltas", &format!("{}", r + 1)]);
    let mut call = base();
    let m = call.inputs[ROTATION_TRIG_LUT].shape[0];
    reshape(&mut call, ROTATION_TRIG_LUT, &[m, 6]);
    assert_rejected(
        call,
        is_shape,
        &["rotation_trig_lut.dim1 = 6", "head_size = 8"],
    );
}

#[test]
fn tensor_data_shorter_than_its_shape_is_rejected() {
    for (i, name) in [
        (QUERY, "query"),
        (KEY_CACHE, "key_cache"),
        (PAST_LENS, "past_lens"),
    ] {
        let mut call = base();
        let n = call.inputs[i].data.len();
        let ty = call.inputs[i].data.elem_type();
        call.inputs[i].data = Data::zeros(ty, n - 1);
        assert_rejected(
            call,
            |e| matches!(e, PaError::BufferSize { .. }),
            &[name, &(n - 1).to_string(), &n.to_string()],
        );
    }
}

#[test]
fn output_buffers_of_the_wrong_size_or_type_are_rejected() {
    for (o, name) in [(0, "output"), (1, "scores")] {
        for delta in [-1i64, 1] {
            let mut call = base();
            let n = call.outputs[o].data.len();
            let m = (n as i64 + delta) as usize;
            let shape = if o == 0 { vec![1, m] } else { vec![m] };
            call.outputs[o] = Owned::new(&shape, Data::poison(F32, m));
            assert_rejected(
                call,
                |e| matches!(e, PaError::BufferSize { .. }),
                &[name, &m.to_string(), &n.to_string()],
            );
        }
        let mut call = base();
        let n = call.outputs[o].data.len();
        let shape = call.outputs[o].shape.clone();
        call.outputs[o] = Owned::new(&shape, Data::poison(F16, n));
        assert_rejected(call, is_type, &[name, "f16", "f32"]);
    }
}

#[test]
fn output_buffer_of_the_right_size_but_wrong_shape_is_rejected() {
    let mut call = base();
    let shape = call.outputs[0].shape.clone();
    let n = call.outputs[0].data.len();
    let transposed = vec![shape[1], shape[0]];
    assert_ne!(transposed, shape, "the base case must not be square");
    call.outputs[0] = Owned::new(&transposed, Data::poison(F32, n));
    assert_rejected(
        call,
        is_shape,
        &["output", &format!("{transposed:?}"), &format!("{shape:?}")],
    );
}

#[test]
fn caches_given_read_only_are_rejected_by_the_list_form() {
    use paged_attention::op::InputArg;
    let mut call = base();
    let list: Vec<InputArg<'_>> = call
        .inputs
        .iter_mut()
        .map(|t| InputArg::Ref(t.view()))
        .collect();
    let e = paged_attention::PaInputs::from_list(list).unwrap_err();
    assert!(matches!(e, PaError::InvalidArgument { .. }), "{e:?}");
    assert!(e.to_string().contains("key_cache"), "{e}");
}
