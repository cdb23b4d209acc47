//! The op (`execute` and `execute_reference`) against the float64 reference of
//! `common/ref64.rs` on seeded random cases: every feature, every (query, cache) type pair,
//! block sizes 1/16/32/48, head sizes 16/64/80/128/256, GQA groups 1/4/8; outputs, scores and
//! the caches after the call.
//!
//! Tolerances (absolute, on values in about unit range; scores relative to max(1, |score|)):
//! - f32 query with f32 cache (or any cache without rotation): 2e-6. The reference is fed the
//!   exact same rounded values, so only f32 accumulation separates the two.
//! - otherwise (f16/bf16 query, whose output is rounded to it, or a half cache with rotation,
//!   where a rotated key may round to the neighbouring half value): 1e-2.

mod common;

use common::call::{Call, Runner, RUNNERS};
use common::ref64::{
    gen_case, reference, Case, DeltaForm, Expected, Features, Geometry, RowRule, ScoreWindow,
    SeqKind,
};
use paged_attention::ElemType::{self, BF16, F16, F32};

const BLOCK_SIZES: [usize; 4] = [1, 16, 32, 48];
const HEAD_SIZES: [usize; 5] = [16, 64, 80, 128, 256];
const GROUPS: [usize; 3] = [1, 4, 8];
const TYPES: [ElemType; 3] = [F32, F16, BF16];

/// Worst errors seen in one or more cases.
#[derive(Clone, Copy, Debug, Default)]
struct Worst {
    output: f64,
    scores: f64,
    rotated: f64,
}

impl Worst {
    fn merge(&mut self, o: Worst) {
        self.output = self.output.max(o.output);
        self.scores = self.scores.max(o.scores);
        self.rotated = self.rotated.max(o.rotated);
    }
}

fn tolerance(c: &Case) -> f64 {
    if c.qt == F32 && (c.ct == F32 || c.rotation.is_none()) {
        2e-6
    } else {
        1e-2
    }
}

/// Relative spacing of the cache type: a rotated key may land one such step away.
fn ulp(ty: ElemType) -> f64 {
    match ty {
        F32 => f32::EPSILON as f64,
        F16 => 2f64.powi(-10),
        BF16 => 2f64.powi(-7),
        ElemType::I32 | ElemType::U8 | ElemType::U4 => unreachable!(),
    }
}

/// Runs `case` with `runner` and checks everything against the reference; returns the errors.
fn check_case(case: &Case, runner: Runner) -> Worst {
    let exp = reference(case);
    let mut call = case.to_call();
    let before = call.clone();
    if let Err(e) = call.run(runner) {
        panic!("{runner:?} rejected a valid case: {e}\n{}", case.describe());
    }
    check_against(case, &exp, &before, &call, runner)
}

