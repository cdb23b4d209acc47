//! The bf16 tiers: prefill items under bf16 math (a bf16 query, or the bf16 precision) with
//! their QK and PV products on AMX-BF16 tiles (`amx`) or on `vdpbf16ps` (`avx512bf16`, CPUs
//! with AVX512-BF16 and no AMX), through the whole op, against the float64 reference of
//! `common/ref64.rs` fed the same rounded values (bf16 query, cache-typed caches).
//!
//! Tolerance (the precision rule for a bf16 query): outputs within 1e-2 absolute, scores
//! within 1e-2 relative to max(1, |score|). Caches are checked by `tests/reference.rs`, whose
//! `execute` runs the same path.
//!
//! The tests ask for the `amx` level and get the best bf16 tier the machine has; on a machine
//! with neither the same cases run on the FMA loops and the tests say so. Where a bf16 tier
//! exists, a test fails unless its items ran on it (counted by the feature `test-hooks`, with
//! which scripts/test.sh runs this binary; without it the results are still checked, but not
//! where they were computed). Each run prints the bf16 tier it exercised ("bf16 tiers
//! exercised: ..."). Tests here hold one lock, so the process-wide item counter measures one
//! test at a time.

mod common;

use common::call::Call;
use common::ref64::{
    bf16_values, reference, with_seqs, Case, Expected, Features, Geometry, ScoreWindow,
};
use paged_attention::kernel::fast::{execute_with, FastOptions, Precision, ScoresMode, SimdLevel};
use paged_attention::ElemType::{self, BF16, F16, F32};
use std::sync::Mutex;

static SERIAL: Mutex<()> = Mutex::new(());

