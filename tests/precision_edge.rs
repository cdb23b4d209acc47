//! The precision choice at the C ABI's edge (`ffi::env`, `docs/contract.md` "Precision"): a
//! bf16 precision the process cannot run (here `PA_SIMD=avx512`, below the bf16 tiers) computes
//! in f32, bit for bit the f32 precision's result, and says so once on stderr however many
//! calls ask; `PA_BF16_QUERY=0` overrides a bf16 choice with f32. Each case runs in a child
//! process of this binary (the variables are read once per process).

mod common;

use common::ref64::{with_seqs, Features, Geometry};
use paged_attention::kernel::fast::{execute_with, Precision};
use paged_attention::{ElemType, Runner};
use std::process::Command;

const CHILD_ENV: &str = "PA_PRECISION_EDGE_CHILD";
const SAID: &str = "bf16 inference precision asked";

/// A prefill on a bf16 cache run three times in the bf16 precision through the edge's options
/// and once in f32: all four outputs and scores must be the same bits.
fn child_body() {
    let geo = Geometry::new(ElemType::F32, ElemType::BF16, 2, 4, 64, 16);
    let case = with_seqs(&geo, &Features::default(), &[(0, 90), (20, 40)], 38_000);
    let run = |p: Precision| {
        let mut c = case.to_call();
        let opts = paged_attention::ffi::env::fast_options(Runner::Auto, p);
        c.with_api(|i, mut o| execute_with(opts, &mut i?, &mut o))
            .expect("valid call");
        c.snapshot()
    };
    let f32_run = run(Precision::F32);
    for _ in 0..3 {
        assert!(
            run(Precision::Bf16) == f32_run,
            "bf16 precision did not fall back to f32"
        );
    }
}

/// Runs the child with `env` set and returns its stderr.
fn child(name: &str, env: &[(&str, &str)]) -> String {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", name, "--test-threads=1", "--nocapture"])
        .env(CHILD_ENV, name)
        .envs(env.iter().copied())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{name}: child failed\n{err}");
    err
}

#[test]
fn bf16_without_bf16_products_falls_back_to_f32_and_says_so_once() {
    if std::env::var(CHILD_ENV).is_ok() {
        return child_body();
    }
    let err = child(
        "bf16_without_bf16_products_falls_back_to_f32_and_says_so_once",
        &[("PA_SIMD", "avx512")],
    );
    assert_eq!(err.matches(SAID).count(), 1, "stderr:\n{err}");
}

#[test]
fn bf16_query_0_overrides_a_bf16_choice_silently() {
    if std::env::var(CHILD_ENV).is_ok() {
        return child_body();
    }
    let err = child(
        "bf16_query_0_overrides_a_bf16_choice_silently",
        &[("PA_BF16_QUERY", "0")],
    );
    assert_eq!(err.matches(SAID).count(), 0, "stderr:\n{err}");
}
