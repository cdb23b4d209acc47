//! The KV cache tensors: one key and one value buffer per layer, `[num_blocks, Hkv, rows, cols]`
//! elements of the cache type each, sized from the converted graph's cache inputs and a byte
//! budget (given, or `auto`: a share of the memory left once the model is compiled), zeroed,
//! and never moved (OpenVINO's request holds tensors over them). The zeroed memory is mapped
//! lazily by the kernel: a block's pages are committed when it is first written, so resident
//! memory grows with the blocks in use, up to the size chosen at start-up.

use crate::config::{KvCacheSize, KV_AUTO_SHARE};
use crate::error::{EngineError, Result};
use crate::memory::{self, Available};
use paged_attention::ElemType;
use std::path::Path;

/// A cache buffer: zeroed, 8-byte aligned bytes.
pub(crate) struct CacheBuf {
    pub words: Vec<u64>,
    /// `[num_blocks, Hkv, rows, cols]`.
    pub shape: [usize; 4],
    pub block_bytes: usize,
}

impl CacheBuf {
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.words.len() * 8;
        // SAFETY: u64 storage viewed as its bytes: same allocation and length in bytes, u8 has no
        // alignment or validity requirement, and the borrow of `self.words` covers the result.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }
}

/// A layer's key and value cache geometry, `[Hkv, rows, cols]` of a block each.
pub(crate) type LayerDims = ([usize; 3], [usize; 3]);

/// Bytes of one block over all layers, keys and values. A block of a cache is the
/// `[Hkv, rows, cols]` elements of its graph input (with u8 and u4 caches the rows or columns of
/// scales and zero points the converter added), sized by the cache's element type. A u4 block is
/// whole bytes when D is even, which the op requires (it refuses the graph otherwise); the check
/// keeps block copies on byte boundaries whatever the shapes.
pub(crate) fn bytes_per_block(layers: &[LayerDims], elem: ElemType, graph: &Path) -> Result<usize> {
    let block_bytes = |[h, r, c]: [usize; 3], what: &str, l: usize| -> Result<usize> {
        let n = h.checked_mul(r).and_then(|hr| hr.checked_mul(c));
        match n.and_then(|n| elem.bytes_for(n).map(|b| (n, b))) {
            Some((n, b)) if (n % 8 * elem.bits()).is_multiple_of(8) => Ok(b),
            _ => Err(EngineError::Model {
                path: graph.to_path_buf(),
                detail: format!(
                    "a block of {what}_cache.{l} ([{h}, {r}, {c}] {elem}) is not a whole number of bytes"
                ),
            }),
        }
    };
    let mut total = 0usize;
    for (l, &(k, v)) in layers.iter().enumerate() {
        total = total
            .checked_add(block_bytes(k, "key", l)?)
            .and_then(|t| t.checked_add(block_bytes(v, "value", l).ok()?))
            .ok_or_else(|| EngineError::Config("a KV cache block's size overflows".into()))?;
    }
    Ok(total.max(1))
}

/// The KV cache the engine allocated, and how its size was chosen.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct KvCachePlan {
    /// Chosen by `--kv-cache-size auto`.
    pub auto: bool,
    pub num_blocks: usize,
    pub block_size: usize,
    /// Bytes of one block over all layers.
    pub block_bytes: usize,
    /// Bytes of one block of the draft model's cache (`--speculative draft`), over all its
    /// layers: a cache of `num_blocks` blocks too, so it holds as many tokens as the target's.
    pub draft_block_bytes: Option<usize>,
    /// Memory available once the model was compiled (before the cache), and its source.
    pub available: Option<Available>,
    /// Bytes of `max_seqs` sequences of the model's whole context, in every cache (`None`: no
    /// context known).
    pub bound: Option<usize>,
    /// This process's resident memory once the model was compiled (before the cache).
    pub resident_before: Option<u64>,
}

impl KvCachePlan {
    /// Bytes of the cache over all layers, the draft model's included.
    pub fn bytes(&self) -> usize {
        self.num_blocks * self.bytes_a_block()
    }

    /// Bytes of a block in every cache: the target's and the draft model's.
    fn bytes_a_block(&self) -> usize {
        self.block_bytes + self.draft_block_bytes.unwrap_or(0)
    }

