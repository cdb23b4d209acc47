//! End to end: the block manager drives the real op (`paged_attention::execute`) through a
//! 60-step generation loop over several sequences (chunked prefill, decode, a beam fork with
//! copy-on-write, a prefix-cache hit, a speculative rollback, score-based eviction with key
//! re-rotation, a finished sequence), and after every op call each output row and each score is
//! compared with a dense float64 attention over that sequence's logical tokens.
//!
//! The test's model: every token has a raw key `k0` and a value; the key given to the op is
//! `RoPE(k0, p)` at the token's logical position `p` (rotate-half layout, the op's). After an
//! eviction the reference drops the evicted tokens and re-applies RoPE at the new positions in
//! f64, while the op's cache holds f32 keys rotated back by the manager's rotation inputs.
//!
//! Tolerance: 1e-4 absolute on outputs and scores (f32 storage, f32 kernel arithmetic, and keys
//! rotated up to twice in f32; the observed error is around 1e-6).

use paged_attention::cache::{
    copy_blocks, rotation_lut, BlockManager, EvictionPolicy, ManagerConfig, RotationDirection,
    SplitMix64,
};
use paged_attention::{execute, PaInputs, PaOutputs};
use paged_attention::{Tensor, TensorMut};

const H: usize = 4;
const HKV: usize = 2;
const D: usize = 16;
const BS: usize = 4;
const NB: usize = 64;
const BASE: f64 = 10000.0;
const TOL: f64 = 1e-4;

#[derive(Clone)]
struct Tok {
    id: u32,
    k0: Vec<f64>, // [HKV * D], before RoPE
    v: Vec<f64>,  // [HKV * D]
}

#[derive(Clone)]
struct Seq {
    id: u64,
    /// Tokens in the cache, in logical order (index = position).
    cached: Vec<Tok>,
    /// Prompt tokens not fed to the op yet.
    pending: Vec<Tok>,
    /// Largest chunk per step while prefilling.
    chunk: usize,
}

fn rand_vec(rng: &mut SplitMix64, n: usize) -> Vec<f64> {
    // Values exactly representable in f32, so the op and the reference start equal.
    (0..n)
        .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32 as f64)
        .collect()
}

fn new_tok(rng: &mut SplitMix64) -> Tok {
    Tok {
        id: rng.next_u64() as u32,
        k0: rand_vec(rng, HKV * D),
        v: rand_vec(rng, HKV * D),
    }
}

/// RoPE (rotate-half) of one `[HKV * D]` key row at position `p`.
fn rope(k: &[f64], p: usize) -> Vec<f64> {
    let half = D / 2;
    let mut out = k.to_vec();
    for h in 0..HKV {
        for i in 0..half {
            let a = p as f64 * BASE.powf(-2.0 * i as f64 / D as f64);
            let (x, y) = (k[h * D + i], k[h * D + half + i]);
            out[h * D + i] = x * a.cos() - y * a.sin();
            out[h * D + half + i] = x * a.sin() + y * a.cos();
        }
    }
    out
}

/// Dense f64 attention of query rows `q` (`[n, H*D]`, positions `past..past+n`) over `toks`;
/// returns the outputs and the scores (softmax weights of the last query row summed over heads).
fn dense(toks: &[Tok], past: usize, q: &[Vec<f64>]) -> (Vec<Vec<f64>>, Vec<f64>) {
    let keys: Vec<Vec<f64>> = toks
        .iter()
        .enumerate()
        .map(|(p, t)| rope(&t.k0, p))
        .collect();
    let scale = 1.0 / (D as f64).sqrt();
    let g = H / HKV;
    let mut outs = Vec::new();
    let mut scores = vec![0.0; toks.len()];
    for (i, qr) in q.iter().enumerate() {
        let pos = past + i;
        let mut out = vec![0.0; H * D];
        for h in 0..H {
            let kvh = h / g;
            let logits: Vec<f64> = (0..=pos)
                .map(|j| {
                    scale
                        * (0..D)
                            .map(|x| qr[h * D + x] * keys[j][kvh * D + x])
                            .sum::<f64>()
                })
                .collect();
            let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for (j, w) in e.iter().enumerate() {
                let w = w / sum;
                for x in 0..D {
                    out[h * D + x] += w * toks[j].v[kvh * D + x];
                }
                if i == q.len() - 1 {
                    scores[j] += w;
                }
            }
        }
        outs.push(out);
    }
    (outs, scores)
}