/// AMX prefill items run so far: the counter of the feature `test-hooks`, `None` without it
/// (the checks of results still run, but nothing proves the tiles ran; scripts/test.sh runs
/// this binary with the feature).
fn tile_items() -> Option<u64> {
    #[cfg(feature = "test-hooks")]
    return Some(paged_attention::kernel::fast::amx_items_run());
    #[cfg(not(feature = "test-hooks"))]
    None
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn amx_present() -> bool {
    SimdLevel::detected() == SimdLevel::Amx
}

/// Whether this machine has a bf16 tier (`avx512bf16` or `amx`); prints the tier once.
fn bf16_present() -> bool {
    let level = SimdLevel::detected();
    static PRINTED: std::sync::Once = std::sync::Once::new();
    PRINTED.call_once(|| {
        eprintln!(
            "bf16 tiers exercised: {}",
            if level >= SimdLevel::Avx512Bf16 {
                level.name()
            } else {
                "none (no AVX512-BF16 or AMX here; the FMA loops ran)"
            }
        )
    });
    level >= SimdLevel::Avx512Bf16
}

fn run_at(call: &Call, simd: SimdLevel) -> Call {
    let mut c = call.clone();
    let opts = FastOptions {
        simd,
        scores: ScoresMode::Auto,
        ..FastOptions::default()
    };
    c.with_api(|inputs, mut outputs| execute_with(opts, &mut inputs?, &mut outputs))
        .expect("valid call");
    c
}

/// Runs `case` at the AMX level and checks outputs and scores against the f64 reference.
fn check(case: &Case) -> f64 {
    let exp = reference(case);
    let got = run_at(&case.to_call(), SimdLevel::Amx);
    within_bf16_rule(&got, &exp, case)
}

/// Checks `got` (a run of `case`) against `exp` at the rule of a bf16 query: outputs within 1e-2
/// absolute, scores within 1e-2 relative to max(1, |score|). Returns the worst output error.
fn within_bf16_rule(got: &Call, exp: &Expected, case: &Case) -> f64 {
    let mut worst = 0f64;
    let out = got.outputs[0].data.to_f64();
    for (i, (&g, &e)) in out.iter().zip(&exp.output).enumerate() {
        let err = (g - e).abs();
        assert!(
            err <= 1e-2,
            "output[{}, {}] = {g}, expected {e} (error {err:e})\n{}",
            i / (case.h * case.d),
            i % (case.h * case.d),
            case.describe()
        );
        worst = worst.max(err);
    }
    let sc = got.outputs[1].data.to_f64();
    for (j, (&g, &e)) in sc.iter().zip(&exp.scores).enumerate() {
        let err = (g - e).abs() / e.abs().max(1.0);
        assert!(
            err <= 1e-2,
            "scores[{j}] = {g}, expected {e} (relative error {err:e})\n{}",
            case.describe()
        );
    }
    worst
}

/// Fails when the machine has a bf16 tier (AMX tiles, or `vdpbf16ps`) but no item ran on it
/// since `before` (with the feature `test-hooks`, which counts them); prints which tier the
/// test exercised.
fn require_tiles(test: &str, before: Option<u64>) {
    require_items(test, before, bf16_present())
}

/// As `require_tiles` for f32 math on bf16 parts, which only AMX tiles run.
fn require_amx_tiles(test: &str, before: Option<u64>) {
    require_items(test, before, amx_present())
}

fn require_items(test: &str, before: Option<u64>, expected: bool) {
    let level = SimdLevel::detected();
    if !expected {
        eprintln!("TIER {test}: {level:?} (FMA loops: no bf16 products for this call here)");
        return;
    }
    match (before, tile_items()) {
        (Some(before), Some(now)) => {
            let items = now - before;
            assert!(
                items > 0,
                "{test}: the CPU has {level:?}, but no prefill item ran on its bf16 products"
            );
            eprintln!(
                "TIER {test}: {} ({items} items on bf16 products)",
                level.name()
            );
        }
        _ => eprintln!(
            "TIER {test}: {} (items not counted: built without feature test-hooks)",
            level.name()
        ),
    }
}

const BLOCK_SIZES: [usize; 4] = [1, 16, 32, 48];
const GROUPS: [usize; 3] = [1, 4, 8];
const HEAD_SIZES: [usize; 9] = [16, 64, 80, 96, 128, 256, 7, 33, 100];
const CACHES: [ElemType; 3] = [BF16, F16, F32];

#[test]
fn bf16_prefill_matches_f64_reference_for_every_block_size_group_head_size_and_cache() {
    let _g = lock();
    let before = tile_items();
    let mut worst = 0f64;
    let mut k = 0;
    for &bs in &BLOCK_SIZES {
        for &g in &GROUPS {
            for &ct in &CACHES {
                let d = HEAD_SIZES[k % HEAD_SIZES.len()];
                let hkv = if g == 1 { 2 } else { 1 };
                let geo = Geometry::new(BF16, ct, hkv, g, d, bs);
                // A prefill of more than one item and a chunked prefill after a past.
                let seqs = [(0, 70 + k % 7), (21 + k, 33 + k % 5)];
                let case = with_seqs(&geo, &Features::default(), &seqs, 40_000 + k as u64);
                worst = worst.max(check(&case));
                k += 1;
            }
        }
    }
    eprintln!("WORST bf16 prefill output error {worst:.3e}");
    require_tiles("block sizes x groups x head sizes x caches", before);
}

#[test]
fn bf16_prefill_matches_f64_reference_with_sliding_window_alibi_and_scores() {
    let _g = lock();
    let before = tile_items();
    for (k, (window, alibi)) in [(true, false), (false, true), (true, true)]
        .into_iter()
        .enumerate()
    {
        for &ct in &CACHES {
            let geo = Geometry::new(BF16, ct, 2, 4, [64, 80, 33][k], [16, 32, 1][k]);
            let f = Features {
                sliding_window: Some(window),
                alibi: Some(alibi),
                score_window: Some(Some(ScoreWindow::PerSeq(vec![]))),
                ..Features::default()
            };
            for seed in 0..3u64 {
                let case = with_seqs(&geo, &f, &[(0, 90), (50, 40)], 41_000 + seed);
                assert!(case.sliding_window.is_some() == window && case.alibi.is_some() == alibi);
                check(&case);
            }
        }
    }
    require_tiles("window, alibi, scores", before);
}

/// Spans of more than one softmax step (more than 256 keys), and a chunked prefill whose past
/// is too long for the per-call packing (items then pack span by span from the cache).
#[test]
fn bf16_long_prefill_and_long_past_match_f64_reference() {
    let _g = lock();
    let before = tile_items();
    for &ct in &CACHES {
        let geo = Geometry::new(BF16, ct, 1, 2, 64, 32);
        let case = with_seqs(&geo, &Features::default(), &[(0, 600)], 42_000);
        check(&case);
        let f = Features {
            sliding_window: Some(false),
            score_window: Some(Some(ScoreWindow::PerSeq(vec![]))),
            ..Features::default()
        };
        let case = with_seqs(&geo, &f, &[(1500, 40)], 42_001);
        check(&case);
    }
    require_tiles("long prefill, long past", before);
}

/// Attention sinks on the tiles: prefill items end their rows with the sink (output and the
/// scores' statistics), with and without a window.
#[test]
fn bf16_prefill_with_sinks_matches_f64_reference() {
    let _g = lock();
    let before = tile_items();
    for (k, &ct) in CACHES.iter().enumerate() {
        let geo = Geometry::new(BF16, ct, 2, 4, 64, 32);
        let f = Features {
            sinks: Some(true),
            sliding_window: Some(k == 1),
            alibi: Some(false),
            score_window: Some(Some(ScoreWindow::PerSeq(vec![]))),
            ..Features::default()
        };
        let case = with_seqs(&geo, &f, &[(0, 90), (50, 40)], 47_000 + k as u64);
        assert!(case.sinks.is_some());
        check(&case);
    }
    require_tiles("sinks", before);
}

#[test]
fn bf16_mixed_batch_matches_f64_reference() {
    let _g = lock();
    let before = tile_items();
    for (k, &ct) in CACHES.iter().enumerate() {
        let geo = Geometry::new(BF16, ct, 2, 4, 128, 16);
        let case = with_seqs(
            &geo,
            &Features::default(),
            &[(300, 1), (0, 45), (17, 0), (64, 1), (40, 23), (5, 2)],
            43_000 + k as u64,
        );
        check(&case);
    }
    require_tiles("mixed batch", before);
}

#[test]
fn bf16_prefill_on_amx_gives_bit_identical_results_for_1_2_and_3_threads() {
    let _g = lock();
    let before = tile_items();
    let geo = Geometry::new(BF16, F16, 2, 4, 80, 32);
    let f = Features {
        alibi: Some(true),
        score_window: Some(Some(ScoreWindow::PerSeq(vec![]))),
        ..Features::default()
    };
    let case = with_seqs(&geo, &f, &[(0, 130), (12, 1), (33, 50)], 44_000);
    let call = case.to_call();
    let pool = |n| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build()
            .unwrap()
    };
    let one = pool(1).install(|| run_at(&call, SimdLevel::Amx));
    for n in [2, 3] {
        let many = pool(n).install(|| run_at(&call, SimdLevel::Amx));
        assert!(
            one.snapshot() == many.snapshot(),
            "1 and {n} threads differ on the AMX tier\n{}",
            case.describe()
        );
    }
    require_tiles("threads", before);
}

