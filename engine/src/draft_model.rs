//! Draft-model speculative decoding: a small model that shares the target's tokenizer proposes
//! each decoding sequence's next `k` tokens greedily; the target verifies them as prompt-lookup
//! drafts are verified (`sampling::verify_draft`, the scheduler's rollback).
//!
//! The draft model has its own model runner, KV cache and block manager, with as many blocks as
//! the target's (a draft holds at most the target's tokens plus `k - 1`). Its cache follows each
//! sequence's tokens: before drafting, the cache is rolled back to the longest prefix it shares
//! with the sequence's tokens now (the rejected drafts go, blocks and prefix-cache entries
//! alike), then one batched call feeds every sequence's missing tokens (its new token, or the
//! accepted drafts and it, or a whole prompt the first time, within the step's token budget)
//! and gives each its first draft, and `k - 1` more batched calls of one token per sequence give
//! the others. A sequence the target no longer runs has its draft cache freed.
//!
//! **Which acceptance rule.** Drafts are greedy: the draft's distribution `q` is a point mass on
//! its argmax, for sampled requests too. The speculative-sampling rule (accept `d` with
//! probability `min(1, p(d) / q(d))`, else sample `norm(max(0, p - q))`) then is: accept with
//! probability `p(d)`, else sample `p` without `d`, renormalised. That is `verify_draft`'s rule
//! for prompt lookup, so the emitted tokens are distributed as the target's `p`, exactly; a
//! sampled draft with its own `q` would be accepted more often, at the cost of keeping `q`.

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::model_dir::ModelDir;
use crate::model_runner::ModelRunner;
use crate::sampling::argmax;
use paged_attention::cache::{
    BlockManager, CacheStats, ManagerConfig, ScheduledSeq, Scheduler, SeqId, Step,
};
use std::collections::HashMap;
use std::time::Duration;

pub(crate) struct DraftModel {
    runner: ModelRunner,
    mgr: BlockManager,
    /// Per sequence, the tokens its draft cache holds (a prefix of the sequence's, then drafts).
    cached: HashMap<SeqId, Vec<u32>>,
    max_batched_tokens: usize,
}

/// Refuses a draft model whose vocabulary is not the target's: its ids would mean other tokens.
pub(crate) fn check_compatible(target: &ModelDir, draft: &ModelDir) -> Result<()> {
    let refuse = |detail: String| {
        Err(EngineError::Model {
            path: draft.path.clone(),
            detail: format!("cannot draft for {}: {detail}", target.path.display()),
        })
    };
    if let (Some(t), Some(d)) = (target.config.vocab_size, draft.config.vocab_size) {
        if t != d {
            return refuse(format!(
                "its vocabulary has {d} tokens (config.json vocab_size), the target's {t}"
            ));
        }
    }
    if let Some(diff) = target.tokenizer.vocabulary_difference(&draft.tokenizer) {
        return refuse(format!("its tokenizer differs from the target's ({diff})"));
    }
    Ok(())
}

/// What a call of the `draft` model costs relative to a decode step of `target`: the size of its
/// weights over the target's (decode steps of both are bound by reading them); 1 when either
/// size is unknown.
pub(crate) fn relative_cost(target: &ModelDir, draft: &ModelDir) -> f64 {
    let size = |m: &ModelDir| {
        std::fs::metadata(m.xml.with_extension("bin"))
            .map(|f| f.len())
            .ok()
            .filter(|&n| n > 0)
    };
    match (size(target), size(draft)) {
        (Some(t), Some(d)) => d as f64 / t as f64,
        _ => 1.0,
    }
}

impl DraftModel {
    /// The draft model (checked with [`check_compatible`], compiled with the target's settings)
    /// over its `runner`, whose cache has `num_blocks` blocks, as many as the target's
    /// ([`crate::kv_cache::KvCachePlan::with_draft`] chose them for both).
    pub fn new(runner: ModelRunner, cfg: &EngineConfig, num_blocks: usize) -> Result<DraftModel> {
        let mgr = BlockManager::new(ManagerConfig {
            num_blocks,
            block_size: cfg.block_size,
            prefix_caching: cfg.prefix_caching,
        })?;
        Ok(DraftModel {
            runner,
            mgr,
            cached: HashMap::new(),
            max_batched_tokens: cfg.max_batched_tokens,
        })
    }

    pub fn cache_stats(&self) -> CacheStats {
        self.mgr.stats()
    }

    pub fn infer_time(&self) -> Duration {
        self.runner.infer_time
    }

    /// Frees the draft caches of sequences `sched` no longer holds (finished or aborted).
    pub fn forget_ended(&mut self, sched: &Scheduler) -> Result<()> {
        let ended: Vec<SeqId> = self
            .cached
            .keys()
            .copied()
            .filter(|&s| sched.tokens(s).is_err())
            .collect();
        for s in ended {
            self.free(s)?;
        }
        Ok(())
    }

    fn free(&mut self, seq: SeqId) -> Result<()> {
        self.cached.remove(&seq);
        Ok(self.mgr.free(seq)?)
    }