struct World {
    m: BlockManager,
    kc: Vec<f32>,
    vc: Vec<f32>,
    rng: SplitMix64,
    seqs: Vec<Seq>,
    events: Events,
}

#[derive(Default, Debug)]
struct Events {
    cow_copies: usize,
    prefix_hit_tokens: usize,
    rollback_freed_blocks: usize,
    evicted_blocks: usize,
    rotated_blocks: usize,
    max_lut_rows: usize,
    compared_rows: usize,
}

impl World {
    fn seq_mut(&mut self, id: u64) -> &mut Seq {
        self.seqs.iter_mut().find(|s| s.id == id).unwrap()
    }

    /// One op call: every live sequence gets its next prompt chunk or one decode token, plus
    /// `extra[id]` draft tokens. Returns nothing; asserts the op against the reference.
    fn step(&mut self, step: usize, drafts: &[(u64, usize)]) {
        let mut batch: Vec<(u64, usize, Vec<Tok>)> = Vec::new(); // (id, past, new tokens)
        for si in 0..self.seqs.len() {
            let id = self.seqs[si].id;
            let new: Vec<Tok> = if !self.seqs[si].pending.is_empty() {
                let n = self.seqs[si].chunk.min(self.seqs[si].pending.len());
                self.seqs[si].pending.drain(..n).collect()
            } else {
                let n = drafts.iter().find(|d| d.0 == id).map_or(1, |d| d.1);
                (0..n).map(|_| new_tok(&mut self.rng)).collect()
            };
            let ids: Vec<u32> = new.iter().map(|t| t.id).collect();
            let a = self.m.append(id, &ids).unwrap();
            assert_eq!(
                a.past_len,
                self.seqs[si].cached.len(),
                "step {step}, seq {id}"
            );
            self.events.cow_copies += a.copies.len();
            copy_blocks(&mut self.kc, &mut self.vc, HKV * BS * D, &a.copies).unwrap();
            batch.push((id, a.past_len, new));
        }

        // Pack Q/K/V rows.
        let (mut q, mut k, mut v) = (vec![], vec![], vec![]);
        let mut qrows: Vec<Vec<Vec<f64>>> = vec![];
        let (mut past_lens, mut begins) = (vec![], vec![0i32]);
        for (_, past, new) in &batch {
            let mut rows = vec![];
            for (i, t) in new.iter().enumerate() {
                let qr = rand_vec(&mut self.rng, H * D);
                q.extend(qr.iter().map(|&x| x as f32));
                rows.push(qr);
                k.extend(rope(&t.k0, past + i).iter().map(|&x| x as f32));
                v.extend(t.v.iter().map(|&x| x as f32));
            }
            qrows.push(rows);
            past_lens.push(*past as i32);
            begins.push(begins.last().unwrap() + new.len() as i32);
        }
        let t = *begins.last().unwrap() as usize;
        let ids: Vec<u64> = batch.iter().map(|b| b.0).collect();
        let (bi, bib) = self.m.block_inputs(&ids).unwrap();
        let rot = self.m.take_rotation();
        let (rbi, rd, lut, lut_rows) = match &rot {
            Some(r) => {
                self.events.rotated_blocks += r.len();
                self.events.max_lut_rows = self.events.max_lut_rows.max(r.lut_rows());
                let lut = rotation_lut(r.lut_rows(), D, BASE, RotationDirection::Backward).unwrap();
                (r.block_indices.clone(), r.deltas.clone(), lut, r.lut_rows())
            }
            None => (vec![], vec![], vec![], 0),
        };
        let scores_len: usize = batch.iter().map(|b| b.1 + b.2.len()).sum();
        let mut out = vec![0f32; t * H * D];
        let mut sc = vec![0f32; scores_len];
        {
            let r = rbi.len();
            let mut inputs = PaInputs {
                query: Tensor::new(&[t, H * D], &q[..]),
                key: Tensor::new(&[t, HKV * D], &k[..]),
                value: Tensor::new(&[t, HKV * D], &v[..]),
                key_cache: TensorMut::new(&[NB, HKV, BS, D], &mut self.kc[..]),
                value_cache: TensorMut::new(&[NB, HKV, BS, D], &mut self.vc[..]),
                past_lens: Tensor::new(&[ids.len()], &past_lens[..]),
                subsequence_begins: Tensor::new(&[ids.len() + 1], &begins[..]),
                block_indices: Tensor::new(&[bi.len()], &bi[..]),
                block_indices_begins: Tensor::new(&[ids.len() + 1], &bib[..]),
                scale: None,
                sliding_window: None,
                alibi_slopes: None,
                rotated_block_indices: (r > 0).then(|| Tensor::new(&[r], &rbi[..])),
                rotation_deltas: (r > 0).then(|| Tensor::new(&[r, BS], &rd[..])),
                rotation_trig_lut: (r > 0).then(|| Tensor::new(&[lut_rows, D], &lut[..])),
                score_aggregation_window: None,
                sinks: None,
            };
            let mut outputs = PaOutputs {
                output: TensorMut::new(&[t, H * D], &mut out[..]),
                scores: TensorMut::new(&[scores_len], &mut sc[..]),
            };
            execute(&mut inputs, &mut outputs)
                .unwrap_or_else(|e| panic!("step {step}: op failed: {e}"));
        }
        self.m.mark_computed();

        // Compare with the dense reference, then commit the new tokens to the model.
        let (mut row, mut soff) = (0usize, 0usize);
        for (b, (id, past, new)) in batch.into_iter().enumerate() {
            let s = self.seq_mut(id);
            s.cached.extend(new.iter().cloned());
            let (want, want_scores) = dense(&s.cached, past, &qrows[b]);
            for (i, w) in want.iter().enumerate() {
                for x in 0..H * D {
                    let got = out[(row + i) * H * D + x] as f64;
                    assert!(
                        (got - w[x]).abs() <= TOL,
                        "step {step}, seq {id}, token {i} (position {}), element {x}: op {got}, \
                         dense f64 {}",
                        past + i,
                        w[x]
                    );
                }
            }
            let len = s.cached.len();
            for j in 0..len {
                let got = sc[soff + j] as f64;
                assert!(
                    (got - want_scores[j]).abs() <= TOL,
                    "step {step}, seq {id}, score of key {j}: op {got}, dense {}",
                    want_scores[j]
                );
            }
            self.m.accumulate_scores(id, &sc[soff..soff + len]).unwrap();
            row += new.len();
            soff += len;
            self.events.compared_rows += new.len();
        }
        self.m
            .check_invariants()
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
    }

