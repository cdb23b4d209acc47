//! `pa simulate`: a synthetic serving workload run through the [`Scheduler`] twice, once with
//! paged blocks and once with contiguous max-length allocation, on the same KV memory.
//!
//! # The workload (all drawn from one splitmix64 stream seeded with `seed`)
//! - **Arrivals**: a Poisson process with `arrival_rate` requests per step (exponential
//!   inter-arrival times); a request joins the queue at the first step at or after its time.
//! - **Prompt length**: drawn from `prompt` (a [`LengthDist`]; default log-normal,
//!   `round(exp(ln(200) + 0.8 * N(0,1)))`), clamped to `1..=max_model_len / 2`.
//! - **Output length**: drawn from `output` (default `1 + floor(Exp(mean = 150 - 1))`), clamped
//!   so that prompt + output <= `max_model_len`.
//! - **Tokens**: uniform random ids (so no prefix hits; prefix caching is off in both runs).
//! - **Priority**: 0 for all (preemption picks the latest arrival).
//!
//! Each step is one op call: up to `max_batched_tokens` token rows (chunked prefill plus one
//! decode token per running sequence) and up to `max_seqs` sequences.
//!
//! # The two allocations, same memory (`num_blocks * block_size` token slots)
//! - **paged**: blocks of `block_size` slots allocated on demand, preemption when they run out;
//! - **contiguous**: every admitted sequence reserves `max_model_len` slots up front (the same
//!   scheduler with one block of `max_model_len` slots per sequence, so it never preempts).
//!
//! # What is measured (after each step's allocation, averaged over steps with work)
//! - utilization = token slots holding a token / slots allocated (reserved) to sequences;
//! - waste = 1 - utilization (internal fragmentation plus unused reservation);
//! - pool occupancy = slots holding a token / all slots of the memory;
//! - peak and mean concurrent sequences (running after scheduling), steps to finish,
//!   generated tokens per step, preemptions;
//! - per request, in steps (a request arriving at step `a` can be scheduled in step `a`; a
//!   token sampled in step `s` exists at `s + 1`): queueing delay = first step it is scheduled
//!   in - `a`; time to first token (TTFT) = first step it emits a token in + 1 - `a`;
//! - completed and dropped requests, each drop with its reason (a request longer than the whole
//!   memory, a memory that holds no contiguous reservation, a scheduler error);
//! - a per-step [`StepRecord`] trace of both runs.
//!
//! # Memory per token
//! [`SimConfig::cache`] with `kv_heads`, `head_size` and `layers` gives the bytes a block takes
//! ([`block_bytes`]); u8 caches count OpenVINO's extra rows (docs/contract.md, "u8 caches":
//! key `[BS + 8, D]` per block and head, value `D + 8` bytes per token and head), u4 caches its
//! u4 layout's ("u4 caches": key `[BS + 16, D]`, value `D + 16` elements, two a byte).

use paged_attention::cache::rng::SplitMix64;
use paged_attention::cache::scheduler::{Request, Scheduler, SchedulerConfig};
use paged_attention::dtype::ElemType;
use paged_attention::op::quant_layout::{KeyQuant, QuantLayout};
use std::collections::HashMap;
use std::fmt;
use std::str::FromStr;

/// A distribution of lengths (in tokens), as `pa simulate` takes it on the command line:
/// `lognormal:MEDIAN,SIGMA`, `exp:MEAN`, `uniform:MIN,MAX` or `fixed:N`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LengthDist {
    /// `round(exp(ln(median) + sigma * N(0,1)))`.
    LogNormal {
        median: f64,
        sigma: f64,
    },
    /// `1 + floor(Exp(mean - 1))`: at least one token, mean `mean`.
    Exponential {
        mean: f64,
    },
    /// Uniform in `min..=max`.
    Uniform {
        min: usize,
        max: usize,
    },
    Fixed(usize),
}