    /// What this process should stay under: its resident memory after compiling plus the whole
    /// cache (the cache's pages are committed as blocks are first written).
    pub fn resident_bound(&self) -> Option<u64> {
        self.resident_before.map(|r| r + self.bytes() as u64)
    }

    /// Sizes the cache of `size` in whole blocks of `block_bytes`. `Auto` takes
    /// [`KV_AUTO_SHARE`] of the memory available now, at most `bound_tokens`' worth; an explicit
    /// size larger than the memory available is refused here, at start-up, rather than found
    /// out by the kernel mid-request.
    pub(crate) fn choose(
        size: KvCacheSize,
        block_bytes: usize,
        block_size: usize,
        bound_tokens: Option<usize>,
    ) -> Result<KvCachePlan> {
        let gb = |b: f64| b / 1e9;
        let available = memory::available();
        let bound_blocks = bound_tokens.map(|t| t.div_ceil(block_size.max(1)));
        let mut plan = KvCachePlan {
            auto: size == KvCacheSize::Auto,
            num_blocks: 0,
            block_size,
            block_bytes,
            draft_block_bytes: None,
            bound: bound_blocks.map(|b| b.saturating_mul(block_bytes)),
            resident_before: memory::resident(),
            available: available.clone(),
        };
        let budget = match (size, &available) {
            (KvCacheSize::Bytes(b), None) => b,
            (KvCacheSize::Bytes(b), Some(a)) => {
                if b as u64 > a.bytes {
                    return Err(EngineError::Config(format!(
                        "out of memory for the KV cache: --kv-cache-size asks for {:.3} GB, and {:.3} GB are available ({}) once the model is compiled; give a smaller size, or `auto`",
                        gb(b as f64),
                        gb(a.bytes as f64),
                        a.source
                    )));
                }
                b
            }
            (KvCacheSize::Auto, Some(a)) => auto_budget(a),
            (KvCacheSize::Auto, None) => {
                return Err(EngineError::Config(
                    "--kv-cache-size auto cannot read the memory available (/proc/meminfo): give a size in GB"
                        .into(),
                ))
            }
        };
        plan.num_blocks = budget / block_bytes;
        if plan.auto {
            if let Some(b) = bound_blocks {
                plan.num_blocks = plan.num_blocks.min(b);
            }
        }
        if plan.num_blocks == 0 {
            return Err(EngineError::Config(match (plan.auto, &available) {
                (true, Some(a)) => format!(
                    "out of memory for the KV cache: {:.3} GB are available ({}) once the model is compiled, and one block of {block_size} tokens takes {block_bytes} bytes",
                    gb(a.bytes as f64),
                    a.source
                ),
                _ => format!(
                    "a KV cache of {budget} bytes holds no block: one block of {block_size} tokens takes {block_bytes} bytes"
                ),
            }));
        }
        Ok(plan)
    }
}

/// What `auto` may take of the memory available: [`KV_AUTO_SHARE`] of it.
fn auto_budget(a: &Available) -> usize {
    (a.bytes as f64 * KV_AUTO_SHARE) as usize
}