    fn add(&mut self, id: u64, prompt: Vec<Tok>, chunk: usize, shared_with: Option<u64>) {
        let ids: Vec<u32> = prompt.iter().map(|t| t.id).collect();
        let cached = self.m.add_sequence(id, &ids).unwrap();
        if let Some(src) = shared_with {
            let src = self.seqs.iter().find(|s| s.id == src).unwrap();
            assert_eq!(
                &src.cached[..cached]
                    .iter()
                    .map(|t| t.id)
                    .collect::<Vec<_>>()[..],
                &ids[..cached]
            );
        }
        self.events.prefix_hit_tokens += cached;
        self.seqs.push(Seq {
            id,
            cached: prompt[..cached].to_vec(),
            pending: prompt[cached..].to_vec(),
            chunk,
        });
    }

    fn evict(&mut self, id: u64, policy: EvictionPolicy) {
        let ev = self.m.evict(id, policy).unwrap();
        if ev.evicted.is_empty() {
            return;
        }
        copy_blocks(&mut self.kc, &mut self.vc, HKV * BS * D, &ev.copies).unwrap();
        self.events.cow_copies += ev.copies.len();
        self.events.evicted_blocks += ev.evicted.len();
        let s = self.seq_mut(id);
        let kept: Vec<Tok> = s
            .cached
            .chunks(BS)
            .enumerate()
            .filter(|(i, _)| !ev.evicted.contains(i))
            .flat_map(|(_, c)| c.to_vec())
            .collect();
        s.cached = kept;
        assert_eq!(s.cached.len(), self.m.len(id).unwrap());
    }
}