/// The precision rule on tiles: an f32 or f16 query is f32 math there too. With a bf16
/// cache its prefill items run on tiles, the query cut into bf16 parts (three for f32, two
/// for f16) and so are the softmax weights (three), so the products give f32 accuracy:
/// outputs within 2e-6 and scores within 1e-5 (relative to max(1, |ref|)) of float64, the
/// tolerances of `fast_vs_reference.rs`, for odd head sizes and a sharp softmax (scale 0.625:
/// exact in every query type, as the scale input has the query's type). On a CPU without AMX
/// the same calls run the FMA loops, checked at their bound for this sharp softmax (8e-6). Where AMX runs, the
/// items are counted. An f32 or f16 cache with such a query stays off the tiles (slower there).
#[test]
fn f32_and_f16_queries_with_a_bf16_cache_run_on_tiles_with_f32_accuracy() {
    let _g = lock();
    for (qt, ct) in [(F32, F32), (F32, F16), (F16, F16), (F16, F32)] {
        let geo = Geometry::new(qt, ct, 2, 8, 64, 16);
        let case = with_seqs(&geo, &Features::default(), &[(0, 80)], 45_900);
        let before = tile_items();
        run_at(&case.to_call(), SimdLevel::Amx);
        assert_eq!(tile_items(), before, "q={qt} c={ct} ran on tiles");
    }
    for (qt, ct) in [(F32, BF16), (F16, BF16)] {
        for (d, scale) in [(64, None), (40, None), (128, Some(0.625))] {
            let geo = Geometry::new(qt, ct, 2, 8, d, 16);
            let f = Features {
                scale: Some(scale),
                ..Features::default()
            };
            let case = with_seqs(&geo, &f, &[(0, 80), (20, 45)], 46_000 + d as u64);
            let exp = reference(&case);
            let before = tile_items();
            let got = run_at(&case.to_call(), SimdLevel::Amx);
            let out = got.outputs[0].data.to_f64();
            // Without AMX the items run on the FMA loops: plain f32 math, whose rounded logits
            // of this sharp softmax with ALiBi (|logit| in the tens) move the weights by a few
            // units of 2^-24 times the logit. Measured on d=128 (AMD EPYC, AVX2): the scalar
            // twin 5.1e-6, AVX2 5.9e-6 (AVX-512 on a Xeon: 4e-6), so 8e-6 there; the tiles,
            // whose products are exact, are held to 2e-6.
            let bound = if amx_present() { 2e-6 } else { 8e-6 };
            for (i, (&g, &e)) in out.iter().zip(&exp.output).enumerate() {
                let tol = bound * e.abs().max(1.0) + if qt == F16 { ulp16(e) } else { 0.0 };
                assert!(
                    (g - e).abs() <= tol,
                    "q={qt} c={ct} d={d}: output[{i}] = {g}, expected {e}\n{}",
                    case.describe()
                );
            }
            let sc = got.outputs[1].data.to_f64();
            for (j, (&g, &e)) in sc.iter().zip(&exp.scores).enumerate() {
                let tol = 1e-5 * e.abs().max(1.0) + if qt == F16 { ulp16(e) } else { 0.0 };
                assert!(
                    (g - e).abs() <= tol,
                    "q={qt} c={ct} d={d}: scores[{j}] = {g}, expected {e}\n{}",
                    case.describe()
                );
            }
            require_amx_tiles(&format!("f32 math q={qt} c={ct} d={d}"), before);
        }
    }
}

