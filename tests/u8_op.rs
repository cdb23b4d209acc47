//! u8 caches as a cache type of the op itself (`execute`, `execute_reference`, validation, shape
//! inference): the layout is read from the shapes, insertion writes exactly the bytes of the
//! byte-checked quantizer (`kernel::quant::insert_u8`, held to OpenVINO's bytes by
//! cli/tests/u8_cache.rs), outputs match the float64 reference over the dequantized caches, rotation
//! of a u8 key cache stays within one quantization step of float64, and wrong shapes are refused
//! with messages that say what a u8 cache must look like.

mod common;

use common::call::{idx, Data, Owned, Runner, RUNNERS};
use common::ref64::{bf16_values, gen_case, reference, Case, Features, Geometry, SeqKind};
use common::u8::{dequantized_case, layout_for, layout_for_bits, u8_call, LAYOUTS};
use paged_attention::kernel::quant::{self, KeyQuant, QuantLayout};
use paged_attention::op::{infer_shapes, PartialInput, PartialShape, DYN};
use paged_attention::{ElemType, PaError};

fn features() -> Features {
    Features {
        rotation: Some(false),
        ..Features::default()
    }
}

/// Worst `|got - want| / (1 + |want|)`.
fn rel_err(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0, f64::max)
}

/// Runs `c` on u8 caches of `l` with `runner`; checks the caches' bytes against `insert_u8` on
/// the same caches and the outputs against float64 attention over the dequantized caches.
/// Returns the worst output and score errors.
fn run_and_check(c: &Case, l: &QuantLayout, runner: Runner) -> (f64, f64) {
    let mut call = u8_call(c, l);
    let mut want_kc = call.inputs[idx::KEY_CACHE].data.u8s().to_vec();
    let mut want_vc = call.inputs[idx::VALUE_CACHE].data.u8s().to_vec();
    let plan = call.validate().expect("u8 call validates");
    assert_eq!(plan.u8.as_ref(), Some(l), "layout read from the shapes");
    let key = call.inputs[idx::KEY].data.to_f64();
    let value = call.inputs[idx::VALUE].data.to_f64();
    let widen = |v: &[f64]| v.iter().map(|&x| x as f32).collect::<Vec<_>>();
    quant::insert_u8(
        l,
        &plan.seqs,
        &c.block_indices,
        &widen(&key),
        &widen(&value),
        &mut want_kc,
        &mut want_vc,
    );
    call.run(runner).expect("u8 call runs");
    let kc = call.inputs[idx::KEY_CACHE].data.u8s();
    let vc = call.inputs[idx::VALUE_CACHE].data.u8s();
    assert!(kc == want_kc.as_slice(), "{runner:?} key cache bytes");
    assert!(vc == want_vc.as_slice(), "{runner:?} value cache bytes");
    let want = reference(&dequantized_case(c, l, kc, vc));
    (
        rel_err(&call.outputs[0].data.to_f64(), &want.output),
        rel_err(&call.outputs[1].data.to_f64(), &want.scores),
    )
}

fn check(qt: ElemType, tol: f64, seeds: std::ops::Range<u64>, seqs: Option<Vec<SeqKind>>) {
    check_past(qt, tol, seeds, seqs, None)
}

/// [`check`], with at most `max_past` cached tokens per sequence when given.
fn check_past(
    qt: ElemType,
    tol: f64,
    seeds: std::ops::Range<u64>,
    seqs: Option<Vec<SeqKind>>,
    max_past: Option<usize>,
) {
    let f = Features { seqs, ..features() };
    check_features(qt, tol, seeds, &f, max_past)
}

