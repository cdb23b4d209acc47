//! The scheduler's C ABI, model-based: requests are queued, steps planned and completed with
//! fuzzed sampled tokens. The simulated cache holds one token id per slot; each step's rows are
//! written where its block tables say (after its copies). Each sequence's rows must carry the
//! request's next unprocessed tokens (from the start again after a preemption), at cache
//! positions past_len.., and (without eviction) every scheduled sequence's whole
//! history must read back through its block table after every step. Between steps a request
//! that just sampled may be forked: the child's history is the parent's with its own last token,
//! and the shared blocks must read back for both (the copies of copy-on-write included).
#![no_main]
use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use paged_attention::ffi::cache::*;
use paged_attention_fuzz::Bytes;

/// # Safety
/// `p` points to `n` valid `T` (or `n == 0`).
unsafe fn view<'a, T>(p: *const T, n: usize) -> &'a [T] {
    if n == 0 {
        &[]
    } else {
        // SAFETY: the caller's guarantee.
        unsafe { std::slice::from_raw_parts(p, n) }
    }
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes::new(data);
    let evict = b.below(3) == 0;
    let cfg = PaSchedulerConfig {
        num_blocks: 1 + b.below(32),
        block_size: 1 + b.below(5),
        prefix_caching: b.u8() as i32 & 1,
        max_batched_tokens: 1 + b.below(32),
        max_seqs: 1 + b.below(4),
        eviction_budget: if evict { 2 + b.below(4) } else { 0 },
        eviction_start: b.below(2),
        eviction_recent: 1,
    };
    let mut s = std::ptr::null_mut();
    // SAFETY: cfg and s are valid.
    if unsafe { pa_scheduler_create(&cfg, &mut s) } != 0 {
        return;
    }
    let bs = cfg.block_size;
    let mut slots = vec![u32::MAX; cfg.num_blocks * bs];
    let mut reqs: BTreeMap<u64, Vec<u32>> = BTreeMap::new();
    // Tokens of each request already sent to the op.
    let mut processed: BTreeMap<u64, usize> = BTreeMap::new();
    let mut steps = 0;
    while !b.is_empty() && steps < 300 {
        steps += 1;
        if b.below(3) == 0 {
            let id = b.below(8) as u64;
            let n = 1 + b.below(3 * bs + 2);
            let prompt: Vec<u32> = (0..n).map(|_| b.below(4) as u32).collect();
            let (max_new, prio) = (1 + b.below(4), b.below(3) as i32);
            // SAFETY: live handle; prompt holds n tokens.
            if unsafe { pa_scheduler_add_request(s, id, prompt.as_ptr(), n, max_new, prio) } == 0 {
                reqs.insert(id, prompt);
                processed.insert(id, 0);
            }
            continue;
        }
        // SAFETY: an all-zero step is a valid value of this plain C struct.
        let mut step: PaSchedulerStep = unsafe { std::mem::zeroed() };
        // SAFETY: live handle; step is writable.
        assert_eq!(
            unsafe { pa_scheduler_schedule(s, &mut step) },
            0,
            "schedule"
        );
        let nb = step.num_seqs;
        // SAFETY: the step's arrays have the documented lengths until the next schedule.
        let (ids, past, sub, blk, begins, emits, toks, tseq, tpos, copies, preempted) = unsafe {
            (
                view(step.seq_ids, nb),
                view(step.past_lens, nb),
                view(step.subsequence_begins, if nb > 0 { nb + 1 } else { 0 }),
                view(step.block_indices, step.num_block_indices),
                view(step.block_indices_begins, if nb > 0 { nb + 1 } else { 0 }),
                view(step.emits, nb),
                view(step.token_ids, step.num_tokens),
                view(step.token_seq, step.num_tokens),
                view(step.token_pos, step.num_tokens),
                view(step.copies, step.num_copies),
                view(step.preempted, step.num_preempted),
            )
        };
        for c in copies {
            let (src, dst) = (c.src as usize * bs, c.dst as usize * bs);
            slots.copy_within(src..src + bs, dst);
        }
        for id in preempted {
            *processed.get_mut(id).expect("preempted an unknown request") = 0;
        }
        let table = |i: usize| &blk[begins[i] as usize..begins[i + 1] as usize];
        for t in 0..step.num_tokens {
            let i = tseq[t] as usize;
            let done = processed
                .get_mut(&ids[i])
                .expect("scheduled an unknown request");
            if *done == 0 {
                // A (re)started request may begin after a prefix found in the prefix cache.
                *done = past[i] as usize;
                assert!(done.is_multiple_of(bs), "a reused prefix is whole blocks");
            }
            assert_eq!(
                toks[t], reqs[&ids[i]][*done],
                "row {t} carries the wrong token"
            );
            *done += 1;
            let p = past[i] as usize + t - sub[i] as usize;
            assert_eq!(tpos[t] as usize, p, "row {t}'s position");
            let blocks = table(i);
            assert!(p / bs < blocks.len(), "row {t} has no block");
            slots[blocks[p / bs] as usize * bs + p % bs] = toks[t];
        }
        if !evict {
            for i in 0..nb {
                let len = past[i] as usize + (sub[i + 1] - sub[i]) as usize;
                let blocks = table(i);
                let got: Vec<u32> = (0..len)
                    .map(|p| slots[blocks[p / bs] as usize * bs + p % bs])
                    .collect();
                assert_eq!(
                    got,
                    reqs[&ids[i]][..len],
                    "sequence {} does not read back",
                    ids[i]
                );
            }
        }
        let scores: Vec<f32> = (0..step.scores_len).map(|_| b.u8() as f32 / 16.0).collect();
        // SAFETY: live handle; scores holds scores_len floats.
        assert_eq!(
            unsafe { pa_scheduler_accumulate_scores(s, scores.as_ptr(), scores.len()) },
            0
        );
        let mut out_ids = Vec::new();
        let mut out_toks = Vec::new();
        for i in 0..nb {
            if emits[i] == 1 {
                let tok = b.below(4) as u32;
                out_ids.push(ids[i]);
                out_toks.push(tok);
                reqs.get_mut(&ids[i])
                    .expect("scheduled an unknown request")
                    .push(tok);
            }
        }
        let mut finished = 0usize;
        // SAFETY: live handle; parallel arrays of out_ids.len() entries.
        let st = unsafe {
            pa_scheduler_complete_step(
                s,
                out_ids.as_ptr(),
                out_toks.as_ptr(),
                out_ids.len(),
                &mut finished,
            )
        };
        assert_eq!(st, 0, "complete_step");
        if !out_ids.is_empty() && b.below(4) == 0 {
            let parent = out_ids[b.below(out_ids.len())];
            let child = 8 + b.below(8) as u64;
            let first = b.below(4) as u32;
            // SAFETY: live handle.
            let st = unsafe { pa_scheduler_fork(s, parent, child, first, 1 + b.below(6)) };
            // Refusals: the parent finished (12), the child exists (13), max_new_tokens too
            // small (2).
            assert!(matches!(st, 0 | 2 | 12 | 13), "fork: status {st}");
            if st == 0 {
                let mut toks = reqs[&parent].clone();
                *toks.last_mut().expect("a parent that sampled has tokens") = first;
                reqs.insert(child, toks);
                processed.insert(child, processed[&parent]);
            }
        }
    }
    let mut c = PaSchedulerCounters::default();
    // SAFETY: live handle; c is writable.
    assert_eq!(unsafe { pa_scheduler_get_counters(s, &mut c) }, 0);
    assert!(c.steps <= steps as u64 && c.evictions <= c.evicted_blocks);
    // SAFETY: created above, destroyed once.
    unsafe { pa_scheduler_destroy(s) };
});
