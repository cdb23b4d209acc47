//! The physical block pool: reference counts, an O(1) free list, and the prefix-cache index
//! (full blocks by content hash) whose unreferenced blocks wait in an O(1) LRU list until their
//! memory is needed.
//!
//! A block is in exactly one of three states:
//! - **free**: on the free list, no hash, ref count 0;
//! - **used**: ref count >= 1 (held by that many block tables);
//! - **cached**: ref count 0 but its content is registered under a hash, so a later prompt can
//!   reuse it; it sits in the LRU list and is handed out (hash dropped) only when the free list
//!   is empty.

use crate::alloc::{try_vec, try_with_capacity};
use crate::error::{PaError, Result};
use std::collections::HashMap;

/// A physical block id: an index into the cache's first dimension (`NB`).
pub type BlockId = u32;

const NIL: u32 = u32::MAX;

/// Seed of the hash chain (the "parent hash" of a sequence's first block).
pub const ROOT_HASH: u64 = 0x9e37_79b9_7f4a_7c15;

/// Content hash of a full block: FNV-1a over the parent hash and the token ids, then a
/// splitmix64 finalizer. Collisions are harmless: a lookup also compares parent and tokens.
pub fn block_hash(parent: u64, tokens: &[u32]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |b: u8| {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    };
    parent.to_le_bytes().into_iter().for_each(&mut eat);
    for t in tokens {
        t.to_le_bytes().into_iter().for_each(&mut eat);
    }
    let mut z = h;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A change to the set of blocks a prefix lookup can match (registered and computed), in the
/// order it happened; replayed from empty, the events give that set. Recorded only when asked
/// for ([`BlockPool::record_events`]): `pa serve --kv-events-endpoint` publishes them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CacheEvent {
    /// A full block became matchable: its hash, its parent's (`None` for a sequence's first
    /// block) and its tokens.
    Stored {
        hash: u64,
        parent: Option<u64>,
        tokens: Box<[u32]>,
    },
    /// A matchable block's content was dropped (its memory reused or rewritten).
    Removed { hash: u64 },
    /// Every block was dropped.
    Cleared,
}

/// What a registered block holds, kept to rule out hash collisions.
#[derive(Clone, Debug)]
struct CachedKey {
    hash: u64,
    parent: u64,
    tokens: Box<[u32]>,
    /// The op has written the block (see `BlockManager::mark_computed`); only computed blocks
    /// are matched.
    computed: bool,
}

/// Counts of the pool (the block-level part of [`crate::cache::CacheStats`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    pub total: usize,
    /// Blocks with ref count >= 1.
    pub used: usize,
    /// Blocks on the free list.
    pub free: usize,
    /// Unreferenced blocks kept for prefix reuse (allocatable too).
    pub cached: usize,
    /// Blocks with ref count >= 2.
    pub shared: usize,
}

/// Fixed pool of `total` blocks.
#[derive(Clone, Debug)]
pub struct BlockPool {
    refs: Vec<u32>,
    free: Vec<BlockId>,
    key: Vec<Option<CachedKey>>,
    by_hash: HashMap<u64, BlockId>,
    // Doubly linked LRU list of cached (ref 0, hashed) blocks; head = least recently used.
    prev: Vec<u32>,
    next: Vec<u32>,
    in_lru: Vec<bool>,
    head: u32,
    tail: u32,
    lru_len: usize,
    shared: usize,
    /// Changes to the matchable set since the last `take_events` (`None`: not recorded).
    events: Option<Vec<CacheEvent>>,
}