/// Every layout and a few geometries, cases drawn with `f`, against float64.
fn check_features(
    qt: ElemType,
    tol: f64,
    seeds: std::ops::Range<u64>,
    f: &Features,
    max_past: Option<usize>,
) {
    for (key, value_group) in LAYOUTS {
        for (hkv, g, d) in [(2, 2, 64), (1, 4, 32), (2, 1, 128), (1, 3, 40)] {
            if value_group > d || !d.is_multiple_of(value_group.max(1)) {
                continue;
            }
            let mut geo = Geometry::new(qt, ElemType::F32, hkv, g, d, 32);
            geo.max_past = max_past.unwrap_or(geo.max_past);
            for seed in seeds.clone() {
                let c = gen_case(seed, &geo, f);
                let l = layout_for(&c, key, value_group);
                for runner in RUNNERS {
                    let (o, s) = run_and_check(&c, &l, runner);
                    assert!(
                        o <= tol && s <= tol,
                        "{runner:?} {l:?} seed {seed}: output {o:e}, scores {s:e} > {tol:e}\n{}",
                        c.describe()
                    );
                }
            }
        }
    }
}

#[test]
fn f32_query_on_u8_caches_end_to_end() {
    check(ElemType::F32, 2e-5, 0..8, None);
}

#[test]
fn f16_and_bf16_queries_on_u8_caches_end_to_end() {
    check(ElemType::F16, 1e-2, 20..23, None);
    check(ElemType::BF16, 1e-2, 40..43, None);
}

/// Prefill items read the rows of their sequence dequantized once per call when those copies
/// fit `2*T*H*D` floats (a prefill from position 0 always does), else they dequantize block by
/// block (a short chunk after a long past): both ways against float64.
#[test]
fn prefill_after_a_long_past_and_from_zero_on_u8_caches() {
    let long = Some(vec![SeqKind::ChunkedPrefill]);
    check_past(ElemType::F32, 2e-5, 80..84, long, Some(400));
    check_past(
        ElemType::F32,
        2e-5,
        90..92,
        Some(vec![SeqKind::Prefill]),
        None,
    );
}

/// Attention sinks on u8 caches: decode whole and cut into key chunks, prefill from zero and
/// after a past, mixed batches, every key/value layout, with the scores of all new tokens.
#[test]
fn sinks_on_u8_caches_end_to_end() {
    use common::ref64::ScoreWindow;
    let runs: [(Option<Vec<SeqKind>>, Option<usize>, u64); 4] = [
        (None, None, 300),
        (Some(vec![SeqKind::Decode; 2]), Some(2500), 310),
        (Some(vec![SeqKind::Prefill]), None, 320),
        (Some(vec![SeqKind::ChunkedPrefill]), Some(400), 330),
    ];
    for (seqs, max_past, seed) in runs {
        let f = Features {
            seqs,
            sinks: Some(true),
            score_window: Some(Some(ScoreWindow::Scalar(-1))),
            ..features()
        };
        check_features(ElemType::F32, 2e-5, seed..seed + 2, &f, max_past);
    }
}

#[test]
fn decode_batches_on_u8_caches() {
    let decodes = Some(vec![SeqKind::Decode; 4]);
    check(ElemType::F32, 2e-5, 60..64, decodes.clone());
    check(ElemType::BF16, 1e-2, 70..72, decodes);
}

/// Decode over long pasts: many online-softmax steps of several blocks each (the steps' rescaling
/// of the accumulators and of the zero points' share, and each step's running max behind the
/// scores), with windows and ALiBi as `features` draws them, against float64. Pasts up to 700
/// keep each sequence whole; up to 2500, few sequences and KV heads get their keys cut into
/// chunks (flash-decoding: each chunk's slot and score weights, merged in chunk order).
#[test]
fn decode_over_many_softmax_steps_on_u8_caches() {
    let decodes = Some(vec![SeqKind::Decode; 3]);
    check_past(ElemType::F32, 2e-5, 100..103, decodes.clone(), Some(700));
    check_past(ElemType::F32, 2e-5, 104..107, decodes.clone(), Some(2500));
    check_past(ElemType::BF16, 1e-2, 110..111, decodes, Some(2500));
}

fn sample(key: KeyQuant, value_group: usize) -> common::call::Call {
    let geo = Geometry::new(ElemType::F32, ElemType::F32, 2, 2, 64, 32);
    let c = gen_case(5, &geo, &features());
    u8_call(&c, &layout_for(&c, key, value_group))
}

