//! The block manager's C ABI, model-based: a simulated cache holds one token id per slot. Every
//! append writes its tokens into the slots the block table names (after the copy-on-write
//! copies the manager asks for), as the op would; after every operation each live sequence's
//! tokens must read back through its block table, and its length must match the model's.
#![no_main]
use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use paged_attention::cache::BlockCopy;
use paged_attention::ffi::cache::*;
use paged_attention_fuzz::Bytes;

const NONE: u32 = u32::MAX;

struct Sim {
    m: *mut PaCacheManager,
    bs: usize,
    nb: usize,
    /// slots[block * bs + slot]: the token the op would have written there.
    slots: Vec<u32>,
    /// The tokens each live sequence must hold.
    seqs: BTreeMap<u64, Vec<u32>>,
}

impl Sim {
    fn table(&self, seq: u64) -> Vec<usize> {
        let mut blocks = vec![0i32; self.nb * 4 + 1];
        let mut begins = [0i32; 2];
        let mut n = 0usize;
        // SAFETY: live handle; buffers sized as passed.
        let st = unsafe {
            pa_cache_block_inputs(
                self.m,
                &seq,
                1,
                blocks.as_mut_ptr(),
                blocks.len(),
                begins.as_mut_ptr(),
                &mut n,
            )
        };
        assert_eq!(st, 0, "block_inputs of a live sequence");
        assert_eq!(begins, [0, n as i32]);
        blocks[..n]
            .iter()
            .map(|&b| {
                assert!(
                    (0..self.nb as i32).contains(&b),
                    "block id {b} out of range"
                );
                b as usize
            })
            .collect()
    }
    fn read(&self, seq: u64, len: usize) -> Vec<u32> {
        let t = self.table(seq);
        assert!(t.len() * self.bs >= len, "table too short for {len} tokens");
        (0..len)
            .map(|p| self.slots[t[p / self.bs] * self.bs + p % self.bs])
            .collect()
    }
    fn copy(&mut self, copies: &[BlockCopy]) {
        for c in copies {
            let (s, d) = (c.src as usize * self.bs, c.dst as usize * self.bs);
            self.slots.copy_within(s..s + self.bs, d);
        }
    }
    fn len(&self, seq: u64) -> usize {
        let mut len = 0;
        // SAFETY: live handle.
        assert_eq!(
            unsafe { pa_cache_sequence_info(self.m, seq, &mut len, std::ptr::null_mut()) },
            0
        );
        len
    }
    fn append(&mut self, seq: u64, tokens: &[u32]) -> i32 {
        let mut past = 0usize;
        let mut copies = [BlockCopy { src: 0, dst: 0 }; 1];
        let mut nc = 0usize;
        // SAFETY: live handle; tokens and copies sized as passed.
        let st = unsafe {
            pa_cache_append(
                self.m,
                seq,
                tokens.as_ptr(),
                tokens.len(),
                &mut past,
                copies.as_mut_ptr(),
                1,
                &mut nc,
            )
        };
        if st == 0 {
            let model = self
                .seqs
                .get_mut(&seq)
                .expect("append succeeded on an unknown sequence");
            assert_eq!(past, model.len(), "past_len");
            model.extend_from_slice(tokens);
            self.copy(&copies[..nc]);
            let t = self.table(seq);
            for (i, &tok) in tokens.iter().enumerate() {
                let p = past + i;
                self.slots[t[p / self.bs] * self.bs + p % self.bs] = tok;
            }
        }
        st
    }
    fn check(&self) {
        let mut stats = PaCacheStats::default();
        // SAFETY: live handle.
        assert_eq!(unsafe { pa_cache_get_stats(self.m, &mut stats) }, 0);
        assert_eq!(stats.sequences, self.seqs.len());
        assert_eq!(stats.total_blocks, self.nb);
        assert!(
            stats.used_blocks + stats.free_blocks + stats.cached_blocks <= self.nb,
            "{stats:?}"
        );
        for (&seq, toks) in &self.seqs {
            assert_eq!(self.len(seq), toks.len(), "length of sequence {seq}");
            assert_eq!(
                &self.read(seq, toks.len()),
                toks,
                "tokens of sequence {seq} do not read back"
            );
        }
    }
}

