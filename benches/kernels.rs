//! Criterion benches of the fast kernels on the shapes (H=32, Hkv=8, D=128, block 32):
//! decode (16 x 1024 past), prefill (1 x 1024), insert (1024 tokens; into f16 and into u8
//! caches) and rotate (64 blocks), with f32 and f16 caches. `cargo bench --bench kernels`
//! (RAYON_NUM_THREADS sets the threads).
//! The end-to-end table against OpenVINO is `tools/bench.py`.

use criterion::{criterion_group, criterion_main, Criterion};
use half::f16;
use paged_attention::kernel::fast::{execute_with, Precision};
use paged_attention::kernel::fast::{insert::insert, rotate::rotate};
use paged_attention::kernel::quant::{insert_u8, KeyQuant, QuantLayout};
use paged_attention::Runner;
use paged_attention::{validate, Float, PaInputs, PaOutputs, Tensor, TensorMut};
use std::time::Duration;
#[path = "../examples/common/mod.rs"]
mod common;

fn noise(n: usize, seed: u64) -> Vec<f32> {
    common::noise(n, seed)
}

const H: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const BS: usize = 32;

/// Inputs of one call with sequences `(past, new)`, cache element type `C`.
struct Call<C> {
    t: usize,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    kc: Vec<C>,
    vc: Vec<C>,
    past: Vec<i32>,
    begins: Vec<i32>,
    bi: Vec<i32>,
    bib: Vec<i32>,
    out: Vec<f32>,
    scores: Vec<f32>,
}

impl<C: Float> Call<C> {
    fn new(seqs: &[(usize, usize)]) -> Self {
        let t: usize = seqs.iter().map(|s| s.1).sum();
        let nblocks: Vec<usize> = seqs.iter().map(|&(p, n)| (p + n).div_ceil(BS)).collect();
        let nb: usize = nblocks.iter().sum();
        // Scatter the blocks like a real pool does (reverse-interleaved order).
        let bi: Vec<i32> = (0..nb).map(|i| ((i * 7919) % nb) as i32).collect();
        let mut bib = vec![0i32];
        let mut begins = vec![0i32];
        for (s, &n) in seqs.iter().zip(&nblocks) {
            bib.push(bib.last().unwrap() + n as i32);
            begins.push(begins.last().unwrap() + s.1 as i32);
        }
        let cache = |seed| {
            noise(nb * HKV * BS * D, seed)
                .into_iter()
                .map(C::from_f32)
                .collect()
        };
        Call {
            t,
            q: noise(t * H * D, 1),
            k: noise(t * HKV * D, 2),
            v: noise(t * HKV * D, 3),
            kc: cache(4),
            vc: cache(5),
            past: seqs.iter().map(|s| s.0 as i32).collect(),
            begins,
            bi,
            bib,
            out: vec![0.0; t * H * D],
            scores: vec![0.0; seqs.iter().map(|s| s.0).sum::<usize>() + t],
        }
    }

    fn run(&mut self, f: impl FnOnce(&mut PaInputs<'_>, &mut PaOutputs<'_>))
    where
        for<'a> paged_attention::ElemsMut<'a>: From<&'a mut Vec<C>>,
    {
        let (t, b, nb) = (self.t, self.past.len(), self.kc.len() / (HKV * BS * D));
        let mut inputs = PaInputs {
            query: Tensor::new(&[t, H * D], &self.q),
            key: Tensor::new(&[t, HKV * D], &self.k),
            value: Tensor::new(&[t, HKV * D], &self.v),
            key_cache: TensorMut::new(&[nb, HKV, BS, D], &mut self.kc),
            value_cache: TensorMut::new(&[nb, HKV, BS, D], &mut self.vc),
            past_lens: Tensor::new(&[b], &self.past),
            subsequence_begins: Tensor::new(&[b + 1], &self.begins),
            block_indices: Tensor::new(&[self.bi.len()], &self.bi),
            block_indices_begins: Tensor::new(&[b + 1], &self.bib),
            scale: None,
            sliding_window: None,
            alibi_slopes: None,
            rotated_block_indices: None,
            rotation_deltas: None,
            rotation_trig_lut: None,
            score_aggregation_window: None,
            sinks: None,
        };
        let n_scores = self.scores.len();
        let mut outputs = PaOutputs {
            output: TensorMut::new(&[t, H * D], &mut self.out),
            scores: TensorMut::new(&[n_scores], &mut self.scores),
        };
        f(&mut inputs, &mut outputs);
    }
}