fn reshape(call: &mut common::call::Call, i: usize, dim: usize, to: usize) {
    let t = &mut call.inputs[i];
    t.shape[dim] = to;
    let n = t.shape.iter().product();
    t.data = Data::U8(vec![0; n]);
}

fn rejects(mut call: common::call::Call, needles: &[&str]) -> PaError {
    let before = call.snapshot();
    let err = call
        .run(Runner::Execute)
        .expect_err("a malformed u8 call must be refused");
    let msg = err.to_string();
    for n in needles {
        assert!(msg.contains(n), "message lacks {n:?}: {msg}");
    }
    assert_eq!(call.snapshot(), before, "a refused call wrote something");
    err
}

#[test]
fn wrong_extra_row_count_is_refused() {
    let mut call = sample(KeyQuant::ByChannel, 0);
    reshape(&mut call, idx::KEY_CACHE, 2, 32 + 4);
    let err = rejects(call, &["key_cache", "36 rows", "block_size + 8 = 40"]);
    assert!(matches!(err, PaError::Shape { .. }), "{err:?}");
}

#[test]
fn value_row_matching_no_group_size_is_refused() {
    // 64 + 12: 12 parameter bytes are not whole groups; 64 + 24: 3 groups do not divide 64.
    for cols in [64 + 12, 64 + 24, 64] {
        let mut call = sample(KeyQuant::ByChannel, 0);
        reshape(&mut call, idx::VALUE_CACHE, 3, cols);
        rejects(
            call,
            &[
                "value_cache",
                &format!("{cols} bytes per token"),
                "no group size",
            ],
        );
    }
    let mut call = sample(KeyQuant::ByToken { group: 0 }, 0);
    reshape(&mut call, idx::KEY_CACHE, 3, 64 + 12);
    rejects(call, &["key_cache", "76 bytes per token", "no group size"]);
}

#[test]
fn key_width_must_give_the_head_size() {
    // by-channel keys name D twice: the key width over Hkv and the key cache's last dimension
    let mut call = sample(KeyQuant::ByChannel, 0);
    reshape(&mut call, idx::KEY_CACHE, 3, 32);
    rejects(call, &["key_cache", "head_size 32"]);
}

#[test]
fn mixed_cache_types_and_u8_inputs_are_refused() {
    let mut call = sample(KeyQuant::ByChannel, 0);
    let n = call.inputs[idx::VALUE_CACHE].shape.iter().product();
    call.inputs[idx::VALUE_CACHE].data = Data::F32(vec![0.0; n]);
    rejects(call, &["value_cache", "u8"]);
    let mut call = sample(KeyQuant::ByChannel, 0);
    let q = &call.inputs[idx::QUERY];
    call.inputs[idx::QUERY] = Owned::new(&q.shape.clone(), Data::U8(vec![0; q.data.len()]));
    rejects(call, &["query", "f32, f16 or bf16"]);
}

/// The quantization step (scale) of each channel of the key at (block, head, slot) of a u8 key
/// cache of `l`: the block's per-channel scales by channel, the row's group scales by token.
fn key_steps(l: &QuantLayout, kc: &[u8], block: usize, head: usize, slot: usize) -> Vec<f64> {
    let dims = l.key_cache_dims(block + 1).unwrap();
    let slab = &kc[(block * l.hkv + head) * dims[2] * dims[3]..][..dims[2] * dims[3]];
    let f = |b: &[u8], i: usize| f32::from_le_bytes(b[4 * i..4 * i + 4].try_into().unwrap()) as f64;
    match l.key {
        KeyQuant::ByChannel => (0..l.d).map(|j| f(slab, j)).collect(),
        KeyQuant::ByToken { group } => {
            let g = if group == 0 { l.d } else { group };
            let row = &slab[slot * dims[3]..][..dims[3]];
            (0..l.d).map(|j| f(&row[j / g * (g + 8)..], 0)).collect()
        }
    }
}

