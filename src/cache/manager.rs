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
/// `#[repr(C)]`: the C ABI's `pa_block_copy`.
#[repr(C)]
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
    /// Computed blocks the prefix cache can offer (held or cached), and the wrapping sum of
    /// their content hashes: two runs whose digests are equal left the same contents there.
    pub prefix_blocks: usize,
    pub prefix_digest: u64,
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
        !s.len.is_multiple_of(self.cfg.block_size)
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
        } else if past_len % bs != 0 {
            // Written in place (this sequence alone holds it): its tokens change, so a hash
            // registered for its old contents (a computed block truncated into) must go.
            self.pool.unregister(self.seq(id)?.blocks[past_len / bs]);
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

    /// Forgets the blocks registered since the last [`Self::mark_computed`] without marking
    /// them: the op call that was to write them failed. They stay unmatchable, and leave the
    /// prefix cache when released.
    pub fn discard_uncomputed(&mut self) {
        self.uncomputed.clear();
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
    /// Blocks past the new end are released. A kept block that becomes partially filled keeps
    /// its prefix-cache registration (its slots still hold those tokens) until [`Self::append`]
    /// writes into it in place; a shared one is copied on that write instead.
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
        let s = self.seq_mut(id)?;
        s.blocks.truncate(keep);
        s.scores.truncate(keep);
        s.len = new_len;
        s.tokens.truncate(new_len.min(s.tokens.len()));
        s.hashes.truncate(new_len / bs);
        Ok(())
    }

    /// Rolls the sequence back to `new_len` tokens after a verification step (speculative
    /// decoding): like [`Self::truncate`], and besides, every block it alone holds that held a
    /// dropped token leaves the prefix cache at once, so the cache never offers a rejected draft
    /// (the kept partial block and the released ones alike). Blocks shared with another
    /// sequence keep their registration: that holder's tokens are valid.
    pub fn rollback(&mut self, id: SeqId, new_len: usize) -> Result<()> {
        let bs = self.cfg.block_size;
        let s = self.seq(id)?;
        if new_len > s.len {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "cannot roll sequence {id} back to {new_len} tokens: it holds {}",
                    s.len
                ),
            });
        }
        // Blocks from the one holding position `new_len` on held a dropped token.
        let first = new_len / bs;
        let stale: Vec<BlockId> = s.blocks[first.min(s.blocks.len())..]
            .iter()
            .copied()
            .filter(|&b| self.pool.ref_count(b) == 1)
            .collect();
        for b in stale {
            self.pool.unregister(b);
        }
        self.truncate(id, new_len)
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

    /// Starts (or stops) recording the changes to the prefix cache's matchable blocks
    /// ([`crate::cache::CacheEvent`]); turn it on before the first step.
    pub fn record_cache_events(&mut self, on: bool) {
        self.pool.record_events(on);
    }

    /// The changes recorded since the last call, oldest first.
    pub fn take_cache_events(&mut self) -> Vec<super::pool::CacheEvent> {
        self.pool.take_events()
    }

    /// Hashes of the blocks a prompt can reuse now (what a replay of the events gives), ascending.
    pub fn cached_hashes(&self) -> Vec<u64> {
        self.pool.matchable_hashes()
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
            prefix_blocks: c.prefix_blocks,
            prefix_digest: c.prefix_digest,
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
    copy_blocks_kv(key_cache, value_cache, block_elems, block_elems, copies)
}

