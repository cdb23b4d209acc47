//! The fast kernels (each SIMD level the CPU has, and the scalar one forced) against the
//! reference kernels on seeded random calls, and 1 vs 2 threads bit-identical.
//!
//! Tolerances: outputs are convex combinations of values in [-1, 1]: f32 within 2e-6 (relative
//! to max(1, |ref|)); f16/bf16 outputs within 1 ulp of the output type plus 2e-6. Scores (sums
//! of up to H*w weights) within 1e-5 relative to max(1, |ref|), plus 1 ulp for f16/bf16. Caches
//! bit-identical (insertion and rotation use the same arithmetic as the reference).

use half::{bf16, f16};
use paged_attention::execute_reference;
use paged_attention::kernel::fast::{execute_with, FastOptions, ScoresMode, SimdLevel};
use paged_attention::{ElemType, PaInputs, PaOutputs, Tensor, TensorMut};

/// xorshift64*: small, seeded, no dependency.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn uniform(&mut self, a: f32) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * a
    }
}

#[derive(Clone, Debug)]
enum Buf {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
}

impl Buf {
    fn from_f32(t: ElemType, v: &[f32]) -> Buf {
        match t {
            ElemType::F32 => Buf::F32(v.to_vec()),
            ElemType::F16 => Buf::F16(v.iter().map(|&x| f16::from_f32(x)).collect()),
            _ => Buf::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect()),
        }
    }
    fn zeros(t: ElemType, n: usize) -> Buf {
        Buf::from_f32(t, &vec![0.0; n])
    }
    fn t<'a>(&'a self, shape: &[usize]) -> Tensor<'a> {
        match self {
            Buf::F32(v) => Tensor::new(shape, v),
            Buf::F16(v) => Tensor::new(shape, v),
            Buf::BF16(v) => Tensor::new(shape, v),
        }
    }
    fn tm<'a>(&'a mut self, shape: &[usize]) -> TensorMut<'a> {
        match self {
            Buf::F32(v) => TensorMut::new(shape, v),
            Buf::F16(v) => TensorMut::new(shape, v),
            Buf::BF16(v) => TensorMut::new(shape, v),
        }
    }
    fn f32s(&self) -> Vec<f32> {
        match self {
            Buf::F32(v) => v.clone(),
            Buf::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            Buf::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
        }
    }
    fn bits(&self) -> Vec<u32> {
        match self {
            Buf::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Buf::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            Buf::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
        }
    }
}

/// Rotation inputs: rotated block indices, deltas, delta columns, LUT, LUT rows.
type Rot = (Vec<i32>, Vec<i32>, usize, Vec<f32>, usize);

/// One random call: all inputs, owned.
#[derive(Clone, Debug)]
struct Case {
    name: String,
    h: usize,
    hkv: usize,
    d: usize,
    dv: usize,
    bs: usize,
    nb: usize,
    qt: ElemType,
    #[allow(dead_code)]
    ct: ElemType,
    q: Buf,
    k: Buf,
    v: Buf,
    kc: Buf,
    vc: Buf,
    past: Vec<i32>,
    begins: Vec<i32>,
    bi: Vec<i32>,
    bib: Vec<i32>,
    scale: Option<Vec<f32>>,
    window: Option<i32>,
    alibi: Option<Vec<f32>>,
    rot: Option<Rot>,
    saw: Option<Vec<i32>>,
    sinks: Option<Vec<f32>>,
}

#[derive(Clone, Debug, Default)]
struct Spec {
    seqs: Vec<(usize, usize)>,
    h: usize,
    hkv: usize,
    d: usize,
    /// The value head size; 0 = `d`.
    dv: usize,
    bs: usize,
    window: usize,
    alibi: bool,
    scale: bool,
    rotation: bool,
    saw: Option<Vec<i32>>,
    sinks: bool,
}