#[test]
fn manager_driven_generation_matches_dense_attention_at_every_step() {
    let mut w = World {
        m: BlockManager::new(ManagerConfig {
            num_blocks: NB,
            block_size: BS,
            prefix_caching: true,
        })
        .unwrap(),
        kc: vec![0.0; NB * HKV * BS * D],
        vc: vec![0.0; NB * HKV * BS * D],
        rng: SplitMix64::new(2024),
        seqs: vec![],
        events: Events::default(),
    };
    let policy = EvictionPolicy {
        start: 1,
        recent: 2,
        budget: 6,
    };
    let prompt_a: Vec<Tok> = (0..22).map(|_| new_tok(&mut w.rng)).collect();
    for step in 0..60 {
        match step {
            0 => w.add(1, prompt_a.clone(), 8, None),
            1 => {
                let p = (0..13).map(|_| new_tok(&mut w.rng)).collect();
                w.add(2, p, 5, None);
            }
            7 => {
                // Beam search: seq 3 shares all of seq 1's blocks (its last one is partial).
                w.m.fork(1, 3).unwrap();
                let mut s = w.seqs[0].clone();
                s.id = 3;
                w.seqs.push(s);
            }
            9 => {
                // Same first 16 prompt tokens as seq 1: 4 blocks from the prefix cache.
                let mut p = prompt_a[..16].to_vec();
                p.extend((0..5).map(|_| new_tok(&mut w.rng)));
                w.add(4, p, 8, Some(1));
                assert_eq!(w.events.prefix_hit_tokens, 16);
            }
            45 => {
                let before = w.m.available_blocks();
                w.m.free(2).unwrap();
                w.seqs.retain(|s| s.id != 2);
                assert!(
                    w.m.available_blocks() > before,
                    "freeing seq 2 returns blocks"
                );
            }
            _ => {}
        }
        if step >= 12 {
            for id in [1, 3, 4] {
                w.evict(id, policy);
            }
        }
        if step == 20 {
            // Speculative decoding: seq 2 verifies 7 draft tokens, accepts 1.
            let len = w.m.len(2).unwrap();
            w.step(step, &[(2, 7)]);
            let blocks_with_drafts = w.m.block_table(2).unwrap().len();
            let avail = w.m.available_blocks();
            w.m.truncate(2, len + 1).unwrap();
            w.seq_mut(2).cached.truncate(len + 1);
            let freed = blocks_with_drafts - w.m.block_table(2).unwrap().len();
            assert_eq!(w.m.block_table(2).unwrap().len(), (len + 1).div_ceil(BS));
            assert_eq!(w.m.available_blocks(), avail + freed);
            w.events.rollback_freed_blocks += freed;
        } else {
            w.step(step, &[]);
        }
    }
    let e = &w.events;
    eprintln!("events: {e:?}");
    assert!(e.cow_copies > 0, "no copy-on-write happened: {e:?}");
    assert_eq!(e.prefix_hit_tokens, 16, "{e:?}");
    assert!(e.rollback_freed_blocks >= 1, "{e:?}");
    assert!(e.evicted_blocks >= 3, "{e:?}");
    assert!(e.rotated_blocks >= 3 && e.max_lut_rows > BS, "{e:?}");
    assert!(e.compared_rows > 200, "{e:?}");
    for s in w.seqs.clone() {
        w.m.free(s.id).unwrap();
    }
    assert_eq!(w.m.stats().used_blocks, 0);
}