/// Rotation of a u8 key cache, every layout variant, both runners, on seeded random calls
/// (rotated blocks holding cached tokens, partly filled blocks that then grow, blocks no sequence
/// reaches, every `rotation_deltas` form, f32 and f16 LUTs):
/// - each rotated key, dequantized after the call, is within one quantization step (its
///   channel's or group's final scale) of the float64 rotation of the key dequantized before the
///   call (one rounding by the rotation's re-quantization, at most half a step, plus at most half
///   a step when insertion later grows the block), and each new key within one step of itself
///   (so new keys are not rotated: rotation comes before insertion);
/// - outputs and scores match float64 attention over the dequantized caches after the call
///   (rotation removed: the caches already hold the rotated keys);
/// - the fast kernels write the same cache bytes as the scalar twin.
///
/// The rotations are large (many rotated keys move by several steps), so a call that skipped or
/// misapplied the rotation fails the first check.
#[test]
fn rotation_of_a_u8_key_cache_is_within_one_step_of_float64() {
    let (mut rotated_rows, mut moved, mut grown) = (0usize, 0usize, 0usize);
    let mut inserted_rows = 0usize;
    for (key, value_group) in LAYOUTS {
        for (qt, hkv, g, d) in [
            (ElemType::F32, 2, 2, 64),
            (ElemType::F32, 1, 4, 32),
            (ElemType::BF16, 2, 1, 128),
            (ElemType::F32, 1, 3, 40),
        ] {
            if value_group > d || !d.is_multiple_of(value_group.max(1)) {
                continue;
            }
            if let KeyQuant::ByToken { group } = key {
                if group > d || !d.is_multiple_of(group.max(1)) {
                    continue;
                }
            }
            let tol = if qt == ElemType::F32 { 2e-5 } else { 1e-2 };
            let mut geo = Geometry::new(qt, ElemType::F32, hkv, g, d, 16);
            geo.max_past = 70;
            geo.max_new = 20;
            for seed in 0..6 {
                let f = Features {
                    rotation: Some(true),
                    ..Features::default()
                };
                let c = gen_case(1300 + seed, &geo, &f);
                let l = layout_for(&c, key, value_group);
                let before = u8_call(&c, &l);
                let (kc0, vc0) = (
                    before.inputs[idx::KEY_CACHE].data.u8s(),
                    before.inputs[idx::VALUE_CACHE].data.u8s(),
                );
                // float64 rotation of the keys the cache held before the call, then insertion
                // of the call's new keys
                let mut held = dequantized_case(&c, &l, kc0, vc0);
                (held.key, held.value) = (c.key.clone(), c.value.clone());
                let want = reference(&held);
                let mut twin: Option<common::call::Call> = None;
                for runner in RUNNERS {
                    let mut call = before.clone();
                    call.run(runner).expect("rotation on a u8 cache runs");
                    let kc = call.inputs[idx::KEY_CACHE].data.u8s();
                    let vc = call.inputs[idx::VALUE_CACHE].data.u8s();
                    let mut row = vec![0f32; d];
                    let mut old = vec![0f32; d];
                    for (i, rule) in want.rows.iter().enumerate() {
                        use common::ref64::RowRule::{Inserted, Rotated};
                        if *rule != Rotated && *rule != Inserted {
                            continue;
                        }
                        let (block, head, slot) = (i / (hkv * c.bs), i / c.bs % hkv, i % c.bs);
                        quant::key_row(&l, kc, block, head, slot, &mut row);
                        quant::key_row(&l, kc0, block, head, slot, &mut old);
                        let steps = key_steps(&l, kc, block, head, slot);
                        let w = &want.key_cache[i * d..][..d];
                        for j in 0..d {
                            let err = (row[j] as f64 - w[j]).abs();
                            // the bound, plus f32 arithmetic on values of this size
                            let bound = steps[j] + 1e-6 * (1.0 + w[j].abs());
                            assert!(
                                err <= bound,
                                "{runner:?} {l:?} seed {seed}: block {block} head {head} \
                                 slot {slot} channel {j}: {} vs float64 {}, step {}\n{}",
                                row[j],
                                w[j],
                                steps[j],
                                c.describe()
                            );
                        }
                        if *rule == Inserted {
                            inserted_rows += 1;
                            continue;
                        }
                        if (0..d).any(|j| (old[j] as f64 - w[j]).abs() > 2.0 * steps[j]) {
                            moved += 1;
                        }
                        let block_grows = (0..c.bs).any(|s| {
                            want.rows[(block * hkv + head) * c.bs + s]
                                == common::ref64::RowRule::Inserted
                        });
                        grown += block_grows as usize;
                        rotated_rows += 1;
                    }
                    let mut after = dequantized_case(&c, &l, kc, vc);
                    after.rotation = None;
                    let exp = reference(&after);
                    let eo = rel_err(&call.outputs[0].data.to_f64(), &exp.output);
                    let es = rel_err(&call.outputs[1].data.to_f64(), &exp.scores);
                    assert!(
                        eo <= tol && es <= tol,
                        "{runner:?} {l:?} seed {seed}: output {eo:e} scores {es:e} > {tol:e}\n{}",
                        c.describe()
                    );
                    match &twin {
                        None => twin = Some(call),
                        Some(t) => {
                            for i in [idx::KEY_CACHE, idx::VALUE_CACHE] {
                                assert_eq!(call.inputs[i], t.inputs[i], "{l:?}: cache {i} bytes");
                            }
                        }
                    }
                }
            }
        }
    }
    assert!(rotated_rows >= 500, "{rotated_rows} rotated rows checked");
    assert!(
        moved * 2 >= rotated_rows,
        "{moved} of {rotated_rows} moved by the rotation"
    );
    assert!(
        grown >= 10,
        "{grown} rotated rows in blocks that grew after rotation"
    );
    assert!(
        inserted_rows >= 500,
        "{inserted_rows} inserted rows checked"
    );
}