fn make(rng: &mut Rng, sp: &Spec, qt: ElemType, ct: ElemType) -> Case {
    let (h, hkv, d, bs) = (sp.h, sp.hkv, sp.d, sp.bs);
    let dv = if sp.dv == 0 { d } else { sp.dv };
    let t: usize = sp.seqs.iter().map(|s| s.1).sum();
    let need: Vec<usize> = sp.seqs.iter().map(|&(p, n)| (p + n).div_ceil(bs)).collect();
    let nb = need.iter().sum::<usize>() + 3;
    // A shuffled block pool; each sequence takes its blocks, plus sometimes a -1 pad.
    let mut pool: Vec<i32> = (0..nb as i32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.below(i + 1));
    }
    let (mut bi, mut bib) = (vec![], vec![0i32]);
    let mut it = pool.iter();
    for &n in &need {
        for _ in 0..n {
            bi.push(*it.next().unwrap());
        }
        if rng.below(2) == 0 {
            bi.push(-1);
        }
        bib.push(bi.len() as i32);
    }
    let mut begins = vec![0i32];
    for s in &sp.seqs {
        begins.push(begins.last().unwrap() + s.1 as i32);
    }
    let qa = if rng.below(2) == 0 { 1.0 } else { 4.0 };
    let rv = |rng: &mut Rng, n: usize, a: f32| (0..n).map(|_| rng.uniform(a)).collect::<Vec<f32>>();
    let q = rv(rng, t * h * d, qa);
    let k = rv(rng, t * hkv * d, 1.0);
    let v = rv(rng, t * hkv * dv, 1.0);
    let kc = rv(rng, nb * hkv * bs * d, 1.0);
    let vc = rv(rng, nb * hkv * bs * dv, 1.0);
    let rot = sp.rotation.then(|| {
        let r = 1 + rng.below(3);
        let rbi: Vec<i32> = (0..r)
            .map(|_| {
                bi.iter()
                    .filter(|&&b| b >= 0)
                    .nth(rng.below(need.iter().sum()))
                    .copied()
                    .unwrap()
            })
            .collect();
        let m = 5;
        let cols = if rng.below(2) == 0 { 1 } else { bs };
        let deltas: Vec<i32> = (0..r * cols).map(|_| rng.below(m) as i32).collect();
        let mut lut = vec![0f32; m * d];
        for row in 0..m {
            for i in 0..d / 2 {
                let a = row as f32 * 0.3 + i as f32 * 0.01;
                lut[row * d + i] = a.cos();
                lut[row * d + d / 2 + i] = a.sin();
            }
        }
        (rbi, deltas, cols, lut, m)
    });
    Case {
        name: format!("{sp:?} q={qt} c={ct}"),
        h,
        hkv,
        d,
        dv,
        bs,
        nb,
        qt,
        ct,
        q: Buf::from_f32(qt, &q),
        k: Buf::from_f32(qt, &k),
        v: Buf::from_f32(qt, &v),
        kc: Buf::from_f32(ct, &kc),
        vc: Buf::from_f32(ct, &vc),
        past: sp.seqs.iter().map(|s| s.0 as i32).collect(),
        begins,
        bi,
        bib,
        scale: sp.scale.then(|| vec![0.05 + rng.uniform(0.04).abs()]),
        window: (sp.window > 0).then_some(sp.window as i32),
        alibi: sp.alibi.then(|| rv(rng, h, 0.5)),
        rot,
        saw: sp.saw.clone(),
        // Around the logits' range: from rows their sink dominates to rows it barely touches.
        sinks: sp
            .sinks
            .then(|| (0..h).map(|_| 1.5 + 4.5 * rng.uniform(1.0)).collect()),
    }
}

struct Result_ {
    out: Buf,
    scores: Buf,
    kc: Buf,
    vc: Buf,
}