/// [`copy_blocks`] for caches whose blocks differ in size: u8 caches in OpenVINO's layout
/// (`op::quant_layout`), whose key blocks hold `Hkv * (BS + 8) * D` bytes (by channel, scales
/// included) and value blocks `Hkv * BS * (D + 8 * D / G)`. Block `b` is contiguous in both, so a
/// copy takes its quantization parameters along.
pub fn copy_blocks_kv<T: Copy>(
    key_cache: &mut [T],
    value_cache: &mut [T],
    key_block_elems: usize,
    value_block_elems: usize,
    copies: &[BlockCopy],
) -> Result<()> {
    let caches = [
        (key_cache, key_block_elems),
        (value_cache, value_block_elems),
    ];
    for (cache, be) in &caches {
        let nb = cache.len().checked_div(*be).unwrap_or(0);
        for c in copies {
            let (s, d) = (c.src as usize, c.dst as usize);
            if s >= nb || d >= nb {
                return Err(PaError::InvalidArgument {
                    detail: format!("block copy {s} -> {d} outside a cache of {nb} blocks"),
                });
            }
        }
    }
    for (cache, be) in caches {
        for c in copies {
            let (s, d) = (c.src as usize, c.dst as usize);
            cache.copy_within(s * be..(s + 1) * be, d * be);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mgr(num_blocks: usize, block_size: usize) -> BlockManager {
        BlockManager::new(ManagerConfig {
            num_blocks,
            block_size,
            prefix_caching: true,
        })
        .unwrap()
    }

    fn toks(r: std::ops::Range<u32>) -> Vec<u32> {
        r.collect()
    }

    #[test]
    fn append_allocates_blocks_on_demand() {
        let mut m = mgr(8, 4);
        m.add_sequence(1, &[]).unwrap();
        let a = m.append(1, &toks(0..5)).unwrap();
        assert_eq!(a.past_len, 0);
        assert_eq!(m.block_table(1).unwrap().len(), 2);
        let a = m.append(1, &toks(5..8)).unwrap();
        assert_eq!(a.past_len, 5);
        assert_eq!(
            m.block_table(1).unwrap().len(),
            2,
            "8 tokens fill exactly 2 blocks"
        );
        m.append(1, &[8]).unwrap();
        assert_eq!(m.block_table(1).unwrap().len(), 3);
        m.check_invariants().unwrap();
    }

    #[test]
    fn append_fails_without_change_when_blocks_run_out() {
        let mut m = mgr(2, 4);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..6)).unwrap();
        let err = m.append(1, &toks(6..9)).unwrap_err();
        assert!(matches!(err, PaError::OutOfBlocks { .. }), "got {err:?}");
        assert_eq!(m.len(1).unwrap(), 6);
        assert_eq!(m.block_table(1).unwrap().len(), 2);
        m.append(1, &toks(6..8)).unwrap();
        m.check_invariants().unwrap();
    }

    #[test]
    fn unknown_sequence_is_an_error() {
        let mut m = mgr(2, 4);
        assert_eq!(
            m.append(9, &[1]).unwrap_err(),
            PaError::UnknownSequence { id: 9 }
        );
        assert!(matches!(m.free(9), Err(PaError::UnknownSequence { id: 9 })));
    }

    #[test]
    fn fork_shares_every_block_and_free_drops_ref_counts() {
        let mut m = mgr(8, 4);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..6)).unwrap();
        m.fork(1, 2).unwrap();
        let t = m.block_table(1).unwrap().to_vec();
        assert_eq!(m.block_table(2).unwrap(), &t[..]);
        for &b in &t {
            assert_eq!(m.ref_count(b), 2);
        }
        assert_eq!(m.stats().shared_blocks, 2);
        m.free(1).unwrap();
        for &b in &t {
            assert_eq!(m.ref_count(b), 1);
        }
        m.free(2).unwrap();
        for &b in &t {
            assert_eq!(m.ref_count(b), 0);
        }
        assert_eq!(m.available_blocks(), 8);
        m.check_invariants().unwrap();
    }

    #[test]
    fn writing_a_shared_partial_block_copies_it_first() {
        let mut m = mgr(8, 4);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..6)).unwrap();
        m.fork(1, 2).unwrap();
        let parent = m.block_table(1).unwrap().to_vec();
        let a = m.append(2, &[100]).unwrap();
        assert_eq!(a.copies.len(), 1);
        assert_eq!(a.copies[0].src, parent[1]);
        let child = m.block_table(2).unwrap().to_vec();
        assert_eq!(child[0], parent[0], "the full block stays shared");
        assert_eq!(child[1], a.copies[0].dst);
        assert_ne!(child[1], parent[1]);
        assert_eq!(m.ref_count(parent[1]), 1);
        // The parent now holds its block alone: no copy.
        assert!(m.append(1, &[200]).unwrap().copies.is_empty());
        m.check_invariants().unwrap();
    }

    #[test]
    fn writing_after_a_full_shared_block_needs_no_copy() {
        let mut m = mgr(8, 4);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..8)).unwrap();
        m.fork(1, 2).unwrap();
        assert!(m.append(2, &[1]).unwrap().copies.is_empty());
    }

    #[test]
    fn copy_blocks_copies_whole_blocks_of_both_caches() {
        let (hkv, bs, d) = (2, 2, 3);
        let be = hkv * bs * d;
        let mut k: Vec<f32> = (0..3 * be).map(|x| x as f32).collect();
        let mut v: Vec<f32> = k.iter().map(|x| -x).collect();
        copy_blocks(&mut k, &mut v, be, &[BlockCopy { src: 0, dst: 2 }]).unwrap();
        assert_eq!(k[2 * be..], k[..be].to_vec()[..]);
        assert_eq!(v[2 * be..], v[..be].to_vec()[..]);
        assert_eq!(k[be], be as f32, "block 1 untouched");
        assert!(copy_blocks(&mut k, &mut v, be, &[BlockCopy { src: 0, dst: 3 }]).is_err());
    }

    #[test]
    fn copy_blocks_kv_copies_blocks_of_different_sizes() {
        // u8 by-channel keys [NB, 2, 4 + 8, 3] and by-token values [NB, 2, 4, 3 + 8]
        let (kb, vb) = (2 * 12 * 3, 2 * 4 * 11);
        let mut k: Vec<u8> = (0..3 * kb).map(|x| x as u8).collect();
        let mut v: Vec<u8> = (0..3 * vb).map(|x| (x * 7) as u8).collect();
        let (k0, v0) = (k.clone(), v.clone());
        copy_blocks_kv(&mut k, &mut v, kb, vb, &[BlockCopy { src: 2, dst: 0 }]).unwrap();
        assert_eq!(k[..kb], k0[2 * kb..]);
        assert_eq!(v[..vb], v0[2 * vb..]);
        assert_eq!(k[kb..], k0[kb..], "blocks 1, 2 untouched");
        assert_eq!(v[vb..], v0[vb..]);
        // block 3 exists in neither cache
        let err = copy_blocks_kv(&mut k, &mut v, kb, vb, &[BlockCopy { src: 3, dst: 0 }]);
        assert!(err.is_err());
        assert_eq!(k[..kb], k0[2 * kb..], "a refused copy writes nothing");
    }

    #[test]
    fn rollback_frees_the_blocks_of_rejected_tokens() {
        let mut m = mgr(8, 4);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..6)).unwrap();
        let before = m.available_blocks();
        m.append(1, &toks(6..13)).unwrap(); // 5 draft-ish tokens more: 4 blocks
        assert_eq!(m.available_blocks(), before - 2);
        m.truncate(1, 7).unwrap();
        assert_eq!(m.len(1).unwrap(), 7);
        assert_eq!(m.block_table(1).unwrap().len(), 2);
        assert_eq!(m.available_blocks(), before);
        assert!(m.truncate(1, 8).is_err(), "cannot grow by truncation");
        m.check_invariants().unwrap();
    }

    #[test]
    fn rollback_into_a_shared_block_copies_on_the_next_write() {
        let mut m = mgr(8, 4);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..8)).unwrap();
        m.fork(1, 2).unwrap();
        m.truncate(2, 6).unwrap();
        let a = m.append(2, &[99]).unwrap();
        assert_eq!(
            a.copies.len(),
            1,
            "block 1 is shared with seq 1: copy before writing"
        );
        assert_eq!(m.len(1).unwrap(), 8);
        m.check_invariants().unwrap();
    }

    /// Found by the cache_manager fuzz target: a computed block truncated into while shared
    /// kept its prefix-cache entry; once the other holder was freed, the next append wrote it
    /// in place (no copy, one reference) and a later prompt reused its old hash with new tokens.
    #[test]
    fn a_block_written_in_place_leaves_the_prefix_cache() {
        let mut m = mgr(8, 2);
        let prompt = [1, 2, 3, 4, 5];
        m.add_sequence(1, &prompt).unwrap();
        m.append(1, &prompt).unwrap();
        m.mark_computed();
        m.fork(1, 2).unwrap();
        // Block 1 ([3, 4]) becomes sequence 1's partial last block while sequence 2 shares it.
        m.truncate(1, 3).unwrap();
        m.free(2).unwrap();
        let a = m.append(1, &[9]).unwrap();
        assert!(a.copies.is_empty(), "sole holder: written in place");
        m.mark_computed();
        // Block 1 now holds [3, 9]: a prompt starting [1, 2, 3, 4] may reuse block 0 only.
        assert_eq!(m.add_sequence(3, &[1, 2, 3, 4, 7]).unwrap(), 2);
        m.check_invariants().unwrap();
    }

    #[test]
    fn prefix_hit_reuses_computed_full_blocks() {
        let mut m = mgr(8, 4);
        let prompt = toks(0..10);
        assert_eq!(m.add_sequence(1, &prompt).unwrap(), 0);
        m.append(1, &prompt).unwrap();
        // Not computed yet: no hit.
        assert_eq!(m.add_sequence(2, &prompt).unwrap(), 0);
        m.free(2).unwrap();
        m.mark_computed();
        assert_eq!(m.add_sequence(2, &prompt).unwrap(), 8);
        let t1 = m.block_table(1).unwrap().to_vec();
        assert_eq!(m.block_table(2).unwrap(), &t1[..2]);
        assert_eq!(m.ref_count(t1[0]), 2);
        // A prompt that differs in block 1 hits block 0 only.
        let mut other = prompt.clone();
        other[5] = 77;
        assert_eq!(m.add_sequence(3, &other).unwrap(), 4);
        m.check_invariants().unwrap();
    }

    #[test]
    fn prefix_hit_leaves_at_least_one_token_to_compute() {
        let mut m = mgr(8, 4);
        let prompt = toks(0..8);
        m.add_sequence(1, &prompt).unwrap();
        m.append(1, &prompt).unwrap();
        m.mark_computed();
        assert_eq!(m.add_sequence(2, &prompt).unwrap(), 4);
    }

    #[test]
    fn freed_prefix_blocks_stay_reusable_until_memory_is_needed() {
        let mut m = mgr(4, 4);
        let p1 = toks(0..9);
        m.add_sequence(1, &p1).unwrap();
        m.append(1, &p1).unwrap();
        m.mark_computed();
        m.free(1).unwrap();
        let s = m.stats();
        assert_eq!((s.cached_blocks, s.free_blocks), (2, 2));
        assert_eq!(m.add_sequence(2, &p1).unwrap(), 8, "hit after free");
        m.free(2).unwrap();
        // A different sequence needing all 4 blocks takes the free ones, then the cached ones
        // least recently used first (block 1 of the prompt was released before block 0).
        m.add_sequence(3, &[]).unwrap();
        m.append(3, &toks(100..112)).unwrap();
        assert_eq!(m.stats().cached_blocks, 1);
        m.add_sequence(4, &[]).unwrap();
        let hit = m.add_sequence(5, &p1).unwrap();
        assert_eq!(hit, 4, "block 0 of the prompt survived, block 1 was reused");
        m.append(3, &toks(112..113)).unwrap_err();
        m.check_invariants().unwrap();
    }

    #[test]
    fn stats_count_fragmentation_as_empty_slots_of_used_blocks() {
        let mut m = mgr(8, 4);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..5)).unwrap();
        m.add_sequence(2, &[]).unwrap();
        m.append(2, &toks(0..2)).unwrap();
        let s = m.stats();
        assert_eq!(s.used_blocks, 3);
        assert_eq!(s.used_slots, 7);
        assert_eq!(s.fragmentation, 5);
        assert_eq!(s.free_blocks, 5);
    }

    #[test]
    fn accumulated_scores_sum_per_block() {
        let mut m = mgr(8, 2);
        m.add_sequence(1, &[]).unwrap();
        m.append(1, &toks(0..3)).unwrap();
        m.accumulate_scores(1, &[1.0, 2.0, 4.0]).unwrap();
        m.accumulate_scores(1, &[1.0, 0.0, 1.0]).unwrap();
        assert_eq!(m.block_scores(1).unwrap(), &[4.0, 5.0]);
        assert!(m.accumulate_scores(1, &[1.0]).is_err());
    }

    #[test]
    fn block_inputs_concatenate_tables_in_batch_order() {
        let mut m = mgr(8, 2);
        for id in [1, 2] {
            m.add_sequence(id, &[]).unwrap();
        }
        m.append(1, &toks(0..3)).unwrap();
        m.append(2, &toks(0..1)).unwrap();
        let (bi, bib) = m.block_inputs(&[2, 1]).unwrap();
        let mut want = m.block_table(2).unwrap().to_vec();
        want.extend_from_slice(m.block_table(1).unwrap());
        assert_eq!(bi, want.iter().map(|&b| b as i32).collect::<Vec<_>>());
        assert_eq!(bib, vec![0, 1, 3]);
    }
}