impl KvCachePlan {
    /// The plan of the target's cache and its draft model's (`--speculative draft`), from
    /// `self`, the target's plan, made once both models were compiled (so `available` is the
    /// memory both left), and `draft_block_bytes`, a block of the draft's cache over all its
    /// layers. Both caches get the same block count: a draft cache holds a sequence's tokens
    /// plus at most `k - 1` drafts, which the target's verification step holds too, so with
    /// fewer blocks the draft could not follow every sequence the target runs, and more would
    /// never be used.
    ///
    /// `auto` splits its share of the memory available: `n` blocks with `n` x (target + draft
    /// block bytes) within [`KV_AUTO_SHARE`] of it, and at most the context bound. An explicit
    /// size is the target's cache alone: the draft's comes on top, and both must fit in the
    /// memory available.
    pub(crate) fn with_draft(mut self, draft_block_bytes: usize) -> Result<KvCachePlan> {
        let target_bytes = self.block_bytes;
        self.draft_block_bytes = Some(draft_block_bytes);
        let both = self.bytes_a_block();
        let bound_blocks = self.bound.map(|b| b / target_bytes.max(1));
        self.bound = bound_blocks.map(|n| n.saturating_mul(both));
        let gb = |b: f64| b / 1e9;
        if !self.auto {
            if let Some(a) = &self.available {
                if self.bytes() as u64 > a.bytes {
                    return Err(EngineError::Config(format!(
                        "out of memory for the KV caches: --kv-cache-size asks for {:.3} GB, the \
                         draft model's cache of as many blocks takes {:.3} GB more, and {:.3} GB \
                         are available ({}) once both models are compiled; give a smaller size, \
                         or `auto`",
                        gb((self.num_blocks * target_bytes) as f64),
                        gb((self.num_blocks * draft_block_bytes) as f64),
                        gb(a.bytes as f64),
                        a.source
                    )));
                }
            }
            return Ok(self);
        }
        let Some(a) = self.available.clone() else {
            return Err(EngineError::Config(
                "--kv-cache-size auto cannot read the memory available (/proc/meminfo) once the \
                 draft model is compiled: give a size in GB"
                    .into(),
            ));
        };
        let fit = auto_budget(&a) / both;
        self.num_blocks = self
            .num_blocks
            .min(fit)
            .min(bound_blocks.unwrap_or(usize::MAX));
        if self.num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "out of memory for the KV caches: {:.3} GB are available ({}) once the model and \
                 the draft model are compiled, and {:.0}% of it does not hold one block of {} \
                 tokens in both caches ({target_bytes} bytes in the model's, {draft_block_bytes} \
                 in the draft's); give a smaller draft model, or an explicit --kv-cache-size",
                gb(a.bytes as f64),
                a.source,
                KV_AUTO_SHARE * 100.0,
                self.block_size,
            )));
        }
        Ok(self)
    }
}

impl std::fmt::Display for KvCachePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let gb = |b: f64| b / 1e9;
        write!(
            f,
            "{:.3} GB, {} blocks of {} tokens ({} bytes a block",
            gb(self.bytes() as f64),
            self.num_blocks,
            self.block_size,
            self.block_bytes
        )?;
        match self.draft_block_bytes {
            Some(d) => write!(f, ", and {d} in the draft model's cache of as many blocks)")?,
            None => write!(f, ")")?,
        }
        if self.auto {
            write!(f, "; auto: {:.0}% of", KV_AUTO_SHARE * 100.0)?;
            match &self.available {
                Some(a) => write!(
                    f,
                    " the {:.3} GB available after compiling {}({})",
                    gb(a.bytes as f64),
                    if self.draft_block_bytes.is_some() {
                        "both models "
                    } else {
                        ""
                    },
                    a.source
                )?,
                None => write!(f, " the memory available")?,
            }
            match self.bound {
                Some(b) => write!(
                    f,
                    ", at most {:.3} GB (context x max sequences)",
                    gb(b as f64)
                )?,
                None => write!(f, " (no context length known to bound it)")?,
            }
        }
        if let Some(r) = self.resident_bound() {
            write!(
                f,
                "; resident memory at most {:.3} GB with the cache full (pages are taken as blocks are first written)",
                gb(r as f64)
            )?;
        }
        Ok(())
    }
}

/// The caches of every layer, `num_blocks` blocks each.
pub(crate) fn allocate(
    layers: &[LayerDims],
    elem: ElemType,
    num_blocks: usize,
) -> Result<Vec<(CacheBuf, CacheBuf)>> {
    let make = |[h, r, c]: [usize; 3]| -> Result<CacheBuf> {
        let block_bytes = elem
            .bytes_for(h * r * c)
            .ok_or_else(|| EngineError::Config("a KV cache block's size overflows".into()))?;
        let bytes = num_blocks
            .checked_mul(block_bytes)
            .ok_or_else(|| EngineError::Config("the KV cache's size overflows".into()))?;
        Ok(CacheBuf {
            words: zeroed_words(bytes.div_ceil(8))?,
            shape: [num_blocks, h, r, c],
            block_bytes,
        })
    };
    layers
        .iter()
        .map(|&(k, v)| Ok((make(k)?, make(v)?)))
        .collect()
}