impl LengthDist {
    /// One length (before the caller's clamp).
    fn sample(&self, rng: &mut SplitMix64) -> usize {
        match *self {
            LengthDist::LogNormal { median, sigma } => {
                (median.max(1.0).ln() + sigma * rng.normal()).exp().round() as usize
            }
            LengthDist::Exponential { mean } => {
                (1.0 + (-(1.0 - rng.next_f64()).ln() * (mean - 1.0).max(0.0)).floor()) as usize
            }
            LengthDist::Uniform { min, max } => rng.range(min, max),
            LengthDist::Fixed(n) => n,
        }
    }
}

impl FromStr for LengthDist {
    type Err = String;
    fn from_str(s: &str) -> Result<LengthDist, String> {
        let syntax = "lognormal:MEDIAN,SIGMA, exp:MEAN, uniform:MIN,MAX or fixed:N";
        let (kind, args) = s
            .split_once(':')
            .ok_or_else(|| format!("`{s}` is not a length distribution ({syntax})"))?;
        let nums: Vec<&str> = args.split(',').map(str::trim).collect();
        let real = |v: &str| -> Result<f64, String> {
            v.parse::<f64>()
                .ok()
                .filter(|x| x.is_finite())
                .ok_or_else(|| format!("`{v}` in `{s}` is not a finite number"))
        };
        let whole = |v: &str| -> Result<usize, String> {
            v.parse::<usize>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or_else(|| format!("`{v}` in `{s}` is not a whole number >= 1"))
        };
        let d = match (kind, nums.as_slice()) {
            ("lognormal", [m, sg]) => LengthDist::LogNormal {
                median: real(m)?,
                sigma: real(sg)?,
            },
            ("exp", [m]) => LengthDist::Exponential { mean: real(m)? },
            ("uniform", [a, b]) => LengthDist::Uniform {
                min: whole(a)?,
                max: whole(b)?,
            },
            ("fixed", [n]) => LengthDist::Fixed(whole(n)?),
            _ => return Err(format!("`{s}` is not a length distribution ({syntax})")),
        };
        match d {
            LengthDist::LogNormal { median, sigma } if median < 1.0 || sigma < 0.0 => {
                Err(format!("`{s}`: the median must be >= 1 and sigma >= 0"))
            }
            LengthDist::Exponential { mean } if mean < 1.0 => {
                Err(format!("`{s}`: the mean must be >= 1"))
            }
            LengthDist::Uniform { min, max } if min > max => {
                Err(format!("`{s}`: MIN must not exceed MAX"))
            }
            d => Ok(d),
        }
    }
}

impl fmt::Display for LengthDist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LengthDist::LogNormal { median, sigma } => write!(f, "lognormal:{median},{sigma}"),
            LengthDist::Exponential { mean } => write!(f, "exp:{mean}"),
            LengthDist::Uniform { min, max } => write!(f, "uniform:{min},{max}"),
            LengthDist::Fixed(n) => write!(f, "fixed:{n}"),
        }
    }
}

/// Parameters of [`simulate`]; see the module docs for how they are used.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimConfig {
    pub seed: u64,
    pub num_requests: usize,
    /// Paged block size.
    pub block_size: usize,
    /// KV memory, in paged blocks.
    pub num_blocks: usize,
    /// Longest sequence (prompt + output): the contiguous reservation.
    pub max_model_len: usize,
    pub prompt: LengthDist,
    pub output: LengthDist,
    /// Requests per step.
    pub arrival_rate: f64,
    pub max_batched_tokens: usize,
    pub max_seqs: usize,
    /// Cache element type (one of [`CACHE_TYPES`]): only the memory figures depend on it.
    pub cache: ElemType,
    pub kv_heads: usize,
    pub head_size: usize,
    pub layers: usize,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            seed: 42,
            num_requests: 1000,
            block_size: 16,
            num_blocks: 2048,
            max_model_len: 2048,
            prompt: LengthDist::LogNormal {
                median: 200.0,
                sigma: 0.8,
            },
            output: LengthDist::Exponential { mean: 150.0 },
            arrival_rate: 1.0,
            max_batched_tokens: 512,
            max_seqs: 256,
            cache: ElemType::F16,
            kv_heads: 8,
            head_size: 128,
            layers: 32,
        }
    }
}

/// The cache element types the simulator reports memory for: the library's one list.
pub use paged_attention::dtype::CACHE_TYPES;

