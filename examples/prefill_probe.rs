//! Quick A/B probe of prefill (not the benchmark of record, which is tools/bench.py): one
//! sequence of 1024 new tokens, H=32, Hkv=8, D=128, block 32, `f32`/`f16`/`bf16` cache (first
//! argument, default bf16), min ms over `reps` (second, default 20), `bf16`/`f32` query (third,
//! default bf16). The tier is the process's (`PA_SIMD` caps it), the threads the library
//! pool's (`PA_NUM_THREADS`):
//! `PA_NUM_THREADS=2 PA_SIMD=avx2 target/release/examples/prefill_probe bf16 20 f32`.
//! The count of prefill items run on AMX tiles is printed when built with `--features
//! test-hooks` (which adds a counter increment per item: time the default build).

use half::{bf16, f16};
use paged_attention::{execute, Float, PaInputs, PaOutputs, Tensor, TensorMut};
use std::time::Instant;
#[path = "common/mod.rs"]
mod common;
use common::noise;

const H: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const BS: usize = 32;
const T: usize = 1024;

/// CPU time (user + system) of the whole process so far, in ms.
fn cpu_ms() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let ru = unsafe {
        let mut ru: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut ru);
        ru
    };
    let tv = |t: libc::timeval| t.tv_sec as f64 * 1e3 + t.tv_usec as f64 / 1e3;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

/// Min wall ms and mean CPU ms per call (CPU time is what other processes' load disturbs
/// least; with more than one thread it includes the pool's idle spinning).
fn bench<Q: Float, C: Float>(reps: usize) -> (f64, f64)
where
    for<'a> paged_attention::ElemsMut<'a>: From<&'a mut Vec<C>> + From<&'a mut Vec<Q>>,
    for<'a> paged_attention::Elems<'a>: From<&'a Vec<Q>>,
{
    let nb = T.div_ceil(BS);
    let bi: Vec<i32> = (0..nb).map(|i| ((i * 7919) % nb) as i32).collect();
    let (q, k, v) = (
        noise::<Q>(T * H * D, 1),
        noise::<Q>(T * HKV * D, 2),
        noise::<Q>(T * HKV * D, 3),
    );
    let mut kc: Vec<C> = vec![C::from_f32(0.0); nb * HKV * BS * D];
    let mut vc = kc.clone();
    let mut out = vec![Q::from_f32(0.0); T * H * D];
    let mut scores = vec![Q::from_f32(0.0); T];
    let (past, begins, bib) = ([0i32], [0i32, T as i32], [0i32, nb as i32]);
    let mut best = f64::INFINITY;
    let mut cpu = 0.0;
    for _ in 0..reps {
        let mut inputs = PaInputs {
            query: Tensor::new(&[T, H * D], &q),
            key: Tensor::new(&[T, HKV * D], &k),
            value: Tensor::new(&[T, HKV * D], &v),
            key_cache: TensorMut::new(&[nb, HKV, BS, D], &mut kc),
            value_cache: TensorMut::new(&[nb, HKV, BS, D], &mut vc),
            past_lens: Tensor::new(&[1], &past[..]),
            subsequence_begins: Tensor::new(&[2], &begins[..]),
            block_indices: Tensor::new(&[nb], &bi),
            block_indices_begins: Tensor::new(&[2], &bib[..]),
            scale: None,
            sliding_window: None,
            alibi_slopes: None,
            rotated_block_indices: None,
            rotation_deltas: None,
            rotation_trig_lut: None,
            score_aggregation_window: None,
            sinks: None,
        };
        let mut outputs = PaOutputs {
            output: TensorMut::new(&[T, H * D], &mut out),
            scores: TensorMut::new(&[T], &mut scores),
        };
        let (t0, c0) = (Instant::now(), cpu_ms());
        execute(&mut inputs, &mut outputs).expect("valid call");
        best = best.min(t0.elapsed().as_secs_f64() * 1e3);
        cpu += cpu_ms() - c0;
    }
    (best, cpu / reps as f64)
}

/// AMX prefill items run so far (feature `test-hooks` only).
fn amx_items() -> Option<u64> {
    #[cfg(feature = "test-hooks")]
    return Some(paged_attention::kernel::fast::amx_items_run());
    #[cfg(not(feature = "test-hooks"))]
    None
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let cache = args.get(1).map(String::as_str).unwrap_or("bf16");
    let reps = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(20);
    let query = args.get(3).map(String::as_str).unwrap_or("bf16");
    let before = amx_items();
    let (ms, cpu) = match (query, cache) {
        ("f32", "f32") => bench::<f32, f32>(reps),
        ("f32", "f16") => bench::<f32, f16>(reps),
        ("f32", _) => bench::<f32, bf16>(reps),
        (_, "f32") => bench::<bf16, f32>(reps),
        (_, "f16") => bench::<bf16, f16>(reps),
        _ => bench::<bf16, bf16>(reps),
    };
    println!(
        "prefill 1x{T} H={H} Hkv={HKV} D={D} BS={BS} q={query} c={cache}: {ms:.2} ms (min of {reps}), CPU {cpu:.2} ms/call, tier {:?}, PA_NUM_THREADS={}, AMX items {}",
        paged_attention::ffi::env::simd_level(),
        std::env::var("PA_NUM_THREADS").unwrap_or_else(|_| "(default)".into()),
        match (before, amx_items()) {
            (Some(b), Some(a)) => (a - b).to_string(),
            _ => "not counted (build with --features test-hooks)".into(),
        }
    );
}
