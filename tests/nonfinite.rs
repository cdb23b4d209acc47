//! Non-finite inputs (docs/contract.md, "Non-finite values"): every path (the reference, and
//! the fast kernels on each SIMD level the CPU has, AMX included for a bf16 query, with scores
//! stashed and recomputed) against the float64 reference of `common/ref64.rs`, on decode,
//! multi-token decode, prefill and mixed calls:
//! - logits that overflow f32 (scale 3e38): the overflowing keys share the weight;
//! - an Inf or NaN in a masked row (a future token's key/value, a cached key/value outside
//!   the window) changes no output of the rows it is masked for: they equal the same call with
//!   finite values there;
//! - a NaN query row gives NaN for that row (output and its score contributions) only;
//! - a `-inf` query (whole row, or one element) follows from its logits.
//!
//! Comparison: where the reference is NaN or +-inf the path must give the same class (NaN, or
//! the same infinity); elsewhere the tolerances of `tests/reference.rs` (2e-6 absolute for an
//! f32 query, 1e-2 for bf16; scores relative to max(1, |score|)).

mod common;

use common::call::{round_to, Call};
use common::ref64::{gen_case, reference, Case, Features, Geometry, Rng, ScoreWindow, SeqKind};
use paged_attention::kernel::fast::{ScoresMode, SimdLevel};
use paged_attention::ElemType::{self, BF16, F32};
use std::sync::Mutex;

/// Tests hold one lock, so the process-wide AMX item counter measures one test at a time.
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

#[derive(Clone, Copy, Debug)]
enum Path {
    Reference,
    Fast(SimdLevel, ScoresMode),
}

/// The reference, then every level the CPU has with both ways of computing scores.
fn paths() -> Vec<Path> {
    let mut v = vec![Path::Reference];
    for l in SimdLevel::ALL {
        if l.effective() == l {
            for s in [ScoresMode::Auto, ScoresMode::Recompute] {
                v.push(Path::Fast(l, s));
            }
        }
    }
    v
}

/// Outputs and scores of `case` on `path`.
fn run(case: &Case, path: Path) -> (Vec<f64>, Vec<f64>) {
    let mut c: Call = case.to_call();
    match path {
        Path::Reference => c.run(common::call::Runner::Reference),
        Path::Fast(simd, scores) => c.run_fast(simd, scores),
    }
    .expect("valid call");
    (c.outputs[0].data.to_f64(), c.outputs[1].data.to_f64())
}

fn tol(case: &Case) -> f64 {
    if case.qt == F32 {
        2e-6
    } else {
        1e-2
    }
}

/// `got` agrees with `want`: same non-finite class where `want` is non-finite, else within
/// `tol` (relative to max(1, |want|) when `rel`).
fn agree(got: f64, want: f64, tol: f64, rel: bool) -> bool {
    if want.is_nan() {
        got.is_nan()
    } else if want.is_infinite() {
        got == want
    } else {
        let scale = if rel { want.abs().max(1.0) } else { 1.0 };
        got.is_finite() && (got - want).abs() <= tol * scale
    }
}

/// Checks every path against the float64 reference; returns the paths' outputs.
fn check(case: &Case, what: &str) -> Vec<(Path, Vec<f64>)> {
    let exp = reference(case);
    let tol = tol(case);
    let row = case.h * case.d;
    let mut outs = Vec::new();
    for path in paths() {
        let (out, sc) = run(case, path);
        for (i, (&g, &e)) in out.iter().zip(&exp.output).enumerate() {
            assert!(
                agree(g, e, tol, false),
                "{what}, {path:?}: output[{}, {}] = {g}, expected {e}\n{}",
                i / row,
                i % row,
                case.describe()
            );
        }
        for (j, (&g, &e)) in sc.iter().zip(&exp.scores).enumerate() {
            assert!(
                agree(g, e, tol, true),
                "{what}, {path:?}: scores[{j}] = {g}, expected {e}\n{}",
                case.describe()
            );
        }
        outs.push((path, out));
    }
    outs
}

/// Checks `bad` (a copy of `good` with non-finite values in rows masked for every row of
/// `unaffected`, a set of output rows `(token, head)`) against the reference, and that those
/// rows equal the same path's output on `good` (within the tolerance: paths may take a
/// different route around a non-finite value).
fn check_unaffected(good: &Case, bad: &Case, unaffected: &[(usize, usize)], what: &str) {
    let base = check(good, &format!("{what} (finite twin)"));
    let got = check(bad, what);
    let (d, tol) = (good.d, tol(good));
    for ((path, a), (_, b)) in base.iter().zip(&got) {
        for &(tok, head) in unaffected {
            let o = (tok * good.h + head) * d;
            for x in 0..d {
                assert!(
                    b[o + x].is_finite() && (a[o + x] - b[o + x]).abs() <= tol,
                    "{what}, {path:?}: token {tok} head {head} [{x}] = {}, finite twin {}\n{}",
                    b[o + x],
                    a[o + x],
                    bad.describe()
                );
            }
        }
    }
}