fn run(
    c: &Case,
    f: &dyn Fn(&mut PaInputs<'_>, &mut PaOutputs<'_>) -> paged_attention::error::Result<()>,
) -> Result_ {
    let (h, hkv, d, dv, bs, nb) = (c.h, c.hkv, c.d, c.dv, c.bs, c.nb);
    let t = *c.begins.last().unwrap() as usize;
    let scores_len = c.past.iter().map(|&p| p as usize).sum::<usize>() + t;
    let (mut kc, mut vc) = (c.kc.clone(), c.vc.clone());
    let mut out = Buf::zeros(c.qt, t * h * dv);
    let mut scores = Buf::zeros(c.qt, scores_len);
    let b = c.past.len();
    let scale_buf = c.scale.as_ref().map(|s| Buf::from_f32(c.qt, s));
    let alibi_buf = c.alibi.as_ref().map(|a| Buf::from_f32(c.qt, a));
    let sink_buf = c.sinks.as_ref().map(|a| Buf::from_f32(c.qt, a));
    let win = c.window.map(|w| vec![w]);
    let lut_buf = c.rot.as_ref().map(|r| {
        Buf::from_f32(
            if c.qt == ElemType::F16 {
                ElemType::F16
            } else {
                ElemType::F32
            },
            &r.3,
        )
    });
    {
        let mut inputs = PaInputs {
            query: c.q.t(&[t, h * d]),
            key: c.k.t(&[t, hkv * d]),
            value: c.v.t(&[t, hkv * dv]),
            key_cache: kc.tm(&[nb, hkv, bs, d]),
            value_cache: vc.tm(&[nb, hkv, bs, dv]),
            past_lens: Tensor::new(&[b], &c.past),
            subsequence_begins: Tensor::new(&[b + 1], &c.begins),
            block_indices: Tensor::new(&[c.bi.len()], &c.bi),
            block_indices_begins: Tensor::new(&[b + 1], &c.bib),
            scale: scale_buf.as_ref().map(|s| s.t(&[])),
            sliding_window: win.as_ref().map(Tensor::scalar),
            alibi_slopes: alibi_buf.as_ref().map(|a| a.t(&[h])),
            rotated_block_indices: c.rot.as_ref().map(|r| Tensor::new(&[r.0.len()], &r.0)),
            rotation_deltas: c.rot.as_ref().map(|r| Tensor::new(&[r.0.len(), r.2], &r.1)),
            rotation_trig_lut: c
                .rot
                .as_ref()
                .zip(lut_buf.as_ref())
                .map(|(r, l)| l.t(&[r.4, d])),
            score_aggregation_window: c.saw.as_ref().map(|w| {
                if w.len() == 1 {
                    Tensor::scalar(w)
                } else {
                    Tensor::new(&[w.len()], w)
                }
            }),
            sinks: sink_buf.as_ref().map(|a| a.t(&[1, h, 1, 1])),
        };
        let mut outputs = PaOutputs {
            output: out.tm(&[t, h * dv]),
            scores: scores.tm(&[scores_len]),
        };
        f(&mut inputs, &mut outputs).unwrap_or_else(|e| panic!("{}: {e}", c.name));
    }
    Result_ {
        out,
        scores,
        kc,
        vc,
    }
}

fn ulp(t: ElemType, x: f32) -> f32 {
    let bits = match t {
        ElemType::F16 => 10,
        ElemType::BF16 => 7,
        _ => return 0.0,
    };
    let e = x.abs().max(6.1e-5).log2().floor();
    2f32.powf(e - bits as f32)
}

fn compare(c: &Case, what: &str, got: &Result_, want: &Result_) {
    let (go, wo) = (got.out.f32s(), want.out.f32s());
    for (i, (&a, &b)) in go.iter().zip(&wo).enumerate() {
        let tol = 2e-6 * b.abs().max(1.0) + ulp(c.qt, b);
        assert!(
            (a - b).abs() <= tol,
            "{what} {}: output[{i}] = {a}, reference {b} (tol {tol})",
            c.name
        );
    }
    let (gs, ws) = (got.scores.f32s(), want.scores.f32s());
    for (i, (&a, &b)) in gs.iter().zip(&ws).enumerate() {
        let tol = 1e-5 * b.abs().max(1.0) + ulp(c.qt, b);
        assert!(
            (a - b).abs() <= tol,
            "{what} {}: scores[{i}] = {a}, reference {b} (tol {tol})",
            c.name
        );
    }
    assert!(
        got.kc.bits() == want.kc.bits(),
        "{what} {}: key_cache differs from the reference",
        c.name
    );
    assert!(
        got.vc.bits() == want.vc.bits(),
        "{what} {}: value_cache differs from the reference",
        c.name
    );
}