/// A u8 call with rotation inputs validates (it used to be refused) and keeps them in its plan.
#[test]
fn rotation_inputs_on_u8_caches_validate() {
    let geo = Geometry::new(ElemType::F32, ElemType::F32, 2, 2, 64, 32);
    let f = Features {
        rotation: Some(true),
        ..Features::default()
    };
    let c = gen_case(9, &geo, &f);
    let mut call = u8_call(&c, &layout_for(&c, KeyQuant::ByChannel, 0));
    let plan = call.validate().expect("rotation on u8 caches validates");
    let r = c.rotation.as_ref().unwrap().blocks.len();
    assert_eq!(plan.rotation.map(|p| p.r), Some(r));
}

fn partial(elem: ElemType, dims: &[i64]) -> PartialInput {
    PartialInput::new(Some(elem), PartialShape::from_dims(dims))
}

#[test]
fn shape_inference_reads_u8_layouts() {
    let i32s = |d: &[i64]| partial(ElemType::I32, d);
    let inputs = |kc: &[i64], vc: &[i64]| {
        vec![
            partial(ElemType::F32, &[DYN, 8 * 64]),
            partial(ElemType::F32, &[DYN, 2 * 64]),
            partial(ElemType::F32, &[DYN, 2 * 64]),
            partial(ElemType::U8, kc),
            partial(ElemType::U8, vc),
            i32s(&[DYN]),
            i32s(&[DYN]),
            i32s(&[DYN]),
            i32s(&[DYN]),
        ]
    };
    for (kc, vc) in [
        ([DYN, 2, 40, 64], [DYN, 2, 32, 72]),
        ([DYN, 2, 32, 96], [DYN, 2, 32, 80]),
    ] {
        let [o, _] = infer_shapes(&inputs(&kc, &vc)).expect("u8 layout infers");
        assert_eq!(o.shape, PartialShape::from_dims(&[DYN, 8 * 64]));
        assert_eq!(o.elem, Some(ElemType::F32));
    }
    let err = infer_shapes(&inputs(&[DYN, 2, 33, 64], &[DYN, 2, 32, 72])).unwrap_err();
    assert!(err.to_string().contains("33 rows"), "{err}");
    let err = infer_shapes(&inputs(&[DYN, 2, 40, 64], &[DYN, 2, 32, 70])).unwrap_err();
    assert!(err.to_string().contains("70 bytes per token"), "{err}");
    // block_size + 8 must not wrap: with a block size of i64::MAX the call is refused with a
    // message that names no wrapped number (found by the fuzzer, whose build panics on the
    // overflow; the input is in fuzz/regressions/infer_shapes/).
    let err = infer_shapes(&inputs(&[DYN, 2, 5, 64], &[DYN, 2, i64::MAX, 72])).unwrap_err();
    let msg = err.to_string();
    assert!(msg.contains("5 rows") && !msg.contains("= -"), "{msg}");
}

