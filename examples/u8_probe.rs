//! Quick probe of decode over u8 caches (not the benchmark of record, which is tools/bench.py
//! --types u8): `cargo run --release --example u8_probe [reps]` prints min ms of decode 16 x 1024
//! and 4 x 4096 (H 32, Hkv 8, D 128, block 32) on u8 caches in OpenVINO's default layout.
//! `U8_PROBE_HOT=1` maps every sequence onto 4 physical blocks, so the cache stays in L2: the
//! time of the loops alone, without memory stalls. `U8_PROBE_SHUFFLE=1` scatters the blocks
//! (a random permutation, as tools/bench.py and a serving cache do). `U8_PROBE_COLD=1` writes
//! 96 MiB between calls, so every call reads its cache from memory (as in a serving loop, where
//! the model's other layers run in between). `U8_PROBE_LONG=1` adds decode 1 x 16384 (one long
//! context: its keys are cut into chunks when sequences x KV heads are few);
//! `U8_PROBE_PREFILL=1` times prefill 1 x 1024 instead (one sequence, no past).
//! `U8_PROBE_HEADS=8,1` sets the query and KV heads (default 32,8). `U8_PROBE_LEVELS=avx512,amx`
//! alternates SIMD levels call by call in one process and prints each level's min (an A/B of
//! two tiers on the same inputs, the host's drift shared).

use paged_attention::kernel::fast::{execute_with, FastOptions, SimdLevel};
use paged_attention::{PaInputs, PaOutputs, Tensor, TensorMut};
use std::time::Instant;

/// Query and KV heads: 32 and 8, or `U8_PROBE_HEADS=H,HKV`.
fn heads() -> (usize, usize) {
    std::env::var("U8_PROBE_HEADS")
        .ok()
        .and_then(|v| {
            let (h, k) = v.split_once(',')?;
            Some((h.parse().ok()?, k.parse().ok()?))
        })
        .unwrap_or((32, 8))
}
const D: usize = 128;
const BS: usize = 32;

/// The levels of `U8_PROBE_LEVELS` (default: the process's own, `PA_SIMD` or detected).
fn levels() -> Vec<SimdLevel> {
    match std::env::var("U8_PROBE_LEVELS") {
        Ok(v) => v
            .split(',')
            .map(|l| SimdLevel::parse(l).unwrap_or_else(|| panic!("unknown level {l:?}")))
            .collect(),
        Err(_) => vec![paged_attention::ffi::env::simd_level()],
    }
}

/// Min ms per level of [`levels`], the levels alternated call by call.
fn bench(seqs: &[(usize, usize)], reps: usize) -> Vec<f64> {
    #[allow(non_snake_case)]
    let (H, HKV) = heads();
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let t: usize = seqs.iter().map(|s| s.1).sum();
    let nblocks: Vec<usize> = seqs.iter().map(|&(p, n)| (p + n).div_ceil(BS)).collect();
    let nb: usize = nblocks.iter().sum();
    let mut kc: Vec<u8> = (0..nb * HKV * (BS + 8) * D).map(|_| next() as u8).collect();
    let mut vc: Vec<u8> = (0..nb * HKV * BS * (D + 8)).map(|_| next() as u8).collect();
    for slab in kc.chunks_mut((BS + 8) * D) {
        for c in 0..D {
            slab[4 * c..4 * c + 4].copy_from_slice(&0.006f32.to_le_bytes());
            slab[4 * (D + c)..4 * (D + c) + 4].copy_from_slice(&120f32.to_le_bytes());
        }
    }
    for row in vc.chunks_mut(D + 8) {
        row[..4].copy_from_slice(&0.006f32.to_le_bytes());
        row[4..8].copy_from_slice(&120f32.to_le_bytes());
    }
    let f = |n: usize, next: &mut dyn FnMut() -> u64| -> Vec<f32> {
        (0..n)
            .map(|_| (next() >> 40) as f32 / 8388608.0 - 1.0)
            .collect()
    };
    let (q, k, v) = (
        f(t * H * D, &mut next),
        f(t * HKV * D, &mut next),
        f(t * HKV * D, &mut next),
    );
    let past: Vec<i32> = seqs.iter().map(|s| s.0 as i32).collect();
    let mut sb = vec![0i32];
    let mut bib = vec![0i32];
    for (s, &(_, n)) in seqs.iter().enumerate() {
        sb.push(sb[s] + n as i32);
        bib.push(bib[s] + nblocks[s] as i32);
    }
    let hot = std::env::var_os("U8_PROBE_HOT").is_some();
    let mut bi: Vec<i32> = (0..nb as i32)
        .rev()
        .map(|b| if hot { b % 4 } else { b })
        .collect();
    if std::env::var_os("U8_PROBE_SHUFFLE").is_some() {
        for i in (1..bi.len()).rev() {
            bi.swap(i, next() as usize % (i + 1));
        }
    }
    let scores_len = seqs.iter().map(|s| s.0 + s.1).sum::<usize>();
    let (mut out, mut scores) = (vec![0f32; t * H * D], vec![0f32; scores_len]);
    let levels = levels();
    let mut best = vec![f64::MAX; levels.len()];
    let mut evict = match std::env::var_os("U8_PROBE_COLD") {
        Some(_) => vec![0u8; 96 << 20],
        None => Vec::new(),
    };
    for rep in 0..reps * levels.len() {
        let li = rep % levels.len();
        for line in evict.chunks_mut(64) {
            line[0] = line[0].wrapping_add(rep as u8);
        }
        let mut inputs = PaInputs {
            query: Tensor::new(&[t, H * D], &q),
            key: Tensor::new(&[t, HKV * D], &k),
            value: Tensor::new(&[t, HKV * D], &v),
            key_cache: TensorMut::new(&[nb, HKV, BS + 8, D], &mut kc),
            value_cache: TensorMut::new(&[nb, HKV, BS, D + 8], &mut vc),
            past_lens: Tensor::new(&[seqs.len()], &past),
            subsequence_begins: Tensor::new(&[sb.len()], &sb),
            block_indices: Tensor::new(&[bi.len()], &bi),
            block_indices_begins: Tensor::new(&[bib.len()], &bib),
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
            output: TensorMut::new(&[t, H * D], &mut out),
            scores: TensorMut::new(&[scores_len], &mut scores),
        };
        let opts = FastOptions {
            simd: levels[li],
            ..FastOptions::default()
        };
        let t0 = Instant::now();
        execute_with(opts, &mut inputs, &mut outputs).expect("u8 decode");
        best[li] = best[li].min(t0.elapsed().as_secs_f64() * 1e3);
    }
    best
}

fn main() {
    let reps = std::env::args()
        .nth(1)
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let mut shapes = vec![
        ("decode 16 x 1024", vec![(1024, 1); 16]),
        ("decode 4 x 4096", vec![(4096, 1); 4]),
    ];
    if std::env::var_os("U8_PROBE_LONG").is_some() {
        shapes.push(("decode 1 x 16384", vec![(16384, 1)]));
    }
    if std::env::var_os("U8_PROBE_PREFILL").is_some() {
        shapes = vec![("prefill 1 x 1024", vec![(0, 1024)])];
    }
    let names: Vec<_> = levels().iter().map(|l| l.name()).collect();
    for (label, seqs) in shapes {
        let mins: Vec<_> = bench(&seqs, reps)
            .into_iter()
            .map(|m| format!("{m:.2}"))
            .collect();
        println!(
            "{label}: u8 min {} ms ({})",
            mins.join(" / "),
            names.join(" / ")
        );
    }
}