fn check_against(
    case: &Case,
    exp: &Expected,
    before: &Call,
    after: &Call,
    runner: Runner,
) -> Worst {
    let tol = tolerance(case);
    let mut worst = Worst::default();
    let ctx = || format!("{runner:?} {}", case.describe());

    let got = after.outputs[0].data.to_f64();
    for (i, (&g, &e)) in got.iter().zip(&exp.output).enumerate() {
        let err = (g - e).abs();
        assert!(
            err <= tol,
            "output[{}, {}] = {g}, expected {e} (error {err:e} > {tol:e})\n{}",
            i / (case.h * case.d),
            i % (case.h * case.d),
            ctx()
        );
        worst.output = worst.output.max(err);
    }
    let got = after.outputs[1].data.to_f64();
    for (j, (&g, &e)) in got.iter().zip(&exp.scores).enumerate() {
        let err = (g - e).abs() / e.abs().max(1.0);
        assert!(
            err <= tol,
            "scores[{j}] = {g}, expected {e} (relative error {err:e} > {tol:e})\n{}",
            ctx()
        );
        worst.scores = worst.scores.max(err);
    }

    // Caches, row by row, by what each row holds.
    let (d, dv) = (case.d, case.dv);
    let kc_before = before.inputs[3].data.bits();
    let vc_before = before.inputs[4].data.bits();
    let kc_bits = after.inputs[3].data.bits();
    let vc_bits = after.inputs[4].data.bits();
    let kc = after.inputs[3].data.to_f64();
    let vc = after.inputs[4].data.to_f64();
    let rot_tol = 2.0 * ulp(case.ct);
    for (r, rule) in exp.rows.iter().enumerate() {
        let span = r * d..(r + 1) * d;
        let vspan = r * dv..(r + 1) * dv;
        let (blk, kh, slot) = (
            r / (case.hkv * case.bs),
            r / case.bs % case.hkv,
            r % case.bs,
        );
        let at = || {
            format!(
                "cache row (block {blk}, kv head {kh}, slot {slot})\n{}",
                ctx()
            )
        };
        match rule {
            RowRule::DontCare => {}
            RowRule::Untouched => {
                assert!(
                    kc_bits[span.clone()] == kc_before[span.clone()],
                    "key_cache changed at an untouched {}",
                    at()
                );
                assert!(
                    vc_bits[vspan.clone()] == vc_before[vspan.clone()],
                    "value_cache changed at an untouched {}",
                    at()
                );
            }
            RowRule::Inserted => {
                for x in span {
                    assert!(
                        kc[x] == exp.key_cache[x],
                        "inserted {}: key element {} is {}, expected {}",
                        at(),
                        x % d,
                        kc[x],
                        exp.key_cache[x]
                    );
                }
                for x in vspan {
                    assert!(
                        vc[x] == exp.value_cache[x],
                        "inserted {}: value element {} is {}, expected {}",
                        at(),
                        x % dv,
                        vc[x],
                        exp.value_cache[x]
                    );
                }
            }
            RowRule::Rotated => {
                assert!(
                    vc_bits[vspan.clone()] == vc_before[vspan.clone()],
                    "value_cache changed at a rotated {} (values are never rotated)",
                    at()
                );
                for x in span {
                    let err = (kc[x] - exp.key_cache[x]).abs() / exp.key_cache[x].abs().max(1.0);
                    assert!(
                        err <= rot_tol,
                        "rotated key {} element {}: {} expected {} (error {err:e})",
                        at(),
                        x % d,
                        kc[x],
                        exp.key_cache[x]
                    );
                    worst.rotated = worst.rotated.max(err);
                }
            }
        }
    }
    // Other inputs are read-only.
    for i in (0..after.inputs.len()).filter(|&i| i != 3 && i != 4) {
        assert!(
            after.inputs[i] == before.inputs[i],
            "input {i} was modified\n{}",
            ctx()
        );
    }
    worst
}

/// Runs `case` with both runners; the two must agree with the reference and with each other
/// bit for bit (today both are the scalar kernel; a fast path must stay within tolerance).
fn check_both(case: &Case) -> Worst {
    let mut w = Worst::default();
    for r in RUNNERS {
        w.merge(check_case(case, r));
    }
    w
}

/// The geometry of case number `k`: cycles through block sizes, head sizes and groups.
fn geometry(qt: ElemType, ct: ElemType, k: usize) -> Geometry {
    let bs = BLOCK_SIZES[k % 4];
    let d = HEAD_SIZES[k % 5];
    let g = GROUPS[k % 3];
    let hkv = if g == 8 || d >= 128 { 1 } else { 1 + k % 2 };
    let mut geo = Geometry::new(qt, ct, hkv, g, d, bs);
    if d >= 128 {
        geo.max_new = 8;
        geo.max_past = 24;
    }
    geo
}

fn dtype_pair(qt: ElemType, ct: ElemType, seed: u64) {
    let mut worst = Worst::default();
    // 20 cases: every block size x head size pair once (lcm(4, 5)), every group.
    for k in 0..20 {
        let case = gen_case(seed + k as u64, &geometry(qt, ct, k), &Features::default());
        worst.merge(check_both(&case));
    }
    eprintln!(
        "WORST q={qt} c={ct}: output {:.3e}, scores {:.3e} (relative), rotated keys {:.3e} (relative)",
        worst.output, worst.scores, worst.rotated
    );
}