const TYPES: [ElemType; 3] = [ElemType::F32, ElemType::F16, ElemType::BF16];

/// Every SIMD level this CPU runs (the scalar one always) but AMX, which differs from
/// `avx512bf16` only in where bf16 products run, printed once per test process so a run shows
/// which tiers it held against the reference (`--nocapture`). Prefill of a bf16 query on the
/// bf16 tiers (`avx512bf16`, `amx`) is bf16 math, held to the float64 reference's 1e-2 in
/// `tests/amx.rs` ([`f32_math`] leaves it out here); every other call is f32 math on them.
fn levels() -> Vec<SimdLevel> {
    let v: Vec<SimdLevel> = SimdLevel::ALL
        .into_iter()
        .filter(|l| l.effective() == *l && *l != SimdLevel::Amx)
        .collect();
    static PRINTED: std::sync::Once = std::sync::Once::new();
    PRINTED.call_once(|| {
        let names: Vec<&str> = v.iter().map(|l| l.name()).collect();
        eprintln!("tiers exercised: {}", names.join(" "));
    });
    v
}

/// The tiers the CPU reports (asked here directly, not through the crate's detection) are all
/// among the levels the tests run, so a broken detection cannot silently skip a tier.
#[test]
fn every_tier_the_cpu_has_is_exercised() {
    let run = levels();
    assert!(run.contains(&SimdLevel::Scalar));
    #[cfg(target_arch = "x86_64")]
    {
        let has = |fs: &[bool]| fs.iter().all(|&f| f);
        let avx2 = has(&[
            is_x86_feature_detected!("avx2"),
            is_x86_feature_detected!("fma"),
            is_x86_feature_detected!("f16c"),
        ]);
        let avx512 = avx2
            && has(&[
                is_x86_feature_detected!("avx512f"),
                is_x86_feature_detected!("avx512bw"),
                is_x86_feature_detected!("avx512vl"),
                is_x86_feature_detected!("avx512dq"),
            ]);
        assert_eq!(run.contains(&SimdLevel::Avx2), avx2, "tiers run: {run:?}");
        assert_eq!(
            run.contains(&SimdLevel::Avx512),
            avx512,
            "tiers run: {run:?}"
        );
        let avx512bf16 = avx512 && is_x86_feature_detected!("avx512bf16");
        assert_eq!(
            run.contains(&SimdLevel::Avx512Bf16),
            avx512bf16,
            "tiers run: {run:?}"
        );
    }
}

/// `PA_SIMD` names round-trip, and asking for a level gives it when the CPU has it, else the
/// best level the CPU has.
#[test]
fn simd_levels_fall_back_to_the_best_the_cpu_has() {
    let best = SimdLevel::detected();
    for l in SimdLevel::ALL {
        assert_eq!(SimdLevel::parse(l.name()), Some(l));
        let want = if l <= best { l } else { best };
        assert_eq!(l.effective(), want, "{l:?} on a CPU whose best is {best:?}");
    }
    assert_eq!(SimdLevel::parse("avx1024"), None);
}

/// Whether a call of query type `qt` at `simd` is f32 math (what this file holds to 2e-6): all
/// but a bf16 query on a bf16 tier.
fn f32_math(simd: SimdLevel, qt: ElemType) -> bool {
    simd < SimdLevel::Avx512Bf16 || qt != ElemType::BF16
}

