//! How an engine is set up: cache type and size, the scheduler's budgets, OpenVINO's options.

use paged_attention::cache::EvictionPolicy;
use paged_attention::dtype::DEFAULT_CACHE_TYPE;
use paged_attention::ElemType;
use std::str::FromStr;

/// OpenVINO's inference precision hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

/// A setting's values and the one name each has (on command lines too).
pub(crate) struct Names<T: 'static>(pub &'static [(T, &'static str)]);

impl<T: Copy + PartialEq> Names<T> {
    /// The name of `v` (tables list every value).
    pub fn name(&self, v: T) -> &'static str {
        self.0.iter().find(|(x, _)| *x == v).map_or("", |(_, n)| n)
    }

    /// The value named `s`; else an error naming `what` and the names there are.
    pub fn parse(&self, s: &str, what: &str) -> Result<T, String> {
        self.0
            .iter()
            .find(|(_, n)| *n == s)
            .map(|(v, _)| *v)
            .ok_or_else(|| {
                let names: Vec<&str> = self.0.iter().map(|(_, n)| *n).collect();
                format!("unknown {what} `{s}` ({})", names.join(", "))
            })
    }
}

impl Precision {
    /// The one name table of the hints (OpenVINO's names, which command lines take too).
    const NAMES: Names<Precision> = Names(&[
        (Precision::F32, "f32"),
        (Precision::Bf16, "bf16"),
        (Precision::F16, "f16"),
    ]);

    pub fn as_str(self) -> &'static str {
        Precision::NAMES.name(self)
    }
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> Result<Precision, String> {
        Precision::NAMES.parse(s, "precision")
    }
}

/// How the engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Element type of the KV caches (one of `paged_attention::dtype::CACHE_TYPES`).
    pub cache_type: ElemType,
    /// Bytes of KV cache over all layers (keys and values); the block count follows.
    pub kv_cache_bytes: usize,
    pub block_size: usize,
    /// Token rows per step (a long prompt is prefilled in chunks of at most this many).
    pub max_batched_tokens: usize,
    /// Sequences per step.
    pub max_seqs: usize,
    pub prefix_caching: bool,
    /// OpenVINO's `INFERENCE_PRECISION_HINT`; `None`: OpenVINO's default for the CPU.
    pub precision: Option<Precision>,
    /// OpenVINO's `INFERENCE_NUM_THREADS`; `None`: all cores.
    pub threads: Option<usize>,
    pub device: String,
    /// Score-driven cache eviction: a sequence holding more than `budget` blocks drops its
    /// lowest-scored middle blocks (the op's attention scores, summed over layers and steps),
    /// keeping `start` leading and `recent` trailing ones; kept keys that move are re-rotated
    /// by the op. The graph then also has the scores outputs and the rotation inputs.
    pub eviction: Option<EvictionPolicy>,
    /// Publish the prefix cache's changes for routers (`pa serve --kv-events-endpoint`).
    pub kv_events: Option<crate::kv_events::KvEventsConfig>,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            cache_type: DEFAULT_CACHE_TYPE,
            kv_cache_bytes: 1 << 30,
            block_size: 32,
            max_batched_tokens: 512,
            max_seqs: 256,
            prefix_caching: true,
            precision: None,
            threads: None,
            device: "CPU".into(),
            eviction: None,
            kv_events: None,
        }
    }
}