macro_rules! dtype_tests {
    ($($name:ident: $q:expr, $c:expr, $seed:expr;)*) => {$(
        #[test]
        fn $name() {
            dtype_pair($q, $c, $seed);
        }
    )*};
}

dtype_tests! {
    f32_query_f32_cache_matches_f64_reference: F32, F32, 1000;
    f32_query_f16_cache_matches_f64_reference: F32, F16, 2000;
    f32_query_bf16_cache_matches_f64_reference: F32, BF16, 3000;
    f16_query_f32_cache_matches_f64_reference: F16, F32, 4000;
    f16_query_f16_cache_matches_f64_reference: F16, F16, 5000;
    f16_query_bf16_cache_matches_f64_reference: F16, BF16, 6000;
    bf16_query_f32_cache_matches_f64_reference: BF16, F32, 7000;
    bf16_query_f16_cache_matches_f64_reference: BF16, F16, 8000;
    bf16_query_bf16_cache_matches_f64_reference: BF16, BF16, 9000;
}

#[test]
fn every_block_size_head_size_and_group_matches_f64_reference() {
    let mut seed = 10_000;
    for &bs in &BLOCK_SIZES {
        for &d in &HEAD_SIZES {
            for &g in &GROUPS {
                let mut geo = Geometry::new(F32, F32, if g == 1 { 2 } else { 1 }, g, d, bs);
                geo.max_new = 6;
                geo.max_past = if d >= 128 { 20 } else { 40 };
                let case = gen_case(seed, &geo, &Features::default());
                check_case(&case, Runner::Execute);
                seed += 1;
            }
        }
    }
}

fn small(qt: ElemType, ct: ElemType) -> Geometry {
    Geometry::new(qt, ct, 2, 2, 16, 4)
}

fn mixed_batch() -> Vec<SeqKind> {
    vec![
        SeqKind::Prefill,
        SeqKind::ChunkedPrefill,
        SeqKind::Decode,
        SeqKind::Empty,
        SeqKind::Decode,
    ]
}

#[test]
fn rotation_in_every_delta_form_and_lut_type_matches_f64_reference() {
    let mut seed = 20_000;
    for (qt, ct) in [(F32, F32), (F16, F16), (BF16, F32), (F32, BF16)] {
        for form in [
            DeltaForm::PerBlock,
            DeltaForm::PerBlockCol,
            DeltaForm::PerSlot,
        ] {
            for lut in [F32, F16] {
                for bs in [1, 5, 16] {
                    let mut geo = small(qt, ct);
                    geo.bs = bs;
                    let f = Features {
                        rotation: Some(true),
                        delta_form: Some(form),
                        lut_type: Some(lut),
                        seqs: Some(mixed_batch()),
                        ..Features::default()
                    };
                    let case = gen_case(seed, &geo, &f);
                    assert!(case.rotation.is_some());
                    check_both(&case);
                    seed += 1;
                }
            }
        }
    }
}

#[test]
fn rotation_works_with_a_head_size_of_two() {
    let mut geo = Geometry::new(F32, F32, 1, 1, 2, 3);
    geo.max_past = 10;
    for seed in 0..5 {
        let f = Features {
            rotation: Some(true),
            ..Features::default()
        };
        check_both(&gen_case(21_000 + seed, &geo, &f));
    }
}

#[test]
fn odd_and_tiny_head_sizes_without_rotation_match_f64_reference() {
    for (i, d) in [1, 3, 7, 33].into_iter().enumerate() {
        let geo = Geometry::new(F32, F32, 2, 2, d, 4);
        let f = Features {
            rotation: Some(false),
            seqs: Some(mixed_batch()),
            ..Features::default()
        };
        check_both(&gen_case(22_000 + i as u64, &geo, &f));
    }
}