/// Bytes of one block of `block_size` tokens, key and value caches of all `kv_heads` heads and
/// `layers` layers; u8 and u4 in OpenVINO's default layouts (keys by channel, one value group),
/// extra rows included. `None` for i32, a zero dimension or an overflow.
pub fn block_bytes(
    cache: ElemType,
    kv_heads: usize,
    head_size: usize,
    block_size: usize,
    layers: usize,
) -> Option<usize> {
    if kv_heads == 0 || head_size == 0 || block_size == 0 || layers == 0 {
        return None;
    }
    let per_layer = match cache {
        ElemType::F32 | ElemType::F16 | ElemType::BF16 => kv_heads
            .checked_mul(block_size)?
            .checked_mul(head_size)?
            .checked_mul(2 * cache.bits() / 8)?,
        ElemType::U8 | ElemType::U4 => {
            let l = QuantLayout {
                hkv: kv_heads,
                d: head_size,
                dv: head_size,
                bs: block_size,
                key: KeyQuant::ByChannel,
                value_group: 0,
                bits: cache.bits(),
            };
            let prod = |d: [usize; 4]| d.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
            let elems = prod(l.key_cache_dims(1)?)?.checked_add(prod(l.value_cache_dims(1)?)?)?;
            cache.bytes_for(elems)?
        }
        ElemType::I32 => return None,
    };
    per_layer.checked_mul(layers)
}

/// One simulated step (one op call) of one run, counted after its allocation.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepRecord {
    /// 0-based step index.
    pub step: u64,
    /// Sequences scheduled in the step, and token rows of the call.
    pub scheduled: usize,
    pub batched_tokens: usize,
    /// Sequences running and waiting after scheduling.
    pub running: usize,
    pub waiting: usize,
    /// Token slots holding a token, slots allocated (reserved) to sequences, all slots.
    pub stored_slots: usize,
    pub allocated_slots: usize,
    pub pool_slots: usize,
    /// Preemptions and completed requests so far.
    pub preemptions: u64,
    pub completed: usize,
}

impl StepRecord {
    /// Stored / allocated slots (`None` when nothing is allocated).
    pub fn utilization(&self) -> Option<f64> {
        (self.allocated_slots > 0).then(|| self.stored_slots as f64 / self.allocated_slots as f64)
    }
    /// Stored / all slots.
    pub fn occupancy(&self) -> f64 {
        self.stored_slots as f64 / self.pool_slots.max(1) as f64
    }
}

/// Why a request did not complete.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DropReason {
    /// Prompt plus output need more blocks than the whole memory has.
    LongerThanMemory,
    /// The scheduler could not be set up on this memory (e.g. contiguous: the memory holds
    /// not even one `max_model_len` reservation); the message says why.
    NoMemory(String),
    /// The scheduler failed mid-run; the request was waiting or running then.
    SchedulerError(String),
}

/// Mean and percentiles of a per-request delay, in steps.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Delay {
    pub mean: f64,
    pub p50: u64,
    pub p99: u64,
    pub max: u64,
}

impl Delay {
    /// `None` for no samples. Percentiles are nearest-rank.
    fn of(mut v: Vec<u64>) -> Option<Delay> {
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
        Some(Delay {
            mean: v.iter().sum::<u64>() as f64 / v.len() as f64,
            p50: rank(0.50),
            p99: rank(0.99),
            max: v[v.len() - 1],
        })
    }
}

/// Measurements of one allocation scheme.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimRun {
    pub steps: u64,
    /// Token slots holding a token / slots allocated to sequences.
    pub utilization: f64,
    /// `1 - utilization`.
    pub waste: f64,
    /// Token slots holding a token / all slots.
    pub occupancy: f64,
    pub peak_concurrent: usize,
    pub mean_concurrent: f64,
    pub tokens_per_step: f64,
    pub preemptions: u64,
    pub completed: usize,
    /// (request id, why), in id order.
    pub dropped: Vec<(u64, DropReason)>,
    /// Time to first token and queueing delay over the requests that got that far.
    pub ttft: Option<Delay>,
    pub queueing: Option<Delay>,
    pub trace: Vec<StepRecord>,
}

