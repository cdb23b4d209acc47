//! Quick probe: serial decode/verify calls (one sequence, f32 cache, block 32) over `LAYERS`
//! layers' caches (30), with `EVICT` MB streamed between calls (18; 0 = hot) as a model's
//! weights evict them. Prints median/min/p90 us a call.
//! `cargo run --release --example cold_probe ROWS CTX [EVICT]`; env `REPS` (40), `LAYERS`,
//! `SHAPE=llama` for 32 query / 8 KV heads of 128 (default SmolLM2-135M: 9 / 3 of 64),
//! `READ_ONLY` to time a plain read of each layer's cache instead.
use paged_attention::{execute_on, PaInputs, PaOutputs, Runner, Tensor, TensorMut};
use std::time::Instant;
#[path = "common/mod.rs"]
mod common;

fn noise(n: usize, seed: u64) -> Vec<f32> {
    common::noise(n, seed)
}
const BS: usize = 32;
fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().unwrap())
        .collect();
    let (rows, ctx) = (args[0], args[1]);
    let (h, hkv, d) = match std::env::var("SHAPE").as_deref() {
        Ok("llama") => (32, 8, 128),
        _ => (9, 3, 64),
    };
    let evict_mb = if args.len() > 2 { args[2] } else { 18 };
    let past = ctx - rows;
    let nb = ctx.div_ceil(BS);
    let nl: u64 = std::env::var("LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(30);
    let layers: Vec<(Vec<f32>, Vec<f32>)> = (0..nl)
        .map(|l| {
            (
                noise(nb * hkv * BS * d, 4 + l),
                noise(nb * hkv * BS * d, 100 + l),
            )
        })
        .collect();
    let mut layers = layers;
    let bi: Vec<i32> = (0..nb as i32).collect();
    let (q, k, v) = (
        noise(rows * h * d, 1),
        noise(rows * hkv * d, 2),
        noise(rows * hkv * d, 3),
    );
    let pastv = vec![past as i32];
    let begins = vec![0, rows as i32];
    let bib = vec![0, nb as i32];
    let mut out = vec![0f32; rows * h * d];
    let mut scores = vec![0f32; ctx];
    let stream = vec![1f32; evict_mb << 18];
    let mut sink = 0f32;
    let mut times = vec![];
    let reps: usize = std::env::var("REPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(40);
    for rep in 0..reps {
        for (kc, vc) in layers.iter_mut() {
            sink += stream.iter().step_by(16).sum::<f32>();
            if std::env::var_os("READ_ONLY").is_some() {
                let t0 = Instant::now();
                let mut acc = [0f32; 16];
                for c in [&kc[..], &vc[..]] {
                    for ch in c.chunks_exact(16) {
                        for i in 0..16 {
                            acc[i] += ch[i];
                        }
                    }
                }
                sink += acc.iter().sum::<f32>();
                if rep > 2 {
                    times.push(t0.elapsed().as_secs_f64() * 1e6);
                }
                continue;
            }
            let mut inputs = PaInputs {
                query: Tensor::new(&[rows, h * d], &q),
                key: Tensor::new(&[rows, hkv * d], &k),
                value: Tensor::new(&[rows, hkv * d], &v),
                key_cache: TensorMut::new(&[nb, hkv, BS, d], kc),
                value_cache: TensorMut::new(&[nb, hkv, BS, d], vc),
                past_lens: Tensor::new(&[1], &pastv),
                subsequence_begins: Tensor::new(&[2], &begins),
                block_indices: Tensor::new(&[nb], &bi),
                block_indices_begins: Tensor::new(&[2], &bib),
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
                output: TensorMut::new(&[rows, h * d], &mut out),
                scores: TensorMut::new(&[ctx], &mut scores),
            };
            let t0 = Instant::now();
            execute_on(Runner::Serial, &mut inputs, &mut outputs).unwrap();
            if rep > 2 {
                times.push(t0.elapsed().as_secs_f64() * 1e6);
            }
        }
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    println!(
        "rows {rows} ctx {ctx} evict {evict_mb} MB: median {:.1} us, min {:.1} us, p90 {:.1} ({})",
        times[times.len() / 2],
        times[0],
        times[times.len() * 9 / 10],
        sink > 0.0
    );
}
