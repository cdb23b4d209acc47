//! u8 caches with non-finite and extreme inputs (docs/contract.md, "Non-finite values"): the
//! fast u8 kernels on every SIMD level the CPU has, with scores stashed and recomputed, against
//! their twin `execute_reference` (the reference kernel over the dequantized caches) on the same
//! call; and the two calls that once went wrong, against float caches too.
//!
//! A property run over seeded random u8 calls (every key/value layout, decode, prefill, mixed,
//! long decodes cut into key chunks, windows down to 1, ALiBi, sinks) each with one of:
//! - NaN query elements or rows: NaN for those rows (output, and their score contributions to
//!   the keys they see) and nothing else: a masked key gets no NaN from a row that cannot see it;
//! - `+-inf` query elements: logits of `+-inf` (or NaN where a key element is 0), as the
//!   dequantized keys give them (the by-channel fold `sum q s q8 - sum q s zp` alone would turn
//!   them into `inf - inf`);
//! - `+inf`, huge or NaN ALiBi slopes, and sinks of `+-inf`, NaN or 1e38;
//! - a scale of 1e38 to 3e38 (logits overflow and are capped: the overflowing keys share the
//!   weight). Which near-threshold logits overflow depends on the last bits of each path's dot
//!   products, so these calls are held to the class of each value (finite, NaN, same infinity)
//!   only; the others to 2e-5 as well (relative to 1 + |value|, as tests/u8_op.rs).

mod common;

use common::call::{Call, Runner};
use common::ref64::{gen_case, Case, Features, Geometry, Rng, ScoreWindow, SeqKind};
use common::u8::{layout_for, u8_call, LAYOUTS};
use paged_attention::kernel::fast::{ScoresMode, SimdLevel};
use paged_attention::ElemType::F32;

/// Outputs and scores of `call` through the fast kernels at `simd`, scores computed `scores`.
fn fast(call: &Call, simd: SimdLevel, scores: ScoresMode) -> (Vec<f64>, Vec<f64>) {
    let mut c = call.clone();
    c.run_fast(simd, scores).expect("valid u8 call");
    (c.outputs[0].data.to_f64(), c.outputs[1].data.to_f64())
}

fn twin(call: &Call) -> (Vec<f64>, Vec<f64>) {
    let mut c = call.clone();
    c.run(Runner::Reference).expect("valid u8 call");
    (c.outputs[0].data.to_f64(), c.outputs[1].data.to_f64())
}

fn levels() -> Vec<SimdLevel> {
    let v: Vec<SimdLevel> = SimdLevel::ALL
        .into_iter()
        .filter(|l| l.effective() == *l)
        .collect();
    static PRINTED: std::sync::Once = std::sync::Once::new();
    PRINTED.call_once(|| {
        let names: Vec<&str> = v.iter().map(|l| l.name()).collect();
        eprintln!("tiers exercised on u8 caches: {}", names.join(" "));
    });
    v
}

/// `got` agrees with `want`: the same class (NaN, the same infinity, finite), and when `tol`
/// is given, finite values within `tol * (1 + |want|)`.
fn agree(got: f64, want: f64, tol: Option<f64>) -> bool {
    if want.is_nan() {
        got.is_nan()
    } else if want.is_infinite() {
        got == want
    } else {
        got.is_finite() && tol.is_none_or(|t| (got - want).abs() <= t * (1.0 + want.abs()))
    }
}

/// Every tier and scores mode against the twin on `call`.
fn check(call: &Call, tol: Option<f64>, what: &str) {
    let (want_o, want_s) = twin(call);
    for simd in levels() {
        for mode in [ScoresMode::Auto, ScoresMode::Recompute] {
            let (o, s) = fast(call, simd, mode);
            for (i, (&g, &w)) in o.iter().zip(&want_o).enumerate() {
                assert!(
                    agree(g, w, tol),
                    "{what}, {simd:?} {mode:?}: output[{i}] = {g}, twin {w}"
                );
            }
            for (j, (&g, &w)) in s.iter().zip(&want_s).enumerate() {
                assert!(
                    agree(g, w, tol),
                    "{what}, {simd:?} {mode:?}: scores[{j}] = {g}, twin {w}"
                );
            }
        }
    }
}

/// The call of the issue: one sequence, past 0, 2 new tokens, window 1, head size 2, block
/// size 2, NaN in the last query row (the scored one). Key 0 is outside that row's window, so
/// its score is 0; the row's own key gets NaN.
#[test]
fn a_nan_row_does_not_reach_a_key_outside_its_window() {
    let geo = Geometry::new(F32, F32, 1, 1, 2, 2);
    let f = Features {
        seqs: Some(vec![SeqKind::Prefill]),
        rotation: Some(false),
        alibi: Some(false),
        sliding_window: Some(false),
        score_window: Some(None),
        ..Features::default()
    };
    let mut case = common::ref64::with_seqs(&geo, &f, &[(0, 2)], 1);
    case.sliding_window = Some(1);
    let d = case.d;
    for x in 0..d {
        case.query[d + x] = f64::NAN;
    }
    for (key, vg) in LAYOUTS {
        if vg > d {
            continue;
        }
        let l = layout_for(&case, key, vg);
        let call = u8_call(&case, &l);
        let (_, s) = twin(&call);
        assert!(s[0] == 0.0 && s[1].is_nan(), "twin scores {s:?}");
        check(&call, Some(2e-5), &format!("{l:?}"));
        // Float caches say the same.
        let mut fc = case.to_call();
        fc.run(Runner::Execute).unwrap();
        let fs = fc.outputs[1].data.to_f64();
        assert!(fs[0] == 0.0 && fs[1].is_nan(), "float caches: {fs:?}");
    }
}