/// The result of [`simulate`].
#[derive(Clone, Debug, PartialEq)]
pub struct SimReport {
    pub config: SimConfig,
    pub mean_prompt: f64,
    pub mean_output: f64,
    pub paged: SimRun,
    pub contiguous: SimRun,
}

struct Workload {
    /// (arrival step, request)
    reqs: Vec<(u64, Request)>,
}

fn workload(cfg: &SimConfig) -> Workload {
    let mut rng = SplitMix64::new(cfg.seed);
    let mut t = 0f64;
    let mut reqs = Vec::with_capacity(cfg.num_requests);
    let max_prompt = (cfg.max_model_len / 2).max(1);
    for id in 0..cfg.num_requests as u64 {
        t += -(1.0 - rng.next_f64()).ln() / cfg.arrival_rate.max(1e-9);
        let prompt = cfg.prompt.sample(&mut rng).clamp(1, max_prompt);
        let output = cfg
            .output
            .sample(&mut rng)
            .clamp(1, (cfg.max_model_len - prompt).max(1));
        let tokens = (0..prompt).map(|_| rng.next_u64() as u32).collect();
        reqs.push((
            t.ceil() as u64,
            Request {
                id,
                prompt: tokens,
                max_new_tokens: output,
                priority: 0,
            },
        ));
    }
    Workload { reqs }
}

fn run(cfg: &SimConfig, w: &Workload, block_size: usize, num_blocks: usize) -> SimRun {
    let mut r = SimRun::default();
    let mut s = match Scheduler::new(SchedulerConfig {
        num_blocks,
        block_size,
        prefix_caching: false,
        max_batched_tokens: cfg.max_batched_tokens,
        max_seqs: cfg.max_seqs,
        eviction: None,
    }) {
        Ok(s) => s,
        Err(e) => {
            let why =
                DropReason::NoMemory(format!("{num_blocks} blocks of {block_size} slots: {e}"));
            r.dropped = w.reqs.iter().map(|q| (q.1.id, why.clone())).collect();
            return r;
        }
    };
    let pool_slots = num_blocks * block_size;
    let (mut stored, mut allocated, mut occupancy, mut concurrent) = (0f64, 0f64, 0f64, 0f64);
    let mut generated = 0u64;
    let mut next = 0;
    let mut step: u64 = 0;
    let mut busy = 0u64;
    let mut rng = SplitMix64::new(cfg.seed ^ 0x5eed);
    let arrival: HashMap<u64, u64> = w.reqs.iter().map(|q| (q.1.id, q.0)).collect();
    let (mut queueing, mut ttft) = (HashMap::new(), HashMap::new());
    let mut failure = None;
    while next < w.reqs.len() || !s.is_idle() {
        while next < w.reqs.len() && w.reqs[next].0 <= step {
            let req = &w.reqs[next].1;
            // The scheduler refuses only a request longer than the whole memory here (the
            // workload never makes an empty prompt or a duplicate id).
            if s.add_request(req.clone()).is_err() {
                r.dropped.push((req.id, DropReason::LongerThanMemory));
            }
            next += 1;
        }
        let now = step;
        step += 1;
        let st = match s.schedule() {
            Ok(st) => st,
            Err(e) => {
                failure = Some(e.to_string());
                break;
            }
        };
        for q in &st.seqs {
            queueing.entry(q.id).or_insert(now - arrival[&q.id]);
            if q.emits {
                ttft.entry(q.id).or_insert(now + 1 - arrival[&q.id]);
            }
        }
        let stats = s.manager().stats();
        let mut rec = StepRecord {
            step: now,
            scheduled: st.seqs.len(),
            batched_tokens: st.num_tokens(),
            running: s.num_running(),
            waiting: s.num_waiting(),
            stored_slots: stats.used_slots,
            allocated_slots: stats.used_blocks * block_size,
            pool_slots,
            preemptions: s.preemptions(),
            completed: r.completed,
        };
        if st.is_empty() {
            let _ = s.complete_step(&[]);
            r.trace.push(rec);
            continue;
        }
        busy += 1;
        stored += rec.stored_slots as f64;
        allocated += rec.allocated_slots as f64;
        occupancy += rec.occupancy();
        concurrent += s.num_running() as f64;
        r.peak_concurrent = r.peak_concurrent.max(s.num_running());
        let sampled: Vec<_> = st
            .seqs
            .iter()
            .filter(|q| q.emits)
            .map(|q| (q.id, rng.next_u64() as u32))
            .collect();
        generated += sampled.len() as u64;
        match s.complete_step(&sampled) {
            Ok(finished) => {
                r.completed += finished.len();
                s.take_finished();
            }
            Err(e) => {
                failure = Some(e.to_string());
                r.trace.push(rec);
                break;
            }
        }
        rec.completed = r.completed;
        r.trace.push(rec);
    }
    if let Some(msg) = failure {
        // Every request still queued or running is lost with the scheduler.
        let why = DropReason::SchedulerError(msg);
        for q in &w.reqs[..next] {
            if s.tokens(q.1.id).is_ok() {
                r.dropped.push((q.1.id, why.clone()));
            }
        }
    }
    let b = busy.max(1) as f64;
    r.steps = step;
    r.utilization = if allocated > 0.0 {
        stored / allocated
    } else {
        0.0
    };
    r.waste = 1.0 - r.utilization;
    r.occupancy = occupancy / b;
    r.mean_concurrent = concurrent / b;
    r.tokens_per_step = generated as f64 / step.max(1) as f64;
    r.preemptions = s.preemptions();
    r.dropped.sort();
    r.dropped.dedup_by_key(|d| d.0);
    r.queueing = Delay::of(queueing.into_values().collect());
    r.ttft = Delay::of(ttft.into_values().collect());
    r
}

