//! Sequences and their block tables over one [`BlockPool`]: append with on-demand allocation,
//! fork with shared blocks, copy-on-write, truncate (speculative rollback), prefix caching, and
//! the op's block inputs for a batch.
//!
//! Every operation either succeeds completely or returns an error having changed nothing.

use super::pool::{block_hash, BlockId, BlockPool, ROOT_HASH};
use crate::error::{PaError, Result};
use std::collections::{BTreeMap, HashMap};

/// A sequence id chosen by the caller.
pub type SeqId = u64;

/// A block copy the caller must perform on both caches before the next op call:
/// `cache[dst, :, :, :] = cache[src, :, :, :]` (see [`copy_blocks`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockCopy {
    pub src: BlockId,
    pub dst: BlockId,
}

/// Result of [`BlockManager::append`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Append {
    /// Tokens cached before the append: the op's `past_lens` entry for this chunk.
    pub past_len: usize,
    /// Copy-on-write copies to perform before the op call that writes the new tokens.
    pub copies: Vec<BlockCopy>,
}

/// Usage statistics of the manager.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub block_size: usize,
    pub total_blocks: usize,
    /// Blocks referenced by at least one sequence.
    pub used_blocks: usize,
    /// Blocks on the free list.
    pub free_blocks: usize,
    /// Unreferenced blocks kept for prefix reuse (also allocatable).
    pub cached_blocks: usize,
    /// Blocks referenced by two or more sequences.
    pub shared_blocks: usize,
    /// Token slots of used blocks that hold a token of some sequence.
    pub used_slots: usize,
    /// Token slots of used blocks that hold no token (internal fragmentation).
    pub fragmentation: usize,
    pub sequences: usize,
}

#[derive(Clone, Debug)]
pub(super) struct Sequence {
    pub(super) blocks: Vec<BlockId>,
    pub(super) len: usize,
    /// Token ids of the cached tokens (for prefix hashing).
    pub(super) tokens: Vec<u32>,
    /// Hash chain of the leading full blocks (`hashes[i]` identifies blocks 0..=i).
    pub(super) hashes: Vec<u64>,
    /// False once eviction moved tokens: later blocks no longer match a plain prompt.
    pub(super) hashable: bool,
    /// Accumulated attention scores per block (see [`BlockManager::accumulate_scores`]).
    pub(super) scores: Vec<f64>,
}

/// Configuration of a [`BlockManager`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ManagerConfig {
    /// `NB`: physical blocks in the caches.
    pub num_blocks: usize,
    /// `BS`: token slots per block.
    pub block_size: usize,
    /// Reuse computed full blocks across sequences with equal prompt prefixes.
    pub prefix_caching: bool,
}

/// The KV-cache block manager.
#[derive(Clone, Debug)]
pub struct BlockManager {
    pub(super) cfg: ManagerConfig,
    pub(super) pool: BlockPool,
    pub(super) seqs: HashMap<SeqId, Sequence>,
    /// Registered blocks the op has not written yet.
    pub(super) uncomputed: Vec<BlockId>,
    /// Blocks whose keys the next op call must rotate back by this many positions.
    pub(super) pending_rotation: BTreeMap<BlockId, u32>,
}