/// Every SIMD level's u8 loops (`fast::quantized` on that level's `QuantMicro`) against float64 attention
/// over the dequantized caches and against the scalar level, on edge geometries: head sizes that
/// leave 16-lane tails (24, 40), more query heads per KV head than a tile has rows (10), block
/// size 16, long contexts spanning many blocks, value heads of another size than the key's
/// (Dv 32 with D 64, Dv 40 with D 24: OpenVINO's `value_cache [?, Hkv, BS, Dv + 8 * Dv / G]`);
/// each on u8 caches and on u4 caches of the same layout (whose decode items read the nibbles
/// in place).
#[test]
fn every_simd_level_matches_float64_and_the_scalar_twin() {
    use paged_attention::kernel::fast::{execute_with, FastOptions, SimdLevel};
    let run = |call: &mut common::call::Call, simd: SimdLevel| {
        call.with_api(|inputs, mut outputs| {
            let opts = FastOptions {
                simd,
                ..FastOptions::default()
            };
            execute_with(opts, &mut inputs.unwrap(), &mut outputs).expect("u8 call runs")
        })
    };
    let mut checked = 0;
    for (qt, tol) in [(ElemType::F32, 2e-5), (ElemType::BF16, 1e-2)] {
        for (hkv, g, (d, dv), bs) in [
            (2, 4, (64, 64), 32),
            (1, 10, (24, 24), 16),
            (2, 3, (40, 40), 32),
            (1, 1, (128, 128), 32),
            (2, 4, (64, 32), 32),
            (1, 10, (24, 40), 16),
        ] {
            let mut geo = Geometry::new(qt, ElemType::F32, hkv, g, d, bs);
            (geo.dv, geo.max_past, geo.max_new) = (dv, 150, 40);
            let layouts = LAYOUTS.into_iter().flat_map(|l| [(l, 8), (l, 4)]);
            for ((key, value_group), bits) in layouts {
                if value_group > dv || !dv.is_multiple_of(value_group.max(1)) {
                    continue;
                }
                if let KeyQuant::ByToken { group } = key {
                    if group > d || !d.is_multiple_of(group.max(1)) {
                        continue;
                    }
                }
                let c = gen_case(checked as u64 + 500, &geo, &features());
                let l = layout_for_bits(&c, key, value_group, bits);
                assert!(l.is_valid(), "{l:?}");
                let mut scalar = u8_call(&c, &l);
                run(&mut scalar, SimdLevel::Scalar);
                let want = reference(&dequantized_case(
                    &c,
                    &l,
                    scalar.inputs[idx::KEY_CACHE].data.u8s(),
                    scalar.inputs[idx::VALUE_CACHE].data.u8s(),
                ));
                for level in SimdLevel::ALL {
                    let mut call = u8_call(&c, &l);
                    run(&mut call, level);
                    let (o, s) = (call.outputs[0].data.to_f64(), call.outputs[1].data.to_f64());
                    let (eo, es) = (rel_err(&o, &want.output), rel_err(&s, &want.scores));
                    assert!(
                        eo <= tol && es <= tol,
                        "{level:?} {l:?}: vs float64 output {eo:e} scores {es:e}\n{}",
                        c.describe()
                    );
                    let twin_o = rel_err(&o, &scalar.outputs[0].data.to_f64());
                    let twin_s = rel_err(&s, &scalar.outputs[1].data.to_f64());
                    assert!(
                        twin_o <= tol && twin_s <= tol,
                        "{level:?} {l:?}: vs scalar twin output {twin_o:e} scores {twin_s:e}"
                    );
                    assert_eq!(
                        call.inputs[idx::KEY_CACHE],
                        scalar.inputs[idx::KEY_CACHE],
                        "{level:?}: key cache bytes"
                    );
                    checked += 1;
                }
            }
        }
    }
    assert!(checked >= 80, "{checked} runs");
}