#[test]
fn alibi_per_query_head_matches_f64_reference() {
    for (i, g) in GROUPS.into_iter().enumerate() {
        for (qt, ct) in [(F32, F32), (F16, BF16)] {
            let geo = Geometry::new(qt, ct, 2, g, 16, 8);
            let f = Features {
                alibi: Some(true),
                sliding_window: Some(false),
                seqs: Some(mixed_batch()),
                ..Features::default()
            };
            let case = gen_case(23_000 + i as u64, &geo, &f);
            // Distinct slopes per query head, so a per-KV-head lookup would be caught.
            let slopes = case.alibi.as_ref().unwrap();
            assert!(slopes.len() == case.h);
            check_both(&case);
        }
    }
}

#[test]
fn sliding_window_of_every_size_matches_f64_reference() {
    for (i, w) in [0, 1, 2, 5, 17, 1000].into_iter().enumerate() {
        for alibi in [false, true] {
            let mut case = gen_case(
                24_000 + i as u64,
                &small(F32, F32),
                &Features {
                    alibi: Some(alibi),
                    seqs: Some(mixed_batch()),
                    ..Features::default()
                },
            );
            case.sliding_window = Some(w);
            check_both(&case);
        }
    }
}

#[test]
fn scale_absent_zero_empty_or_given_matches_f64_reference() {
    for (i, scale) in [None, Some(0.0), Some(0.125), Some(1.5)]
        .into_iter()
        .enumerate()
    {
        for all_16 in [false, true] {
            let mut case = gen_case(
                25_000 + i as u64,
                &small(F32, F32),
                &Features {
                    scale: Some(scale),
                    seqs: Some(mixed_batch()),
                    ..Features::default()
                },
            );
            // all_16 gives an absent scale as an empty tensor.
            case.all_16 = all_16;
            check_both(&case);
        }
    }
}

#[test]
fn score_window_in_every_form_matches_f64_reference() {
    let forms = vec![
        None,
        Some(ScoreWindow::Scalar(1)),
        Some(ScoreWindow::Scalar(3)),
        Some(ScoreWindow::Scalar(0)),
        Some(ScoreWindow::Scalar(-1)),
        Some(ScoreWindow::Scalar(i32::MAX)),
        Some(ScoreWindow::PerSeq(vec![2, 0, -1, 5, 1])),
        Some(ScoreWindow::PerSeq(vec![-3, 100, 0, 0, 7])),
    ];
    for (i, w) in forms.into_iter().enumerate() {
        for all_16 in [false, true] {
            let mut case = gen_case(
                26_000 + i as u64,
                &small(F32, F32),
                &Features {
                    score_window: Some(w.clone()),
                    seqs: Some(mixed_batch()),
                    ..Features::default()
                },
            );
            case.all_16 = all_16;
            case.rank1_scalars = false;
            check_both(&case);
        }
    }
}

#[test]
fn scalars_given_as_one_element_rank1_tensors_match_f64_reference() {
    let mut case = gen_case(
        27_000,
        &small(F32, F32),
        &Features {
            scale: Some(Some(0.25)),
            sliding_window: Some(true),
            score_window: Some(Some(ScoreWindow::Scalar(2))),
            seqs: Some(vec![SeqKind::ChunkedPrefill]),
            ..Features::default()
        },
    );
    case.rank1_scalars = true;
    check_both(&case);
}

#[test]
fn sequences_with_zero_new_tokens_get_zero_scores_and_no_writes() {
    let case = gen_case(
        28_000,
        &small(F32, F32),
        &Features {
            seqs: Some(vec![SeqKind::Empty, SeqKind::Decode, SeqKind::Empty]),
            score_window: Some(Some(ScoreWindow::Scalar(-1))),
            ..Features::default()
        },
    );
    check_both(&case);
    // A batch in which no sequence has a new token: T = 0.
    let case = gen_case(
        28_001,
        &small(F16, F32),
        &Features {
            seqs: Some(vec![SeqKind::Empty, SeqKind::Empty, SeqKind::Empty]),
            ..Features::default()
        },
    );
    assert_eq!(case.t(), 0);
    check_both(&case);
}

