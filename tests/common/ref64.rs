//! A float64 reference of the PagedAttention op, written from SPEC.md alone, and a seeded
//! random case generator. Nothing here calls or mirrors the crate's kernels: the only crate
//! items used are the public types needed to hand a case to the op (through `super::call`).
//!
//! A [`Case`] holds every value already rounded to the type it is stored in (query type for
//! query/key/value/scale/slopes, cache type for the caches, LUT type for the LUT), so the
//! reference is "fed the same rounded values" as the kernel. The reference then rounds to the
//! cache type exactly where the op stores into the cache (rotated keys, inserted rows), and
//! computes attention and scores in f64.

use super::call::{round_to, Call, Data, Owned};
use paged_attention::ElemType;

/// A tiny seeded PRNG (splitmix64); no crates.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        assert!(lo <= hi);
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in `[lo, hi)`.
    pub fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }
    pub fn chance(&mut self, p: f64) -> bool {
        self.unit() < p
    }
    pub fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.range(0, v.len() - 1)]
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.range(0, i);
            v.swap(i, j);
        }
    }
}

/// Shape of `rotation_deltas`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(clippy::enum_variant_names)]
pub enum DeltaForm {
    /// `[R]`: one delta per block.
    PerBlock,
    /// `[R, 1]`: one delta per block.
    PerBlockCol,
    /// `[R, BS]`: one delta per slot.
    PerSlot,
}

#[derive(Clone, Debug)]
pub struct RotationCase {
    pub blocks: Vec<i32>,
    pub form: DeltaForm,
    /// `R * cols` deltas, row-major.
    pub deltas: Vec<i32>,
    /// `[M, D]`: cos of M angles sets in the first D/2 columns, sin in the last D/2.
    pub lut: Vec<f64>,
    pub m: usize,
    pub lut_type: ElemType,
}

impl RotationCase {
    pub fn cols(&self, bs: usize) -> usize {
        match self.form {
            DeltaForm::PerSlot => bs,
            _ => 1,
        }
    }
}

/// score_aggregation_window.
#[derive(Clone, Debug, PartialEq)]
pub enum ScoreWindow {
    Scalar(i32),
    PerSeq(Vec<i32>),
}

/// One sequence: tokens already cached and new tokens of this call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Seq {
    pub past: usize,
    pub n: usize,
}

/// A complete op call in f64, every value already rounded to its storage type.
#[derive(Clone, Debug)]
pub struct Case {
    pub qt: ElemType,
    pub ct: ElemType,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    /// Value head size (`d` unless a test sets another: value `[T, Hkv*Dv]`, value cache
    /// `[NB, Hkv, BS, Dv]`, output `[T, H*Dv]`).
    pub dv: usize,
    pub bs: usize,
    pub nb: usize,
    pub seqs: Vec<Seq>,
    /// `[T, H*D]`
    pub query: Vec<f64>,
    /// `[T, Hkv*D]`
    pub key: Vec<f64>,
    pub value: Vec<f64>,
    /// `[NB, Hkv, BS, D]`
    pub key_cache: Vec<f64>,
    pub value_cache: Vec<f64>,
    pub block_indices: Vec<i32>,
    pub block_indices_begins: Vec<i32>,
    /// `None`: not provided. `Some(0.0)`: the default 1/sqrt(D) too.
    pub scale: Option<f64>,
    pub sliding_window: Option<i32>,
    pub alibi: Option<Vec<f64>>,
    /// One sink logit per query head (input 16), given as `[H]` or, with `sinks_4d`,
    /// `[1, H, 1, 1]`.
    pub sinks: Option<Vec<f64>>,
    pub sinks_4d: bool,
    pub rotation: Option<RotationCase>,
    pub score_window: Option<ScoreWindow>,
    /// Give absent optional inputs as empty tensors up to input 15 (instead of omitting the
    /// trailing ones).
    pub all_16: bool,
    /// Give scalars as one-element rank-1 tensors.
    pub rank1_scalars: bool,
}