/// One unit in the last place of `x` as f16 (an f16 output is the f32 result rounded once).
fn ulp16(x: f64) -> f64 {
    2f64.powf(x.abs().max(6.1e-5).log2().floor() - 10.0)
}

/// `call` at `simd` in `precision`.
fn run_with(call: &Call, simd: SimdLevel, precision: Precision) -> Call {
    let mut c = call.clone();
    let opts = FastOptions {
        simd,
        precision,
        ..FastOptions::default()
    };
    c.with_api(|inputs, mut outputs| execute_with(opts, &mut inputs?, &mut outputs))
        .expect("valid call");
    c
}

/// The bf16 precision (the deployment's choice, `pa_precision`, OpenVINO's bf16 hint): an f32
/// or f16 query with any float cache, rounded to bf16 for the prefill items on a bf16 tier.
/// Held to the rule of a bf16 query: outputs within 1e-2 absolute and scores within 1e-2
/// relative to max(1, |score|) of the float64 reference fed the rounded query (and the cache's
/// values). With a bf16 cache and the other query-typed inputs bf16 values, the same call with
/// the query declared bf16 must give the same outputs and scores once rounded to bf16, bit for
/// bit (the precision runs the bf16 query's path), and the f32 precision must give other
/// outputs (the choice took effect).
#[test]
fn bf16_precision_rounds_an_f32_or_f16_query_for_every_float_cache() {
    let _g = lock();
    let mut worst = 0f64;
    let mut changed = false;
    for (k, (qt, ct, d, window, alibi)) in [
        (F32, BF16, 64, false, false),
        (F32, BF16, 128, true, true),
        (F32, BF16, 33, false, true),
        (F16, BF16, 128, false, false),
        (F16, BF16, 80, true, false),
        (F32, F32, 128, false, false),
        (F32, F16, 64, true, true),
        (F16, F16, 100, false, true),
        (F16, F32, 256, false, false),
    ]
    .into_iter()
    .enumerate()
    {
        let geo = Geometry::new(qt, ct, 2, 4, d, 16);
        let f = Features {
            // Exact in bf16, so the call with a bf16 query gets the same scale.
            scale: Some(Some(0.125)),
            sliding_window: Some(window),
            alibi: Some(alibi),
            score_window: Some(Some(ScoreWindow::Scalar(5))),
            ..Features::default()
        };
        let mut case = with_seqs(&geo, &f, &[(0, 90), (17, 40)], 47_000 + k as u64);
        // Keys, values and slopes as bf16 values: only the query differs from a bf16 call's.
        case.key = bf16_values(&case.key);
        case.value = bf16_values(&case.value);
        case.alibi = case.alibi.as_deref().map(bf16_values);
        let mut rounded = case.clone();
        rounded.query = bf16_values(&case.query);
        assert_ne!(rounded.query, case.query, "the query has bits below bf16");
        let exp = reference(&rounded);

        let before = tile_items();
        let got = run_with(&case.to_call(), SimdLevel::Amx, Precision::Bf16);
        require_tiles(&format!("bf16 precision q={qt} c={ct} d={d}"), before);
        worst = worst.max(within_bf16_rule(&got, &exp, &case));
        let out = got.outputs[0].data.to_f64();
        if !bf16_present() {
            continue;
        }
        // An f16 output rounded again to bf16 is not the f32 result rounded once: the bitwise
        // check is for f32 queries.
        if qt == F32 && ct == BF16 {
            bitwise_as_bf16_query(&got, &rounded, d);
        }
        let f32_math = run_with(&case.to_call(), SimdLevel::Amx, Precision::F32);
        // (A narrow window can leave every row a single key: its output is that value either
        // way, so the check is over all cases.)
        changed |= f32_math.outputs[0].data.to_f64() != out;
    }
    assert!(
        changed || !bf16_present(),
        "the bf16 precision changed no output: the f32 math ran"
    );
    eprintln!("WORST bf16 precision output error {worst:.3e}");
}