impl BlockManager {
    pub fn new(cfg: ManagerConfig) -> Result<BlockManager> {
        if cfg.block_size == 0 || cfg.num_blocks == 0 {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "num_blocks and block_size must be positive, but they are {} and {}",
                    cfg.num_blocks, cfg.block_size
                ),
            });
        }
        Ok(BlockManager {
            cfg,
            pool: BlockPool::new(cfg.num_blocks)?,
            seqs: HashMap::new(),
            uncomputed: Vec::new(),
            pending_rotation: BTreeMap::new(),
        })
    }

    pub fn config(&self) -> ManagerConfig {
        self.cfg
    }

    pub fn block_size(&self) -> usize {
        self.cfg.block_size
    }

    /// Blocks an allocation can obtain right now (free plus cached).
    pub fn available_blocks(&self) -> usize {
        self.pool.available()
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.pool.ref_count(b)
    }

    pub fn contains(&self, id: SeqId) -> bool {
        self.seqs.contains_key(&id)
    }

    /// Ids of all sequences, ascending.
    pub fn sequence_ids(&self) -> Vec<SeqId> {
        let mut v: Vec<_> = self.seqs.keys().copied().collect();
        v.sort_unstable();
        v
    }

    pub(super) fn seq(&self, id: SeqId) -> Result<&Sequence> {
        self.seqs.get(&id).ok_or(PaError::UnknownSequence { id })
    }

    /// Cached tokens of a sequence.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        Ok(self.seq(id)?.len)
    }

    /// The sequence's block table (physical block of each logical block).
    pub fn block_table(&self, id: SeqId) -> Result<&[BlockId]> {
        Ok(&self.seq(id)?.blocks)
    }

    /// Accumulated score of each logical block of the sequence.
    pub fn block_scores(&self, id: SeqId) -> Result<&[f64]> {
        Ok(&self.seq(id)?.scores)
    }

    fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.cfg.block_size)
    }

    /// Blocks an [`append`](Self::append) of `n` tokens would allocate (new blocks plus a
    /// copy-on-write copy), so a scheduler can check before committing.
    pub fn blocks_needed(&self, id: SeqId, n: usize) -> Result<usize> {
        let s = self.seq(id)?;
        Ok(self.blocks_needed_for(s, n))
    }

    fn blocks_needed_for(&self, s: &Sequence, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        let new = self.blocks_for(s.len + n) - s.blocks.len();
        new + usize::from(self.needs_cow(s))
    }

    /// Whether the next write lands in a block some other table also holds.
    fn needs_cow(&self, s: &Sequence) -> bool {
        s.len % self.cfg.block_size != 0
            && self.pool.ref_count(s.blocks[s.len / self.cfg.block_size]) > 1
    }

    /// Creates an empty sequence, reusing computed cached blocks that hold the leading full
    /// blocks of `prompt` (at most `(prompt.len() - 1) / BS` blocks, so at least one prompt
    /// token is left to compute). Returns the number of tokens already cached; the caller then
    /// appends `prompt[returned..]`.
    pub fn add_sequence(&mut self, id: SeqId, prompt: &[u32]) -> Result<usize> {
        if self.seqs.contains_key(&id) {
            return Err(PaError::InvalidState {
                detail: format!("sequence {id} already exists"),
            });
        }
        let bs = self.cfg.block_size;
        let mut seq = Sequence {
            blocks: Vec::new(),
            len: 0,
            tokens: Vec::new(),
            hashes: Vec::new(),
            hashable: true,
            scores: Vec::new(),
        };
        if self.cfg.prefix_caching && !prompt.is_empty() {
            let mut parent = ROOT_HASH;
            for chunk in prompt[..prompt.len() - 1].chunks_exact(bs) {
                let h = block_hash(parent, chunk);
                let Some(b) = self.pool.lookup(h, parent, chunk) else {
                    break;
                };
                self.pool.retain(b)?;
                seq.blocks.push(b);
                seq.hashes.push(h);
                seq.tokens.extend_from_slice(chunk);
                seq.scores.push(0.0);
                seq.len += bs;
                parent = h;
            }
        }
        let cached = seq.len;
        self.seqs.insert(id, seq);
        Ok(cached)
    }

    /// Appends `tokens` to the sequence, allocating blocks on demand. When the block the first
    /// new token lands in is shared, it is copied first (copy-on-write); the copies are returned
    /// and must be performed before the op call. Fails with `OutOfBlocks`, changing nothing,
    /// when the pool cannot supply the blocks.
    pub fn append(&mut self, id: SeqId, tokens: &[u32]) -> Result<Append> {
        let bs = self.cfg.block_size;
        let s = self.seq(id)?;
        let need = self.blocks_needed_for(s, tokens.len());
        if need > self.pool.available() {
            return Err(PaError::OutOfBlocks {
                detail: format!(
                    "sequence {id} needs {need} blocks for {} tokens, {} available",
                    tokens.len(),
                    self.pool.available()
                ),
            });
        }
        let cow = self.needs_cow(s);
        let past_len = s.len;
        let mut copies = Vec::new();
        if cow {
            let i = past_len / bs;
            let src = self.seq(id)?.blocks[i];
            let dst = self.alloc()?;
            self.release_block(src)?;
            if let Some(&d) = self.pending_rotation.get(&src) {
                self.pending_rotation.insert(dst, d);
            }
            copies.push(BlockCopy { src, dst });
            self.seq_mut(id)?.blocks[i] = dst;
        }
        let new_blocks = self.blocks_for(past_len + tokens.len()) - self.seq(id)?.blocks.len();
        for _ in 0..new_blocks {
            let b = self.alloc()?;
            let s = self.seq_mut(id)?;
            s.blocks.push(b);
            s.scores.push(0.0);
        }
        let prefix = self.cfg.prefix_caching;
        let s = self
            .seqs
            .get_mut(&id)
            .ok_or(PaError::UnknownSequence { id })?;
        s.tokens.extend_from_slice(tokens);
        s.len += tokens.len();
        if s.hashable {
            while s.hashes.len() < s.len / bs {
                let i = s.hashes.len();
                let parent = i.checked_sub(1).map_or(ROOT_HASH, |p| s.hashes[p]);
                let chunk = &s.tokens[i * bs..(i + 1) * bs];
                let h = block_hash(parent, chunk);
                s.hashes.push(h);
                let b = s.blocks[i];
                if prefix && self.pool.register(b, h, parent, chunk) {
                    self.uncomputed.push(b);
                }
            }
        }
        Ok(Append { past_len, copies })
    }

    /// Marks every block registered since the last call as written by the op: call after the
    /// op call that wrote them, so later prompts can reuse them.
    pub fn mark_computed(&mut self) {
        for b in std::mem::take(&mut self.uncomputed) {
            self.pool.mark_computed(b);
        }
    }

    /// A new sequence `child` sharing every block of `parent` (beam search). Writes to a shared
    /// partially filled block are later copied on write.
    pub fn fork(&mut self, parent: SeqId, child: SeqId) -> Result<()> {
        if self.seqs.contains_key(&child) {
            return Err(PaError::InvalidState {
                detail: format!("sequence {child} already exists"),
            });
        }
        let s = self.seq(parent)?.clone();
        for &b in &s.blocks {
            self.pool.retain(b)?;
        }
        self.seqs.insert(child, s);
        Ok(())
    }

    /// Removes the sequence, dropping its references (last block first, so the LRU keeps the
    /// shared prefix longest).
    pub fn free(&mut self, id: SeqId) -> Result<()> {
        let s = self
            .seqs
            .remove(&id)
            .ok_or(PaError::UnknownSequence { id })?;
        for &b in s.blocks.iter().rev() {
            self.release_block(b)?;
        }
        Ok(())
    }

    /// Shortens the sequence to `new_len` tokens (speculative decoding: rejected draft tokens).
    /// Blocks past the new end are released; a kept block that becomes partially filled loses
    /// its prefix-cache registration if this sequence alone holds it.
    pub fn truncate(&mut self, id: SeqId, new_len: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.seq(id)?;
        if new_len > s.len {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "cannot truncate sequence {id} to {new_len} tokens: it holds {}",
                    s.len
                ),
            });
        }
        let keep = self.blocks_for(new_len);
        let dropped: Vec<BlockId> = s.blocks[keep..].to_vec();
        for &b in dropped.iter().rev() {
            self.release_block(b)?;
        }
        if new_len % bs != 0 {
            let b = self.seq(id)?.blocks[new_len / bs];
            if self.pool.ref_count(b) == 1 {
                self.pool.unregister(b);
            }
        }
        let s = self.seq_mut(id)?;
        s.blocks.truncate(keep);
        s.scores.truncate(keep);
        s.len = new_len;
        s.tokens.truncate(new_len.min(s.tokens.len()));
        s.hashes.truncate(new_len / bs);
        Ok(())
    }

    /// Adds the op's `scores` output for this sequence (`len` values, one per cached token,
    /// i.e. `past_lens[s] + n_s` after the call) to the per-block accumulators.
    pub fn accumulate_scores(&mut self, id: SeqId, scores: &[f32]) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.seq_mut(id)?;
        if scores.len() != s.len {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "sequence {id} holds {} tokens but {} scores were given",
                    s.len,
                    scores.len()
                ),
            });
        }
        for (acc, chunk) in s.scores.iter_mut().zip(scores.chunks(bs)) {
            *acc += chunk.iter().map(|&x| x as f64).sum::<f64>();
        }
        Ok(())
    }

    /// The op's block inputs for a batch of sequences, in order: `(block_indices,
    /// block_indices_begins)` (`[N]` and `[B+1]`, i32).
    pub fn block_inputs(&self, ids: &[SeqId]) -> Result<(Vec<i32>, Vec<i32>)> {
        let mut indices = Vec::new();
        let mut begins = vec![0i32];
        for &id in ids {
            indices.extend(self.seq(id)?.blocks.iter().map(|&b| b as i32));
            begins.push(
                i32::try_from(indices.len()).map_err(|_| PaError::InvalidArgument {
                    detail: "block_indices longer than i32::MAX".into(),
                })?,
            );
        }
        Ok((indices, begins))
    }

    pub fn stats(&self) -> CacheStats {
        let bs = self.cfg.block_size;
        let mut fill = vec![0usize; self.cfg.num_blocks];
        for s in self.seqs.values() {
            for (i, &b) in s.blocks.iter().enumerate() {
                let f = (s.len - i * bs).min(bs);
                fill[b as usize] = fill[b as usize].max(f);
            }
        }
        let c = self.pool.counts();
        let used_slots: usize = fill.iter().sum();
        CacheStats {
            block_size: bs,
            total_blocks: c.total,
            used_blocks: c.used,
            free_blocks: c.free,
            cached_blocks: c.cached,
            shared_blocks: c.shared,
            used_slots,
            fragmentation: c.used * bs - used_slots,
            sequences: self.seqs.len(),
        }
    }

    /// Checks every invariant: the pool's own, and that each block's ref count equals the
    /// number of block tables holding it. `Err` describes the first one broken.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.pool.check()?;
        let mut holders = vec![0u32; self.cfg.num_blocks];
        for (id, s) in &self.seqs {
            if s.blocks.len() != self.blocks_for(s.len) || s.scores.len() != s.blocks.len() {
                return Err(format!(
                    "sequence {id}: {} blocks for {} tokens",
                    s.blocks.len(),
                    s.len
                ));
            }
            for &b in &s.blocks {
                holders[b as usize] += 1;
            }
        }
        for (b, &h) in holders.iter().enumerate() {
            let r = self.pool.ref_count(b as BlockId);
            if r != h {
                return Err(format!("block {b}: ref count {r}, held by {h} tables"));
            }
        }
        let distinct = holders.iter().filter(|&&h| h > 0).count();
        let c = self.pool.counts();
        if c.free + c.cached + distinct != c.total {
            return Err(format!(
                "free {} + cached {} + referenced {distinct} != total {}",
                c.free, c.cached, c.total
            ));
        }
        Ok(())
    }

    pub(super) fn seq_mut(&mut self, id: SeqId) -> Result<&mut Sequence> {
        self.seqs
            .get_mut(&id)
            .ok_or(PaError::UnknownSequence { id })
    }

    pub(super) fn alloc(&mut self) -> Result<BlockId> {
        let b = self.pool.allocate().ok_or_else(|| PaError::OutOfBlocks {
            detail: "the block pool is empty".into(),
        })?;
        // A recycled block carries no pending rotation of its previous owner.
        self.pending_rotation.remove(&b);
        Ok(b)
    }

    pub(super) fn release_block(&mut self, b: BlockId) -> Result<()> {
        self.pool.release(b)?;
        if self.pool.ref_count(b) == 0 {
            self.pending_rotation.remove(&b);
        }
        Ok(())
    }
}

/// Performs block copies on a key and a value cache, both `[NB, Hkv, BS, D]` row-major with
/// `block_elems = Hkv * BS * D` elements per block. Any element type.
pub fn copy_blocks<T: Copy>(
    key_cache: &mut [T],
    value_cache: &mut [T],
    block_elems: usize,
    copies: &[BlockCopy],
) -> Result<()> {
    for cache in [&mut *key_cache, &mut *value_cache] {
        let nb = cache.len().checked_div(block_elems).unwrap_or(0);
        for c in copies {
            let (s, d) = (c.src as usize, c.dst as usize);
            if s >= nb || d >= nb {
                return Err(PaError::InvalidArgument {
                    detail: format!("block copy {s} -> {d} outside a cache of {nb} blocks"),
                });
            }
        }
    }
    for cache in [key_cache, value_cache] {
        for c in copies {
            let (s, d) = (c.src as usize, c.dst as usize);
            cache.copy_within(s * block_elems..(s + 1) * block_elems, d * block_elems);
        }
    }
    Ok(())
}