#[test]
fn long_mixed_batches_in_every_dtype_pair_match_f64_reference() {
    let mut seed = 29_000;
    for qt in TYPES {
        for ct in TYPES {
            let mut geo = Geometry::new(qt, ct, 2, 4, 64, 16);
            geo.max_new = 40;
            geo.max_past = 100;
            let f = Features {
                seqs: Some(mixed_batch()),
                ..Features::default()
            };
            check_case(&gen_case(seed, &geo, &f), Runner::Execute);
            seed += 1;
        }
    }
}

#[test]
fn slots_that_hold_no_token_do_not_change_the_result() {
    for seed in 0..4 {
        let f = |nan| Features {
            seqs: Some(mixed_batch()),
            nan_garbage: Some(nan),
            ..Features::default()
        };
        let a = gen_case(30_000 + seed, &small(F32, F16), &f(true));
        let b = gen_case(30_000 + seed, &small(F32, F16), &f(false));
        let mut ca = a.to_call();
        let mut cb = b.to_call();
        ca.run(Runner::Execute).unwrap();
        cb.run(Runner::Execute).unwrap();
        assert_eq!(
            ca.outputs[0].data.bits(),
            cb.outputs[0].data.bits(),
            "output depends on slots that hold no token\n{}",
            a.describe()
        );
        assert_eq!(ca.outputs[1].data.bits(), cb.outputs[1].data.bits());
    }
}

fn run_in_pool(threads: usize, call: &Call, runner: Runner) -> Call {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let mut c = call.clone();
    pool.install(|| c.run(runner)).expect("valid call");
    c
}

#[test]
fn one_thread_and_two_threads_give_bit_identical_results() {
    for seed in 0..6u64 {
        let qt = TYPES[seed as usize % 3];
        let ct = TYPES[(seed as usize / 3 + seed as usize) % 3];
        let mut geo = Geometry::new(qt, ct, 2, 4, 64, 16);
        geo.max_new = 30;
        geo.max_past = 60;
        let case = gen_case(
            31_000 + seed,
            &geo,
            &Features {
                seqs: Some(mixed_batch()),
                score_window: Some(Some(ScoreWindow::Scalar(-1))),
                ..Features::default()
            },
        );
        let call = case.to_call();
        for runner in RUNNERS {
            let one = run_in_pool(1, &call, runner);
            let two = run_in_pool(2, &call, runner);
            let three = run_in_pool(3, &call, runner);
            assert!(
                one.snapshot() == two.snapshot() && one.snapshot() == three.snapshot(),
                "{runner:?}: results depend on the thread count\n{}",
                case.describe()
            );
        }
    }
}

/// A single 8192-token prefill: the kernel must handle it (online softmax, O(T*H*D) memory).
/// Kept to one small head so the scalar code finishes in debug builds; the f64 reference checks
/// a sample of the rows (every 61st token and the last 8).
#[test]
fn a_single_8192_token_prefill_matches_f64_reference() {
    let geo = Geometry::new(F32, F16, 1, 1, 16, 32);
    let case = gen_case(
        32_000,
        &geo,
        &Features {
            seqs: Some(vec![SeqKind::Prefill]),
            rotation: Some(false),
            alibi: Some(false),
            sliding_window: Some(false),
            scale: Some(None),
            ..Features::default()
        },
    );
    let case = force_prefill_len(case, 8192, 32_001);
    assert_eq!(case.t(), 8192);
    let mut call = case.to_call();
    call.run(Runner::Execute).expect("valid call");
    let exp = reference_sampled(&case);
    let got = call.outputs[0].data.to_f64();
    let hd = case.h * case.d;
    for (tok, row) in exp.iter() {
        for x in 0..hd {
            let (g, e) = (got[tok * hd + x], row[x]);
            assert!(
                (g - e).abs() <= 2e-6,
                "output[{tok}, {x}] = {g}, expected {e}"
            );
        }
    }
}