fn check_spec(rng: &mut Rng, sp: &Spec, types: &[(ElemType, ElemType)]) {
    for &(qt, ct) in types {
        let c = make(rng, sp, qt, ct);
        let want = run(&c, &|i, o| execute_reference(i, o));
        for simd in levels().into_iter().filter(|&l| f32_math(l, qt)) {
            for scores in [ScoresMode::Auto, ScoresMode::Recompute] {
                let opts = FastOptions {
                    simd,
                    scores,
                    ..FastOptions::default()
                };
                let got = run(&c, &|i, o| execute_with(opts, i, o));
                compare(&c, &format!("{opts:?}"), &got, &want);
            }
        }
    }
}

fn all_types() -> Vec<(ElemType, ElemType)> {
    TYPES
        .iter()
        .flat_map(|&q| TYPES.iter().map(move |&c| (q, c)))
        .collect()
}

fn base(seqs: &[(usize, usize)]) -> Spec {
    Spec {
        seqs: seqs.to_vec(),
        h: 8,
        hkv: 2,
        d: 64,
        bs: 16,
        ..Default::default()
    }
}

#[test]
fn fast_matches_reference_on_decode_for_all_dtype_pairs() {
    let mut rng = Rng(1);
    check_spec(
        &mut rng,
        &base(&[(700, 1), (33, 1), (0, 1), (16, 1)]),
        &all_types(),
    );
}

#[test]
fn fast_matches_reference_on_prefill_for_all_dtype_pairs() {
    let mut rng = Rng(2);
    check_spec(&mut rng, &base(&[(0, 70)]), &all_types());
    check_spec(&mut rng, &base(&[(37, 45)]), &all_types());
}

#[test]
fn fast_matches_reference_on_mixed_batches_with_empty_sequences() {
    let mut rng = Rng(3);
    check_spec(
        &mut rng,
        &base(&[(100, 40), (5, 0), (300, 1), (0, 0), (0, 3), (64, 9)]),
        &all_types(),
    );
}

#[test]
fn fast_matches_reference_for_gqa_group_sizes() {
    let mut rng = Rng(4);
    for (h, hkv) in [(4, 4), (8, 2), (16, 2), (3, 3), (12, 4)] {
        let sp = Spec {
            h,
            hkv,
            ..base(&[(90, 1), (20, 25)])
        };
        check_spec(
            &mut rng,
            &sp,
            &[
                (ElemType::F32, ElemType::F32),
                (ElemType::F32, ElemType::F16),
            ],
        );
    }
}

#[test]
fn fast_matches_reference_for_block_and_head_sizes() {
    let mut rng = Rng(5);
    for bs in [1, 16, 32, 48] {
        for d in [16, 64, 80, 96, 128, 256, 7, 17, 1] {
            let sp = Spec {
                bs,
                d,
                ..base(&[(50, 1), (10, 20)])
            };
            check_spec(
                &mut rng,
                &sp,
                &[
                    (ElemType::F32, ElemType::F32),
                    (ElemType::BF16, ElemType::F16),
                ],
            );
        }
    }
}

#[test]
fn fast_matches_reference_with_window_alibi_scale_rotation() {
    let mut rng = Rng(6);
    for (window, alibi, scale, rotation) in [
        (7, false, false, false),
        (40, false, true, false),
        (0, true, false, false),
        (20, true, true, true),
        (0, false, false, true),
        (1, false, false, false),
    ] {
        let sp = Spec {
            window,
            alibi,
            scale,
            rotation,
            ..base(&[(90, 1), (30, 37), (0, 12)])
        };
        check_spec(&mut rng, &sp, &all_types());
    }
}

#[test]
fn fast_matches_reference_for_score_windows() {
    let mut rng = Rng(7);
    for saw in [vec![-1], vec![0], vec![5], vec![3, -1, 0], vec![100]] {
        let mut sp = base(&[(40, 9), (70, 1), (0, 20)]);
        if saw.len() == 1 {
            sp.seqs.truncate(3);
        }
        sp.saw = Some(saw);
        check_spec(
            &mut rng,
            &sp,
            &[
                (ElemType::F32, ElemType::F32),
                (ElemType::F16, ElemType::BF16),
            ],
        );
    }
}

