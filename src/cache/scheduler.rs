//! Continuous batching over a [`BlockManager`]: each [`Scheduler::schedule`] call picks the
//! sequences and token chunks of one op call and returns the op's inputs for it.
//!
//! Policy, per step:
//! 1. (optional) score-based eviction of running sequences over their block budget, except
//!    those still in (chunked) prefill;
//! 2. running sequences, most important first (priority descending, then arrival), each gets
//!    its next chunk (a decode token, or the next piece of its prompt) within the step's token
//!    budget; when blocks run out, the least important running sequence not yet scheduled is
//!    preempted (freed, and later recomputed from its tokens), possibly the sequence itself;
//! 3. if nothing was preempted, waiting requests are admitted in the same order while the
//!    token budget, `max_seqs` and free blocks last (prefix-cache hits cost no blocks); a
//!    request that does not fit stops admission (no overtaking).
//!
//! Between steps a decoding request can be forked ([`Scheduler::fork`], a parallel sample that
//! shares its blocks); [`Scheduler::counters`] counts what happened, so a serving loop can show
//! that forks, prefix hits, copies, evictions and rotations really occurred.

use super::eviction::{EvictionPolicy, RotationInputs};
use super::manager::{BlockCopy, BlockManager, ManagerConfig, SeqId};
use crate::error::{PaError, Result};
use std::collections::HashMap;

/// Why a request stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// It generated `max_new_tokens`.
    Length,
    /// The caller ended it early: an end-of-sequence token or a stop string
    /// ([`Scheduler::finish`]).
    Stop,
    /// The caller aborted it ([`Scheduler::abort`]), possibly before it ran.
    Abort,
}

impl FinishReason {
    /// OpenAI's `finish_reason` word: `length`, `stop` or `abort`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Abort => "abort",
        }
    }
}

/// Configuration of a [`Scheduler`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    pub num_blocks: usize,
    pub block_size: usize,
    pub prefix_caching: bool,
    /// Token rows per op call (`T` at most).
    pub max_batched_tokens: usize,
    /// Sequences per op call (`B` at most).
    pub max_seqs: usize,
    /// Evict blocks of running sequences that exceed `budget` blocks.
    pub eviction: Option<EvictionPolicy>,
}

/// A generation request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub id: SeqId,
    /// Prompt token ids, at least one.
    pub prompt: Vec<u32>,
    /// The request finishes after this many generated tokens (at least one).
    pub max_new_tokens: usize,
    /// Larger is more important; the least important running sequence is preempted first.
    pub priority: i32,
}

/// One sequence of a step, in batch order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub id: SeqId,
    /// Tokens already cached (`past_lens` entry).
    pub past_len: usize,
    /// Token rows of this sequence in the step.
    pub num_tokens: usize,
    /// Whether the chunk ends at the sequence's last known token (or at the last draft token
    /// after it), so the caller samples a new token from its logits rows (and passes it to
    /// [`Scheduler::complete_step`]).
    pub emits: bool,
    /// How many of the chunk's trailing token rows get a logits row (0..=`num_tokens`): 1 when
    /// it emits; `1 + draft_len` when it verifies drafts; every row of a prompt chunk when the
    /// request asked for prompt logits ([`Scheduler::set_prompt_logits`]). Row `j` of these is
    /// the logits after position `past_len + num_tokens - logits_rows + j`.
    pub logits_rows: usize,
    /// Of the chunk's trailing tokens, how many are draft tokens to verify (speculative
    /// decoding, [`Scheduler::set_draft`]); they follow the sequence's last known token.
    pub draft_len: usize,
}

/// One op call: the op's block and offset inputs, the token packing, and the cache work
/// (copies, rotation) to do before the call.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Step {
    pub seqs: Vec<ScheduledSeq>,
    /// `past_lens`, `[B]`.
    pub past_lens: Vec<i32>,
    /// `subsequence_begins`, `[B+1]`.
    pub subsequence_begins: Vec<i32>,
    /// `block_indices`, `[N]`.
    pub block_indices: Vec<i32>,
    /// `block_indices_begins`, `[B+1]`.
    pub block_indices_begins: Vec<i32>,
    /// Token id of each packed row, `[T]`.
    pub token_ids: Vec<u32>,
    /// Batch index (into `seqs`) of each packed row, `[T]`.
    pub token_seq: Vec<i32>,
    /// Position of each packed row in its sequence's cache (`past_len + i`; after an eviction
    /// the kept tokens are renumbered from 0, matching the rotation of their keys), `[T]`.
    pub token_pos: Vec<i32>,
    /// Block copies to perform on both caches before the op call, in order.
    pub copies: Vec<BlockCopy>,
    /// Rotation inputs for this op call (after an eviction).
    pub rotation: Option<RotationInputs>,
    /// Sequences preempted in this step (back to waiting, recomputed later).
    pub preempted: Vec<SeqId>,
    /// Blocks evicted in this step, over all sequences.
    pub evicted_blocks: usize,
}

impl Step {
    /// Appends one sequence's rows: its tokens (`parts` one after another, `seq.num_tokens`
    /// in all) at positions `seq.past_len..`, its `past_lens` entry and the end of its
    /// subsequence. The caller has pushed `subsequence_begins`' leading 0.
    pub fn push_seq(&mut self, parts: &[&[u32]], seq: ScheduledSeq) {
        let (b, past, n) = (self.seqs.len(), seq.past_len, seq.num_tokens);
        debug_assert_eq!(
            parts.iter().map(|p| p.len()).sum::<usize>(),
            n,
            "rows of {}",
            seq.id
        );
        debug_assert!(
            !self.subsequence_begins.is_empty(),
            "the leading 0 comes first"
        );
        for p in parts {
            self.token_ids.extend_from_slice(p);
        }
        self.token_seq.extend(std::iter::repeat_n(b as i32, n));
        self.token_pos.extend((past..past + n).map(|p| p as i32));
        self.past_lens.push(past as i32);
        self.subsequence_begins.push(self.token_ids.len() as i32);
        self.seqs.push(seq);
    }

