//! What an engine has done, as its client records it after every step: the core's figures, the
//! requests finished by reason, time to first token, inter-token and end-to-end latency; and
//! their Prometheus text (`pa serve`'s `/metrics`).
//!
//! Names (docs/api.md, "Metrics"): vLLM's metric names, which the Kubernetes routers and the
//! common dashboards read, spelled with `pa_` in place of `vllm:` so that the exposition passes
//! `promtool check metrics` (which refuses `:` in a name); [`Naming::Vllm`] spells them as vLLM
//! does, for routers that cannot be pointed at other names. Figures vLLM has no name for are
//! `pa_` in both spellings. Every series carries `model_name`.

use crate::config::named;
use crate::engine_core::{EngineCore, EngineStats};
use crate::kv_cache::KvCachePlan;
use paged_attention::cache::{CacheStats, FinishReason, SchedulerCounters};
use paged_attention::ElemType;
use std::fmt::Write;

/// How `/metrics` spells the names vLLM also has.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Naming {
    /// `pa_num_requests_waiting`: passes `promtool check metrics`.
    #[default]
    Pa,
    /// `vllm:num_requests_waiting`: what routers read without being told other names.
    Vllm,
}

named!(Naming, "metric naming", { Pa => "pa", Vllm => "vllm" });

/// Bucket bounds in seconds, vLLM's (so its dashboards' quantiles read the same).
const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
const ITL_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
];
const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Histogram of seconds, Prometheus style (cumulative buckets).
#[derive(Clone, Debug)]
pub struct Histogram {
    bounds: &'static [f64],
    /// Observations per bucket (not cumulative; `render` sums them).
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }
}

/// Requests finished, by reason (OpenAI's words, vLLM's `finished_reason` label).
const REASONS: [FinishReason; 3] = [
    FinishReason::Stop,
    FinishReason::Length,
    FinishReason::Abort,
];

/// An engine's figures at the end of its last step.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub stats: EngineStats,
    pub counters: SchedulerCounters,
    pub cache: CacheStats,
    pub running: usize,
    pub waiting: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub cache_type: Option<ElemType>,
    pub prefix_caching: bool,
    /// Requests ended, indexed as [`REASONS`].
    finished: [u64; REASONS.len()],
    /// The KV cache's size and how it was chosen.
    pub kv_cache: KvCachePlan,
    pub ttft: Histogram,
    /// Between consecutive tokens of one output.
    pub itl: Histogram,
    /// A request's mean time per output token after its first.
    pub tpot: Histogram,
    pub e2e: Histogram,
    /// KV-event batches numbered and dropped (`None`: not published).
    pub kv_events: Option<(u64, u64)>,
}

impl Default for Snapshot {
    fn default() -> Snapshot {
        Snapshot {
            stats: EngineStats::default(),
            counters: SchedulerCounters::default(),
            cache: CacheStats::default(),
            running: 0,
            waiting: 0,
            num_blocks: 0,
            block_size: 0,
            cache_type: None,
            prefix_caching: false,
            kv_cache: KvCachePlan::default(),
            finished: [0; REASONS.len()],
            ttft: Histogram::new(TTFT_BUCKETS),
            itl: Histogram::new(ITL_BUCKETS),
            tpot: Histogram::new(ITL_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
            kv_events: None,
        }
    }
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
        self.prefix_caching = core.prefix_caching();
        if self.kv_cache.num_blocks == 0 {
            self.kv_cache = core.kv_cache_plan().clone();
        }
    }

    pub(crate) fn count_finished(&mut self, reason: FinishReason) {
        if let Some(i) = REASONS.iter().position(|&r| r == reason) {
            self.finished[i] += 1;
        }
    }

    /// Requests that ended for `reason`.
    pub fn finished(&self, reason: FinishReason) -> u64 {
        REASONS
            .iter()
            .position(|&r| r == reason)
            .map_or(0, |i| self.finished[i])
    }

