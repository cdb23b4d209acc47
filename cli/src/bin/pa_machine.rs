//! Measures this machine's limits for the benchmark table (`tools/bench.py` runs it):
//! read bandwidth with a streaming-read kernel, the f32 FMA peak with a register-blocked FMA
//! loop, on CPUs with AVX512-BF16 the bf16 dot-product peak (`vdpbf16ps` on registers) and, on
//! CPUs with AMX, the bf16 tile peak with tile products that stay in registers, all on the rayon
//! pool (`RAYON_NUM_THREADS`). Prints one JSON line.

use clap::Parser;
use paged_attention::kernel::fast::SimdLevel;
use rayon::prelude::*;
use std::time::Instant;

/// Measures this machine's read bandwidth (a parallel sum over 1 GiB, best of 5) and f32 FMA
/// peak (and the bf16 dot-product peak where the CPU has AVX512-BF16, the AMX-BF16 tile peak
/// where it has AMX, else null) on the rayon pool (RAYON_NUM_THREADS threads); prints one JSON
/// line: {"threads", "read_gbs", "fma_gflops", "dot_bf16_gflops", "amx_bf16_gflops", "simd",
/// "runs"}: "simd" is the
/// best level the CPU has, "runs" the one the library's calls run at in this environment
/// (`PA_SIMD` can lower it). Takes a few seconds and 1 GiB of memory.
#[derive(Parser)]
#[command(name = "pa_machine", version)]
struct Cli {}

fn main() {
    // Parsed before anything is measured, so `--help` and `--version` start no probe.
    Cli::parse();
    let threads = rayon::current_num_threads();
    let bw = read_bandwidth();
    let fma = fma_peak(threads);
    let json = |g: Option<f64>| g.map_or("null".to_string(), |g| format!("{g:.1}"));
    let (dot, amx) = (json(dot_peak(threads)), json(amx_peak(threads)));
    println!(
        "{{\"threads\": {threads}, \"read_gbs\": {bw:.2}, \"fma_gflops\": {fma:.1}, \"dot_bf16_gflops\": {dot}, \"amx_bf16_gflops\": {amx}, \"simd\": \"{:?}\", \"runs\": \"{:?}\"}}",
        SimdLevel::detected(),
        paged_attention::ffi::env::simd_level()
    );
}

/// GB/s of a parallel sum over 1 GiB (well past every cache), best of 5.
fn read_bandwidth() -> f64 {
    let n = (1usize << 30) / 4;
    let data: Vec<f32> = (0..n).into_par_iter().map(|i| (i & 7) as f32).collect();
    let best = best_secs(|| data.par_chunks(1 << 16).map(sum_chunk).sum::<f32>());
    (n * 4) as f64 / best / 1e9
}

fn sum_chunk(c: &[f32]) -> f32 {
    let mut acc = [0f32; 32];
    for ch in c.chunks_exact(32) {
        for i in 0..32 {
            acc[i] += ch[i];
        }
    }
    acc.iter().sum()
}

/// GFLOP/s of independent FMAs on every thread, at the widest vectors the CPU has (AVX-512:
/// 12 accumulators x 16 lanes; AVX2: x 8 lanes), best of 5.
fn fma_peak(threads: usize) -> f64 {
    let iters = 20_000_000usize;
    let lanes = if avx512() {
        16.0
    } else if avx2() {
        8.0
    } else {
        1.0
    };
    let flops_per_iter = 12.0 * lanes * 2.0;
    best_gflops(threads, iters as f64 * flops_per_iter, || fma_loop(iters))
}

/// GFLOP/s of `vdpbf16ps` on every thread (16 independent accumulators of 16 lanes x 2
/// multiply-adds per round, 64 flops an instruction), best of 5; None without AVX512-BF16.
fn dot_peak(threads: usize) -> Option<f64> {
    use paged_attention::kernel::fast::bf16_dot_products as products;
    let rounds = 10_000_000usize;
    products(1).then(|| best_gflops(threads, rounds as f64 * 16.0 * 64.0, || products(rounds)))
}

/// GFLOP/s of AMX-BF16 tile products on every thread (four independent products per round on
/// tiles in registers), best of 5; None without AMX.
fn amx_peak(threads: usize) -> Option<f64> {
    use paged_attention::kernel::fast::amx_bf16_tile_products as products;
    let rounds = 200_000usize;
    products(1).then(|| best_gflops(threads, rounds as f64 * 4.0 * 16384.0, || products(rounds)))
}

/// GFLOP/s of `run` (`flops` each) on every thread of the pool at once, best of 5.
fn best_gflops<R: Send>(threads: usize, flops: f64, run: impl Fn() -> R + Sync) -> f64 {
    let best = best_secs(|| {
        (0..threads)
            .into_par_iter()
            .map(|_| run())
            .collect::<Vec<R>>()
    });
    threads as f64 * flops / best / 1e9
}

/// Seconds of the fastest of 5 runs of `run` (its result kept, so the work is not dropped).
fn best_secs<R>(mut run: impl FnMut() -> R) -> f64 {
    (0..5)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(run());
            t.elapsed().as_secs_f64()
        })
        .fold(f64::MAX, f64::min)
}

fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx512f")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

fn fma_loop(iters: usize) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F was detected just above.
        return unsafe { fma_loop_avx512(iters) };
    }
    #[cfg(target_arch = "x86_64")]
    if avx2() {
        // SAFETY: AVX2 and FMA were detected just above.
        return unsafe { fma_loop_avx2(iters) };
    }
    let mut a = [1.0f32; 12];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = x.mul_add(0.999_999, 1e-7);
        }
    }
    a.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm256_set1_ps(0.999_999);
    let c = _mm256_set1_ps(1e-7);
    let mut a = [_mm256_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm256_fmadd_ps(*x, m, c);
        }
    }
    let mut s = _mm256_setzero_ps();
    for x in a {
        s = _mm256_add_ps(s, x);
    }
    let mut out = [0f32; 8];
    // SAFETY: `out` holds 8 floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), s) };
    out.iter().sum()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn fma_loop_avx512(iters: usize) -> f32 {
    use std::arch::x86_64::*;
    let m = _mm512_set1_ps(0.999_999);
    let c = _mm512_set1_ps(1e-7);
    let mut a = [_mm512_set1_ps(1.0); 12];
    for _ in 0..iters {
        for x in a.iter_mut() {
            *x = _mm512_fmadd_ps(*x, m, c);
        }
    }
    let mut s = _mm512_setzero_ps();
    for x in a {
        s = _mm512_add_ps(s, x);
    }
    _mm512_reduce_add_ps(s)
}
