//! The scalar reference path over u8 caches (`kernel::reference::run_reference_u8`) against the float64
//! reference (tests/common/ref64.rs) run over the dequantized caches, on seeded random calls that
//! mix prefill, chunked prefill, decode and empty sequences, for every u8 layout variant.
//!
//! `run_reference_u8` is public only with the feature `test-hooks` (scripts/test.sh runs this
//! binary with it); without it this binary has no tests.
#![cfg(feature = "test-hooks")]

mod common;

use common::ref64::{gen_case, reference, Case, Features, Geometry};
use common::u8::{dequantized_case, u8_caches_with_past, LAYOUTS};
use paged_attention::kernel::quant::{self, KeyQuant, QuantLayout};
use paged_attention::{ElemType, Float};

fn typed<Q: Float>(v: &[f64]) -> Vec<Q> {
    v.iter().map(|&x| Q::from_f32(x as f32)).collect()
}

/// Runs one case on u8 caches with query type Q; returns (worst output error, worst score error,
/// worst output distance to float64 attention over the unquantized caches).
fn run_case<Q: Float>(c: &Case, l: &QuantLayout) -> (f64, f64, f64) {
    let plan = c.to_call().validate().expect("generated case validates");
    let (mut kc, mut vc) = u8_caches_with_past(c, l);
    let mut out = vec![Q::from_f32(f32::NAN); c.t() * c.h * c.d];
    let mut scores = vec![Q::from_f32(f32::NAN); c.scores_len()];
    paged_attention::kernel::reference::run_reference_u8(
        &plan,
        l,
        None,
        &typed::<Q>(&c.query),
        &typed::<Q>(&c.key),
        &typed::<Q>(&c.value),
        &c.block_indices,
        &mut kc,
        &mut vc,
        &mut out,
        &mut scores,
    )
    .expect("run_reference_u8");
    let want = reference(&dequantized_case(c, l, &kc, &vc));
    let exact = reference(c);
    let err = |got: &[Q], want: &[f64]| {
        assert_eq!(got.len(), want.len());
        got.iter()
            .zip(want)
            .map(|(g, w)| (g.to_f32() as f64 - w).abs() / (1.0 + w.abs()))
            .fold(0.0, f64::max)
    };
    (
        err(&out, &want.output),
        err(&scores, &want.scores),
        err(&out, &exact.output),
    )
}

fn features() -> Features {
    Features {
        rotation: Some(false),
        ..Features::default()
    }
}

fn check(qt: ElemType, tol: f64, seeds: std::ops::Range<u64>) {
    let mut worst_vs_exact: f64 = 0.0;
    for (key, value_group) in LAYOUTS {
        for (hkv, g, d) in [(2, 2, 64), (1, 4, 32), (2, 1, 128)] {
            if value_group > d {
                continue;
            }
            let geo = Geometry::new(qt, ElemType::F32, hkv, g, d, 32);
            let l = QuantLayout {
                hkv,
                d,
                dv: d,
                bs: 32,
                key,
                value_group,
                bits: 8,
            };
            for seed in seeds.clone() {
                let c = gen_case(seed, &geo, &features());
                let (o, s, e) = match qt {
                    ElemType::F32 => run_case::<f32>(&c, &l),
                    ElemType::BF16 => run_case::<half::bf16>(&c, &l),
                    _ => run_case::<half::f16>(&c, &l),
                };
                assert!(
                    o <= tol && s <= tol,
                    "{l:?} seed {seed}: output {o:e}, scores {s:e} > {tol:e}\n{}",
                    c.describe()
                );
                worst_vs_exact = worst_vs_exact.max(e);
            }
        }
    }
    // what quantization costs, for the record (not a bound of this test)
    println!(
        "{qt}: worst output distance to attention over unquantized caches: {worst_vs_exact:.3e}"
    );
}

#[test]
fn f32_query_matches_float64_over_dequantized_caches() {
    check(ElemType::F32, 2e-5, 0..12);
}

#[test]
fn bf16_query_matches_float64_over_dequantized_caches() {
    check(ElemType::BF16, 1e-2, 100..106);
}

