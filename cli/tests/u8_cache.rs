//! u8 caches against the bytes OpenVINO 2026.4.1's built-in PagedAttention writes.
//!
//! The fixtures in cli/tests/data/u8_cache/<case>/ were produced by
//! `.venv/bin/python tools/ov_u8_cache.py fixtures cli/tests/data/u8_cache` (the CPU plugin with
//! `KV_CACHE_PRECISION=u8`, f32 inference, one thread): per step the new keys/values, the
//! sequence inputs and the two caches after the call, starting from zeroed caches. Each case
//! replays the steps through our insertion, feeding each step our own caches of the step before,
//! and requires every byte of both caches to equal OpenVINO's.

use paged_attention::kernel::quant::{self, KeyQuant, QuantLayout};
use paged_attention::op::validate::SeqPlan;
use paged_attention_cli::npy::{read_npy, NpyArray, NpyDtype};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

fn data_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/u8_cache")
}

fn load(dir: &Path, name: &str) -> NpyArray {
    read_npy(&dir.join(format!("{name}.npy"))).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn f32s(a: &NpyArray) -> Vec<f32> {
    assert_eq!(a.dtype, NpyDtype::F32);
    a.bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn i32s(a: &NpyArray) -> Vec<i32> {
    assert_eq!(a.dtype, NpyDtype::I32);
    a.bytes
        .chunks_exact(4)
        .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

fn num(j: &Json, key: &str) -> usize {
    j.get(key)
        .and_then(Json::as_u64)
        .unwrap_or_else(|| panic!("case.json: {key}")) as usize
}

struct Case {
    name: String,
    layout: QuantLayout,
    nb: usize,
    steps: usize,
    dir: PathBuf,
}

fn cases() -> Vec<Case> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(data_dir()).expect("tests/data/u8_cache") {
        let dir = entry.unwrap().path();
        let text = std::fs::read_to_string(dir.join("case.json")).unwrap();
        let j: Json = serde_json::from_str(&text).unwrap();
        let by_token = matches!(j.get("key_by_token"), Some(Json::Bool(true)));
        let layout = QuantLayout {
            hkv: num(&j, "Hkv"),
            d: num(&j, "D"),
            dv: num(&j, "D"),
            bs: 32,
            key: if by_token {
                KeyQuant::ByToken {
                    group: num(&j, "key_group"),
                }
            } else {
                KeyQuant::ByChannel
            },
            value_group: num(&j, "value_group"),
            bits: 8,
        };
        out.push(Case {
            name: dir.file_name().unwrap().to_string_lossy().into_owned(),
            layout,
            nb: num(&j, "NB"),
            steps: num(&j, "steps"),
            dir,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn seqs(past: &[i32], sb: &[i32], bib: &[i32]) -> Vec<SeqPlan> {
    (0..past.len())
        .map(|s| SeqPlan {
            past: past[s] as usize,
            begin: sb[s] as usize,
            n: (sb[s + 1] - sb[s]) as usize,
            block_begin: bib[s] as usize,
            score_tokens: 0,
            score_offset: 0,
        })
        .collect()
}

fn first_diff(ours: &[u8], theirs: &[u8]) -> Option<(usize, u8, u8)> {
    ours.iter()
        .zip(theirs)
        .enumerate()
        .find(|(_, (a, b))| a != b)
        .map(|(i, (a, b))| (i, *a, *b))
}

/// The inputs of step `step` of a case: keys, values, sequences, block indices.
struct Step {
    key: Vec<f32>,
    value: Vec<f32>,
    plan: Vec<SeqPlan>,
    bi: Vec<i32>,
}

impl Case {
    fn step(&self, step: usize) -> Step {
        let get = |n: &str| load(&self.dir, &format!("step{step}_{n}"));
        Step {
            key: f32s(&get("key")),
            value: f32s(&get("value")),
            plan: seqs(
                &i32s(&get("past_lens")),
                &i32s(&get("subsequence_begins")),
                &i32s(&get("block_indices_begins")),
            ),
            bi: i32s(&get("block_indices")),
        }
    }

    /// The zeroed key and value caches every replay starts from, with their dims.
    fn zeroed_caches(&self) -> ([usize; 4], [usize; 4], Vec<u8>, Vec<u8>) {
        let kd = self.layout.key_cache_dims(self.nb).unwrap();
        let vd = self.layout.value_cache_dims(self.nb).unwrap();
        let (kc, vc) = (
            vec![0u8; kd.iter().product()],
            vec![0u8; vd.iter().product()],
        );
        (kd, vd, kc, vc)
    }
}

/// Replays a case's steps through `insert`; returns (case, step, cache, first differing byte).
fn replay(
    case: &Case,
    insert: impl Fn(&QuantLayout, &[SeqPlan], &[i32], &[f32], &[f32], &mut [u8], &mut [u8]),
) -> Vec<String> {
    let l = &case.layout;
    let (kd, vd, mut kc, mut vc) = case.zeroed_caches();
    let mut failures = Vec::new();
    for step in 0..case.steps {
        let get = |n: &str| load(&case.dir, &format!("step{step}_{n}"));
        let s = case.step(step);
        insert(l, &s.plan, &s.bi, &s.key, &s.value, &mut kc, &mut vc);
        let k_ov = get("key_cache_after");
        let v_ov = get("value_cache_after");
        assert_eq!(k_ov.shape, kd.to_vec(), "{}: key cache shape", case.name);
        assert_eq!(v_ov.shape, vd.to_vec(), "{}: value cache shape", case.name);
        for (what, ours, theirs) in [("key", &kc, &k_ov.bytes), ("value", &vc, &v_ov.bytes)] {
            if let Some((i, a, b)) = first_diff(ours, theirs) {
                let n = ours
                    .iter()
                    .zip(theirs.iter())
                    .filter(|(a, b)| a != b)
                    .count();
                failures.push(format!(
                    "{} step {step} {what} cache: {n} bytes differ, first at byte {i}: ours {a}, OpenVINO {b}",
                    case.name
                ));
            }
        }
    }
    failures
}

fn ours(
    l: &QuantLayout,
    plan: &[SeqPlan],
    bi: &[i32],
    key: &[f32],
    value: &[f32],
    kc: &mut [u8],
    vc: &mut [u8],
) {
    quant::insert_u8(l, plan, bi, key, value, kc, vc);
}

#[test]
fn insertion_matches_openvino_byte_for_byte() {
    let cases = cases();
    assert!(cases.len() >= 9, "fixtures missing: {}", cases.len());
    let mut failures = Vec::new();
    let mut steps = 0;
    for c in &cases {
        steps += c.steps;
        failures.extend(replay(c, ours));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    assert!(steps >= 20);
}

/// The fixtures tell the conventions apart: an insertion that keeps a by-channel block's range
/// from its first tokens (instead of re-quantizing the block) must fail the comparison.
#[test]
fn fixtures_reject_a_fixed_block_range() {
    let fixed_range = |l: &QuantLayout,
                       plan: &[SeqPlan],
                       bi: &[i32],
                       key: &[f32],
                       value: &[f32],
                       kc: &mut [u8],
                       vc: &mut [u8]| {
        // values as usual; keys of a block that already holds tokens quantized with its old
        // parameters, keys of a fresh block quantized alone
        let before = kc.to_vec();
        quant::insert_u8(l, plan, bi, key, value, kc, vc);
        let d = l.d;
        let slab = (l.bs + quant::PARAM_BYTES) * d;
        for sp in plan {
            if sp.past % l.bs == 0 || sp.n == 0 {
                continue;
            }
            let block = bi[sp.block_begin + sp.past / l.bs] as usize;
            for h in 0..l.hkv {
                let at = (block * l.hkv + h) * slab;
                let old = &before[at..at + slab];
                let take = (l.bs - sp.past % l.bs).min(sp.n);
                let mut out = old.to_vec();
                for t in 0..take {
                    let row = &key[((sp.begin + t) * l.hkv + h) * d..][..d];
                    for j in 0..d {
                        let s = f32::from_le_bytes(old[4 * j..4 * j + 4].try_into().unwrap());
                        let z = f32::from_le_bytes(
                            old[4 * (d + j)..4 * (d + j) + 4].try_into().unwrap(),
                        );
                        let q = (row[j] / s + z).round_ties_even().clamp(0.0, 255.0) as u8;
                        out[quant::PARAM_BYTES * d + (sp.past % l.bs + t) * d + j] = q;
                    }
                }
                kc[at..at + slab].copy_from_slice(&out);
            }
        }
    };
    let by_channel: Vec<Case> = cases()
        .into_iter()
        .filter(|c| c.layout.key == KeyQuant::ByChannel)
        .collect();
    let failing = by_channel
        .iter()
        .filter(|c| !replay(c, fixed_range).is_empty())
        .count();
    assert!(failing >= 3, "only {failing} by-channel cases noticed");
}

/// Dequantized rows are within the quantization step of the keys and values that went in (half a
/// step for values and fresh key blocks; a re-quantized block's earlier keys carry the rounding
/// of both quantizations).
#[test]
fn dequantized_rows_are_within_the_step() {
    for case in cases() {
        let l = case.layout;
        let (d, bs) = (l.d, l.bs);
        let (_, _, mut kc, mut vc) = case.zeroed_caches();
        // logical position -> (key, value) as given, per sequence
        let mut given: Vec<Vec<(Vec<f32>, Vec<f32>)>> = Vec::new();
        for step in 0..case.steps {
            let Step {
                key,
                value,
                plan,
                bi,
            } = case.step(step);
            quant::insert_u8(&l, &plan, &bi, &key, &value, &mut kc, &mut vc);
            given.resize(plan.len(), Vec::new());
            for (s, sp) in plan.iter().enumerate() {
                for i in 0..sp.n {
                    let t = sp.begin + i;
                    let w = l.hkv * d;
                    given[s].push((
                        key[t * w..(t + 1) * w].to_vec(),
                        value[t * w..(t + 1) * w].to_vec(),
                    ));
                }
                let mut k = vec![0f32; d];
                let mut v = vec![0f32; d];
                for (pos, (kg, vg)) in given[s].iter().enumerate() {
                    let block = bi[sp.block_begin + pos / bs] as usize;
                    for h in 0..l.hkv {
                        quant::key_row(&l, &kc, block, h, pos % bs, &mut k);
                        quant::value_row(&l, &vc, block, h, pos % bs, &mut v);
                        let (kg, vg) = (&kg[h * d..(h + 1) * d], &vg[h * d..(h + 1) * d]);
                        let step_of = |xs: &[f32]| {
                            let (lo, hi) = xs
                                .iter()
                                .fold((f32::MAX, f32::MIN), |(a, b), &x| (a.min(x), b.max(x)));
                            (hi - lo) / 255.0
                        };
                        // values: half a step of the group's range (+ f32 rounding)
                        let g = if l.value_group == 0 { d } else { l.value_group };
                        for (c, (gs, vs)) in vg.chunks(g).zip(v.chunks(g)).enumerate() {
                            let tol = 0.5 * step_of(gs) * 1.0001 + 1e-5;
                            for (a, b) in gs.iter().zip(vs) {
                                assert!(
                                    (a - b).abs() <= tol,
                                    "{} value group {c}: {a} vs {b}",
                                    case.name
                                );
                            }
                        }
                        // keys: the block's range per channel bounds the step; two roundings at most
                        for j in 0..d {
                            let lo_block = pos - pos % bs;
                            let hi_block = (lo_block + bs).min(given[s].len());
                            let col: Vec<f32> = match l.key {
                                KeyQuant::ByChannel => (lo_block..hi_block)
                                    .map(|p| given[s][p].0[h * d + j])
                                    .collect(),
                                KeyQuant::ByToken { group } => {
                                    let g = if group == 0 { d } else { group };
                                    kg[j / g * g..(j / g + 1) * g].to_vec()
                                }
                            };
                            let tol = step_of(&col) * 1.0001 + 1e-4;
                            assert!(
                                (kg[j] - k[j]).abs() <= tol,
                                "{} key pos {pos} ch {j}: {} vs {}",
                                case.name,
                                kg[j],
                                k[j]
                            );
                        }
                    }
                }
            }
        }
    }
}