#[test]
fn fast_matches_reference_on_long_decode_split_into_chunks() {
    let mut rng = Rng(8);
    let sp = Spec {
        h: 8,
        hkv: 1,
        d: 32,
        bs: 32,
        ..base(&[(5000, 1), (1100, 2)])
    };
    check_spec(
        &mut rng,
        &sp,
        &[
            (ElemType::F32, ElemType::F32),
            (ElemType::F32, ElemType::BF16),
        ],
    );
    let sp = Spec { window: 1500, ..sp };
    check_spec(&mut rng, &sp, &[(ElemType::F32, ElemType::F16)]);
}

/// Attention sinks on every tier, every dtype pair, with scores of every new token stashed and
/// recomputed: decode, prefill, mixed batches, GQA 1 and 8, long decodes cut into key chunks,
/// a window.
#[test]
fn fast_matches_reference_with_sinks() {
    let mut rng = Rng(21);
    let saw = Some(vec![-1, -1, -1]);
    for seqs in [
        &[(40, 1), (0, 33), (17, 9)][..],
        &[(0, 70), (3, 1), (0, 0)][..],
    ] {
        let sp = Spec {
            sinks: true,
            saw: saw.clone(),
            ..base(seqs)
        };
        check_spec(&mut rng, &sp, &all_types());
        let sp = Spec {
            h: 8,
            hkv: 1,
            window: 20,
            ..sp
        };
        check_spec(&mut rng, &sp, &[(ElemType::BF16, ElemType::F16)]);
    }
    let sp = Spec {
        h: 4,
        hkv: 4,
        d: 32,
        bs: 32,
        sinks: true,
        saw: Some(vec![-1, -1]),
        ..base(&[(5000, 1), (1100, 2)])
    };
    check_spec(
        &mut rng,
        &sp,
        &[
            (ElemType::F32, ElemType::F32),
            (ElemType::BF16, ElemType::BF16),
        ],
    );
}

/// A value head size other than the key's (value cache `[NB, Hkv, BS, Dv]`, output
/// `[T, H*Dv]`) on every tier: decode, prefill, mixed batches, long decodes cut into key
/// chunks, windows, ALiBi, rotation, sinks and scores (stashed and recomputed), values wider and
/// narrower than keys, sizes off the vector width.
#[test]
fn fast_matches_reference_with_value_head_size_other_than_key_head_size() {
    let mut rng = Rng(33);
    for (d, dv) in [(64, 32), (32, 96), (16, 40)] {
        let sp = Spec {
            d,
            dv,
            saw: Some(vec![-1, -1, -1]),
            ..base(&[(40, 1), (0, 70), (17, 9)])
        };
        check_spec(&mut rng, &sp, &all_types());
        let sp = Spec {
            window: 20,
            alibi: true,
            scale: true,
            rotation: true,
            sinks: true,
            ..sp
        };
        check_spec(
            &mut rng,
            &sp,
            &[
                (ElemType::F32, ElemType::F32),
                (ElemType::BF16, ElemType::F16),
            ],
        );
    }
    let sp = Spec {
        h: 8,
        hkv: 1,
        d: 32,
        dv: 64,
        bs: 32,
        sinks: true,
        saw: Some(vec![-1, -1]),
        ..base(&[(5000, 1), (1100, 2)])
    };
    check_spec(
        &mut rng,
        &sp,
        &[
            (ElemType::F32, ElemType::F32),
            (ElemType::F16, ElemType::BF16),
        ],
    );
}