/// Rebuilds `case` as one prefill of `n` tokens with fresh values (same geometry and types).
fn force_prefill_len(case: Case, n: usize, seed: u64) -> Case {
    let mut rng = common::ref64::Rng::new(seed);
    let (h, hkv, d, bs) = (case.h, case.hkv, case.d, case.bs);
    let nb = n.div_ceil(bs) + 1;
    let mut blocks: Vec<i32> = (0..nb as i32).collect();
    rng.shuffle(&mut blocks);
    let mut r = |len: usize, ty: ElemType| -> Vec<f64> {
        (0..len)
            .map(|_| common::call::round_to(ty, rng.uniform(-1.0, 1.0)))
            .collect()
    };
    Case {
        nb,
        seqs: vec![common::ref64::Seq { past: 0, n }],
        query: r(n * h * d, case.qt),
        key: r(n * hkv * d, case.qt),
        value: r(n * hkv * d, case.qt),
        key_cache: r(nb * hkv * bs * d, case.ct),
        value_cache: r(nb * hkv * bs * d, case.ct),
        block_indices: blocks[..nb - 1].to_vec(),
        block_indices_begins: vec![0, nb as i32 - 1],
        ..case
    }
}

/// The f64 reference output rows of a sample of tokens of a single-sequence prefill.
fn reference_sampled(case: &Case) -> Vec<(usize, Vec<f64>)> {
    let (h, d, g) = (case.h, case.d, case.g());
    let n = case.t();
    let scale = 1.0 / (d as f64).sqrt();
    let kv = |buf: &Vec<f64>, j: usize, kh: usize| -> Vec<f64> {
        // New tokens only (past = 0): the cache row of position j is the input row j, rounded.
        (0..d)
            .map(|x| common::call::round_to(case.ct, buf[(j * case.hkv + kh) * d + x]))
            .collect()
    };
    let toks: Vec<usize> = (0..n).filter(|t| t % 61 == 0 || *t + 8 >= n).collect();
    toks.into_iter()
        .map(|tok| {
            let mut row = vec![0.0; h * d];
            for head in 0..h {
                let q = &case.query[(tok * h + head) * d..][..d];
                let kh = head / g;
                let logits: Vec<f64> = (0..=tok)
                    .map(|j| {
                        let k = kv(&case.key, j, kh);
                        scale * (0..d).map(|x| q[x] * k[x]).sum::<f64>()
                    })
                    .collect();
                let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = logits.iter().map(|l| (l - m).exp()).sum();
                for (j, l) in logits.iter().enumerate() {
                    let v = kv(&case.value, j, kh);
                    let w = (l - m).exp() / sum;
                    for x in 0..d {
                        row[head * d + x] += w * v[x];
                    }
                }
            }
            (tok, row)
        })
        .collect()
}

/// Attention sinks (input 16, `[H]` or `[1, H, 1, 1]`): one logit per query head in each row's
/// softmax, with no value. Every (query, cache) type pair and group, on mixed batches (decode,
/// prefill, chunked prefill, empty), scores in every window form.
#[test]
fn sinks_in_every_dtype_pair_and_group_match_f64_reference() {
    let mut seed = 60_000;
    for qt in TYPES {
        for ct in TYPES {
            for g in GROUPS {
                let geo = Geometry::new(qt, ct, if g == 8 { 1 } else { 2 }, g, 64, 16);
                let f = Features {
                    sinks: Some(true),
                    seqs: Some(mixed_batch()),
                    ..Features::default()
                };
                let case = gen_case(seed, &geo, &f);
                assert!(case.sinks.as_ref().is_some_and(|s| s.len() == case.h));
                check_both(&case);
                seed += 1;
            }
        }
    }
}