/// The other call of the issue: decode over 7 cached tokens with scale 3e38 (every input
/// finite). Logits overflow and are capped; nothing is NaN, as with float caches.
#[test]
fn an_overflowing_scale_gives_finite_outputs_as_float_caches_do() {
    let geo = Geometry::new(F32, F32, 2, 2, 16, 16);
    let f = Features {
        rotation: Some(false),
        alibi: Some(false),
        sliding_window: Some(false),
        score_window: Some(None),
        ..Features::default()
    };
    for scale in [1e38, 3e38] {
        let mut case = common::ref64::with_seqs(&geo, &f, &[(7, 1)], 2);
        case.scale = Some(scale);
        let mut fc = case.to_call();
        fc.run(Runner::Execute).unwrap();
        assert!(fc.outputs[0].data.to_f64().iter().all(|x| x.is_finite()));
        for (key, vg) in LAYOUTS {
            if vg > case.d {
                continue;
            }
            let l = layout_for(&case, key, vg);
            let call = u8_call(&case, &l);
            let (o, s) = twin(&call);
            assert!(
                o.iter().chain(&s).all(|x| x.is_finite()),
                "twin {o:?} {s:?}"
            );
            check(&call, None, &format!("scale {scale:e} {l:?}"));
        }
    }
}

/// What a property case puts in.
#[derive(Clone, Copy, Debug)]
enum Poison {
    NanQueryElement,
    NanQueryRow,
    InfQueryElement,
    AlibiInf,
    AlibiHuge,
    Sinks,
    HugeScale,
}

const POISONS: [Poison; 7] = [
    Poison::NanQueryElement,
    Poison::NanQueryRow,
    Poison::InfQueryElement,
    Poison::AlibiInf,
    Poison::AlibiHuge,
    Poison::Sinks,
    Poison::HugeScale,
];

fn poisoned(seed: u64, p: Poison) -> Case {
    let mut rng = Rng::new(seed ^ 0x5eed);
    let d = rng.pick(&[2, 8, 16, 32]);
    let (hkv, g) = (rng.range(1, 2), rng.pick(&[1, 2, 4]));
    let mut geo = Geometry::new(F32, F32, hkv, g, d, rng.pick(&[2, 16, 32]));
    let long = rng.chance(0.2);
    geo.max_past = if long { 2500 } else { 60 };
    geo.max_new = 24;
    let kinds = if long {
        vec![SeqKind::Decode; rng.range(1, 2)]
    } else {
        (0..rng.range(1, 3))
            .map(|_| rng.pick(&[SeqKind::Prefill, SeqKind::ChunkedPrefill, SeqKind::Decode]))
            .collect()
    };
    let f = Features {
        seqs: Some(kinds),
        rotation: Some(false),
        sinks: Some(rng.chance(0.3)),
        score_window: Some(Some(ScoreWindow::Scalar(rng.pick(&[-1, 1, 3])))),
        ..Features::default()
    };
    let mut case = gen_case(seed, &geo, &f);
    if rng.chance(0.5) {
        case.sliding_window = Some(rng.range(1, 7) as i32);
    }
    let (t, h) = (case.t(), case.h);
    match p {
        Poison::NanQueryElement | Poison::NanQueryRow if t > 0 => {
            for _ in 0..rng.range(1, 2) {
                let row = rng.range(0, t * h - 1);
                if matches!(p, Poison::NanQueryRow) {
                    case.query[row * d..(row + 1) * d].fill(f64::NAN);
                } else {
                    case.query[row * d + rng.range(0, d - 1)] = f64::NAN;
                }
            }
        }
        Poison::InfQueryElement if t > 0 => {
            for _ in 0..rng.range(1, 2) {
                let row = rng.range(0, t * h - 1);
                let inf = rng.pick(&[f64::INFINITY, f64::NEG_INFINITY]);
                case.query[row * d + rng.range(0, d - 1)] = inf;
            }
        }
        Poison::AlibiInf | Poison::AlibiHuge => {
            let mut a: Vec<f64> = (0..h).map(|_| rng.uniform(0.0, 0.5)).collect();
            a[rng.range(0, h - 1)] = match p {
                Poison::AlibiInf => f64::INFINITY,
                _ => 1e37,
            };
            case.alibi = Some(a);
        }
        Poison::Sinks => {
            let pick = [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, 1e38, -1e38, 2.0];
            case.sinks = Some((0..h).map(|_| rng.pick(&pick)).collect());
        }
        Poison::HugeScale => case.scale = Some(rng.pick(&[1e38, 2e38, 3e38])),
        _ => {}
    }
    case
}

/// The property run: 280 seeded cases, each on every layout that fits its head size.
#[test]
fn fast_u8_kernels_agree_with_their_twin_on_non_finite_and_extreme_inputs() {
    for seed in 0..280u64 {
        let p = POISONS[seed as usize % POISONS.len()];
        let case = poisoned(seed, p);
        for (key, vg) in LAYOUTS {
            if vg > case.d {
                continue;
            }
            let l = layout_for(&case, key, vg);
            let call = u8_call(&case, &l);
            let tol = (!matches!(p, Poison::HugeScale | Poison::AlibiHuge)).then_some(2e-5);
            check(
                &call,
                tol,
                &format!("seed {seed} {p:?} {l:?}\n{}", case.describe()),
            );
        }
    }
}