/// A seeded case of `kinds`; `long` makes prefill sequences long enough for several query
/// tiles (prefill items), else new-token runs stay short (decode items with several tokens).
fn case(seed: u64, qt: ElemType, ct: ElemType, kinds: &[SeqKind], long: bool) -> Case {
    let mut geo = Geometry::new(qt, ct, 2, 2, 32, 16);
    geo.max_new = if long { 70 } else { 6 };
    geo.max_past = 40;
    let f = Features {
        rotation: Some(false),
        alibi: Some(seed.is_multiple_of(3)),
        sliding_window: Some(false),
        scale: Some(Some(round_to(qt, 0.25))),
        score_window: Some(Some(ScoreWindow::Scalar(-1))),
        seqs: Some(kinds.to_vec()),
        nan_garbage: Some(false),
        ..Features::default()
    };
    let mut c = gen_case(seed, &geo, &f);
    // Queries in [-1, 1] (the generator may pick 3): logits stay within the few units where
    // f32 rounding keeps outputs within the f32 tolerance over contexts of 100 keys.
    let mut rng = Rng::new(seed);
    for q in c.query.iter_mut() {
        *q = round_to(qt, rng.uniform(-1.0, 1.0));
    }
    c
}

/// Query/cache type pairs: f32 query on every tier; bf16 query (AMX prefill items).
const TYPES: [(ElemType, ElemType); 3] = [(F32, F32), (F32, BF16), (BF16, BF16)];

/// Call shapes: decode, decode of several new tokens, prefill, mixed.
fn shapes() -> Vec<(&'static str, Vec<SeqKind>, bool)> {
    use SeqKind::*;
    vec![
        ("decode", vec![Decode, Decode], false),
        (
            "multi-token decode",
            vec![ChunkedPrefill, ChunkedPrefill],
            false,
        ),
        ("prefill", vec![Prefill], true),
        ("chunked prefill", vec![ChunkedPrefill], true),
        ("mixed", vec![Prefill, Decode, ChunkedPrefill, Decode], true),
    ]
}

/// First token index of each sequence.
fn begins(c: &Case) -> Vec<usize> {
    let mut v = vec![0];
    for s in &c.seqs {
        v.push(v.last().unwrap() + s.n);
    }
    v
}

/// Requires that bf16 products (AMX tiles, or `vdpbf16ps`) ran since `before` when the CPU has
/// them and the cases had a bf16 query with prefill items (with the feature `test-hooks`,
/// which counts them).
fn require_tiles(before: Option<u64>, bf16_prefill: bool) {
    if bf16_prefill && SimdLevel::detected() >= SimdLevel::Avx512Bf16 {
        if let (Some(before), Some(now)) = (before, tile_items()) {
            assert!(now > before, "no prefill item ran on bf16 products");
        }
    }
}

#[test]
fn overflowing_logits_share_the_weight_among_the_overflowing_keys() {
    let _g = lock();
    let before = tile_items();
    for (qt, ct) in TYPES {
        for (i, (name, kinds, long)) in shapes().into_iter().enumerate() {
            let mut c = case(100 + i as u64, qt, ct, &kinds, long);
            c.alibi = None;
            c.scale = Some(round_to(qt, 3e38));
            check(&c, &format!("{name}, scale 3e38"));
        }
    }
    require_tiles(before, true);
}

/// Each sequence with at least two new tokens: a future token's value (or key) row gets
/// `bad` at element 3; every earlier token of that sequence, and every other sequence, must
/// not change.
#[test]
fn a_non_finite_future_row_does_not_reach_earlier_tokens() {
    let _g = lock();
    let before = tile_items();
    for (qt, ct) in TYPES {
        for (i, (name, kinds, long)) in shapes().into_iter().enumerate() {
            for (k, (bad, in_key)) in [
                (f64::INFINITY, false),
                (f64::NAN, false),
                (f64::NEG_INFINITY, true),
                (f64::NAN, true),
            ]
            .into_iter()
            .enumerate()
            {
                let good = case(200 + (i * 4 + k) as u64, qt, ct, &kinds, long);
                let b = begins(&good);
                let mut c = good.clone();
                let mut unaffected = Vec::new();
                for (s, sq) in good.seqs.iter().enumerate() {
                    if sq.n < 2 {
                        continue;
                    }
                    // A token past the first: the middle one.
                    let i0 = sq.n / 2;
                    let tok = b[s] + i0;
                    let row = (tok * c.hkv + (s % c.hkv)) * c.d + 3;
                    if in_key {
                        c.key[row] = bad;
                    } else {
                        c.value[row] = bad;
                    }
                    for t in b[s]..tok {
                        unaffected.extend((0..c.h).map(|h| (t, h)));
                    }
                }
                for (s, sq) in good.seqs.iter().enumerate() {
                    if sq.n < 2 {
                        for t in b[s]..b[s] + sq.n {
                            unaffected.extend((0..c.h).map(|h| (t, h)));
                        }
                    }
                }
                let what = format!("{name}, {qt:?}/{ct:?}, {bad} in a future {}", {
                    if in_key {
                        "key"
                    } else {
                        "value"
                    }
                });
                check_unaffected(&good, &c, &unaffected, &what);
            }
        }
    }
    require_tiles(before, true);
}

