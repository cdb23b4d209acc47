//! `pa simulate`: a synthetic serving workload run through the [`Scheduler`] twice, once with
//! paged blocks and once with contiguous max-length allocation, on the same KV memory.
//!
//! # The workload (all drawn from one splitmix64 stream seeded with `seed`)
//! - **Arrivals**: a Poisson process with `arrival_rate` requests per step (exponential
//!   inter-arrival times); a request joins the queue at the first step at or after its time.
//! - **Prompt length**: log-normal, `round(exp(ln(prompt_median) + prompt_sigma * N(0,1)))`,
//!   clamped to `1..=max_model_len / 2`.
//! - **Output length**: `1 + floor(Exp(mean = output_mean - 1))`, clamped so that
//!   prompt + output <= `max_model_len`.
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
//!   generated tokens per step, preemptions.

use super::rng::SplitMix64;
use super::scheduler::{Request, Scheduler, SchedulerConfig};
use std::fmt;

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
    pub prompt_median: f64,
    pub prompt_sigma: f64,
    pub output_mean: f64,
    /// Requests per step.
    pub arrival_rate: f64,
    pub max_batched_tokens: usize,
    pub max_seqs: usize,
}

impl Default for SimConfig {
    fn default() -> SimConfig {
        SimConfig {
            seed: 42,
            num_requests: 1000,
            block_size: 16,
            num_blocks: 2048,
            max_model_len: 2048,
            prompt_median: 200.0,
            prompt_sigma: 0.8,
            output_mean: 150.0,
            arrival_rate: 1.0,
            max_batched_tokens: 512,
            max_seqs: 256,
        }
    }
}

/// Measurements of one allocation scheme.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
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
        let p = (cfg.prompt_median.max(1.0).ln() + cfg.prompt_sigma * rng.normal()).exp();
        let prompt = (p.round() as usize).clamp(1, max_prompt);
        let o = 1.0 + (-(1.0 - rng.next_f64()).ln() * (cfg.output_mean - 1.0).max(0.0)).floor();
        let output = (o as usize).clamp(1, (cfg.max_model_len - prompt).max(1));
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
    let mut s = match Scheduler::new(SchedulerConfig {
        num_blocks,
        block_size,
        prefix_caching: false,
        max_batched_tokens: cfg.max_batched_tokens,
        max_seqs: cfg.max_seqs,
        eviction: None,
    }) {
        Ok(s) => s,
        Err(_) => return SimRun::default(),
    };
    let pool_slots = (num_blocks * block_size) as f64;
    let mut r = SimRun::default();
    let (mut stored, mut allocated, mut occupancy, mut concurrent) = (0f64, 0f64, 0f64, 0f64);
    let mut generated = 0u64;
    let mut next = 0;
    let mut step: u64 = 0;
    let mut busy = 0u64;
    let mut rng = SplitMix64::new(cfg.seed ^ 0x5eed);
    while next < w.reqs.len() || !s.is_idle() {
        while next < w.reqs.len() && w.reqs[next].0 <= step {
            // Requests longer than the whole memory are dropped (the config avoids them).
            let _ = s.add_request(w.reqs[next].1.clone());
            next += 1;
        }
        step += 1;
        let st = match s.schedule() {
            Ok(st) => st,
            Err(_) => break,
        };
        if st.is_empty() {
            let _ = s.complete_step(&[]);
            continue;
        }
        busy += 1;
        let stats = s.manager().stats();
        stored += stats.used_slots as f64;
        allocated += (stats.used_blocks * block_size) as f64;
        occupancy += stats.used_slots as f64 / pool_slots;
        concurrent += s.num_running() as f64;
        r.peak_concurrent = r.peak_concurrent.max(s.num_running());
        let sampled: Vec<_> = st
            .seqs
            .iter()
            .filter(|q| q.emits)
            .map(|q| (q.id, rng.next_u64() as u32))
            .collect();
        generated += sampled.len() as u64;
        if s.complete_step(&sampled).is_err() {
            break;
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

impl fmt::Display for SimReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "workload: {} requests (seed {}), prompt log-normal median {} sigma {} (mean {:.1}), \
             output 1+Exp(mean {}) (mean {:.1}), {} arrivals/step",
            c.num_requests,
            c.seed,
            c.prompt_median,
            c.prompt_sigma,
            self.mean_prompt,
            c.output_mean,
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
            prompt_median: 60.0,
            output_mean: 40.0,
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
}