impl Case {
    pub fn t(&self) -> usize {
        self.seqs.iter().map(|s| s.n).sum()
    }
    pub fn b(&self) -> usize {
        self.seqs.len()
    }
    pub fn g(&self) -> usize {
        self.h / self.hkv
    }
    pub fn past_lens(&self) -> Vec<i32> {
        self.seqs.iter().map(|s| s.past as i32).collect()
    }
    pub fn subsequence_begins(&self) -> Vec<i32> {
        let mut v = vec![0i32];
        for s in &self.seqs {
            v.push(v.last().unwrap() + s.n as i32);
        }
        v
    }
    pub fn scores_len(&self) -> usize {
        self.seqs.iter().map(|s| s.past + s.n).sum()
    }
    /// Offset of row (block, kv head, slot) in a cache.
    pub fn vrow(&self, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.hkv + head) * self.bs + slot) * self.dv
    }
    pub fn row(&self, block: usize, head: usize, slot: usize) -> usize {
        ((block * self.hkv + head) * self.bs + slot) * self.d
    }
    /// Physical block holding logical position `pos` of sequence `s`.
    pub fn block_of(&self, s: usize, pos: usize) -> usize {
        let id = self.block_indices[self.block_indices_begins[s] as usize + pos / self.bs];
        assert!(
            id >= 0,
            "case bug: position {pos} of sequence {s} in a -1 slot"
        );
        id as usize
    }
    pub fn describe(&self) -> String {
        format!(
            "q={} c={} H={} Hkv={} D={} BS={} NB={} seqs={:?} scale={:?} window={:?} alibi={} sinks={} rot={:?} scorew={:?} all16={}",
            self.qt,
            self.ct,
            self.h,
            self.hkv,
            self.d,
            self.bs,
            self.nb,
            self.seqs.iter().map(|s| (s.past, s.n)).collect::<Vec<_>>(),
            self.scale,
            self.sliding_window,
            self.alibi.is_some(),
            self.sinks.is_some(),
            self.rotation.as_ref().map(|r| (r.blocks.len(), r.form, r.m, r.lut_type)),
            self.score_window,
            self.all_16,
        )
    }

    /// The call as the op takes it, with output buffers filled with NaN.
    pub fn to_call(&self) -> Call {
        let (t, qt, ct) = (self.t(), self.qt, self.ct);
        let cache_shape = [self.nb, self.hkv, self.bs, self.d];
        let b = self.b();
        let mut inputs = vec![
            Owned::new(&[t, self.h * self.d], Data::from_f64(qt, &self.query)),
            Owned::new(&[t, self.hkv * self.d], Data::from_f64(qt, &self.key)),
            Owned::new(&[t, self.hkv * self.dv], Data::from_f64(qt, &self.value)),
            Owned::new(&cache_shape, Data::from_f64(ct, &self.key_cache)),
            Owned::new(
                &[self.nb, self.hkv, self.bs, self.dv],
                Data::from_f64(ct, &self.value_cache),
            ),
            Owned::i32s(&[b], self.past_lens()),
            Owned::i32s(&[b + 1], self.subsequence_begins()),
            Owned::i32s(&[self.block_indices.len()], self.block_indices.clone()),
            Owned::i32s(&[b + 1], self.block_indices_begins.clone()),
        ];
        let scalar_shape: &[usize] = if self.rank1_scalars { &[1] } else { &[] };
        let mut opt: Vec<Option<Owned>> = vec![None; 8];
        if let Some(s) = self.scale {
            opt[0] = Some(Owned::new(scalar_shape, Data::from_f64(qt, &[s])));
        }
        if let Some(w) = self.sliding_window {
            opt[1] = Some(Owned::i32s(scalar_shape, vec![w]));
        }
        if let Some(a) = &self.alibi {
            opt[2] = Some(Owned::new(&[self.h], Data::from_f64(qt, a)));
        }
        if let Some(r) = &self.rotation {
            let nr = r.blocks.len();
            opt[3] = Some(Owned::i32s(&[nr], r.blocks.clone()));
            let shape = match r.form {
                DeltaForm::PerBlock => vec![nr],
                DeltaForm::PerBlockCol => vec![nr, 1],
                DeltaForm::PerSlot => vec![nr, self.bs],
            };
            opt[4] = Some(Owned::i32s(&shape, r.deltas.clone()));
            opt[5] = Some(Owned::new(
                &[r.m, self.d],
                Data::from_f64(r.lut_type, &r.lut),
            ));
        }
        match &self.score_window {
            None => {}
            Some(ScoreWindow::Scalar(w)) => {
                // A one-element [1] window is a per-sequence window when B = 1 only.
                let shape: &[usize] = if b == 1 { scalar_shape } else { &[] };
                opt[6] = Some(Owned::i32s(shape, vec![*w]));
            }
            Some(ScoreWindow::PerSeq(v)) => opt[6] = Some(Owned::i32s(&[b], v.clone())),
        }
        if let Some(sk) = &self.sinks {
            let shape = if self.sinks_4d {
                vec![1, self.h, 1, 1]
            } else {
                vec![self.h]
            };
            opt[7] = Some(Owned::new(&shape, Data::from_f64(qt, sk)));
        }
        let last = opt.iter().rposition(|o| o.is_some());
        let last = if self.all_16 {
            Some(last.map_or(6, |l| l.max(6)))
        } else {
            last
        };
        let empty_types = [
            qt,
            ElemType::I32,
            qt,
            ElemType::I32,
            ElemType::I32,
            ElemType::F32,
            ElemType::I32,
            qt,
        ];
        if let Some(last) = last {
            for (i, o) in opt.into_iter().enumerate().take(last + 1) {
                inputs.push(o.unwrap_or_else(|| Owned::empty(empty_types[i])));
            }
        }
        Call {
            inputs,
            outputs: [
                Owned::new(
                    &[t, self.h * self.dv],
                    Data::poison(qt, t * self.h * self.dv),
                ),
                Owned::new(&[self.scores_len()], Data::poison(qt, self.scores_len())),
            ],
        }
    }
}