/// Long prefills and mixed batches on u8 caches (several prefill items per KV head, partial
/// scores of several items per sequence, by-channel key blocks re-quantized as chunks land),
/// and decode-only batches (whose items take runs of KV heads that differ between one and two
/// threads for 12 sequences; long pasts cut into key chunks): the library's pool at 2 threads gives the same bits as one thread (caches,
/// outputs and scores), and both stay within the f32 bound of float64 attention over the
/// dequantized caches.
#[test]
fn u8_calls_are_bit_identical_on_one_and_two_threads() {
    use paged_attention::threads::set_num_threads;
    use paged_attention::Runner as R;
    let run = |c: &common::call::Call, runner: R| {
        let mut c = c.clone();
        c.with_api(|i, mut o| paged_attention::execute_on(runner, &mut i.unwrap(), &mut o))
            .expect("u8 call runs");
        c
    };
    set_num_threads(2).unwrap();
    let mut checked = 0;
    // The last geometry's pasts (up to 2500) get decode sequences cut into key chunks.
    let geometries = [
        (2, 4, 64, 100),
        (1, 3, 40, 100),
        (3, 1, 32, 100),
        (4, 2, 32, 100),
        (1, 4, 32, 2500),
    ];
    for (hkv, g, d, past) in geometries {
        let mut geo = Geometry::new(ElemType::F32, ElemType::F32, hkv, g, d, 16);
        geo.max_new = 150;
        geo.max_past = past;
        let kinds = [
            vec![SeqKind::Prefill],
            vec![SeqKind::ChunkedPrefill, SeqKind::Decode, SeqKind::Prefill],
            vec![SeqKind::Decode],
            vec![SeqKind::Decode; 3],
            // Enough sequences that one thread's items take runs of 2 KV heads (Hkv 4) where
            // two threads' take one head each (the cut aims at 32 items per thread).
            vec![SeqKind::Decode; 12],
        ];
        for (key, value_group) in LAYOUTS {
            if value_group > d || !d.is_multiple_of(value_group.max(1)) {
                continue;
            }
            if let KeyQuant::ByToken { group } = key {
                if group > d || !d.is_multiple_of(group.max(1)) {
                    continue;
                }
            }
            for seqs in &kinds {
                let f = Features {
                    seqs: Some(seqs.clone()),
                    ..features()
                };
                let c = gen_case(checked as u64 + 900, &geo, &f);
                let l = layout_for(&c, key, value_group);
                let call = u8_call(&c, &l);
                let one = run(&call, R::Serial);
                let two = run(&call, R::Auto);
                for i in [idx::KEY_CACHE, idx::VALUE_CACHE] {
                    assert_eq!(one.inputs[i], two.inputs[i], "{l:?}: cache {i} bytes");
                }
                for o in 0..2 {
                    let (a, b) = (&one.outputs[o].data, &two.outputs[o].data);
                    let same = a
                        .to_f64()
                        .iter()
                        .zip(b.to_f64())
                        .all(|(x, y)| x.to_bits() == y.to_bits());
                    assert!(same, "{l:?}: output {o} differs between 1 and 2 threads");
                }
                let want = reference(&dequantized_case(
                    &c,
                    &l,
                    one.inputs[idx::KEY_CACHE].data.u8s(),
                    one.inputs[idx::VALUE_CACHE].data.u8s(),
                ));
                let eo = rel_err(&one.outputs[0].data.to_f64(), &want.output);
                let es = rel_err(&one.outputs[1].data.to_f64(), &want.scores);
                assert!(
                    eo <= 2e-5 && es <= 2e-5,
                    "{l:?}: output {eo:e} scores {es:e}"
                );
                checked += 1;
            }
        }
    }
    assert!(checked >= 20, "{checked} runs");
}