/// Runs the workload of `cfg` with paged and with contiguous allocation.
pub fn simulate(cfg: &SimConfig) -> SimReport {
    let w = workload(cfg);
    let n = w.reqs.len().max(1) as f64;
    let mean_prompt = w.reqs.iter().map(|r| r.1.prompt.len() as f64).sum::<f64>() / n;
    let mean_output = w
        .reqs
        .iter()
        .map(|r| r.1.max_new_tokens as f64)
        .sum::<f64>()
        / n;
    let bs = cfg.block_size.max(1);
    let paged = run(cfg, &w, bs, cfg.num_blocks);
    let slots = cfg.num_blocks * bs;
    let contiguous = run(cfg, &w, cfg.max_model_len, slots / cfg.max_model_len.max(1));
    SimReport {
        config: *cfg,
        mean_prompt,
        mean_output,
        paged,
        contiguous,
    }
}

impl DropReason {
    fn describe(&self, c: &SimConfig) -> String {
        match self {
            DropReason::LongerThanMemory => format!(
                "prompt + output longer than the whole KV memory ({} token slots)",
                c.num_blocks * c.block_size
            ),
            DropReason::NoMemory(e) => format!("no scheduler on this memory: {e}"),
            DropReason::SchedulerError(e) => format!("scheduler error: {e}"),
        }
    }
}