fn tokens(b: &mut Bytes, n: usize) -> Vec<u32> {
    // A small alphabet, so equal prefixes (and prefix-cache hits) are common.
    (0..n).map(|_| b.below(4) as u32).collect()
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let nb = 1 + b.below(24);
    let bs = 1 + b.below(5);
    let prefix = b.u8() as i32 & 1;
    let mut m = std::ptr::null_mut();
    // SAFETY: `m` is writable.
    assert_eq!(
        unsafe { pa_cache_manager_create(nb, bs, prefix, &mut m) },
        0
    );
    let mut sim = Sim {
        m,
        bs,
        nb,
        slots: vec![NONE; nb * bs],
        seqs: BTreeMap::new(),
    };
    let mut steps = 0;
    while !b.is_empty() && steps < 200 {
        steps += 1;
        let op = b.below(9);
        let seq = b.below(6) as u64;
        match op {
            0 => {
                let n = b.below(3 * bs + 2);
                let prompt = tokens(&mut b, n);
                let mut cached = usize::MAX;
                // SAFETY: live handle; prompt holds n tokens.
                let st = unsafe { pa_cache_add_sequence(m, seq, prompt.as_ptr(), n, &mut cached) };
                if st == 0 {
                    assert!(
                        cached % bs == 0 && (cached < n || cached == 0),
                        "cached {cached} of {n}"
                    );
                    sim.seqs.insert(seq, prompt[..cached].to_vec());
                    if sim.append(seq, &prompt[cached..]) != 0 {
                        // Out of blocks for the rest of the prompt: give the sequence up.
                        // SAFETY: live handle.
                        assert_eq!(unsafe { pa_cache_free_sequence(m, seq) }, 0);
                        sim.seqs.remove(&seq);
                    }
                } else {
                    assert!(sim.seqs.contains_key(&seq), "add_sequence failed: {st}");
                }
            }
            1 => {
                let n = b.below(2 * bs + 1);
                let t = tokens(&mut b, n);
                let st = sim.append(seq, &t);
                assert!(
                    st == 0 || st == 11 || !sim.seqs.contains_key(&seq),
                    "append failed: {st}"
                );
            }
            2 => {
                // SAFETY: live handle.
                assert_eq!(unsafe { pa_cache_mark_computed(m) }, 0);
            }
            3 => {
                let child = b.below(6) as u64;
                // SAFETY: live handle.
                let st = unsafe { pa_cache_fork(m, seq, child) };
                if st == 0 {
                    let toks = sim.seqs[&seq].clone();
                    assert!(
                        sim.seqs.insert(child, toks).is_none(),
                        "fork over a live child"
                    );
                }
            }
            4 => {
                // SAFETY: live handle.
                let st = unsafe { pa_cache_free_sequence(m, seq) };
                assert_eq!(st == 0, sim.seqs.remove(&seq).is_some());
            }
            5 => {
                let new_len = b.below(4 * bs + 1);
                // SAFETY: live handle.
                let st = unsafe { pa_cache_truncate(m, seq, new_len) };
                if st == 0 {
                    let s = sim
                        .seqs
                        .get_mut(&seq)
                        .expect("truncate of an unknown sequence");
                    assert!(new_len <= s.len());
                    s.truncate(new_len);
                }
            }
            6 => {
                let len = sim.seqs.get(&seq).map_or(0, Vec::len);
                let scores: Vec<f32> = (0..len).map(|_| b.u8() as f32 / 16.0).collect();
                // SAFETY: live handle; scores holds len floats.
                unsafe { pa_cache_accumulate_scores(m, seq, scores.as_ptr(), len) };
            }
            7 => {
                let (start, recent, budget) = (b.below(3), b.below(3), b.below(6));
                let old = sim.seqs.get(&seq).cloned();
                let mut copies = vec![BlockCopy { src: 0, dst: 0 }; budget.max(1)];
                let (mut nc, mut ev) = (0usize, 0usize);
                // SAFETY: live handle; copies holds copies.len() entries.
                let st = unsafe {
                    pa_cache_evict(
                        m,
                        seq,
                        start,
                        recent,
                        budget,
                        copies.as_mut_ptr(),
                        copies.len(),
                        &mut nc,
                        &mut ev,
                    )
                };
                if st == 0 {
                    let old = old.expect("evict of an unknown sequence");
                    sim.copy(&copies[..nc]);
                    let new_len = sim.len(seq);
                    let now = sim.read(seq, new_len);
                    let old_blocks: Vec<&[u32]> = old.chunks(bs).collect();
                    let new_blocks: Vec<&[u32]> = now.chunks(bs).collect();
                    assert_eq!(new_blocks.len() + ev, old_blocks.len(), "evicted count");
                    if ev > 0 {
                        assert!(new_blocks.len() <= budget);
                        let k = start.min(new_blocks.len());
                        assert_eq!(new_blocks[..k], old_blocks[..k], "first blocks kept");
                        let r = recent.min(new_blocks.len());
                        assert_eq!(
                            new_blocks[new_blocks.len() - r..],
                            old_blocks[old_blocks.len() - r..],
                            "recent blocks kept"
                        );
                        // The kept blocks are the old ones, in order.
                        let mut it = old_blocks.iter();
                        for nb_ in &new_blocks {
                            assert!(it.any(|o| o == nb_), "a kept block's tokens changed");
                        }
                    }
                    sim.seqs.insert(seq, now);
                    let (mut r, mut rows) = (0usize, 0usize);
                    // SAFETY: live handle.
                    assert_eq!(
                        unsafe { pa_cache_pending_rotation(m, &mut r, &mut rows) },
                        0
                    );
                    let mut idx = vec![0i32; r];
                    let mut deltas = vec![0i32; r * bs];
                    let mut got = 0usize;
                    // SAFETY: live handle; buffers sized as passed.
                    let st = unsafe {
                        pa_cache_take_rotation(
                            m,
                            idx.as_mut_ptr(),
                            r,
                            deltas.as_mut_ptr(),
                            r * bs,
                            &mut got,
                        )
                    };
                    assert_eq!((st, got), (0, r));
                    assert!(idx.iter().all(|&i| (0..nb as i32).contains(&i)));
                    assert!(deltas.iter().all(|&d| d >= 0 && (d as usize) < rows.max(1)));
                }
            }
            _ => {}
        }
        sim.check();
    }
    // SAFETY: created above, destroyed once.
    unsafe { pa_cache_manager_destroy(m) };
});
