//! Quick A/B probe of the decode path (not the benchmark of record, which is tools/bench.py):
//! `cargo run --release --example decode_probe [reps]` prints min ms and KV GB/s of the
//! issue's two decode workloads for f32/f16/bf16 caches, next to a streaming-read bandwidth.

use half::{bf16, f16};
use paged_attention::{execute, Float, PaInputs, PaOutputs, Tensor, TensorMut};
use rayon::prelude::*;
use std::time::Instant;
#[path = "common/mod.rs"]
mod common;

fn noise(n: usize, seed: u64) -> Vec<f32> {
    common::noise(n, seed)
}

const H: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const BS: usize = 32;

fn bench<C: Float>(seqs: &[(usize, usize)], reps: usize, hot: bool) -> (f64, f64)
where
    for<'a> paged_attention::ElemsMut<'a>: From<&'a mut Vec<C>>,
{
    let t: usize = seqs.iter().map(|s| s.1).sum();
    let nblocks: Vec<usize> = seqs.iter().map(|&(p, n)| (p + n).div_ceil(BS)).collect();
    let nb: usize = nblocks.iter().sum();
    // `hot`: every table entry points at one of 2 blocks, so the same work runs from cache.
    let bi: Vec<i32> = (0..nb)
        .map(|i| {
            if hot {
                (i % 2) as i32
            } else {
                ((i * 7919) % nb) as i32
            }
        })
        .collect();
    let mut bib = vec![0i32];
    let mut begins = vec![0i32];
    for (s, &n) in seqs.iter().zip(&nblocks) {
        bib.push(bib.last().unwrap() + n as i32);
        begins.push(begins.last().unwrap() + s.1 as i32);
    }
    let cache = |seed| -> Vec<C> {
        noise(nb * HKV * BS * D, seed)
            .into_iter()
            .map(C::from_f32)
            .collect()
    };
    let (q, k, v) = (
        noise(t * H * D, 1),
        noise(t * HKV * D, 2),
        noise(t * HKV * D, 3),
    );
    let (mut kc, mut vc) = (cache(4), cache(5));
    let past: Vec<i32> = seqs.iter().map(|s| s.0 as i32).collect();
    let mut out = vec![0f32; t * H * D];
    let mut scores = vec![0f32; seqs.iter().map(|s| s.0).sum::<usize>() + t];
    let b = seqs.len();
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let mut inputs = PaInputs {
            query: Tensor::new(&[t, H * D], &q),
            key: Tensor::new(&[t, HKV * D], &k),
            value: Tensor::new(&[t, HKV * D], &v),
            key_cache: TensorMut::new(&[nb, HKV, BS, D], &mut kc),
            value_cache: TensorMut::new(&[nb, HKV, BS, D], &mut vc),
            past_lens: Tensor::new(&[b], &past),
            subsequence_begins: Tensor::new(&[b + 1], &begins),
            block_indices: Tensor::new(&[bi.len()], &bi),
            block_indices_begins: Tensor::new(&[b + 1], &bib),
            scale: None,
            sliding_window: None,
            alibi_slopes: None,
            rotated_block_indices: None,
            rotation_deltas: None,
            rotation_trig_lut: None,
            score_aggregation_window: None,
            sinks: None,
        };
        let n_scores = scores.len();
        let mut outputs = PaOutputs {
            output: TensorMut::new(&[t, H * D], &mut out),
            scores: TensorMut::new(&[n_scores], &mut scores),
        };
        let (t0, c0) = (Instant::now(), cpu_ns());
        execute(&mut inputs, &mut outputs).expect("execute");
        let wall = t0.elapsed().as_secs_f64();
        // PROBE_CPU: CPU time of all threads instead of wall time (immune to preemption).
        let t = if std::env::var_os("PROBE_CPU").is_some() {
            (cpu_ns() - c0) as f64 * 1e-9
        } else {
            wall
        };
        best = best.min(t);
    }
    let elems = seqs.iter().map(|s| s.0 + s.1).sum::<usize>() * HKV * D * 2;
    let kv = C::TYPE.bytes_for(elems).unwrap_or(0);
    (best * 1e3, kv as f64 / best / 1e9)
}

/// CPU time of every thread of this process so far, in ns (Linux schedstat).
fn cpu_ns() -> u64 {
    let mut t = 0;
    if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
        for e in dir.flatten() {
            if let Ok(s) = std::fs::read_to_string(e.path().join("schedstat")) {
                t += s
                    .split_whitespace()
                    .next()
                    .and_then(|x| x.parse::<u64>().ok())
                    .unwrap_or(0);
            }
        }
    }
    t
}

fn read_bw() -> f64 {
    let data = vec![1f32; 1 << 28];
    let mut best = 0f64;
    for _ in 0..5 {
        let t0 = Instant::now();
        let s: f32 = data
            .par_chunks(1 << 16)
            .map(|c| {
                let mut a = [0f32; 32];
                for ch in c.chunks_exact(32) {
                    for i in 0..32 {
                        a[i] += ch[i];
                    }
                }
                a.iter().sum::<f32>()
            })
            .sum();
        std::hint::black_box(s);
        best = best.max((data.len() * 4) as f64 / t0.elapsed().as_secs_f64() / 1e9);
    }
    best
}

fn main() {
    let reps: usize = std::env::args().nth(1).map_or(30, |s| s.parse().unwrap());
    // PROBE_ONE=f16|f32|bf16: only decode16 from cache, for profiling (with PROBE_PREFILL=1:
    // prefill 1 x 1024 instead, to compare SIMD tiers by CPU time on a busy machine).
    if let Ok(ty) = std::env::var("PROBE_ONE") {
        let seqs = if std::env::var_os("PROBE_PREFILL").is_some() {
            vec![(0, 1024)]
        } else {
            vec![(1024, 1); 16]
        };
        let hot = std::env::var_os("PROBE_COLD").is_none();
        let (ms, _) = match ty.as_str() {
            "f32" => bench::<f32>(&seqs, reps, hot),
            "f16" => bench::<f16>(&seqs, reps, hot),
            _ => bench::<bf16>(&seqs, reps, hot),
        };
        println!("{ty} hot={hot} {ms:.2} ms");
        return;
    }
    let bw = read_bw();
    println!("read bw {bw:.1} GB/s");
    if std::env::var_os("PROBE_BW").is_some() {
        return;
    }
    for (name, seqs) in [
        ("decode16", vec![(1024, 1); 16]),
        ("decode4", vec![(4096, 1); 4]),
    ] {
        for hot in [false, true] {
            let r = [
                bench::<f32>(&seqs, reps, hot),
                bench::<f16>(&seqs, reps, hot),
                bench::<bf16>(&seqs, reps, hot),
            ];
            for (ty, (ms, gbs)) in ["f32", "f16", "bf16"].iter().zip(r) {
                let tag = if hot { " hot" } else { "" };
                println!(
                    "{name}{tag} {ty:5} {ms:7.2} ms {gbs:5.1} GB/s {:4.0}%",
                    gbs / bw * 100.0
                );
            }
        }
    }
}