    /// `T`.
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }
    /// Length of the op's `scores` output: `sum(past_lens) + T`.
    pub fn scores_len(&self) -> usize {
        self.past_lens.iter().map(|&p| p as usize).sum::<usize>() + self.num_tokens()
    }
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }
    /// Logits rows of the step, over all sequences (the length of `sampled_tokens_indices`).
    pub fn num_logits_rows(&self) -> usize {
        self.seqs.iter().map(|s| s.logits_rows).sum()
    }
    /// The packed token rows (indices into the step's `T` rows) that get logits, in batch order:
    /// the `logits_rows` trailing rows of each sequence (the op's `sampled_tokens_indices`).
    pub fn logits_token_rows(&self) -> impl Iterator<Item = usize> + '_ {
        self.seqs.iter().enumerate().flat_map(|(i, s)| {
            let end = self.subsequence_begins[i + 1] as usize;
            end - s.logits_rows..end
        })
    }
    /// For each sequence, in batch order, its range in the gathered logits rows
    /// (`num_logits_rows()` in all; empty when it gets none).
    pub fn logits_ranges(&self) -> Vec<std::ops::Range<usize>> {
        let mut at = 0;
        self.seqs
            .iter()
            .map(|s| {
                at += s.logits_rows;
                at - s.logits_rows..at
            })
            .collect()
    }
}

/// Events since the scheduler was created (see [`Scheduler::counters`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerCounters {
    /// Steps handed out by `schedule`.
    pub steps: u64,
    pub preemptions: u64,
    pub forks: u64,
    /// Admissions that reused cached blocks, and the tokens they reused.
    pub prefix_hits: u64,
    pub prefix_hit_tokens: u64,
    /// Tokens admissions looked up in the prefix cache (every admission's prompt, and a
    /// preempted sequence's tokens again when it is readmitted), with prefix caching on.
    pub prefix_query_tokens: u64,
    /// Block copies handed out (copy-on-write and copies of shared blocks eviction moves).
    pub block_copies: u64,
    /// Sequences that lost blocks to eviction (one per sequence and step), and the blocks.
    pub evictions: u64,
    pub evicted_blocks: u64,
    /// Entries of the rotation inputs handed out (blocks whose keys were re-rotated).
    pub rotated_blocks: u64,
}

#[derive(Clone, Debug)]
struct Entry {
    req: Request,
    /// Prompt then generated tokens.
    tokens: Vec<u32>,
    /// Tokens of `tokens` already fed to the op (cached or evicted).
    processed: usize,
    generated: usize,
    arrival: u64,
    /// Draft tokens to verify after the last known token in the next step (not in `tokens`).
    draft: Vec<u32>,
    /// Give logits rows for the prompt's positions (see [`Scheduler::set_prompt_logits`]).
    prompt_logits: bool,
    /// Prompt positions whose logits rows were handed out already (not again on recompute).
    prompt_rows_given: usize,
}