impl BlockPool {
    /// A pool of `total` free blocks (ids `0..total`). `total` is at most `i32::MAX`, since
    /// the op's `block_indices` are i32; a pool the memory cannot hold is `OutOfMemory`.
    pub fn new(total: usize) -> Result<BlockPool> {
        if total > i32::MAX as usize {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "num_blocks must be at most {} (the op's block_indices are i32), but it is \
                     {total}",
                    i32::MAX
                ),
            });
        }
        let what = "the block pool's per-block state";
        let mut free = try_with_capacity(total, what)?;
        // Reversed so that block 0 is handed out first.
        free.extend((0..total as u32).rev());
        Ok(BlockPool {
            refs: try_vec(total, 0, what)?,
            free,
            key: try_vec(total, None, what)?,
            by_hash: HashMap::new(),
            prev: try_vec(total, NIL, what)?,
            next: try_vec(total, NIL, what)?,
            in_lru: try_vec(total, false, what)?,
            head: NIL,
            tail: NIL,
            lru_len: 0,
            shared: 0,
            events: None,
        })
    }

    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks an allocation can get: free ones plus cached ones (whose hash is then dropped).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru_len
    }

    pub fn ref_count(&self, b: BlockId) -> u32 {
        self.refs.get(b as usize).copied().unwrap_or(0)
    }

    pub fn counts(&self) -> PoolCounts {
        PoolCounts {
            total: self.total(),
            used: self.total() - self.free.len() - self.lru_len,
            free: self.free.len(),
            cached: self.lru_len,
            shared: self.shared,
        }
    }

    /// Takes a block (ref count 1): a free one, else the least recently used cached one.
    /// `None` when every block is in use.
    pub fn allocate(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let b = self.head;
                if b == NIL {
                    return None;
                }
                self.lru_remove(b);
                self.unregister(b);
                b
            }
        };
        debug_assert_eq!(
            self.refs[b as usize], 0,
            "allocated block {b} was referenced"
        );
        self.refs[b as usize] = 1;
        Some(b)
    }

    /// Adds a reference (a fork, or a prefix hit on a cached block).
    pub fn retain(&mut self, b: BlockId) -> Result<()> {
        let r = self
            .refs
            .get(b as usize)
            .copied()
            .ok_or_else(|| bad_block(b))?;
        if r == 0 {
            if !self.in_lru[b as usize] {
                return Err(PaError::InvalidState {
                    detail: format!("block {b} is free and cannot be retained"),
                });
            }
            self.lru_remove(b);
        }
        if r == 1 {
            self.shared += 1;
        }
        self.refs[b as usize] = r + 1;
        Ok(())
    }

    /// Drops a reference. At zero the block becomes cached (if its content is registered and
    /// computed) or free. Releasing an unreferenced block is an error, never a double free.
    pub fn release(&mut self, b: BlockId) -> Result<()> {
        let r = self
            .refs
            .get(b as usize)
            .copied()
            .ok_or_else(|| bad_block(b))?;
        match r {
            0 => Err(PaError::InvalidState {
                detail: format!("block {b} released but not referenced (double free)"),
            }),
            1 => {
                self.refs[b as usize] = 0;
                match &self.key[b as usize] {
                    Some(k) if k.computed => self.lru_push(b),
                    Some(_) => {
                        self.unregister(b);
                        self.free.push(b);
                    }
                    None => self.free.push(b),
                }
                Ok(())
            }
            _ => {
                if r == 2 {
                    self.shared -= 1;
                }
                self.refs[b as usize] = r - 1;
                Ok(())
            }
        }
    }

    /// Registers a full, used block's content under `hash`. Returns false (and registers
    /// nothing) when another block already holds that content.
    pub fn register(&mut self, b: BlockId, hash: u64, parent: u64, tokens: &[u32]) -> bool {
        if self.by_hash.contains_key(&hash) || self.key[b as usize].is_some() {
            return false;
        }
        self.by_hash.insert(hash, b);
        self.key[b as usize] = Some(CachedKey {
            hash,
            parent,
            tokens: tokens.into(),
            computed: false,
        });
        true
    }

    /// Forgets a block's content hash (its content is about to change).
    pub fn unregister(&mut self, b: BlockId) {
        if let Some(k) = self.key.get_mut(b as usize).and_then(Option::take) {
            if self.by_hash.get(&k.hash) == Some(&b) {
                self.by_hash.remove(&k.hash);
            }
            if k.computed {
                if let Some(events) = &mut self.events {
                    events.push(CacheEvent::Removed { hash: k.hash });
                }
            }
        }
    }

    pub fn is_registered(&self, b: BlockId) -> bool {
        self.key.get(b as usize).is_some_and(Option::is_some)
    }

    /// Marks a registered block as written by the op, so later prompts can match it.
    pub fn mark_computed(&mut self, b: BlockId) {
        if let Some(Some(k)) = self.key.get_mut(b as usize) {
            if k.computed {
                return;
            }
            k.computed = true;
            if let Some(events) = &mut self.events {
                events.push(CacheEvent::Stored {
                    hash: k.hash,
                    parent: (k.parent != ROOT_HASH).then_some(k.parent),
                    tokens: k.tokens.clone(),
                });
            }
        }
    }

    /// Starts (or stops) recording [`CacheEvent`]s. Recording starts from the set as it is:
    /// turn it on before the first block is computed for a replay to give the whole set.
    pub fn record_events(&mut self, on: bool) {
        self.events = on.then(|| self.events.take().unwrap_or_default());
    }

    /// The events recorded since the last call, oldest first.
    pub fn take_events(&mut self) -> Vec<CacheEvent> {
        self.events.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Hashes of the blocks a prefix lookup can match now, ascending.
    pub fn matchable_hashes(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self
            .key
            .iter()
            .flatten()
            .filter(|k| k.computed)
            .map(|k| k.hash)
            .collect();
        v.sort_unstable();
        v
    }

    /// The computed block holding (parent, tokens), if any.
    pub fn lookup(&self, hash: u64, parent: u64, tokens: &[u32]) -> Option<BlockId> {
        let b = *self.by_hash.get(&hash)?;
        let k = self.key[b as usize].as_ref()?;
        (k.computed && k.parent == parent && *k.tokens == *tokens).then_some(b)
    }

    fn lru_push(&mut self, b: BlockId) {
        let i = b as usize;
        self.prev[i] = self.tail;
        self.next[i] = NIL;
        if self.tail != NIL {
            self.next[self.tail as usize] = b;
        } else {
            self.head = b;
        }
        self.tail = b;
        self.in_lru[i] = true;
        self.lru_len += 1;
    }

    fn lru_remove(&mut self, b: BlockId) {
        let i = b as usize;
        let (p, n) = (self.prev[i], self.next[i]);
        if p != NIL {
            self.next[p as usize] = n;
        } else {
            self.head = n;
        }
        if n != NIL {
            self.prev[n as usize] = p;
        } else {
            self.tail = p;
        }
        self.prev[i] = NIL;
        self.next[i] = NIL;
        self.in_lru[i] = false;
        self.lru_len -= 1;
    }

    /// Checks the pool's own invariants; `Err` describes the first one broken.
    pub fn check(&self) -> std::result::Result<(), String> {
        let mut seen = vec![false; self.total()];
        for &b in &self.free {
            let i = b as usize;
            if seen[i] {
                return Err(format!("block {b} is on the free list twice"));
            }
            seen[i] = true;
            if self.refs[i] != 0 || self.key[i].is_some() {
                return Err(format!("free block {b} has refs or a hash"));
            }
        }
        let (mut n, mut b) = (0, self.head);
        while b != NIL {
            let i = b as usize;
            if seen[i] || self.refs[i] != 0 || self.key[i].is_none() {
                return Err(format!(
                    "cached block {b} is also free, referenced or unhashed"
                ));
            }
            seen[i] = true;
            n += 1;
            b = self.next[i];
        }
        if n != self.lru_len {
            return Err(format!(
                "LRU list has {n} blocks, counter says {}",
                self.lru_len
            ));
        }
        for (i, &s) in seen.iter().enumerate() {
            if !s && self.refs[i] == 0 {
                return Err(format!(
                    "block {i} is unreferenced but neither free nor cached (leak)"
                ));
            }
        }
        let shared = self.refs.iter().filter(|&&r| r >= 2).count();
        if shared != self.shared {
            return Err(format!(
                "shared counter {} but {shared} blocks shared",
                self.shared
            ));
        }
        Ok(())
    }
}