#[test]
fn wrong_cache_size_is_an_error() {
    let geo = Geometry::new(ElemType::F32, ElemType::F32, 2, 2, 64, 32);
    let c = gen_case(3, &geo, &features());
    let plan = c.to_call().validate().unwrap();
    let l = QuantLayout {
        hkv: 2,
        d: 64,
        dv: 64,
        bs: 32,
        key: KeyQuant::ByChannel,
        value_group: 0,
        bits: 8,
    };
    let (mut kc, mut vc) = u8_caches_with_past(&c, &l);
    kc.pop();
    let mut out = vec![0f32; c.t() * c.h * c.d];
    let mut scores = vec![0f32; c.scores_len()];
    let q = typed::<f32>(&c.query);
    let err = paged_attention::kernel::reference::run_reference_u8(
        &plan,
        &l,
        None,
        &q,
        &q[..0],
        &q[..0],
        &c.block_indices,
        &mut kc,
        &mut vc,
        &mut out,
        &mut scores,
    )
    .unwrap_err();
    assert!(err.to_string().contains("key_cache"), "{err}");
}

/// Rotation inputs that do not fit the call (a block, a delta or a LUT width out of range, or
/// given without the plan's rotation) are an error from the public entry point, not a panic, and
/// leave the caches as they were.
#[test]
fn rotation_inputs_that_do_not_fit_are_an_error() {
    let geo = Geometry::new(ElemType::F32, ElemType::F32, 2, 2, 64, 32);
    let f = Features {
        rotation: Some(true),
        ..Features::default()
    };
    let c = gen_case(4, &geo, &f);
    let plan = c.to_call().validate().unwrap();
    let l = QuantLayout {
        hkv: 2,
        d: 64,
        dv: 64,
        bs: 32,
        key: KeyQuant::ByChannel,
        value_group: 0,
        bits: 8,
    };
    let (kc0, vc0) = u8_caches_with_past(&c, &l);
    let r = c.rotation.as_ref().unwrap();
    let cols = r.cols(c.bs);
    let lut: Vec<f32> = r.lut.iter().map(|&x| x as f32).collect();
    let q = typed::<f32>(&c.query);
    let (k, v) = (typed::<f32>(&c.key), typed::<f32>(&c.value));
    let run = |rot: Option<&quant::KeyRotation>, plan: &paged_attention::Plan| {
        let (mut kc, mut vc) = (kc0.clone(), vc0.clone());
        let mut out = vec![0f32; c.t() * c.h * c.d];
        let mut scores = vec![0f32; c.scores_len()];
        let res = paged_attention::kernel::reference::run_reference_u8(
            plan,
            &l,
            rot,
            &q,
            &k,
            &v,
            &c.block_indices,
            &mut kc,
            &mut vc,
            &mut out,
            &mut scores,
        );
        (res, kc == kc0 && vc == vc0)
    };
    let mut bad_block = r.blocks.clone();
    bad_block[0] = c.nb as i32;
    let mut bad_delta = r.deltas.clone();
    bad_delta[0] = r.m as i32;
    let good = quant::KeyRotation {
        blocks: &r.blocks,
        deltas: &r.deltas,
        delta_cols: cols,
        lut: &lut,
    };
    let cases = [
        quant::KeyRotation {
            blocks: &bad_block,
            ..good
        },
        quant::KeyRotation {
            deltas: &bad_delta,
            ..good
        },
        quant::KeyRotation {
            lut: &lut[..lut.len() - 1],
            ..good
        },
    ];
    for rot in &cases {
        let (res, unchanged) = run(Some(rot), &plan);
        let err = res.expect_err("rotation inputs that do not fit");
        assert!(err.to_string().contains("rotation"), "{err}");
        assert!(unchanged, "a refused call wrote the caches");
    }
    let mut no_rot = c.clone();
    no_rot.rotation = None;
    let (res, _) = run(Some(&good), &no_rot.to_call().validate().unwrap());
    assert!(res.is_err(), "rotation inputs the plan does not have");
    let (res, unchanged) = run(Some(&good), &plan);
    res.expect("the call's own rotation inputs");
    assert!(!unchanged, "the call wrote its tokens and rotated keys");
}