fn fmt_delay(d: &Option<Delay>) -> String {
    match d {
        Some(d) => format!("{:.1}/{}/{}", d.mean, d.p50, d.p99),
        None => "-".into(),
    }
}

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "workload: {} requests (seed {}), prompt {} (mean {:.1}), output {} (mean {:.1}), \
             {} arrivals/step",
            c.num_requests,
            c.seed,
            c.prompt,
            self.mean_prompt,
            c.output,
            self.mean_output,
            c.arrival_rate
        )?;
        writeln!(
            f,
            "memory: {} token slots ({} blocks of {}); contiguous reserves {} per sequence; \
             {} tokens / {} sequences per step",
            c.num_blocks * c.block_size,
            c.num_blocks,
            c.block_size,
            c.max_model_len,
            c.max_batched_tokens,
            c.max_seqs
        )?;
        writeln!(
            f,
            "KV bytes per token ({} layers x {} KV heads x head size {}; u8 and u4 with their \
             scale and zero-point rows):",
            c.layers, c.kv_heads, c.head_size
        )?;
        for t in CACHE_TYPES {
            let bb = block_bytes(t, c.kv_heads, c.head_size, c.block_size, c.layers);
            let mark = if t == c.cache {
                "  <- --cache-type"
            } else {
                ""
            };
            match bb {
                Some(bb) => writeln!(
                    f,
                    "  {:<5} {:>10.1} B/token  {:>10.1} MiB for the {} slots{mark}",
                    t.name(),
                    bb as f64 / c.block_size as f64,
                    (bb as f64 * c.num_blocks as f64) / (1u64 << 20) as f64,
                    c.num_blocks * c.block_size
                )?,
                None => writeln!(f, "  {:<5} (size overflows){mark}", t.name())?,
            }
        }
        writeln!(
            f,
            "{:<12} {:>11} {:>7} {:>10} {:>6} {:>8} {:>7} {:>10} {:>11}",
            "allocation",
            "utilization",
            "waste",
            "occupancy",
            "peak",
            "mean",
            "steps",
            "tok/step",
            "preemptions"
        )?;
        for (name, r) in [("paged", &self.paged), ("contiguous", &self.contiguous)] {
            writeln!(
                f,
                "{:<12} {:>10.1}% {:>6.1}% {:>9.1}% {:>6} {:>8.1} {:>7} {:>10.2} {:>11}",
                name,
                100.0 * r.utilization,
                100.0 * r.waste,
                100.0 * r.occupancy,
                r.peak_concurrent,
                r.mean_concurrent,
                r.steps,
                r.tokens_per_step,
                r.preemptions
            )?;
        }
        writeln!(
            f,
            "{:<12} {:>9} {:>7}  {:>22}  {:>22}",
            "requests", "completed", "dropped", "TTFT mean/p50/p99", "queueing mean/p50/p99"
        )?;
        for (name, r) in [("paged", &self.paged), ("contiguous", &self.contiguous)] {
            writeln!(
                f,
                "{:<12} {:>9} {:>7}  {:>22}  {:>22}",
                name,
                r.completed,
                r.dropped.len(),
                fmt_delay(&r.ttft),
                fmt_delay(&r.queueing)
            )?;
        }
        writeln!(f, "(delays in steps; one step is one op call)")?;
        for (name, r) in [("paged", &self.paged), ("contiguous", &self.contiguous)] {
            let mut why: Vec<(&DropReason, usize)> = Vec::new();
            for (_, d) in &r.dropped {
                match why.iter_mut().find(|w| w.0 == d) {
                    Some(w) => w.1 += 1,
                    None => why.push((d, 1)),
                }
            }
            for (d, n) in why {
                writeln!(f, "dropped ({name}): {n} requests: {}", d.describe(c))?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> SimConfig {
        SimConfig {
            num_requests: 120,
            num_blocks: 256,
            max_model_len: 512,
            prompt: LengthDist::LogNormal {
                median: 60.0,
                sigma: 0.8,
            },
            output: LengthDist::Exponential { mean: 40.0 },
            max_batched_tokens: 256,
            ..SimConfig::default()
        }
    }

    #[test]
    fn paged_allocation_uses_memory_better_than_contiguous() {
        let r = simulate(&small());
        assert!(
            r.paged.utilization > 0.85,
            "paged utilization {} should be near 1 (only last blocks partly empty)",
            r.paged.utilization
        );
        assert!(
            r.contiguous.utilization < r.paged.utilization,
            "contiguous {} vs paged {}",
            r.contiguous.utilization,
            r.paged.utilization
        );
        assert!(r.paged.peak_concurrent > r.contiguous.peak_concurrent);
        assert!(r.contiguous.peak_concurrent <= 256 * 16 / 512);
        assert_eq!(r.contiguous.preemptions, 0);
    }

    #[test]
    fn simulation_is_deterministic_for_a_seed() {
        let a = simulate(&small());
        let b = simulate(&small());
        assert_eq!(a, b);
        assert!(a.to_string().contains("paged"));
    }

    #[test]
    fn every_request_completes_or_is_dropped_with_a_reason() {
        // 4 blocks of 16 slots: most prompts (median 200) cannot fit, and no 2048-slot
        // contiguous reservation fits at all.
        let cfg = SimConfig {
            num_requests: 10,
            num_blocks: 4,
            ..SimConfig::default()
        };
        let r = simulate(&cfg);
        assert_eq!(r.paged.completed + r.paged.dropped.len(), 10);
        assert!(!r.paged.dropped.is_empty());
        assert!(r
            .paged
            .dropped
            .iter()
            .all(|d| d.1 == DropReason::LongerThanMemory));
        assert_eq!(r.contiguous.completed, 0);
        assert_eq!(r.contiguous.dropped.len(), 10);
        assert!(matches!(r.contiguous.dropped[0].1, DropReason::NoMemory(_)));
        let text = r.to_string();
        assert!(
            text.contains("longer than the whole KV memory (64 token slots)"),
            "{text}"
        );
        assert!(text.contains("no scheduler on this memory"), "{text}");
    }

    #[test]
    fn delays_and_trace_are_consistent() {
        let r = simulate(&small());
        for run in [&r.paged, &r.contiguous] {
            assert_eq!(run.completed, 120);
            assert!(run.dropped.is_empty());
            let (q, t) = (run.queueing.unwrap(), run.ttft.unwrap());
            // A token exists at the end of a step the request was scheduled in.
            assert!(t.p50 >= 1 && t.mean >= q.mean + 1.0, "{t:?} {q:?}");
            assert!(q.p50 <= q.p99 && q.p99 <= q.max);
            assert_eq!(run.trace.len() as u64, run.steps);
            assert_eq!(run.trace.last().unwrap().completed, 120);
            for (k, s) in run.trace.iter().enumerate() {
                assert_eq!(s.step, k as u64);
                assert!(s.stored_slots <= s.allocated_slots && s.allocated_slots <= s.pool_slots);
            }
        }
        // Contiguous admits fewer sequences at once, so requests wait longer for a slot.
        assert!(r.contiguous.queueing.unwrap().mean > r.paged.queueing.unwrap().mean);
    }

    #[test]
    fn bytes_per_token_count_the_u8_parameter_rows() {
        // Hkv 8, D 128, block 16, one layer. f16: K and V, 2 bytes each.
        assert_eq!(
            block_bytes(ElemType::F16, 8, 128, 16, 1),
            Some(16 * 8 * 128 * 2 * 2)
        );
        assert_eq!(
            block_bytes(ElemType::F32, 8, 128, 16, 2),
            Some(2 * 16 * 8 * 128 * 4 * 2)
        );
        // u8: key [16 + 8 rows, 128] per head, value 128 + 8 bytes per token and head.
        assert_eq!(
            block_bytes(ElemType::U8, 8, 128, 16, 1),
            Some(8 * (24 * 128) + 8 * 16 * 136)
        );
        // u4: key [16 + 16 rows, 128] nibbles per head, value 128 + 16 nibbles per token and head.
        assert_eq!(
            block_bytes(ElemType::U4, 8, 128, 16, 1),
            Some((8 * (32 * 128) + 8 * 16 * 144) / 2)
        );
        assert_eq!(block_bytes(ElemType::I32, 8, 128, 16, 1), None);
        assert_eq!(block_bytes(ElemType::F16, usize::MAX, 128, 16, 1), None);
    }

    #[test]
    fn length_distributions_parse_and_sample_in_range() {
        let d: LengthDist = "uniform:5,9".parse().unwrap();
        assert_eq!(d, LengthDist::Uniform { min: 5, max: 9 });
        let mut rng = SplitMix64::new(1);
        let v: Vec<usize> = (0..200).map(|_| d.sample(&mut rng)).collect();
        assert!(v.iter().all(|&n| (5..=9).contains(&n)));
        assert!(v.contains(&5) && v.contains(&9));
        assert_eq!("fixed:7".parse(), Ok(LengthDist::Fixed(7)));
        assert_eq!(
            "lognormal:200,0.8"
                .parse::<LengthDist>()
                .unwrap()
                .to_string(),
            "lognormal:200,0.8"
        );
        for bad in [
            "",
            "exp",
            "exp:0.5",
            "uniform:9,5",
            "fixed:0",
            "lognormal:1",
            "exp:NaN",
        ] {
            assert!(bad.parse::<LengthDist>().is_err(), "{bad}");
        }
    }
}
