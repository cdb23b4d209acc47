//! How an engine is set up: cache type and size, the scheduler's budgets, OpenVINO's options.

use crate::speculative::SpeculativeConfig;
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

/// Gives an enum of settings its one name table (`NAMES`), `as_str` and `FromStr`, whose error
/// names `what` and the names there are: `named!(Type, "what", { Variant => "name", ... });`.
macro_rules! named {
    ($ty:ident, $what:literal, { $($v:ident => $s:literal),+ $(,)? }) => {
        impl $ty {
            /// The one name table of the values (what command lines take).
            pub(crate) const NAMES: $crate::config::Names<$ty> =
                $crate::config::Names(&[$(($ty::$v, $s)),+]);

            pub fn as_str(self) -> &'static str {
                $ty::NAMES.name(self)
            }
        }

        impl ::std::str::FromStr for $ty {
            type Err = String;
            fn from_str(s: &str) -> Result<$ty, String> {
                $ty::NAMES.parse(s, $what)
            }
        }
    };
}
pub(crate) use named;

// OpenVINO's names of the hints, which command lines take too.
named!(Precision, "precision", { F32 => "f32", Bf16 => "bf16", F16 => "f16" });

/// How big the KV cache is: `Auto` (the default) or a number of bytes over all layers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum KvCacheSize {
    /// [`KV_AUTO_SHARE`] of the memory available once the model is compiled (the smaller of
    /// `MemAvailable` and what the cgroup's `memory.max` leaves), at most what `max_seqs`
    /// sequences of the model's whole context take.
    #[default]
    Auto,
    Bytes(usize),
}

/// The share of the memory available after compiling that `--kv-cache-size auto` takes. Half:
/// the rest is for OpenVINO's activations, the tokenizer, the OS's page cache and a second
/// replica started on the same machine (each replica takes half of what it finds).
pub const KV_AUTO_SHARE: f64 = 0.5;

impl FromStr for KvCacheSize {
    type Err = String;
    /// `auto`, or a positive number of GB (1e9 bytes).
    fn from_str(s: &str) -> Result<KvCacheSize, String> {
        if s == "auto" {
            return Ok(KvCacheSize::Auto);
        }
        match s.parse::<f64>() {
            Ok(gb) if gb > 0.0 && gb * 1e9 < usize::MAX as f64 => {
                Ok(KvCacheSize::Bytes(((gb * 1e9) as usize).max(1)))
            }
            _ => Err(format!(
                "the KV cache size is `auto` or a positive number of GB, got `{s}`"
            )),
        }
    }
}

/// How the engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Element type of the KV caches (one of `paged_attention::dtype::CACHE_TYPES`).
    pub cache_type: ElemType,
    /// KV cache over all layers (keys and values); the block count follows.
    pub kv_cache: KvCacheSize,
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
    /// Speculative decoding (not with `eviction`).
    pub speculative: Option<SpeculativeConfig>,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            cache_type: DEFAULT_CACHE_TYPE,
            kv_cache: KvCacheSize::Auto,
            block_size: 32,
            max_batched_tokens: 512,
            max_seqs: 256,
            prefix_caching: true,
            precision: None,
            threads: None,
            device: "CPU".into(),
            eviction: None,
            kv_events: None,
            speculative: None,
        }
    }
}