    /// Prometheus text (format 0.0.4). `in_flight`: HTTP requests admitted and not answered yet.
    pub fn prometheus(&self, model_name: &str, naming: Naming, in_flight: usize) -> String {
        let mut w = Exposition::new(model_name, naming);
        let usage = if self.num_blocks == 0 {
            0.0
        } else {
            self.cache.used_blocks as f64 / self.num_blocks as f64
        };
        let (s, c) = (&self.stats, &self.counters);
        // (name, a vLLM name too, type, help, value)
        #[rustfmt::skip]
        let rows: [(&str, bool, &str, &str, f64); 17] = [
            ("num_requests_running", true, "gauge", "Requests whose sequences are running.", self.running as f64),
            ("num_requests_waiting", true, "gauge", "Requests waiting to start (queued or preempted).", self.waiting as f64),
            ("kv_cache_usage_perc", true, "gauge", "Fraction of KV-cache blocks in use, 0 to 1.", usage),
            ("prefix_cache_queries_total", true, "counter", "Prompt tokens looked up in the prefix cache.", c.prefix_query_tokens as f64),
            ("prefix_cache_hits_total", true, "counter", "Prompt tokens found in the prefix cache.", c.prefix_hit_tokens as f64),
            ("num_preemptions_total", true, "counter", "Sequences preempted for lack of KV-cache blocks.", c.preemptions as f64),
            ("prompt_tokens_total", true, "counter", "Prompt tokens admitted.", s.prompt_tokens as f64),
            ("generation_tokens_total", true, "counter", "Tokens generated.", s.generated_tokens as f64),
            ("requests_in_flight", false, "gauge", "HTTP requests admitted and not answered yet.", in_flight as f64),
            ("kv_blocks_used", false, "gauge", "KV-cache blocks referenced by a sequence.", self.cache.used_blocks as f64),
            ("kv_blocks", false, "gauge", "KV-cache blocks in all.", self.num_blocks as f64),
            ("kv_blocks_cached", false, "gauge", "Unreferenced KV-cache blocks kept for prefix reuse.", self.cache.cached_blocks as f64),
            ("engine_steps_total", false, "counter", "Engine steps.", s.steps as f64),
            ("engine_infer_seconds_total", false, "counter", "Time in OpenVINO's infer().", s.infer_time.as_secs_f64()),
            ("kv_cache_size_bytes", false, "gauge", "Bytes of KV cache allocated (all layers, a draft model's cache included), as --kv-cache-size chose.", self.kv_cache.bytes() as f64),
            ("spec_decode_num_draft_tokens_total", true, "counter", "Draft tokens verified (speculative decoding).", s.draft_tokens as f64),
            ("spec_decode_num_accepted_tokens_total", true, "counter", "Draft tokens accepted (speculative decoding).", s.accepted_draft_tokens as f64),
        ];
        for (name, vllm, kind, help, v) in rows {
            w.scalar(name, vllm, kind, help, v);
        }
        if let Some((batches, dropped)) = self.kv_events {
            #[rustfmt::skip]
            let kv: [(&str, &str, u64); 2] = [
                ("kv_events_batches_total", "KV-event batches published (or dropped).", batches),
                ("kv_events_dropped_total", "KV-event batches dropped: the queue to the socket was full.", dropped),
            ];
            for (name, help, v) in kv {
                w.scalar(name, false, "counter", help, v as f64);
            }
        }
        if naming == Naming::Vllm {
            // The name vLLM used before kv_cache_usage_perc; older routers still read it.
            w.scalar(
                "gpu_cache_usage_perc",
                true,
                "gauge",
                "Deprecated spelling of kv_cache_usage_perc.",
                usage,
            );
        }
        let name = w.name("request_success_total", true);
        w.family(&name, "counter", "Requests ended, by finish reason.");
        for (r, n) in REASONS.iter().zip(self.finished) {
            w.sample(&name, &[("finished_reason", r.as_str())], n as f64);
        }
        let name = w.name("cache_config_info", true);
        w.family(&name, "gauge", "The KV cache's configuration, in labels.");
        let (bs, nb) = (self.block_size.to_string(), self.num_blocks.to_string());
        let labels = [
            ("block_size", bs.as_str()),
            ("num_gpu_blocks", nb.as_str()),
            ("cache_dtype", self.cache_type.map_or("", ElemType::name)),
            (
                "enable_prefix_caching",
                if self.prefix_caching { "True" } else { "False" },
            ),
        ];
        w.sample(&name, &labels, 1.0);
        #[rustfmt::skip]
        let hists: [(&str, &str, &Histogram); 4] = [
            ("time_to_first_token_seconds", "From admission to the first token.", &self.ttft),
            ("inter_token_latency_seconds", "Between consecutive tokens of one output.", &self.itl),
            ("request_time_per_output_token_seconds", "A request's mean time per output token after the first.", &self.tpot),
            ("e2e_request_latency_seconds", "From admission to the request's end.", &self.e2e),
        ];
        for (name, help, h) in hists {
            w.histogram(name, help, h);
        }
        if naming == Naming::Vllm {
            // vLLM's older name of the inter-token histogram, which dashboards still plot.
            w.histogram(
                "time_per_output_token_seconds",
                "Deprecated spelling of inter_token_latency_seconds.",
                &self.itl,
            );
        }
        w.out
    }
}

/// Prometheus text being written: every sample gets the `model_name` label.
struct Exposition {
    out: String,
    naming: Naming,
    /// `model_name="..."`, escaped.
    model: String,
}

impl Exposition {
    fn new(model_name: &str, naming: Naming) -> Exposition {
        Exposition {
            out: String::new(),
            naming,
            model: format!("model_name=\"{}\"", escape_label(model_name)),
        }
    }