/// A sliding window that the first new token of each sequence sees one cached row through
/// and the later ones do not: that row's key or value gets `bad`.
#[test]
fn a_non_finite_row_outside_the_window_does_not_reach_the_tokens_it_is_masked_for() {
    let _g = lock();
    let before = tile_items();
    for (qt, ct) in TYPES {
        for (i, (name, kinds, long)) in shapes().into_iter().enumerate() {
            if name == "decode" || name == "prefill" {
                continue; // one new token per sequence, or no cached row
            }
            for (k, (bad, in_key)) in [
                (f64::INFINITY, false),
                (f64::NAN, false),
                (f64::INFINITY, true),
                (f64::NAN, true),
            ]
            .into_iter()
            .enumerate()
            {
                let mut good = case(300 + (i * 4 + k) as u64, qt, ct, &kinds, long);
                let b = begins(&good);
                // Window w: token 0 of a sequence (position past) sees past - w + 1, token 1
                // does not. The smallest past with two new tokens sets it.
                let past = good
                    .seqs
                    .iter()
                    .filter(|s| s.n >= 2 && s.past >= 1)
                    .map(|s| s.past)
                    .min()
                    .expect("a sequence with a past and two new tokens");
                let w = past.min(9);
                good.sliding_window = Some(w as i32);
                let mut c = good.clone();
                let mut unaffected = Vec::new();
                for (s, sq) in good.seqs.iter().enumerate() {
                    if sq.n >= 2 && sq.past + 1 >= w {
                        let j = sq.past + 1 - w;
                        let blk = c.block_of(s, j);
                        for kh in 0..c.hkv {
                            let r = c.row(blk, kh, j % c.bs) + 5;
                            if in_key {
                                c.key_cache[r] = bad;
                            } else {
                                c.value_cache[r] = bad;
                            }
                        }
                        for t in b[s] + 1..b[s] + sq.n {
                            unaffected.extend((0..c.h).map(|h| (t, h)));
                        }
                    }
                }
                let what = format!(
                    "{name}, {qt:?}/{ct:?}, window {w}, {bad} in an out-of-window {}",
                    if in_key { "key" } else { "value" }
                );
                check_unaffected(&good, &c, &unaffected, &what);
            }
        }
    }
    require_tiles(before, true);
}

/// One NaN element in one query row per sequence (its last token, a score row): that row's
/// output and its score contributions are NaN, every other row equals the finite call.
#[test]
fn a_nan_query_row_gives_nan_for_that_row_only() {
    let _g = lock();
    let before = tile_items();
    for (qt, ct) in TYPES {
        for (i, (name, kinds, long)) in shapes().into_iter().enumerate() {
            let good = case(400 + i as u64, qt, ct, &kinds, long);
            let b = begins(&good);
            let mut c = good.clone();
            let mut unaffected = Vec::new();
            for (s, sq) in good.seqs.iter().enumerate() {
                if sq.n == 0 {
                    continue;
                }
                let (tok, head) = (b[s] + sq.n - 1, (s + 1) % c.h);
                c.query[(tok * c.h + head) * c.d + 7] = f64::NAN;
                for t in b[s]..b[s] + sq.n {
                    unaffected.extend((0..c.h).filter(|&h| (t, h) != (tok, head)).map(|h| (t, h)));
                }
            }
            let what = format!("{name}, {qt:?}/{ct:?}, NaN query");
            check_unaffected(&good, &c, &unaffected, &what);
            // The NaN rows really are NaN (the reference says so; a guard on the test itself).
            let exp = reference(&c);
            for (s, sq) in good.seqs.iter().enumerate() {
                if sq.n > 0 {
                    let (tok, head) = (b[s] + sq.n - 1, (s + 1) % c.h);
                    assert!(exp.output[(tok * c.h + head) * c.d].is_nan());
                }
            }
        }
    }
    require_tiles(before, true);
}

/// A query row of `-inf` (every logit NaN or -inf: no distribution, NaN), and a query row
/// with one `-inf` element (logits of +-inf: the +inf keys share the weight, -inf keys get 0).
#[test]
fn a_minus_inf_query_follows_from_its_logits() {
    let _g = lock();
    let before = tile_items();
    for (qt, ct) in TYPES {
        for (i, (name, kinds, long)) in shapes().into_iter().enumerate() {
            for whole in [true, false] {
                let mut c = case(500 + i as u64, qt, ct, &kinds, long);
                let b = begins(&c);
                for (s, sq) in c.seqs.clone().iter().enumerate() {
                    if sq.n == 0 {
                        continue;
                    }
                    let o = ((b[s] + sq.n - 1) * c.h + s % c.h) * c.d;
                    if whole {
                        c.query[o..o + c.d].fill(f64::NEG_INFINITY);
                    } else {
                        c.query[o + 2] = f64::NEG_INFINITY;
                    }
                }
                let what = format!("{name}, {qt:?}/{ct:?}, -inf query (whole row: {whole})");
                check(&c, &what);
            }
        }
    }
    require_tiles(before, true);
}