    /// Greedy drafts for `wanted` (sequence, how many drafts, at least 1), in `k` batched calls
    /// at most: each sequence's drafts, for those whose missing tokens fitted the token budget
    /// and the draft cache's free blocks (the others draft nothing this step).
    pub fn propose(
        &mut self,
        sched: &Scheduler,
        wanted: &[(SeqId, usize)],
    ) -> Result<Vec<(SeqId, Vec<u32>)>> {
        // Each sequence's missing tokens, and the blocks it needs for them and its drafts.
        let mut budget = self.max_batched_tokens;
        let mut reserved = 0usize;
        let mut chunks: Vec<(SeqId, usize, Vec<u32>)> = Vec::new(); // (seq, drafts, tokens)
        for &(seq, k) in wanted {
            if budget == 0 {
                break;
            }
            let tokens = sched.tokens(seq)?;
            let keep = match self.cached.get(&seq) {
                // At least the last token is fed again: its logits give the first draft.
                Some(c) => common_prefix(c, tokens).min(tokens.len() - 1),
                None => {
                    let hit = self.mgr.add_sequence(seq, tokens)?;
                    self.cached.insert(seq, tokens[..hit].to_vec());
                    hit
                }
            };
            let c = self
                .cached
                .get_mut(&seq)
                .ok_or(EngineError::Config(format!("draft sequence {seq} is gone")))?;
            if keep < c.len() {
                self.mgr.rollback(seq, keep)?;
                c.truncate(keep);
            }
            let n = (tokens.len() - keep).min(budget);
            // The catch-up is fed whole or in part; drafts follow only a whole one.
            let k = if keep + n == tokens.len() { k } else { 0 };
            let need = self.mgr.blocks_needed(seq, n + k.saturating_sub(1))?;
            if reserved + need > self.mgr.available_blocks() {
                // The caches of sequences not drafting now (preempted ones, constrained ones)
                // make room first; failing that, this one drafts nothing this step.
                let idle: Vec<SeqId> = self
                    .cached
                    .keys()
                    .copied()
                    .filter(|s| !wanted.iter().any(|w| w.0 == *s))
                    .collect();
                for s in idle {
                    self.free(s)?;
                }
                if reserved + need > self.mgr.available_blocks() {
                    continue;
                }
            }
            reserved += need;
            budget -= n;
            chunks.push((seq, k, tokens[keep..keep + n].to_vec()));
        }
        let mut drafts: Vec<(SeqId, Vec<u32>)> = chunks
            .iter()
            .filter(|c| c.1 > 0)
            .map(|c| (c.0, Vec::with_capacity(c.1)))
            .collect();
        if chunks.is_empty() {
            return Ok(drafts);
        }
        // Draft position j: the first call feeds the missing tokens, later ones the last draft.
        let mut j = 0;
        loop {
            let feed: Vec<(SeqId, &[u32], bool)> = if j == 0 {
                chunks
                    .iter()
                    .map(|(s, k, t)| (*s, &t[..], *k > 0))
                    .collect()
            } else {
                drafts
                    .iter()
                    .zip(chunks.iter().filter(|c| c.1 > 0))
                    .filter(|(d, c)| d.1.len() < c.1)
                    .map(|(d, _)| (d.0, std::slice::from_ref(d.1.last().unwrap_or(&0)), true))
                    .collect()
            };
            if feed.is_empty() {
                break;
            }
            let next = self.run(&feed)?;
            for (seq, token) in next {
                if let Some(d) = drafts.iter_mut().find(|d| d.0 == seq) {
                    d.1.push(token);
                }
            }
            j += 1;
        }
        Ok(drafts)
    }

    /// One batched call: appends each sequence's `tokens` to its draft cache and returns the
    /// argmax after the last one for those that emit.
    fn run(&mut self, feed: &[(SeqId, &[u32], bool)]) -> Result<Vec<(SeqId, u32)>> {
        let mut step = Step::default();
        step.subsequence_begins.push(0);
        for &(seq, tokens, emits) in feed {
            let a = self.mgr.append(seq, tokens)?;
            step.copies.extend(a.copies);
            let rows = ScheduledSeq {
                id: seq,
                past_len: a.past_len,
                num_tokens: tokens.len(),
                emits,
                logits_rows: usize::from(emits),
                draft_len: 0,
            };
            step.push_seq(&[tokens], rows);
            if let Some(c) = self.cached.get_mut(&seq) {
                c.extend_from_slice(tokens);
            }
        }
        let ids: Vec<SeqId> = feed.iter().map(|f| f.0).collect();
        (step.block_indices, step.block_indices_begins) = self.mgr.block_inputs(&ids)?;
        let ran = self.runner.execute(&step);
        if let Err(e) = ran {
            // The appended tokens were not computed: forget these caches.
            for s in ids {
                self.free(s)?;
            }
            return Err(e);
        }
        self.mgr.mark_computed();
        let (logits, ranges) = self.runner.logits(&step)?;
        Ok(step
            .seqs
            .iter()
            .zip(ranges)
            .filter(|(_, r)| !r.is_empty())
            .map(|(s, r)| (s.id, argmax(logits.row(r.end - 1))))
            .collect())
    }
}

/// Length of the longest common prefix of `a` and `b`.
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

#[cfg(test)]
mod tests {
    use super::common_prefix;

    #[test]
    fn common_prefix_stops_at_the_first_difference() {
        assert_eq!(common_prefix(&[1, 2, 3, 4], &[1, 2, 5, 4]), 2);
        assert_eq!(common_prefix(&[1, 2], &[1, 2, 3]), 2);
        assert_eq!(common_prefix(&[], &[1]), 0);
    }
}