    /// `base` spelled for this exposition: `vllm:base` for a vLLM name under [`Naming::Vllm`],
    /// else `pa_base`.
    fn name(&self, base: &str, vllm: bool) -> String {
        match (vllm, self.naming) {
            (true, Naming::Vllm) => format!("vllm:{base}"),
            _ => format!("pa_{base}"),
        }
    }

    fn family(&mut self, name: &str, kind: &str, help: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], v: f64) {
        let _ = write!(self.out, "{name}{{{}", self.model);
        for (k, val) in labels {
            let _ = write!(self.out, ",{k}=\"{}\"", escape_label(val));
        }
        let _ = writeln!(self.out, "}} {}", number(v));
    }

    fn scalar(&mut self, base: &str, vllm: bool, kind: &str, help: &str, v: f64) {
        let name = self.name(base, vllm);
        self.family(&name, kind, help);
        self.sample(&name, &[], v);
    }

    /// A histogram of a vLLM name.
    fn histogram(&mut self, base: &str, help: &str, h: &Histogram) {
        let name = self.name(base, true);
        self.family(&name, "histogram", help);
        let bucket = format!("{name}_bucket");
        let mut cumulative = 0;
        for (b, c) in h.bounds.iter().zip(&h.counts) {
            cumulative += c;
            self.sample(&bucket, &[("le", &number(*b))], cumulative as f64);
        }
        self.sample(&bucket, &[("le", "+Inf")], h.count as f64);
        self.sample(&format!("{name}_sum"), &[], h.sum);
        self.sample(&format!("{name}_count"), &[], h.count as f64);
    }
}

/// A sample value as the text format writes it.
fn number(v: f64) -> String {
    if v.is_nan() {
        "NaN".into()
    } else if v.is_infinite() {
        if v > 0.0 { "+Inf" } else { "-Inf" }.into()
    } else {
        format!("{v}")
    }
}

/// A label value: backslash, double quote and line feed escaped.
fn escape_label(v: &str) -> String {
    let mut s = String::with_capacity(v.len());
    for ch in v.chars() {
        match ch {
            '\\' => s.push_str("\\\\"),
            '"' => s.push_str("\\\""),
            '\n' => s.push_str("\\n"),
            c => s.push(c),
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative_and_end_at_the_count() {
        let mut h = Histogram::new(&[0.1, 1.0]);
        for v in [0.05, 0.5, 0.7, 3.0] {
            h.observe(v);
        }
        let mut w = Exposition::new("m", Naming::Pa);
        w.histogram("x_seconds", "x.", &h);
        let want = "\
# HELP pa_x_seconds x.
# TYPE pa_x_seconds histogram
pa_x_seconds_bucket{model_name=\"m\",le=\"0.1\"} 1
pa_x_seconds_bucket{model_name=\"m\",le=\"1\"} 3
pa_x_seconds_bucket{model_name=\"m\",le=\"+Inf\"} 4
pa_x_seconds_sum{model_name=\"m\"} 4.25
pa_x_seconds_count{model_name=\"m\"} 4
";
        assert_eq!(w.out, want);
    }

    #[test]
    fn model_name_label_is_escaped() {
        let mut w = Exposition::new("a\"b\\c\nd", Naming::Pa);
        w.scalar("g", false, "gauge", "g.", 1.0);
        assert!(
            w.out.contains("pa_g{model_name=\"a\\\"b\\\\c\\nd\"} 1\n"),
            "{}",
            w.out
        );
    }

    #[test]
    fn vllm_naming_spells_only_vllm_names_with_its_prefix() {
        let s = Snapshot::default().prometheus("m", Naming::Vllm, 0);
        assert!(
            s.contains("\nvllm:num_requests_waiting{model_name=\"m\"} 0\n"),
            "{s}"
        );
        assert!(s.contains("\nvllm:gpu_cache_usage_perc{"), "{s}");
        assert!(s.contains("\npa_kv_blocks{model_name=\"m\"} 0\n"), "{s}");
        assert!(!s.contains("vllm:kv_blocks"), "{s}");
        let p = Snapshot::default().prometheus("m", Naming::Pa, 0);
        assert!(!p.contains("vllm:"), "{p}");
        assert!(!p.contains("gpu_cache_usage_perc"), "{p}");
        assert!(
            p.contains("\npa_num_requests_waiting{model_name=\"m\"} 0\n"),
            "{p}"
        );
    }

    #[test]
    fn naming_parses_its_own_names_only() {
        for n in [Naming::Pa, Naming::Vllm] {
            assert_eq!(n.as_str().parse::<Naming>(), Ok(n));
        }
        assert!("vLLM".parse::<Naming>().is_err());
    }
}