/// Sinks where the fast kernel takes its other paths: decode over long contexts (cut into key
/// chunks merged afterwards), a long prefill (tiles of many keys; AMX for a bf16 query where
/// the CPU has it), scores of every new token (the stashed logits), and a sliding window.
#[test]
fn sinks_over_long_contexts_and_long_prefills_match_f64_reference() {
    let shapes: [&[(usize, usize)]; 4] = [
        &[(3000, 1)],
        &[(2100, 1), (700, 1)],
        &[(0, 300)],
        &[(900, 40), (1500, 1)],
    ];
    let mut seed = 61_000;
    for (qt, ct) in [(F32, F32), (BF16, BF16), (F16, F32)] {
        for seqs in shapes {
            for window in [None, Some(500)] {
                let geo = Geometry::new(qt, ct, 2, 4, 64, 32);
                let f = Features {
                    sinks: Some(true),
                    alibi: Some(false),
                    sliding_window: Some(false),
                    // The last 16 tokens (every token of a long prefill would sum thousands
                    // of weights per score, past what f32 sums hold to 2e-6).
                    score_window: Some(Some(ScoreWindow::Scalar(16))),
                    ..Features::default()
                };
                let mut case = common::ref64::with_seqs(&geo, &f, seqs, seed);
                case.sliding_window = window;
                check_both(&case);
                seed += 1;
            }
        }
    }
}

/// A sink of `-inf` changes nothing (bit for bit against the same call without sinks); a huge
/// sink takes almost all the weight (outputs and scores near 0); NaN makes the rows NaN.
#[test]
fn sinks_of_minus_infinity_change_nothing_and_huge_ones_take_the_weight() {
    let geo = Geometry::new(F32, F32, 2, 4, 32, 16);
    let f = Features {
        seqs: Some(mixed_batch()),
        score_window: Some(Some(ScoreWindow::Scalar(-1))),
        ..Features::default()
    };
    let plain = gen_case(62_000, &geo, &f);
    for runner in RUNNERS {
        let mut a = plain.to_call();
        a.run(runner).unwrap();
        let mut with = plain.clone();
        with.sinks = Some(vec![f64::NEG_INFINITY; plain.h]);
        let mut b = with.to_call();
        b.run(runner).unwrap();
        assert_eq!(
            a.outputs[0].data.bits(),
            b.outputs[0].data.bits(),
            "{runner:?}: output"
        );
        assert_eq!(
            a.outputs[1].data.bits(),
            b.outputs[1].data.bits(),
            "{runner:?}: scores"
        );

        with.sinks = Some(vec![1e30; plain.h]);
        let mut c = with.to_call();
        c.run(runner).unwrap();
        let out = c.outputs[0].data.to_f64();
        assert!(out.iter().all(|x| x.abs() < 1e-20), "{runner:?}: {out:?}");
        assert!(c.outputs[1].data.to_f64().iter().all(|x| x.abs() < 1e-20));

        let mut nan = vec![0.0; plain.h];
        nan[1] = f64::NAN;
        with.sinks = Some(nan);
        let mut d = with.to_call();
        d.run(runner).unwrap();
        let out = d.outputs[0].data.to_f64();
        let hd = plain.h * plain.d;
        for (i, x) in out.iter().enumerate() {
            let head = (i % hd) / plain.d;
            assert_eq!(x.is_nan(), head == 1, "{runner:?}: element {i} = {x}");
        }
    }
}

/// A value head size other than the key head size (OpenVINO's `v_head_size`; value cache
/// `[NB, Hkv, BS, Dv]`, output `[T, H*Dv]`): wider and narrower values, every dtype pair, GQA,
/// windows, ALiBi, rotation of the keys, sinks, scores, on mixed batches.
#[test]
fn value_head_size_other_than_key_head_size_matches_f64_reference() {
    let mut seed = 63_000;
    for (d, dv) in [(64, 32), (32, 96), (16, 8), (48, 128)] {
        for (qt, ct) in [(F32, F32), (BF16, F16), (F16, BF16)] {
            for g in [1, 4] {
                let mut geo = Geometry::new(qt, ct, 2, g, d, 16);
                geo.dv = dv;
                let f = Features {
                    seqs: Some(mixed_batch()),
                    sinks: Some(seed % 2 == 0),
                    ..Features::default()
                };
                let case = gen_case(seed, &geo, &f);
                assert_eq!((case.d, case.dv), (d, dv));
                check_both(&case);
                seed += 1;
            }
        }
    }
}