#[test]
fn fast_results_do_not_depend_on_thread_count() {
    let mut rng = Rng(9);
    let sp = Spec {
        h: 8,
        hkv: 2,
        d: 64,
        bs: 32,
        alibi: true,
        saw: Some(vec![-1]),
        ..base(&[(2000, 1), (300, 70), (40, 1), (0, 33)])
    };
    for (qt, ct) in [
        (ElemType::F32, ElemType::F32),
        (ElemType::F16, ElemType::BF16),
    ] {
        let c = make(&mut rng, &sp, qt, ct);
        for simd in levels() {
            let opts = FastOptions {
                simd,
                scores: ScoresMode::Auto,
                ..FastOptions::default()
            };
            let pool = |n| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(n)
                    .build()
                    .unwrap()
            };
            let a = pool(1).install(|| run(&c, &|i, o| execute_with(opts, i, o)));
            let b = pool(2).install(|| run(&c, &|i, o| execute_with(opts, i, o)));
            let e = pool(3).install(|| run(&c, &|i, o| execute_with(opts, i, o)));
            for r in [&b, &e] {
                assert!(
                    a.out.bits() == r.out.bits(),
                    "{simd:?}: output differs between thread counts"
                );
                assert!(
                    a.scores.bits() == r.scores.bits(),
                    "{simd:?}: scores differ between thread counts"
                );
                assert!(
                    a.kc.bits() == r.kc.bits() && a.vc.bits() == r.vc.bits(),
                    "{simd:?}: caches differ"
                );
            }
        }
    }
}

#[test]
fn fast_decode_tiles_match_reference_for_every_group_size_head_size_and_block_size() {
    // Decode items run their own loops: rows of 1..8 query heads per KV head (and several new
    // tokens), head sizes that leave 24/16/8/single-column remainders, blocks of 1 key up to
    // more keys than one staging pass of weights (64), contexts at chunk edges.
    let mut rng = Rng(10);
    for (h, hkv) in [(1, 1), (2, 1), (6, 2), (5, 1), (7, 1), (16, 2), (24, 8)] {
        for (d, bs) in [(1, 1), (7, 3), (24, 16), (40, 80), (56, 32), (136, 5)] {
            let sp = Spec {
                h,
                hkv,
                d,
                bs,
                ..base(&[
                    (0, 1),
                    (1, 1),
                    (bs * 9 - 1, 1),
                    (bs * 9, 2),
                    (257, 3),
                    (3 * bs + 1, 4),
                ])
            };
            check_spec(
                &mut rng,
                &sp,
                &[
                    (ElemType::F32, ElemType::F32),
                    (ElemType::F32, ElemType::F16),
                    (ElemType::BF16, ElemType::BF16),
                ],
            );
        }
    }
}

#[test]
fn fast_decode_matches_reference_across_chunk_edges() {
    let mut rng = Rng(11);
    for ctx in [255, 256, 257, 511, 4096, 4097, 16 * 256 + 33] {
        let sp = Spec {
            h: 8,
            hkv: 2,
            d: 32,
            bs: 32,
            ..base(&[(ctx - 1, 1), (ctx, 1)])
        };
        check_spec(&mut rng, &sp, &[(ElemType::F32, ElemType::F32)]);
        let sp = Spec {
            window: 300,
            alibi: true,
            ..sp
        };
        check_spec(&mut rng, &sp, &[(ElemType::F16, ElemType::F16)]);
    }
}

/// Prefill tiles: rows not a multiple of 8 or 16 (G = 3, 5, 1), odd D and D not a multiple
/// of 8, BS = 1 and BS not a multiple of the 6-key QK block, key tiles cut mid-block by the
/// causal edge, and f16/bf16 caches both widened once per call (short past) and tile by tile
/// (a past too long for the per-call copy).
#[test]
fn fast_matches_reference_on_prefill_tile_edges() {
    let mut rng = Rng(10);
    for (h, hkv, d, bs, seqs) in [
        (6, 2, 13, 7, vec![(0, 50), (9, 23)]),
        (5, 1, 24, 1, vec![(3, 40)]),
        (4, 4, 9, 32, vec![(61, 70)]),
        (8, 2, 40, 16, vec![(1500, 20)]),
        (8, 2, 17, 8, vec![(700, 12), (0, 9)]),
    ] {
        let sp = Spec {
            h,
            hkv,
            d,
            bs,
            ..base(&seqs)
        };
        check_spec(
            &mut rng,
            &sp,
            &[
                (ElemType::F32, ElemType::F32),
                (ElemType::F32, ElemType::F16),
                (ElemType::BF16, ElemType::BF16),
            ],
        );
    }
}