/// `got` (an f32 query rounded by the bf16 precision) rounded to bf16 equals, bit for bit, the
/// outputs and scores of the same call with the query declared bf16 (`rounded`'s values).
fn bitwise_as_bf16_query(got: &Call, rounded: &Case, d: usize) {
    let mut as_bf16 = rounded.clone();
    as_bf16.qt = BF16;
    let bq = run_with(&as_bf16.to_call(), SimdLevel::Amx, Precision::F32);
    for o in 0..2 {
        let a = bf16_values(&got.outputs[o].data.to_f64());
        let b = bq.outputs[o].data.to_f64();
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                x.to_bits() == y.to_bits(),
                "d={d}: output {o}[{i}] rounded to bf16 {x}, the bf16 query gave {y}"
            );
        }
    }
}

/// The bf16 precision changes nothing where it does not apply: a bf16 query (bf16 math in
/// either), the levels below `avx512bf16` (no bf16 products: f32, said once on stderr), and
/// decode-only calls (decode stays f32): bit-identical outputs and scores with it and without.
#[test]
fn bf16_precision_changes_nothing_elsewhere() {
    let _g = lock();
    for (k, (qt, ct, simd, seqs)) in [
        (BF16, BF16, SimdLevel::Amx, &[(0, 70), (9, 30)][..]),
        (BF16, F32, SimdLevel::Amx, &[(0, 70), (9, 30)][..]),
        (F32, BF16, SimdLevel::Avx512, &[(0, 70), (9, 30)][..]),
        (F32, F32, SimdLevel::Avx2, &[(0, 70), (9, 30)][..]),
        (F16, BF16, SimdLevel::Scalar, &[(0, 70), (9, 30)][..]),
        (F32, F32, SimdLevel::Amx, &[(70, 1), (9, 1), (200, 1)][..]),
        (F32, BF16, SimdLevel::Amx, &[(70, 1), (9, 1)][..]),
    ]
    .into_iter()
    .enumerate()
    {
        let geo = Geometry::new(qt, ct, 2, 4, 64, 16);
        let seed = 47_100 + k as u64;
        let case = with_seqs(&geo, &Features::default(), seqs, seed);
        let call = case.to_call();
        let on = run_with(&call, simd, Precision::Bf16);
        let off = run_with(&call, simd, Precision::F32);
        for o in 0..2 {
            let (a, b) = (on.outputs[o].data.to_f64(), off.outputs[o].data.to_f64());
            assert!(
                a.iter().zip(&b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "q={qt} c={ct} {simd:?} {seqs:?}: output {o} differs with the bf16 precision"
            );
        }
    }
}
