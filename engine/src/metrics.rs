//! What an engine has done, as its client records it after every step: the core's figures, the
//! requests finished and aborted, time to first token and per output token; and their
//! Prometheus text (`pa serve`'s `/metrics`).

use crate::engine_core::{EngineCore, EngineStats};
use paged_attention::cache::{CacheStats, SchedulerCounters};
use paged_attention::ElemType;
use std::fmt::Write;

/// Histogram of seconds, Prometheus style (cumulative buckets).
#[derive(Default, Clone, Debug)]
pub struct Histogram {
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

const BUCKETS: [f64; 12] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
];

impl Histogram {
    pub fn observe(&mut self, v: f64) {
        if self.counts.is_empty() {
            self.counts = vec![0; BUCKETS.len()];
        }
        for (c, b) in self.counts.iter_mut().zip(BUCKETS) {
            if v <= b {
                *c += 1;
            }
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let c = self.counts.get(i).copied().unwrap_or(0);
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {c}");
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{le=\"+Inf\"}} {}\n{name}_sum {}\n{name}_count {}",
            self.count, self.sum, self.count
        );
    }
}

/// An engine's figures at the end of its last step.
#[derive(Default, Clone, Debug)]
pub struct Snapshot {
    pub stats: EngineStats,
    pub counters: SchedulerCounters,
    pub cache: CacheStats,
    pub running: usize,
    pub waiting: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub cache_type: Option<ElemType>,
    /// Requests that ended on their own (length or stop), and aborted ones.
    pub finished: u64,
    pub aborted: u64,
    pub ttft: Histogram,
    pub tpot: Histogram,
}

impl Snapshot {
    /// The core's side of the figures, now.
    pub(crate) fn read_core(&mut self, core: &EngineCore) {
        self.stats = core.stats();
        self.counters = core.counters();
        self.cache = core.cache_stats();
        self.running = core.num_running();
        self.waiting = core.num_waiting();
        self.num_blocks = core.num_blocks();
        self.block_size = core.block_size();
        self.cache_type = Some(core.cache_type());
    }

    /// Prometheus text; `in_flight`: HTTP requests admitted and not answered yet.
    pub fn prometheus(&self, in_flight: usize) -> String {
        let mut s = String::new();
        let hit_rate = if self.stats.prompt_tokens == 0 {
            0.0
        } else {
            self.counters.prefix_hit_tokens as f64 / self.stats.prompt_tokens as f64
        };
        #[rustfmt::skip]
        let rows: [(&str, &str, &str, f64); 16] = [
            ("pa_requests_running", "Requests whose sequences are running.", "gauge", self.running as f64),
            ("pa_requests_waiting", "Requests waiting to start.", "gauge", self.waiting as f64),
            ("pa_requests_in_flight", "HTTP requests admitted and not answered yet.", "gauge", in_flight as f64),
            ("pa_kv_blocks_used", "KV cache blocks referenced by a sequence.", "gauge", self.cache.used_blocks as f64),
            ("pa_kv_blocks_total", "KV cache blocks in all.", "gauge", self.num_blocks as f64),
            ("pa_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache / prompt tokens.", "gauge", hit_rate),
            ("pa_prefix_cache_hits_total", "Requests that reused cached prefix blocks.", "counter", self.counters.prefix_hits as f64),
            ("pa_preemptions_total", "Sequences preempted for lack of blocks.", "counter", self.counters.preemptions as f64),
            ("pa_generated_tokens_total", "Tokens generated.", "counter", self.stats.generated_tokens as f64),
            ("pa_prompt_tokens_total", "Prompt tokens admitted.", "counter", self.stats.prompt_tokens as f64),
            ("pa_requests_finished_total", "Requests finished (length or stop).", "counter", self.finished as f64),
            ("pa_requests_aborted_total", "Requests aborted (client gone, shutdown).", "counter", self.aborted as f64),
            ("pa_engine_steps_total", "Engine steps.", "counter", self.stats.steps as f64),
            ("pa_engine_infer_seconds_total", "Time in OpenVINO's infer().", "counter", self.stats.infer_time.as_secs_f64()),
            ("vllm:spec_decode_num_draft_tokens_total", "Draft tokens verified (speculative decoding).", "counter", self.stats.draft_tokens as f64),
            ("vllm:spec_decode_num_accepted_tokens_total", "Draft tokens accepted (speculative decoding).", "counter", self.stats.accepted_draft_tokens as f64),
        ];
        for (name, help, kind, v) in rows {
            let _ = writeln!(s, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}");
        }
        self.ttft.render(
            "pa_time_to_first_token_seconds",
            "From admission to the first token.",
            &mut s,
        );
        self.tpot.render(
            "pa_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.",
            &mut s,
        );
        s
    }
}