fn op<C: Float>(c: &mut Criterion, name: &str, seqs: &[(usize, usize)])
where
    for<'a> paged_attention::ElemsMut<'a>: From<&'a mut Vec<C>>,
{
    let mut call = Call::<C>::new(seqs);
    c.bench_function(&format!("{name}/{}", C::TYPE), |b| {
        // The options the C ABI gives pa_execute (PA_SIMD and PA_BF16_QUERY read at the edge).
        let opts = paged_attention::ffi::env::fast_options(Runner::Auto, Precision::F32);
        b.iter(|| call.run(|i, o| execute_with(opts, i, o).expect("execute")))
    });
}

fn decode(c: &mut Criterion) {
    op::<f32>(c, "decode_16x1024", &[(1024, 1); 16]);
    op::<f16>(c, "decode_16x1024", &[(1024, 1); 16]);
    op::<f32>(c, "decode_4x4096", &[(4096, 1); 4]);
}

fn prefill(c: &mut Criterion) {
    op::<f32>(c, "prefill_1x1024", &[(0, 1024)]);
    op::<f16>(c, "prefill_1x1024", &[(0, 1024)]);
}

fn insert_bench(c: &mut Criterion) {
    let mut call = Call::<f16>::new(&[(0, 1024)]);
    let mut plan = None;
    call.run(|i, _| plan = Some(validate(i).expect("validate")));
    let plan = plan.unwrap();
    c.bench_function("insert_1024_tokens/f32->f16", |b| {
        b.iter(|| insert(Runner::Auto, &plan, &call.k, &mut call.kc, &call.bi))
    });
}

fn insert_u8_bench(c: &mut Criterion) {
    let mut call = Call::<f32>::new(&[(0, 1024)]);
    let mut plan = None;
    call.run(|i, _| plan = Some(validate(i).expect("validate")));
    let plan = plan.unwrap();
    // OpenVINO's default u8 layout: keys by channel, values by token (one group of D).
    let l = QuantLayout {
        hkv: HKV,
        d: D,
        dv: D,
        bs: BS,
        key: KeyQuant::ByChannel,
        value_group: 0,
        bits: 8,
    };
    let nb = 1024 / BS;
    let mut kc = vec![0u8; nb * HKV * (BS + 8) * D];
    let mut vc = vec![0u8; nb * HKV * BS * (D + 8)];
    let (seqs, bi) = (&plan.seqs, &call.bi);
    c.bench_function("insert_u8_1024_tokens/serial", |b| {
        b.iter(|| insert_u8(&l, seqs, bi, &call.k, &call.v, &mut kc, &mut vc))
    });
}

fn rotate_bench(c: &mut Criterion) {
    let mut call = Call::<f32>::new(&[(2048, 1)]);
    let mut plan = None;
    call.run(|i, _| plan = Some(validate(i).expect("validate")));
    let plan = plan.unwrap();
    let rbi: Vec<i32> = (0..64).collect();
    let rd: Vec<i32> = (0..64 * BS as i32).map(|i| i % 16).collect();
    let lut_v = noise(16 * D, 9);
    c.bench_function("rotate_64_blocks/f32", |b| {
        b.iter(|| rotate(Runner::Auto, &plan, BS, &mut call.kc, &rbi, &rd, &lut_v))
    });
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(3));
    targets = decode, prefill, insert_bench, insert_u8_bench, rotate_bench
}
criterion_main!(benches);