/// `n` zero words from the allocator's zeroed memory (fresh pages are mapped zero and only
/// committed when written, so a large cache costs nothing until used), or an error when the
/// memory is not available.
fn zeroed_words(n: usize) -> Result<Vec<u64>> {
    let oom = || {
        EngineError::Config(format!(
            "cannot allocate a KV cache of {} bytes",
            n.saturating_mul(8)
        ))
    };
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u64>(n).map_err(|_| oom())?;
    // SAFETY: `layout` has a non-zero size (n > 0).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<u64>();
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` was allocated by the global allocator with the layout of `n` u64s, all
    // initialised (zero), so it is a valid Vec with length and capacity `n`.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A target's `auto` plan as `choose` makes it once both models are compiled, `available`
    /// bytes left then: `num_blocks` chosen, `bound_blocks` of context bound.
    fn target(num_blocks: usize, bound_blocks: Option<usize>, available: u64) -> KvCachePlan {
        KvCachePlan {
            auto: true,
            num_blocks,
            block_size: 32,
            block_bytes: 600_000,
            draft_block_bytes: None,
            available: Some(Available {
                bytes: available,
                source: "cgroup memory.max",
            }),
            bound: bound_blocks.map(|b| b * 600_000),
            resident_before: Some(400_000_000),
        }
    }

    /// Half of 1 GB left once both models are compiled is 500 MB; a block takes 600 kB in the
    /// target's cache and 200 kB in the draft's, 800 kB in all: 625 blocks of each, 500 MB.
    /// The target's own choice (833 blocks, half of 1 GB / 600 kB) and a context bound above
    /// 625 do not bind; a bound of 512 blocks, or a choice of 600, does.
    #[test]
    fn auto_splits_its_share_between_the_target_and_draft_caches() {
        let plan = target(833, Some(4000), 1_000_000_000)
            .with_draft(200_000)
            .unwrap();
        assert_eq!(plan.num_blocks, 625);
        assert_eq!(plan.draft_block_bytes, Some(200_000));
        assert_eq!(plan.bytes(), 500_000_000);
        assert_eq!(plan.bound, Some(4000 * 800_000));
        assert_eq!(plan.resident_bound(), Some(900_000_000));
        let shown = plan.to_string();
        assert!(
            shown.starts_with("0.500 GB, 625 blocks of 32 tokens (600000 bytes a block, and 200000 in the draft model's cache of as many blocks); auto: 50% of the 1.000 GB available after compiling both models (cgroup memory.max), at most 3.200 GB"),
            "{shown}"
        );

        let bounded = target(833, Some(512), 1_000_000_000).with_draft(200_000);
        assert_eq!(bounded.unwrap().num_blocks, 512);
        let first = target(600, None, 1_000_000_000).with_draft(200_000);
        assert_eq!(first.unwrap().num_blocks, 600);
    }

    /// 1.5 MB left: half is 750 kB, under one block of both caches (800 kB).
    #[test]
    fn auto_refuses_a_draft_when_one_block_of_both_caches_does_not_fit() {
        let err = target(1, None, 1_500_000)
            .with_draft(200_000)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "out of memory for the KV caches: 0.002 GB are available (cgroup memory.max)"
            ) && err.contains("600000 bytes in the model's, 200000 in the draft's"),
            "{err}"
        );
        // 1.6 MB: exactly one block of each.
        let one = target(1, None, 1_600_000).with_draft(200_000).unwrap();
        assert_eq!((one.num_blocks, one.bytes()), (1, 800_000));
    }

    /// An explicit size is the target's cache: its block count stays, the draft's comes on top,
    /// and both must fit in the memory left.
    #[test]
    fn an_explicit_size_keeps_its_blocks_with_a_draft() {
        let mut t = target(1666, None, 2_000_000_000);
        t.auto = false;
        let plan = t.clone().with_draft(200_000).unwrap();
        assert_eq!(plan.num_blocks, 1666);
        assert_eq!(plan.bytes(), 1666 * 800_000);
        // 1.0 GB of the target's cache fits in 1.2 GB; with the draft's 0.333 GB more, not.
        t.available.as_mut().unwrap().bytes = 1_200_000_000;
        let err = t.with_draft(200_000).unwrap_err().to_string();
        assert!(
            err.contains("--kv-cache-size asks for 1.000 GB, the draft model's cache of as many blocks takes 0.333 GB more, and 1.200 GB are available (cgroup memory.max)"),
            "{err}"
        );
    }
}