/// What the reference computes: outputs and expected caches, plus which cache rows matter.
#[derive(Clone, Debug)]
pub struct Expected {
    pub output: Vec<f64>,
    pub scores: Vec<f64>,
    pub key_cache: Vec<f64>,
    pub value_cache: Vec<f64>,
    /// Per cache row (block, kv head, slot): what the kernel must leave there.
    pub rows: Vec<RowRule>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RowRule {
    /// Bit-identical to the value before the call (a cached token not rotated, or a block no
    /// sequence reaches and that is not rotated).
    Untouched,
    /// A new token's row: exactly the new key/value rounded to the cache type.
    Inserted,
    /// A rotated key (value untouched): close to the f64 rotation rounded to the cache type.
    Rotated,
    /// A slot past a sequence's length in a block it reaches: don't care.
    DontCare,
}

/// A logit as the op holds it (contract, "Non-finite values"): the op computes logits in f32,
/// where one beyond the range is an infinity, and `+inf` counts as the largest finite f32 (so
/// the keys whose logits overflow share the weight); NaN stays NaN.
fn f32_logit(l: f64) -> f64 {
    let max = f32::MAX as f64;
    if l > max {
        max
    } else if l < -max {
        f64::NEG_INFINITY
    } else {
        l
    }
}

/// The op, in f64, in SPEC order.
pub fn reference(c: &Case) -> Expected {
    let (d, dv, bs, hkv, h, g) = (c.d, c.dv, c.bs, c.hkv, c.h, c.g());
    let mut kc = c.key_cache.clone();
    let mut vc = c.value_cache.clone();
    let nrows = c.nb * hkv * bs;

    // Which rows hold tokens before and after the call, and which blocks are reached.
    let mut rows = vec![RowRule::Untouched; nrows];
    for (s, sq) in c.seqs.iter().enumerate() {
        let len = sq.past + sq.n;
        for blk in 0..len.div_ceil(bs) {
            let b = c.block_of(s, blk * bs);
            for slot in 0..bs {
                let pos = blk * bs + slot;
                for kh in 0..hkv {
                    let r = (b * hkv + kh) * bs + slot;
                    rows[r] = if pos >= len {
                        RowRule::DontCare
                    } else if pos >= sq.past {
                        RowRule::Inserted
                    } else {
                        RowRule::Untouched
                    };
                }
            }
        }
    }

    // 1. Rotation of the cached keys, rounded to the cache type when stored.
    if let Some(r) = &c.rotation {
        let half = d / 2;
        let cols = r.cols(bs);
        for (ri, &blk) in r.blocks.iter().enumerate() {
            let blk = blk as usize;
            for slot in 0..bs {
                let delta = r.deltas[ri * cols + if cols == 1 { 0 } else { slot }] as usize;
                let cos = &r.lut[delta * d..delta * d + half];
                let sin = &r.lut[delta * d + half..(delta + 1) * d];
                for kh in 0..hkv {
                    let row = c.row(blk, kh, slot);
                    let rr = (blk * hkv + kh) * bs + slot;
                    if rows[rr] == RowRule::Untouched {
                        rows[rr] = RowRule::Rotated;
                    }
                    for i in 0..half {
                        let x = kc[row + i];
                        let y = kc[row + half + i];
                        kc[row + i] = round_to(c.ct, x * cos[i] - y * sin[i]);
                        kc[row + half + i] = round_to(c.ct, x * sin[i] + y * cos[i]);
                    }
                }
            }
        }
    }

    // 2. Insertion at logical position past + i.
    let begins = c.subsequence_begins();
    for (s, sq) in c.seqs.iter().enumerate() {
        for i in 0..sq.n {
            let pos = sq.past + i;
            let tok = begins[s] as usize + i;
            let b = c.block_of(s, pos);
            for kh in 0..hkv {
                let dst = c.row(b, kh, pos % bs);
                let src = (tok * hkv + kh) * d;
                for x in 0..d {
                    kc[dst + x] = round_to(c.ct, c.key[src + x]);
                }
                let (dst, src) = (c.vrow(b, kh, pos % bs), (tok * hkv + kh) * dv);
                for x in 0..dv {
                    vc[dst + x] = round_to(c.ct, c.value[src + x]);
                }
            }
        }
    }

    // 3. Attention and 4. scores.
    let scale = match c.scale {
        Some(s) if s != 0.0 => s,
        _ => 1.0 / (d as f64).sqrt(),
    };
    let window = c.sliding_window.filter(|&w| w > 0).map(|w| w as usize);
    let t = c.t();
    let mut out = vec![0.0; t * h * dv];
    let mut scores = vec![0.0; c.scores_len()];
    let mut score_off = 0;
    for (s, sq) in c.seqs.iter().enumerate() {
        let ctx = sq.past + sq.n;
        let w = match &c.score_window {
            None => 1,
            Some(ScoreWindow::Scalar(w)) => *w,
            Some(ScoreWindow::PerSeq(v)) => v[s],
        };
        let score_tokens = if w < 0 { sq.n } else { (w as usize).min(sq.n) };
        for i in 0..sq.n {
            let tok = begins[s] as usize + i;
            let p = sq.past + i;
            let lo = window.map_or(0, |w| (p + 1).saturating_sub(w));
            for head in 0..h {
                let q = &c.query[(tok * h + head) * d..][..d];
                let kh = head / g;
                let mut logits = Vec::with_capacity(p + 1 - lo);
                for j in lo..=p {
                    let row = c.row(c.block_of(s, j), kh, j % bs);
                    let dot: f64 = (0..d).map(|x| q[x] * kc[row + x]).sum();
                    let mut l = scale * dot;
                    if let Some(a) = &c.alibi {
                        l += a[head] * (j as f64 - p as f64);
                    }
                    logits.push(f32_logit(l));
                }
                let mut m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                // A sink joins the max and the denominator and has no value.
                let sink = c.sinks.as_ref().map(|sk| f32_logit(sk[head]));
                if let Some(sk) = sink {
                    m = m.max(sk);
                }
                let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
                let sum: f64 = e.iter().sum::<f64>() + sink.map_or(0.0, |sk| (sk - m).exp());
                let o = &mut out[(tok * h + head) * dv..][..dv];
                for (k, j) in (lo..=p).enumerate() {
                    let wgt = e[k] / sum;
                    let row = c.vrow(c.block_of(s, j), kh, j % bs);
                    for x in 0..dv {
                        o[x] += wgt * vc[row + x];
                    }
                    if i >= sq.n - score_tokens {
                        scores[score_off + j] += wgt;
                    }
                }
            }
        }
        score_off += ctx;
    }
    Expected {
        output: out,
        scores,
        key_cache: kc,
        value_cache: vc,
        rows,
    }
}

/// Which features a generated case uses; `None` picks at random.
#[derive(Clone, Debug, Default)]
pub struct Features {
    pub rotation: Option<bool>,
    pub delta_form: Option<DeltaForm>,
    pub lut_type: Option<ElemType>,
    pub alibi: Option<bool>,
    pub sliding_window: Option<bool>,
    /// Scale: `Some(None)` not provided, `Some(Some(0.0))` zero, etc.
    pub scale: Option<Option<f64>>,
    pub score_window: Option<Option<ScoreWindow>>,
    /// Kinds of sequences, in order; random when `None`.
    pub seqs: Option<Vec<SeqKind>>,
    /// Fill slots that hold no token with NaN (rather than large finite garbage).
    pub nan_garbage: Option<bool>,
    /// Attention sinks: only when `Some(true)` (no random draw otherwise, so the cases of
    /// seeds chosen before sinks existed stay the same).
    pub sinks: Option<bool>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqKind {
    Prefill,
    ChunkedPrefill,
    Decode,
    Empty,
}

/// Geometry and types of a generated case.
#[derive(Clone, Debug)]
pub struct Geometry {
    pub qt: ElemType,
    pub ct: ElemType,
    pub h: usize,
    pub hkv: usize,
    pub d: usize,
    /// Value head size (`d` from [`Geometry::new`]).
    pub dv: usize,
    pub bs: usize,
    /// Most new tokens of a prefill / chunk.
    pub max_new: usize,
    /// Most cached tokens of a sequence with a past.
    pub max_past: usize,
}

impl Geometry {
    pub fn new(qt: ElemType, ct: ElemType, hkv: usize, g: usize, d: usize, bs: usize) -> Self {
        Geometry {
            qt,
            ct,
            h: hkv * g,
            hkv,
            d,
            dv: d,
            bs,
            max_new: 12,
            max_past: 40,
        }
    }
}

/// A seeded random case: a packed batch mixing prefill, chunked prefill, decode and empty
/// sequences on random non-contiguous blocks, with the features of `f` (random where unset).
pub fn gen_case(seed: u64, geo: &Geometry, f: &Features) -> Case {
    let mut rng = Rng::new(seed);
    let (qt, ct, h, hkv, d, bs) = (geo.qt, geo.ct, geo.h, geo.hkv, geo.d, geo.bs);
    let kinds = f.seqs.clone().unwrap_or_else(|| {
        let n = rng.range(1, 4);
        (0..n)
            .map(|_| {
                rng.pick(&[
                    SeqKind::Prefill,
                    SeqKind::ChunkedPrefill,
                    SeqKind::Decode,
                    SeqKind::Decode,
                    SeqKind::Empty,
                ])
            })
            .collect()
    });
    let seqs: Vec<Seq> = kinds
        .iter()
        .map(|k| match k {
            SeqKind::Prefill => Seq {
                past: 0,
                n: rng.range(1, geo.max_new),
            },
            SeqKind::ChunkedPrefill => Seq {
                past: rng.range(1, geo.max_past),
                n: rng.range(2, geo.max_new.max(2)),
            },
            SeqKind::Decode => Seq {
                past: rng.range(1, geo.max_past),
                n: 1,
            },
            SeqKind::Empty => Seq {
                past: rng.range(0, geo.max_past),
                n: 0,
            },
        })
        .collect();

    // Blocks: each sequence gets what it needs from a shuffled pool, plus free blocks nobody
    // reaches; block lists are padded with -1 (or an unreached block id) past the reached slots.
    let need: Vec<usize> = seqs.iter().map(|s| (s.past + s.n).div_ceil(bs)).collect();
    let free = rng.range(1, 3);
    let nb = need.iter().sum::<usize>() + free;
    let mut pool: Vec<i32> = (0..nb as i32).collect();
    rng.shuffle(&mut pool);
    let mut next = 0;
    let mut block_indices = Vec::new();
    let mut block_indices_begins = vec![0i32];
    for &n in &need {
        block_indices.extend_from_slice(&pool[next..next + n]);
        next += n;
        for _ in 0..rng.range(0, 2) {
            let pad = if rng.chance(0.7) {
                -1
            } else {
                pool[nb - 1 - rng.range(0, free - 1)]
            };
            block_indices.push(pad);
        }
        block_indices_begins.push(block_indices.len() as i32);
    }
    let unreached: Vec<i32> = pool[next..].to_vec();

    let t: usize = seqs.iter().map(|s| s.n).sum();
    let amp = rng.pick(&[1.0, 1.0, 3.0]);
    let mut rand_vec = |n: usize, ty: ElemType, a: f64| -> Vec<f64> {
        (0..n).map(|_| round_to(ty, rng.uniform(-a, a))).collect()
    };
    let query = rand_vec(t * h * d, qt, amp);
    let key = rand_vec(t * hkv * d, qt, 1.0);
    let dv = geo.dv;
    let value = rand_vec(t * hkv * dv, qt, 1.0);
    let mut key_cache = rand_vec(nb * hkv * bs * d, ct, 1.0);
    let mut value_cache = rand_vec(nb * hkv * bs * dv, ct, 1.0);

    let mut case = Case {
        qt,
        ct,
        h,
        hkv,
        d,
        dv,
        bs,
        nb,
        seqs,
        query,
        key,
        value,
        key_cache: vec![],
        value_cache: vec![],
        block_indices,
        block_indices_begins,
        scale: None,
        sliding_window: None,
        alibi: None,
        sinks: None,
        sinks_4d: false,
        rotation: None,
        score_window: None,
        all_16: false,
        rank1_scalars: false,
    };

    // Garbage where no token is (slots past a sequence's length, and new tokens' slots before
    // insertion): a kernel that reads them gets NaN or huge logits.
    let nan = f.nan_garbage.unwrap_or_else(|| rng.chance(0.5));
    for (s, sq) in case.seqs.iter().enumerate() {
        let len = sq.past + sq.n;
        for pos in sq.past..len.div_ceil(bs) * bs {
            let b = case.block_of(s, pos);
            for kh in 0..hkv {
                let row = case.row(b, kh, pos % bs);
                for x in 0..d {
                    key_cache[row + x] = if nan { f64::NAN } else { round_to(ct, 60.0) };
                }
                let row = case.vrow(b, kh, pos % bs);
                for x in 0..dv {
                    value_cache[row + x] = if nan {
                        f64::NAN
                    } else {
                        round_to(ct, -1000.0 - x as f64)
                    };
                }
            }
        }
    }
    case.key_cache = key_cache;
    case.value_cache = value_cache;

    let rotation = f.rotation.unwrap_or_else(|| rng.chance(0.4)) && d % 2 == 0;
    if rotation {
        // Some blocks holding cached tokens, maybe one nobody reaches; no duplicates.
        let mut candidates: Vec<i32> = Vec::new();
        for (s, sq) in case.seqs.iter().enumerate() {
            for blk in 0..sq.past.div_ceil(bs) {
                candidates.push(case.block_of(s, blk * bs) as i32);
            }
        }
        rng.shuffle(&mut candidates);
        let mut blocks: Vec<i32> = candidates
            .iter()
            .take(rng.range(1, candidates.len().max(1)))
            .copied()
            .collect();
        if blocks.is_empty() || rng.chance(0.3) {
            blocks.push(unreached[rng.range(0, unreached.len() - 1)]);
        }
        rng.shuffle(&mut blocks);
        let form = f.delta_form.unwrap_or_else(|| {
            rng.pick(&[
                DeltaForm::PerBlock,
                DeltaForm::PerBlockCol,
                DeltaForm::PerSlot,
            ])
        });
        let lut_type = f
            .lut_type
            .unwrap_or_else(|| rng.pick(&[ElemType::F32, ElemType::F16]));
        let m = rng.range(1, 6);
        let half = d / 2;
        let mut lut = vec![0.0; m * d];
        for r in 0..m {
            let shift = rng.range(0, 40) as f64;
            for i in 0..half {
                let theta = shift * 10000f64.powf(-(2.0 * i as f64) / d as f64);
                lut[r * d + i] = round_to(lut_type, theta.cos());
                lut[r * d + half + i] = round_to(lut_type, theta.sin());
            }
        }
        let cols = if form == DeltaForm::PerSlot { bs } else { 1 };
        let deltas = (0..blocks.len() * cols)
            .map(|_| rng.range(0, m - 1) as i32)
            .collect();
        case.rotation = Some(RotationCase {
            blocks,
            form,
            deltas,
            lut,
            m,
            lut_type,
        });
    }
    if f.alibi.unwrap_or_else(|| rng.chance(0.3)) {
        case.alibi = Some(
            (0..h)
                .map(|_| round_to(qt, rng.uniform(0.0, 0.5)))
                .collect(),
        );
    }
    if f.sliding_window.unwrap_or_else(|| rng.chance(0.3)) {
        let max_ctx = case.seqs.iter().map(|s| s.past + s.n).max().unwrap_or(1);
        case.sliding_window = Some(rng.range(0, max_ctx.max(1)) as i32);
    }
    case.scale = f.scale.unwrap_or_else(|| match rng.range(0, 3) {
        0 => None,
        1 => Some(0.0),
        _ => Some(round_to(qt, rng.uniform(0.03, 0.4))),
    });
    let b = case.b();
    case.score_window = f
        .score_window
        .clone()
        .unwrap_or_else(|| match rng.range(0, 3) {
            0 => None,
            1 => Some(ScoreWindow::Scalar(rng.pick(&[-1, 0, 1, 3, 100]))),
            _ => Some(ScoreWindow::PerSeq(
                (0..b).map(|_| rng.pick(&[-2, 0, 1, 2, 5, 1000])).collect(),
            )),
        });
    case.all_16 = rng.chance(0.3);
    case.rank1_scalars = rng.chance(0.3);
    if f.sinks == Some(true) {
        // Around the logits' range: some rows dominated by their sink, most not.
        case.sinks = Some(
            (0..h)
                .map(|_| round_to(qt, rng.uniform(-3.0, 6.0)))
                .collect(),
        );
        case.sinks_4d = rng.chance(0.5);
    }
    case
}

/// A case with the given sequences (past, new) and fresh values, on the geometry of `geo`.
pub fn with_seqs(geo: &Geometry, f: &Features, seqs: &[(usize, usize)], seed: u64) -> Case {
    let mut case = gen_case(
        seed,
        geo,
        &Features {
            seqs: Some(vec![SeqKind::Prefill]),
            rotation: Some(false),
            ..f.clone()
        },
    );
    let mut rng = Rng::new(seed ^ 0xA3);
    let bs = case.bs;
    let need: Vec<usize> = seqs.iter().map(|&(p, n)| (p + n).div_ceil(bs)).collect();
    let nb = need.iter().sum::<usize>() + 1;
    let mut blocks: Vec<i32> = (0..nb as i32).collect();
    rng.shuffle(&mut blocks);
    let (mut bi, mut bib) = (vec![], vec![0i32]);
    let mut it = blocks.iter();
    for &n in &need {
        bi.extend(it.by_ref().take(n));
        bib.push(bi.len() as i32);
    }
    let (h, hkv, d, dv) = (case.h, case.hkv, case.d, case.dv);
    let t: usize = seqs.iter().map(|s| s.1).sum();
    let mut r = |len: usize, ty: ElemType, a: f64| -> Vec<f64> {
        (0..len).map(|_| round_to(ty, rng.uniform(-a, a))).collect()
    };
    case.nb = nb;
    case.seqs = seqs.iter().map(|&(past, n)| Seq { past, n }).collect();
    case.query = r(t * h * d, case.qt, 3.0);
    case.key = r(t * hkv * d, case.qt, 1.0);
    case.value = r(t * hkv * dv, case.qt, 1.0);
    case.key_cache = r(nb * hkv * bs * d, case.ct, 1.0);
    case.value_cache = r(nb * hkv * bs * dv, case.ct, 1.0);
    case.block_indices = bi;
    case.block_indices_begins = bib;
    if let Some(w) = case.sliding_window {
        let max_ctx = seqs.iter().map(|s| s.0 + s.1).max().unwrap_or(1);
        case.sliding_window = Some(w.min(max_ctx as i32));
    }
    if let Some(ScoreWindow::PerSeq(_)) = case.score_window {
        case.score_window = Some(ScoreWindow::PerSeq(vec![-1; seqs.len()]));
    }
    case
}

/// `v` (finite f32 values) rounded to bf16, nearest even, kept as f64. By the bits, through
/// f32: `half`'s `bf16::from_f64` rounds some values just past a midpoint down
/// (-2.7265632152557373 gave -2.71875, not -2.734375), which a bitwise check in tests/amx.rs caught.
pub fn bf16_values(v: &[f64]) -> Vec<f64> {
    v.iter()
        .map(|&x| {
            let b = (x as f32).to_bits();
            f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000) as f64
        })
        .collect()
}