fn bad_block(b: BlockId) -> PaError {
    PaError::InvalidArgument {
        detail: format!("block id {b} is outside the pool"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocation_fails_when_exhausted() {
        let mut p = BlockPool::new(3).unwrap();
        let got: Vec<_> = (0..3).map(|_| p.allocate()).collect();
        assert_eq!(got, vec![Some(0), Some(1), Some(2)]);
        assert_eq!(p.allocate(), None, "a 4th block from a pool of 3");
        p.release(1).unwrap();
        assert_eq!(p.allocate(), Some(1), "the freed block is reused");
    }

    #[test]
    fn releasing_an_unreferenced_block_is_an_error_not_a_double_free() {
        let mut p = BlockPool::new(2).unwrap();
        let b = p.allocate().unwrap();
        p.release(b).unwrap();
        assert!(matches!(p.release(b), Err(PaError::InvalidState { .. })));
        assert_eq!(p.counts().free, 2);
        p.check().unwrap();
    }

    #[test]
    fn cached_blocks_are_reused_least_recently_used_first() {
        let mut p = BlockPool::new(3).unwrap();
        let (a, b, c) = (
            p.allocate().unwrap(),
            p.allocate().unwrap(),
            p.allocate().unwrap(),
        );
        for (blk, tok) in [(a, 1u32), (b, 2), (c, 3)] {
            assert!(p.register(blk, block_hash(ROOT_HASH, &[tok]), ROOT_HASH, &[tok]));
            p.mark_computed(blk);
        }
        p.release(b).unwrap();
        p.release(a).unwrap();
        assert_eq!(p.counts().cached, 2);
        // b was released first: it is the least recently used and goes first.
        assert_eq!(p.allocate(), Some(b));
        assert_eq!(p.lookup(block_hash(ROOT_HASH, &[2]), ROOT_HASH, &[2]), None);
        assert_eq!(
            p.lookup(block_hash(ROOT_HASH, &[1]), ROOT_HASH, &[1]),
            Some(a)
        );
        p.check().unwrap();
    }

    /// Replays events into a set, as a subscriber does.
    fn replay(set: &mut std::collections::BTreeSet<u64>, events: Vec<CacheEvent>) {
        for e in events {
            match e {
                CacheEvent::Stored { hash, .. } => assert!(set.insert(hash), "{hash} stored twice"),
                CacheEvent::Removed { hash } => assert!(set.remove(&hash), "{hash} not stored"),
                CacheEvent::Cleared => set.clear(),
            }
        }
    }

    #[test]
    fn events_replay_to_the_matchable_set() {
        let mut p = BlockPool::new(2).unwrap();
        p.record_events(true);
        let mut set = std::collections::BTreeSet::new();
        let (a, b) = (p.allocate().unwrap(), p.allocate().unwrap());
        let ha = block_hash(ROOT_HASH, &[1, 2]);
        let hb = block_hash(ha, &[3, 4]);
        p.register(a, ha, ROOT_HASH, &[1, 2]);
        p.register(b, hb, ha, &[3, 4]);
        assert!(
            p.take_events().is_empty(),
            "registered, not computed: not matchable yet"
        );
        p.mark_computed(a);
        p.mark_computed(b);
        p.mark_computed(b);
        let ev = p.take_events();
        assert_eq!(
            ev,
            vec![
                CacheEvent::Stored {
                    hash: ha,
                    parent: None,
                    tokens: vec![1, 2].into()
                },
                CacheEvent::Stored {
                    hash: hb,
                    parent: Some(ha),
                    tokens: vec![3, 4].into()
                },
            ]
        );
        replay(&mut set, ev);
        assert_eq!(
            set.iter().copied().collect::<Vec<_>>(),
            p.matchable_hashes()
        );
        // Released: cached, still matchable. Reallocated (LRU first: b): b's hash goes.
        p.release(b).unwrap();
        p.release(a).unwrap();
        assert!(p.take_events().is_empty());
        assert_eq!(p.allocate(), Some(b));
        let ev = p.take_events();
        assert_eq!(ev, vec![CacheEvent::Removed { hash: hb }]);
        replay(&mut set, ev);
        assert_eq!(
            set.iter().copied().collect::<Vec<_>>(),
            p.matchable_hashes()
        );
        assert_eq!(p.matchable_hashes(), vec![ha]);
        // An uncomputed block dropped on release makes no event.
        let h = block_hash(ROOT_HASH, &[9, 9]);
        p.register(b, h, ROOT_HASH, &[9, 9]);
        p.release(b).unwrap();
        assert!(p.take_events().is_empty());
        p.record_events(false);
        p.allocate();
        p.allocate();
        assert!(p.take_events().is_empty(), "not recording");
    }

    #[test]
    fn uncomputed_blocks_are_never_matched_nor_cached() {
        let mut p = BlockPool::new(1).unwrap();
        let a = p.allocate().unwrap();
        let h = block_hash(ROOT_HASH, &[7]);
        p.register(a, h, ROOT_HASH, &[7]);
        assert_eq!(p.lookup(h, ROOT_HASH, &[7]), None);
        p.release(a).unwrap();
        assert_eq!(
            p.counts().free,
            1,
            "an unwritten block goes back to the free list"
        );
        assert!(!p.is_registered(a));
    }
}