/// The bf16 precision on u8 and u4 caches (the prefill items' dequantized keys and values
/// packed once into bf16 panels, products on the best bf16 tier here): outputs within 1e-2
/// absolute and scores within 1e-2 relative to max(1, |score|) of float64 attention over the
/// rounded operands (query, and the dequantized cache rows, rounded to bf16), and, on a CPU
/// with bf16 products, not the f32 precision's outputs (the choice took effect). Prints the
/// bf16 tier exercised.
#[test]
fn bf16_precision_on_u8_and_u4_caches_matches_float64_of_the_rounded_operands() {
    use paged_attention::kernel::fast::{execute_with, FastOptions, Precision, SimdLevel};
    let run = |call: &mut common::call::Call, precision: Precision| {
        call.with_api(|inputs, mut outputs| {
            let opts = FastOptions {
                simd: SimdLevel::Amx,
                precision,
                ..FastOptions::default()
            };
            execute_with(opts, &mut inputs.unwrap(), &mut outputs).expect("u8 call runs")
        })
    };
    let level = SimdLevel::Amx.effective();
    eprintln!("bf16 tiers exercised on u8 caches: {}", level.name());
    let (mut worst, mut changed, mut runs) = (0f64, false, 0);
    for (k, (hkv, g, d, bits)) in [(2, 4, 64, 8), (1, 8, 128, 4), (2, 2, 40, 8), (1, 4, 64, 4)]
        .into_iter()
        .enumerate()
    {
        let mut geo = Geometry::new(ElemType::F32, ElemType::F32, hkv, g, d, 32);
        (geo.max_past, geo.max_new) = (100, 150);
        for (key, value_group) in LAYOUTS {
            if value_group > d || !d.is_multiple_of(value_group.max(1)) {
                continue;
            }
            let c = gen_case(900 + k as u64, &geo, &features());
            let l = layout_for_bits(&c, key, value_group, bits);
            let mut call = u8_call(&c, &l);
            run(&mut call, Precision::Bf16);
            let mut exp_case = dequantized_case(
                &c,
                &l,
                call.inputs[idx::KEY_CACHE].data.u8s(),
                call.inputs[idx::VALUE_CACHE].data.u8s(),
            );
            for v in [
                &mut exp_case.query,
                &mut exp_case.key,
                &mut exp_case.value,
                &mut exp_case.key_cache,
                &mut exp_case.value_cache,
            ] {
                *v = bf16_values(v);
            }
            let want = reference(&exp_case);
            let out = call.outputs[0].data.to_f64();
            for (i, (&o, &w)) in out.iter().zip(&want.output).enumerate() {
                assert!(
                    (o - w).abs() <= 1e-2,
                    "{l:?}: output[{i}] = {o}, float64 {w}\n{}",
                    c.describe()
                );
                worst = worst.max((o - w).abs());
            }
            let sc = call.outputs[1].data.to_f64();
            for (j, (&o, &w)) in sc.iter().zip(&want.scores).enumerate() {
                assert!(
                    (o - w).abs() <= 1e-2 * w.abs().max(1.0),
                    "{l:?}: scores[{j}] = {o}, float64 {w}\n{}",
                    c.describe()
                );
            }
            let mut f32_call = u8_call(&c, &l);
            run(&mut f32_call, Precision::F32);
            changed |= f32_call.outputs[0].data.to_f64() != out;
            runs += 1;
        }
    }
    assert!(runs >= 12, "{runs} runs");
    assert!(
        changed || level < SimdLevel::Avx512Bf16,
        "the bf16 precision changed no output on {level:?}"
    );
    eprintln!("WORST u8/u4 bf16 precision output error {worst:.3e}");
}
