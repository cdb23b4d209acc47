//! The KV-cache block manager and scheduler around the op (issue 6): which physical blocks of
//! `key_cache` / `value_cache` (`[NB, Hkv, BS, D]`) hold which sequence's tokens, and which
//! sequences run in each op call.
//!
//! - `pool`: physical blocks, ref counts, O(1) free list, prefix-cache index with an LRU.
//! - `manager`: sequences and block tables; append, fork, copy-on-write, truncate, prefix hits.
//! - `eviction`: per-block scores, score-based eviction, the op's rotation inputs and LUT.
//! - `scheduler`: continuous batching with chunked prefill and preemption; yields op inputs.
//! - `rng`: the small seeded PRNG the `pa simulate` workload and the tests use (no extra crates).
//!
//! All safe Rust; the C ABI is `crate::ffi::cache` / `include/paged_attention_cache.h`.

pub mod eviction;
pub mod manager;
pub mod pool;
pub mod rng;
pub mod scheduler;

pub use eviction::{
    fill_rotation_lut, rotation_lut, rotation_lut_len, Eviction, EvictionPolicy, RotationDirection,
    RotationInputs,
};
pub use manager::{
    copy_blocks, copy_blocks_kv, Append, BlockCopy, BlockManager, CacheStats, ManagerConfig, SeqId,
};
pub use pool::{block_hash, BlockId, BlockPool, CacheEvent};
pub use rng::SplitMix64;
pub use scheduler::{
    FinishReason, Request, ScheduledSeq, Scheduler, SchedulerConfig, SchedulerCounters, Step,
};