/// Continuous-batching scheduler owning its [`BlockManager`].
#[derive(Clone, Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    mgr: BlockManager,
    entries: HashMap<SeqId, Entry>,
    waiting: Vec<SeqId>,
    running: Vec<SeqId>,
    arrivals: u64,
    /// Sequences of the step handed out and not completed yet.
    in_flight: Option<Vec<ScheduledSeq>>,
    /// Requests finished since the last [`Scheduler::take_finished`].
    finished: Vec<(SeqId, FinishReason)>,
    counters: SchedulerCounters,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Result<Scheduler> {
        if cfg.max_batched_tokens == 0 || cfg.max_seqs == 0 {
            return Err(PaError::InvalidArgument {
                detail: "max_batched_tokens and max_seqs must be positive".into(),
            });
        }
        let mgr = BlockManager::new(ManagerConfig {
            num_blocks: cfg.num_blocks,
            block_size: cfg.block_size,
            prefix_caching: cfg.prefix_caching,
        })?;
        Ok(Scheduler {
            cfg,
            mgr,
            entries: HashMap::new(),
            waiting: Vec::new(),
            running: Vec::new(),
            arrivals: 0,
            in_flight: None,
            finished: Vec::new(),
            counters: SchedulerCounters::default(),
        })
    }

    pub fn config(&self) -> SchedulerConfig {
        self.cfg
    }
    pub fn manager(&self) -> &BlockManager {
        &self.mgr
    }
    /// See [`BlockManager::record_cache_events`].
    pub fn record_cache_events(&mut self, on: bool) {
        self.mgr.record_cache_events(on);
    }
    /// See [`BlockManager::take_cache_events`].
    pub fn take_cache_events(&mut self) -> Vec<crate::cache::CacheEvent> {
        self.mgr.take_cache_events()
    }
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }
    pub fn num_running(&self) -> usize {
        self.running.len()
    }
    /// No request waiting or running.
    pub fn is_idle(&self) -> bool {
        self.entries.is_empty()
    }
    /// Preemptions since creation.
    pub fn preemptions(&self) -> u64 {
        self.counters.preemptions
    }
    /// Events since creation.
    pub fn counters(&self) -> SchedulerCounters {
        self.counters
    }
    /// Prompt and generated tokens of a live request.
    pub fn tokens(&self, id: SeqId) -> Result<&[u32]> {
        Ok(&self.entry(id)?.tokens)
    }

    fn entry(&self, id: SeqId) -> Result<&Entry> {
        self.entries.get(&id).ok_or(PaError::UnknownSequence { id })
    }

    /// Queues a request. Rejects an empty prompt, zero `max_new_tokens`, a duplicate id, and
    /// a request that could not fit in the whole pool even alone (with eviction: its prompt,
    /// which is never evicted while prefilling; without: prompt plus `max_new_tokens`).
    pub fn add_request(&mut self, req: Request) -> Result<()> {
        if req.prompt.is_empty() || req.max_new_tokens == 0 {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "request {} needs a prompt and max_new_tokens >= 1, got {} and {}",
                    req.id,
                    req.prompt.len(),
                    req.max_new_tokens
                ),
            });
        }
        if self.entries.contains_key(&req.id) {
            return Err(PaError::InvalidState {
                detail: format!("request {} already exists", req.id),
            });
        }
        // With eviction the prompt must still fit whole, since prefill is never evicted.
        let need = match self.cfg.eviction {
            None => req.prompt.len() + req.max_new_tokens,
            Some(_) => req.prompt.len(),
        }
        .div_ceil(self.cfg.block_size);
        if need > self.cfg.num_blocks {
            return Err(PaError::OutOfBlocks {
                detail: format!(
                    "request {} may need {need} blocks, the pool has {}",
                    req.id, self.cfg.num_blocks
                ),
            });
        }
        let id = req.id;
        self.entries.insert(
            id,
            Entry {
                tokens: req.prompt.clone(),
                req,
                processed: 0,
                generated: 0,
                arrival: self.arrivals,
                draft: Vec::new(),
                prompt_logits: false,
                prompt_rows_given: 0,
            },
        );
        self.arrivals += 1;
        self.waiting.push(id);
        Ok(())
    }

    /// Sort key: most important first.
    fn rank(&self, id: SeqId) -> (i32, u64) {
        let e = &self.entries[&id];
        (-e.req.priority, e.arrival)
    }

    fn preempt(&mut self, id: SeqId) -> Result<()> {
        self.mgr.free(id)?;
        if let Some(e) = self.entries.get_mut(&id) {
            e.processed = 0;
            e.draft.clear();
        }
        self.running.retain(|&r| r != id);
        self.waiting.push(id);
        self.counters.preemptions += 1;
        Ok(())
    }

    /// Forks the running request `parent` into a new request `child` (a parallel sample): the
    /// child shares all of the parent's cached blocks (a write into a shared partial block is
    /// copied first) and continues from the parent's tokens, with `first_token` in place of the
    /// parent's last sampled token. Only between steps, and only while the parent decodes (its
    /// one unprocessed token is that sampled token). The child inherits the parent's priority
    /// and generated count: it finishes after `max_new_tokens` generated tokens in all, which
    /// must be more than the parent has generated.
    pub fn fork(
        &mut self,
        parent: SeqId,
        child: SeqId,
        first_token: u32,
        max_new_tokens: usize,
    ) -> Result<()> {
        if self.in_flight.is_some() {
            return Err(PaError::InvalidState {
                detail: "fork() while a step is in flight (call complete_step() first)".into(),
            });
        }
        if self.entries.contains_key(&child) {
            return Err(PaError::InvalidState {
                detail: format!("request {child} already exists"),
            });
        }
        let p = self.entry(parent)?;
        let decoding =
            self.running.contains(&parent) && p.generated >= 1 && p.tokens.len() == p.processed + 1;
        if !decoding {
            return Err(PaError::InvalidState {
                detail: format!("request {parent} is not decoding, so it cannot be forked"),
            });
        }
        if max_new_tokens <= p.generated {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "the fork of request {parent} needs max_new_tokens > {} (generated so far), \
                     got {max_new_tokens}",
                    p.generated
                ),
            });
        }
        let mut e = p.clone();
        self.mgr.fork(parent, child)?;
        if let Some(last) = e.tokens.last_mut() {
            *last = first_token;
        }
        e.req.id = child;
        e.req.max_new_tokens = max_new_tokens;
        e.arrival = self.arrivals;
        self.arrivals += 1;
        self.entries.insert(child, e);
        self.running.push(child);
        self.counters.forks += 1;
        Ok(())
    }

    /// Ends a live request early because the caller decided it is done (it sampled an
    /// end-of-sequence token, or its text reached a stop string): its blocks are freed at once
    /// and it is reported by [`take_finished`](Self::take_finished) with
    /// [`FinishReason::Stop`]. Only between steps.
    pub fn finish(&mut self, id: SeqId) -> Result<()> {
        self.remove(id, FinishReason::Stop)
    }

    /// Aborts a request, waiting or running: its blocks are freed at once and it is reported
    /// with [`FinishReason::Abort`]. Only between steps (a step in flight is writing its blocks).
    pub fn abort(&mut self, id: SeqId) -> Result<()> {
        self.remove(id, FinishReason::Abort)
    }

    fn remove(&mut self, id: SeqId, reason: FinishReason) -> Result<()> {
        if self.in_flight.is_some() {
            return Err(PaError::InvalidState {
                detail: format!(
                    "request {id} cannot end while a step is in flight (call complete_step() first)"
                ),
            });
        }
        self.entry(id)?;
        self.drop_seq(id)?;
        self.finished.push((id, reason));
        Ok(())
    }

    /// Frees a request's blocks (if it has any) and forgets it, waiting or running.
    fn drop_seq(&mut self, id: SeqId) -> Result<()> {
        if self.mgr.contains(id) {
            self.mgr.free(id)?;
        }
        self.entries.remove(&id);
        self.running.retain(|&r| r != id);
        self.waiting.retain(|&r| r != id);
        Ok(())
    }

    /// The requests that finished since the last call, with their reasons, in the order they
    /// finished: those that reached `max_new_tokens` in [`complete_step`](Self::complete_step),
    /// and those ended by [`finish`](Self::finish) or [`abort`](Self::abort).
    pub fn take_finished(&mut self) -> Vec<(SeqId, FinishReason)> {
        std::mem::take(&mut self.finished)
    }

    /// Plans the next op call. Errors if the previous step was not completed.
    pub fn schedule(&mut self) -> Result<Step> {
        if self.in_flight.is_some() {
            return Err(PaError::InvalidState {
                detail: "schedule() called before complete_step() of the previous step".into(),
            });
        }
        let mut step = Step::default();
        if let Some(policy) = self.cfg.eviction {
            for id in self.running.clone() {
                // Not while the sequence is still in (chunked) prefill: only its last token's
                // scores exist yet, so the ranking would be arbitrary (OpenVINO GenAI skips
                // these too). More than one unprocessed token means a prompt chunk is pending.
                let e = self.entry(id)?;
                if e.tokens.len() - e.processed > 1 {
                    continue;
                }
                match self.mgr.evict(id, policy) {
                    Ok(ev) => {
                        if !ev.evicted.is_empty() {
                            self.counters.evictions += 1;
                        }
                        step.evicted_blocks += ev.evicted.len();
                        step.copies.extend(ev.copies);
                    }
                    Err(PaError::OutOfBlocks { .. }) => {}
                    Err(e) => return Err(e),
                }
            }
        }

        let mut budget = self.cfg.max_batched_tokens;
        let mut order = self.running.clone();
        order.sort_by_key(|&id| self.rank(id));
        let mut chunks: Vec<(SeqId, usize, usize, usize)> = Vec::new(); // (id, past_len, n, drafts)
        let mut idx = 0;
        while idx < order.len() && budget > 0 {
            let id = order[idx];
            let e = self.entry(id)?;
            let left = e.tokens.len() - e.processed;
            let n = left.min(budget);
            // Drafts ride along only behind the whole rest of the sequence, within the budget
            // and the free blocks (they shrink before anything is preempted for them).
            let mut d = if n == left {
                e.draft.len().min(budget - n)
            } else {
                0
            };
            while d > 0 && self.mgr.blocks_needed(id, n + d)? > self.mgr.available_blocks() {
                d -= 1;
            }
            let need = self.mgr.blocks_needed(id, n + d)?;
            while need > self.mgr.available_blocks() && order.len() > idx + 1 {
                let victim = order.pop().unwrap_or(id);
                self.preempt(victim)?;
                step.preempted.push(victim);
            }
            if need > self.mgr.available_blocks() {
                order.pop();
                self.preempt(id)?;
                step.preempted.push(id);
                break;
            }
            let e = self.entry(id)?;
            let mut toks = e.tokens[e.processed..e.processed + n].to_vec();
            toks.extend_from_slice(&e.draft[..d]);
            let a = self.mgr.append(id, &toks)?;
            step.copies.extend(a.copies);
            chunks.push((id, a.past_len, n, d));
            budget -= n + d;
            idx += 1;
        }

        if step.preempted.is_empty() {
            let mut waiting = std::mem::take(&mut self.waiting);
            waiting.sort_by_key(|&id| self.rank(id));
            self.waiting = waiting;
            while budget > 0 && self.running.len() < self.cfg.max_seqs && !self.waiting.is_empty() {
                let id = self.waiting[0];
                let e = self.entry(id)?;
                let tokens = e.tokens.clone();
                // Prompt logits need every prompt row computed: no prefix-cache reuse.
                let lookup: &[u32] = if e.prompt_logits { &[] } else { &tokens };
                let cached = self.mgr.add_sequence(id, lookup)?;
                let n = (tokens.len() - cached).min(budget);
                if self.mgr.blocks_needed(id, n)? > self.mgr.available_blocks() {
                    self.mgr.free(id)?;
                    break;
                }
                let a = self.mgr.append(id, &tokens[cached..cached + n])?;
                step.copies.extend(a.copies);
                if let Some(e) = self.entries.get_mut(&id) {
                    e.processed = cached;
                }
                if self.cfg.prefix_caching {
                    self.counters.prefix_query_tokens += tokens.len() as u64;
                }
                if cached > 0 {
                    self.counters.prefix_hits += 1;
                    self.counters.prefix_hit_tokens += cached as u64;
                }
                chunks.push((id, a.past_len, n, 0));
                budget -= n;
                self.waiting.remove(0);
                self.running.push(id);
            }
        }

        let ids: Vec<SeqId> = chunks.iter().map(|c| c.0).collect();
        let (bi, bib) = self.mgr.block_inputs(&ids)?;
        step.block_indices = bi;
        step.block_indices_begins = bib;
        step.subsequence_begins.push(0);
        for &(id, past, n, d) in &chunks {
            let e = self
                .entries
                .get_mut(&id)
                .ok_or(PaError::UnknownSequence { id })?;
            let start = e.processed;
            // Drafts are cached by the op but not processed until accepted (complete_step).
            e.processed += n;
            let emits = e.processed == e.tokens.len();
            let mut logits_rows = if emits { 1 + d } else { 0 };
            if e.prompt_logits {
                let prompt_len = e.req.prompt.len();
                let from = start.max(e.prompt_rows_given);
                let to = (start + n).min(prompt_len);
                if from < to {
                    // Within the first prefill, so these rows end the chunk (d is 0).
                    logits_rows = logits_rows.max(start + n - from);
                    e.prompt_rows_given = to;
                }
            }
            let rows = ScheduledSeq {
                id,
                past_len: past,
                num_tokens: n + d,
                emits,
                logits_rows,
                draft_len: d,
            };
            step.push_seq(&[&e.tokens[start..start + n], &e.draft[..d]], rows);
        }
        step.rotation = self.mgr.take_rotation();
        let c = &mut self.counters;
        c.steps += 1;
        c.evicted_blocks += step.evicted_blocks as u64;
        c.block_copies += step.copies.len() as u64;
        c.rotated_blocks += step.rotation.as_ref().map_or(0, |r| r.len()) as u64;
        self.in_flight = Some(step.seqs.clone());
        Ok(step)
    }

    /// Adds the op's `scores` output of a step (`step.scores_len()` values) to the per-block
    /// accumulators that eviction ranks by. Call between `schedule` and `complete_step`.
    pub fn accumulate_scores(&mut self, step: &Step, scores: &[f32]) -> Result<()> {
        if scores.len() != step.scores_len() {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "the step has {} scores, {} were given",
                    step.scores_len(),
                    scores.len()
                ),
            });
        }
        let mut off = 0;
        for s in &step.seqs {
            let n = s.past_len + s.num_tokens;
            self.mgr.accumulate_scores(s.id, &scores[off..off + n])?;
            off += n;
        }
        Ok(())
    }

    /// Finishes the step handed out by [`schedule`](Self::schedule): `sampled` holds one new
    /// token for every scheduled sequence with `emits` set (and no other). Returns the requests
    /// that finished (reached `max_new_tokens`); their blocks are freed.
    pub fn complete_step(&mut self, sampled: &[(SeqId, u32)]) -> Result<Vec<SeqId>> {
        let accepted: Vec<(SeqId, &[u32])> = sampled
            .iter()
            .map(|(id, t)| (*id, std::slice::from_ref(t)))
            .collect();
        self.complete_step_accepted(&accepted)
    }

    /// [`complete_step`](Self::complete_step) for a step that verified drafts: for every
    /// emitting sequence, its accepted tokens, 1 to `draft_len + 1` of them: the first
    /// `len - 1` equal its drafts, the last is the model's own next token. The cache keeps the
    /// accepted drafts and drops the rejected ones at once (their blocks return to the pool and
    /// never to the prefix cache). Tokens past `max_new_tokens` are dropped.
    pub fn complete_step_accepted(&mut self, accepted: &[(SeqId, &[u32])]) -> Result<Vec<SeqId>> {
        let seqs = self
            .in_flight
            .as_ref()
            .ok_or_else(|| PaError::InvalidState {
                detail: "complete_step() without a scheduled step".into(),
            })?;
        let emitting: Vec<SeqId> = seqs.iter().filter(|s| s.emits).map(|s| s.id).collect();
        let mut given: Vec<SeqId> = accepted.iter().map(|s| s.0).collect();
        given.sort_unstable();
        let mut want = emitting.clone();
        want.sort_unstable();
        if given != want {
            return Err(PaError::InvalidArgument {
                detail: format!(
                    "complete_step needs tokens for each emitting sequence {want:?}, got \
                     {given:?}"
                ),
            });
        }
        for &(id, toks) in accepted {
            let d = seqs.iter().find(|s| s.id == id).map_or(0, |s| s.draft_len);
            let draft = &self.entry(id)?.draft;
            if toks.is_empty()
                || toks.len() > d + 1
                || toks[..toks.len() - 1] != draft[..toks.len() - 1]
            {
                return Err(PaError::InvalidArgument {
                    detail: format!(
                        "sequence {id} verified {d} drafts {:?}; {toks:?} is not an accepted \
                         prefix of them plus one token",
                        &draft[..d]
                    ),
                });
            }
        }
        let seqs = self.in_flight.take().unwrap_or_default();
        // Drafts live for one step: those left out of it (no budget) are stale after it.
        for e in self.entries.values_mut() {
            e.draft.clear();
        }
        let mut finished = Vec::new();
        for &(id, toks) in accepted {
            let d = seqs.iter().find(|s| s.id == id).map_or(0, |s| s.draft_len);
            let e = self
                .entries
                .get_mut(&id)
                .ok_or(PaError::UnknownSequence { id })?;
            let room = e.req.max_new_tokens - e.generated;
            let toks = &toks[..toks.len().min(room)];
            e.tokens.extend_from_slice(toks);
            e.generated += toks.len();
            // Accepted drafts are cached; the last token is the next to feed.
            e.processed = e.tokens.len() - 1;
            if d > 0 {
                self.mgr.rollback(id, e.processed)?;
            }
            if e.generated >= e.req.max_new_tokens {
                finished.push(id);
            }
        }
        self.mgr.mark_computed();
        for &id in &finished {
            self.mgr.free(id)?;
            self.entries.remove(&id);
            self.running.retain(|&r| r != id);
            self.finished.push((id, FinishReason::Length));
        }
        Ok(finished)
    }

    /// Abandons the step handed out by [`schedule`](Self::schedule) when its op call failed:
    /// none of its tokens counts as computed. Its sequences are removed and their blocks
    /// freed; the blocks the step filled never reach the prefix cache. Returns their ids; they
    /// are not reported by [`take_finished`](Self::take_finished) (the caller fails them).
    /// The other requests keep their state and go on with the next step.
    pub fn fail_step(&mut self) -> Result<Vec<SeqId>> {
        let seqs = self.in_flight.take().ok_or_else(|| PaError::InvalidState {
            detail: "fail_step() without a scheduled step".into(),
        })?;
        for e in self.entries.values_mut() {
            e.draft.clear();
        }
        self.mgr.discard_uncomputed();
        let ids: Vec<SeqId> = seqs.iter().map(|s| s.id).collect();
        for &id in &ids {
            self.drop_seq(id)?;
        }
        Ok(ids)
    }

    /// Draft tokens for a decoding sequence to verify in the next step, after its last known
    /// token (speculative decoding). Only between steps and only while the sequence decodes;
    /// cut to what `max_new_tokens` leaves after the model's own next token. The next
    /// [`schedule`](Self::schedule) may shorten them further (token budget, free blocks);
    /// [`complete_step_accepted`](Self::complete_step_accepted) consumes them.
    pub fn set_draft(&mut self, id: SeqId, draft: &[u32]) -> Result<()> {
        if self.in_flight.is_some() {
            return Err(PaError::InvalidState {
                detail: "set_draft() while a step is in flight".into(),
            });
        }
        let decoding = self.running.contains(&id);
        let e = self
            .entries
            .get_mut(&id)
            .ok_or(PaError::UnknownSequence { id })?;
        if !decoding || e.generated == 0 || e.tokens.len() != e.processed + 1 {
            return Err(PaError::InvalidState {
                detail: format!("request {id} is not decoding, so it cannot verify drafts"),
            });
        }
        let room = e.req.max_new_tokens.saturating_sub(e.generated + 1);
        e.draft.clear();
        e.draft.extend_from_slice(&draft[..draft.len().min(room)]);
        Ok(())
    }

    /// Whether a live request is decoding (running, its prompt done, one token to feed): the
    /// state in which [`set_draft`](Self::set_draft) accepts drafts.
    pub fn is_decoding(&self, id: SeqId) -> bool {
        self.entries.get(&id).is_some_and(|e| {
            e.generated > 0 && e.tokens.len() == e.processed + 1 && self.running.contains(&id)
        })
    }

    /// Asks for logits rows at the prompt's positions of a waiting request that has not run
    /// yet (echoed prompt logprobs): each prompt chunk's `logits_rows` then covers all its rows,
    /// once per position (not again when a preempted request recomputes), and the request
    /// skips the prefix cache so that every prompt row is computed. Row `j` of a chunk with
    /// `past_len` p holds the logits after position `p + j`, i.e. the prediction of prompt
    /// token `p + j + 1`.
    pub fn set_prompt_logits(&mut self, id: SeqId, on: bool) -> Result<()> {
        let waiting = self.waiting.contains(&id);
        let e = self
            .entries
            .get_mut(&id)
            .ok_or(PaError::UnknownSequence { id })?;
        if !waiting || e.processed > 0 || e.prompt_rows_given > 0 {
            return Err(PaError::InvalidState {
                detail: format!("request {id} has started; ask for prompt logits when adding it"),
            });
        }
        e.prompt_logits = on;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(num_blocks: usize, max_batched_tokens: usize) -> Scheduler {
        Scheduler::new(SchedulerConfig {
            num_blocks,
            block_size: 4,
            prefix_caching: true,
            max_batched_tokens,
            max_seqs: 8,
            eviction: None,
        })
        .unwrap()
    }

    fn req(id: SeqId, prompt_len: u32, max_new: usize, priority: i32) -> Request {
        Request {
            id,
            prompt: (0..prompt_len).map(|t| t + 1000 * id as u32).collect(),
            max_new_tokens: max_new,
            priority,
        }
    }

    fn sample(step: &Step) -> Vec<(SeqId, u32)> {
        step.seqs
            .iter()
            .filter(|s| s.emits)
            .map(|s| (s.id, 7))
            .collect()
    }

    #[test]
    fn finish_and_abort_free_blocks_at_once_and_report_reasons() {
        let mut s = sched(16, 64);
        s.add_request(req(1, 10, 50, 0)).unwrap();
        s.add_request(req(2, 6, 50, 0)).unwrap();
        s.add_request(req(3, 4, 1, 0)).unwrap();
        let step = s.schedule().unwrap();
        assert!(
            s.finish(1).is_err(),
            "no early end while the step is in flight"
        );
        s.complete_step(&sample(&step)).unwrap();
        let used = s.manager().stats().used_blocks;
        assert_eq!(
            used,
            3 + 2,
            "request 3 finished by length and freed its block"
        );
        s.finish(1).unwrap();
        assert_eq!(
            s.manager().stats().used_blocks,
            2,
            "request 1's 3 blocks freed at once"
        );
        s.add_request(req(4, 5, 5, 0)).unwrap();
        s.abort(4).unwrap(); // still waiting
        s.abort(2).unwrap(); // running
        assert_eq!(s.manager().stats().used_blocks, 0);
        assert!(s.is_idle());
        assert_eq!(
            s.take_finished(),
            vec![
                (3, FinishReason::Length),
                (1, FinishReason::Stop),
                (4, FinishReason::Abort),
                (2, FinishReason::Abort)
            ]
        );
        assert!(s.take_finished().is_empty());
        assert!(matches!(
            s.abort(2),
            Err(PaError::UnknownSequence { id: 2 })
        ));
        s.manager().check_invariants().unwrap();
    }

    #[test]
    fn chunked_prefill_respects_the_token_budget_then_decodes() {
        let mut s = sched(16, 4);
        s.add_request(req(1, 10, 2, 0)).unwrap();
        let mut chunks = vec![];
        loop {
            let st = s.schedule().unwrap();
            assert!(st.num_tokens() <= 4);
            chunks.push((st.past_lens.clone(), st.num_tokens(), st.seqs[0].emits));
            if s.complete_step(&sample(&st)).unwrap() == vec![1] {
                break;
            }
        }
        let want = vec![
            (vec![0], 4, false),
            (vec![4], 4, false),
            (vec![8], 2, true),
            (vec![10], 1, true),
        ];
        assert_eq!(chunks, want);
        assert!(s.is_idle());
        assert_eq!(s.manager().available_blocks(), 16);
    }

    #[test]
    fn step_inputs_describe_the_packed_batch() {
        let mut s = sched(16, 64);
        s.add_request(req(1, 5, 3, 0)).unwrap();
        s.add_request(req(2, 3, 3, 0)).unwrap();
        let st = s.schedule().unwrap();
        assert_eq!(st.past_lens, vec![0, 0]);
        assert_eq!(st.subsequence_begins, vec![0, 5, 8]);
        assert_eq!(st.block_indices_begins, vec![0, 2, 3]);
        assert_eq!(st.token_seq, vec![0, 0, 0, 0, 0, 1, 1, 1]);
        assert_eq!(st.token_pos, vec![0, 1, 2, 3, 4, 0, 1, 2]);
        assert_eq!(&st.token_ids[5..], &[2000, 2001, 2002]);
        assert_eq!(st.scores_len(), 8);
        s.complete_step(&[(1, 50), (2, 60)]).unwrap();
        let st = s.schedule().unwrap();
        assert_eq!(st.past_lens, vec![5, 3]);
        assert_eq!(
            st.token_ids,
            vec![50, 60],
            "decode feeds the sampled tokens"
        );
        assert_eq!(st.scores_len(), 10);
    }

    #[test]
    fn admission_stops_when_blocks_run_out() {
        let mut s = sched(4, 64);
        s.add_request(req(1, 8, 4, 0)).unwrap(); // 2 blocks
        s.add_request(req(2, 8, 4, 0)).unwrap(); // 2 blocks
        s.add_request(req(3, 2, 4, 0)).unwrap(); // would need 1
        let st = s.schedule().unwrap();
        let ids: Vec<_> = st.seqs.iter().map(|q| q.id).collect();
        assert_eq!(ids, vec![1, 2]);
        assert_eq!(s.num_waiting(), 1);
    }

    #[test]
    fn out_of_blocks_preempts_the_lowest_priority_sequence_and_recomputes_it_later() {
        let mut s = sched(4, 64);
        s.add_request(req(1, 7, 6, 5)).unwrap();
        s.add_request(req(2, 7, 6, 0)).unwrap();
        let st = s.schedule().unwrap(); // both prefilled, 2 blocks each, pool full
        s.complete_step(&sample(&st)).unwrap();
        // Decode: seq 1 fills its block 1 (8 tokens), fine. Next decode needs a block.
        let st = s.schedule().unwrap();
        assert!(st.preempted.is_empty());
        s.complete_step(&sample(&st)).unwrap();
        let st = s.schedule().unwrap();
        assert_eq!(st.preempted, vec![2], "priority 0 loses its blocks");
        assert_eq!(st.seqs.len(), 1);
        assert_eq!(s.num_waiting(), 1);
        s.complete_step(&sample(&st)).unwrap();
        // Run to completion: seq 2 is readmitted and recomputes prompt + generated tokens,
        // except its first block, still in the prefix cache.
        let mut recomputed = false;
        let mut preempted_done = false;
        for _ in 0..50 {
            if s.is_idle() {
                break;
            }
            let st = s.schedule().unwrap();
            if let Some(q) = st.seqs.iter().find(|q| q.id == 2) {
                if !preempted_done {
                    assert_eq!(q.past_len, 4, "readmitted with its first block cached");
                    assert_eq!(q.num_tokens, 5, "prompt 7 + 2 generated - 4 cached");
                    recomputed = true;
                    preempted_done = true;
                }
            }
            s.complete_step(&sample(&st)).unwrap();
            s.manager().check_invariants().unwrap();
        }
        assert!(recomputed);
        assert!(s.is_idle());
        assert!(s.preemptions() >= 1);
    }

    #[test]
    fn complete_step_requires_exactly_the_emitting_sequences() {
        let mut s = sched(8, 64);
        s.add_request(req(1, 3, 2, 0)).unwrap();
        assert!(s.complete_step(&[]).is_err(), "nothing scheduled yet");
        let st = s.schedule().unwrap();
        assert!(s.schedule().is_err(), "previous step not completed");
        assert!(s.complete_step(&[]).is_err());
        assert!(s.complete_step(&[(1, 1), (2, 1)]).is_err());
        s.complete_step(&sample(&st)).unwrap();
    }

    #[test]
    fn a_request_larger_than_the_pool_is_rejected() {
        let mut s = sched(2, 64);
        assert!(matches!(
            s.add_request(req(1, 8, 1, 0)),
            Err(PaError::OutOfBlocks { .. })
        ));
        assert!(s.add_request(req(1, 0, 1, 0)).is_err());
    }

    #[test]
    fn a_fork_shares_the_blocks_copies_the_partial_one_and_continues_with_its_token() {
        let mut s = sched(16, 64);
        s.add_request(req(1, 6, 4, 0)).unwrap(); // blocks 0..4 full, 4..6 partial
        assert!(
            matches!(s.fork(1, 2, 9, 4), Err(PaError::InvalidState { .. })),
            "waiting, not decoding"
        );
        let st = s.schedule().unwrap();
        assert!(matches!(
            s.fork(1, 2, 9, 4),
            Err(PaError::InvalidState { .. })
        ));
        s.complete_step(&[(1, 50)]).unwrap();
        assert!(matches!(
            s.fork(1, 2, 9, 1),
            Err(PaError::InvalidArgument { .. })
        ));
        assert!(matches!(
            s.fork(3, 2, 9, 4),
            Err(PaError::UnknownSequence { .. })
        ));
        assert!(matches!(
            s.fork(1, 1, 9, 4),
            Err(PaError::InvalidState { .. })
        ));
        let before = s.manager().stats();
        s.fork(1, 2, 60, 3).unwrap();
        assert_eq!(
            s.manager().stats().used_blocks,
            before.used_blocks,
            "no block allocated"
        );
        assert_eq!(s.manager().stats().shared_blocks, 2);
        assert_eq!(
            s.tokens(2).unwrap(),
            &[1000, 1001, 1002, 1003, 1004, 1005, 60]
        );
        let st2 = s.schedule().unwrap();
        assert_eq!(
            st2.token_ids,
            vec![50, 60],
            "each continues with its own token"
        );
        assert_eq!(st2.past_lens, vec![6, 6]);
        assert_eq!(
            st2.copies.len(),
            1,
            "the shared partial block is copied once"
        );
        let (t1, t2) = (
            s.manager().block_table(1).unwrap(),
            s.manager().block_table(2).unwrap(),
        );
        assert_eq!(t1[0], t2[0], "the full block stays shared");
        assert_ne!(t1[1], t2[1]);
        assert_eq!(
            st2.copies[0].src, st.block_indices[1] as u32,
            "the copy starts from the prompt's partial block"
        );
        s.complete_step(&[(1, 51), (2, 61)]).unwrap();
        let c = s.counters();
        assert_eq!((c.forks, c.steps, c.block_copies), (1, 2, 1));
        // The child finishes after 3 generated tokens in all (1 inherited + 2), the parent
        // after 4.
        let st3 = s.schedule().unwrap();
        assert_eq!(s.complete_step(&sample(&st3)).unwrap(), vec![2]);
        let st4 = s.schedule().unwrap();
        assert_eq!(s.complete_step(&sample(&st4)).unwrap(), vec![1]);
        assert!(s.is_idle());
        s.manager().check_invariants().unwrap();
    }

    #[test]
    fn counters_see_prefix_hits_evictions_and_rotations() {
        let mut s = Scheduler::new(SchedulerConfig {
            num_blocks: 16,
            block_size: 4,
            prefix_caching: true,
            max_batched_tokens: 64,
            max_seqs: 8,
            eviction: Some(EvictionPolicy {
                start: 1,
                recent: 1,
                budget: 3,
            }),
        })
        .unwrap();
        s.add_request(req(1, 9, 8, 0)).unwrap();
        let mut evicted_steps = 0;
        while !s.is_idle() {
            let st = s.schedule().unwrap();
            if st.evicted_blocks > 0 {
                evicted_steps += 1;
                let r = st.rotation.as_ref().expect("kept blocks moved");
                assert!(!r.is_empty());
            }
            let scores: Vec<f32> = (0..st.scores_len()).map(|i| i as f32).collect();
            s.accumulate_scores(&st, &scores).unwrap();
            s.complete_step(&sample(&st)).unwrap();
        }
        let c = s.counters();
        assert!(evicted_steps >= 1);
        assert_eq!(c.evictions, evicted_steps);
        assert!(c.evicted_blocks >= c.evictions && c.rotated_blocks >= c.evictions);
        assert_eq!((c.prefix_hits, c.forks, c.preemptions), (0, 0, 0));
        let mut r = req(1, 9, 1, 0); // request 1's prompt again: its first block is cached
        r.id = 2;
        s.add_request(r).unwrap();
        let st = s.schedule().unwrap();
        assert!(st.past_lens[0] >= 4);
        let c = s.counters();
        assert_eq!(
            (c.prefix_hits, c.prefix_hit_tokens),
            (1, st.past_lens[0] as u64)
        );
        assert_eq!(
            c.prefix_query_tokens, 18,
            "two admissions of 9-token prompts"
        );
    }

    #[test]
    fn a_repeated_prompt_is_admitted_from_the_prefix_cache() {
        let mut s = sched(16, 64);
        s.add_request(req(1, 9, 1, 0)).unwrap();
        let st = s.schedule().unwrap();
        s.complete_step(&sample(&st)).unwrap();
        let mut r = req(1, 9, 1, 0);
        r.id = 2;
        s.add_request(r).unwrap();
        let st = s.schedule().unwrap();
        assert_eq!(st.past_lens, vec![8], "two cached blocks reused");
        assert_eq!(st.num_tokens(), 1);
    }

    #[test]
    fn drafts_ride_with_the_decode_token_and_rejected_ones_leave_the_cache() {
        let mut s = sched(16, 64);
        s.add_request(req(1, 6, 20, 0)).unwrap();
        assert!(s.set_draft(1, &[1, 2]).is_err(), "waiting, not decoding");
        let st = s.schedule().unwrap();
        assert_eq!(st.seqs[0].logits_rows, 1);
        s.complete_step(&[(1, 50)]).unwrap();
        assert!(s.is_decoding(1));
        s.set_draft(1, &[51, 52, 53]).unwrap();
        let st = s.schedule().unwrap();
        let q = &st.seqs[0];
        assert_eq!(
            (q.past_len, q.num_tokens, q.draft_len, q.logits_rows),
            (6, 4, 3, 4)
        );
        assert_eq!(st.token_ids, vec![50, 51, 52, 53]);
        assert_eq!(st.logits_token_rows().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
        assert!(
            s.complete_step_accepted(&[(1, &[51, 99, 7])]).is_err(),
            "99 is not the second draft"
        );
        assert!(s
            .complete_step_accepted(&[(1, &[51, 52, 53, 54, 55])])
            .is_err());
        // Positions 6..10 were written (blocks 1 and 2); every draft rejected, the model's own.
        s.complete_step_accepted(&[(1, &[60])]).unwrap();
        assert_eq!(s.tokens(1).unwrap()[6..], [50, 60]);
        assert_eq!(s.manager().len(1).unwrap(), 7, "50 cached, 60 to feed");
        let stats = s.manager().stats();
        assert_eq!(stats.used_blocks, 2);
        assert_eq!(
            stats.prefix_blocks, 1,
            "block 1 held the rejected draft 51 and left the prefix cache"
        );
        let st = s.schedule().unwrap();
        assert_eq!((st.past_lens[0], st.token_ids.clone()), (7, vec![60]));
        s.complete_step(&sample(&st)).unwrap();
        s.manager().check_invariants().unwrap();
    }

    #[test]
    fn drafts_shrink_to_the_token_budget_and_max_new_tokens() {
        let mut s = sched(16, 3);
        s.add_request(req(1, 2, 4, 0)).unwrap();
        let st = s.schedule().unwrap();
        s.complete_step(&sample(&st)).unwrap();
        s.set_draft(1, &[1, 2, 3, 4, 5]).unwrap();
        let st = s.schedule().unwrap();
        assert_eq!(
            st.seqs[0].draft_len, 2,
            "max_new 4: 1 generated + 2 drafts + 1 own"
        );
        s.complete_step_accepted(&[(1, &[1, 2, 9])]).unwrap();
        assert!(s.is_idle(), "4 tokens generated");
        let mut s = sched(16, 3);
        s.add_request(req(1, 2, 20, 0)).unwrap();
        let st = s.schedule().unwrap();
        s.complete_step(&sample(&st)).unwrap();
        s.set_draft(1, &[1, 2, 3, 4, 5]).unwrap();
        let st = s.schedule().unwrap();
        assert_eq!(st.num_tokens(), 3, "the budget of 3 rows holds 2 drafts");
    }

    #[test]
    fn prompt_logits_cover_every_prompt_row_once() {
        let mut s = sched(16, 4);
        s.add_request(req(1, 9, 2, 0)).unwrap();
        // Cache the prompt's first blocks: a prompt-logits request must still compute them.
        while !s.is_idle() {
            let st = s.schedule().unwrap();
            s.complete_step(&sample(&st)).unwrap();
        }
        let mut r = req(1, 9, 2, 0);
        r.id = 2;
        s.add_request(r).unwrap();
        s.set_prompt_logits(2, true).unwrap();
        let mut rows = vec![];
        while !s.is_idle() {
            let st = s.schedule().unwrap();
            let q = &st.seqs[0];
            rows.push((q.past_len, q.num_tokens, q.logits_rows));
            assert!(s.set_prompt_logits(2, false).is_err());
            s.complete_step(&sample(&st)).unwrap();
        }
        assert_eq!(rows, vec![(0, 4, 4), (4, 4, 4), (8, 1, 1), (9, 1, 1)]);
    }
}
