//! The engine core: requests in, events out, one [`EngineCore::step`] at a time. A step is
//! schedule (the project's continuous-batching scheduler and block manager: chunked prefill
//! under a token budget, decodes, preemption when blocks run out, prefix-cache hits), run (the
//! model runner), sample (one token per sequence that reached its end), update (the scheduler,
//! forks of n > 1 requests, and the output processor, which ends outputs on an end-of-sequence
//! id, a stop string or `max_new_tokens`). A request with `n` > 1 prefills once; its other
//! outputs are forks of the first (sharing its blocks, copy-on-write) from its first token on.
//!
//! With speculative decoding, each decoding sequence first proposes draft tokens (prompt
//! lookup, `speculative`), the step verifies them with its other work, and the update applies
//! the accepted tokens one at a time through the same path as a sampled token.
//!
//! The core knows no threads, channels or HTTP: an engine client drives it.

use crate::config::EngineConfig;
use crate::error::{EngineError, Result};
use crate::model_dir::ModelDir;
use crate::model_runner::ModelRunner;
use crate::output_processor::OutputText;
use crate::request::{Event, GenerationParams, RequestError, RequestId};
use crate::sampling::{sample, verify_draft};
use crate::speculative::{self, SpeculativeConfig};
use crate::tokenizer::TextTokenizer;
use paged_attention::cache::{
    CacheStats, FinishReason, Request, Scheduler, SchedulerConfig, SchedulerCounters, SeqId,
    SplitMix64, Step,
};
use paged_attention::ElemType;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Time and work since the engine started.
#[derive(Clone, Copy, Debug, Default)]
pub struct EngineStats {
    pub steps: u64,
    pub prompt_tokens: u64,
    pub generated_tokens: u64,
    /// In `infer()`.
    pub infer_time: Duration,
    /// In whole steps (scheduling, copies, inputs, infer, sampling, detokenization).
    pub step_time: Duration,
    /// Speculative decoding: draft tokens verified, and those accepted.
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
}

/// One output of a request.
struct Output {
    seq: SeqId,
    rng: SplitMix64,
    text: OutputText,
}

struct RequestState {
    params: GenerationParams,
    stop_ids: Vec<u32>,
    /// The prompt's distinct tokens, sorted, when a penalty counts them (else empty).
    prompt_tokens: Vec<u32>,
    outputs: Vec<Output>,
}

pub struct EngineCore {
    tokenizer: Arc<TextTokenizer>,
    eos: Vec<u32>,
    context: Option<usize>,
    runner: ModelRunner,
    cache_type: ElemType,
    sched: Scheduler,
    requests: HashMap<RequestId, RequestState>,
    /// Scheduler sequence -> (request, output index).
    seqs: HashMap<SeqId, (RequestId, usize)>,
    next_seq: SeqId,
    scratch: Vec<(f32, u32)>,
    /// A logits row with the penalties applied, and the token counts they use.
    penalized: Vec<f32>,
    counts: Vec<(u32, u32)>,
    /// An output's tokens so far plus those accepted in this step (for the penalties).
    so_far: Vec<u32>,
    speculative: Option<SpeculativeConfig>,
    stats: EngineStats,
}

impl EngineCore {
    /// Loads a model directory: reads its configuration and tokenizer, converts the stateful
    /// graph to our op in memory, compiles it and allocates the caches of `cfg`.
    pub fn load(dir: impl AsRef<Path>, cfg: &EngineConfig) -> Result<EngineCore> {
        EngineCore::from_model_dir(ModelDir::open(dir)?, cfg)
    }

    pub fn from_model_dir(md: ModelDir, cfg: &EngineConfig) -> Result<EngineCore> {
        if cfg.block_size == 0 || cfg.max_batched_tokens == 0 || cfg.max_seqs == 0 {
            return Err(EngineError::Config(
                "block size, max batched tokens and max sequences must be positive".into(),
            ));
        }
        if cfg.speculative.is_some() && cfg.eviction.is_some() {
            return Err(EngineError::Config(
                "speculative decoding does not combine with cache eviction".into(),
            ));
        }
        let (runner, num_blocks) = ModelRunner::load(&md, cfg)?;
        let sched = Scheduler::new(SchedulerConfig {
            num_blocks,
            block_size: cfg.block_size,
            prefix_caching: cfg.prefix_caching,
            max_batched_tokens: cfg.max_batched_tokens,
            max_seqs: cfg.max_seqs,
            eviction: cfg.eviction,
        })?;
        Ok(EngineCore {
            eos: md.eos_token_ids(),
            context: md.config.max_position_embeddings,
            tokenizer: md.tokenizer,
            runner,
            cache_type: cfg.cache_type,
            sched,
            requests: HashMap::new(),
            seqs: HashMap::new(),
            next_seq: 0,
            scratch: Vec::new(),
            penalized: Vec::new(),
            counts: Vec::new(),
            so_far: Vec::new(),
            speculative: cfg.speculative,
            stats: EngineStats::default(),
        })
    }

    pub fn tokenizer(&self) -> &Arc<TextTokenizer> {
        &self.tokenizer
    }
    /// The model's context (`max_position_embeddings`), when config.json gives it.
    pub fn context_len(&self) -> Option<usize> {
        self.context
    }
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos
    }
    pub fn num_blocks(&self) -> usize {
        self.sched.config().num_blocks
    }
    pub fn block_size(&self) -> usize {
        self.sched.config().block_size
    }
    pub fn cache_type(&self) -> ElemType {
        self.cache_type
    }
    pub fn cache_stats(&self) -> CacheStats {
        self.sched.manager().stats()
    }
    pub fn counters(&self) -> SchedulerCounters {
        self.sched.counters()
    }
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            infer_time: self.runner.infer_time,
            ..self.stats
        }
    }
    pub fn num_waiting(&self) -> usize {
        self.sched.num_waiting()
    }
    pub fn num_running(&self) -> usize {
        self.sched.num_running()
    }
    /// No request waiting or running.
    pub fn is_idle(&self) -> bool {
        self.requests.is_empty()
    }

    /// Queues request `id` (not in use). Refuses it alone (nothing else changes) when the prompt
    /// is empty or does not fit the model's context or the whole KV cache, or the parameters are
    /// out of range. `max_new_tokens` is cut to what the context leaves.
    pub fn add_request(
        &mut self,
        id: RequestId,
        prompt: Vec<u32>,
        params: GenerationParams,
    ) -> Result<()> {
        let refuse = |e: RequestError| Err(EngineError::Request(e));
        let mut params = params;
        if self.requests.contains_key(&id) {
            return refuse(RequestError::prompt(format!("request {id} is in use")));
        }
        if prompt.is_empty() {
            return refuse(RequestError::prompt("the prompt is empty (no tokens)"));
        }
        params.validate().map_err(EngineError::Request)?;
        if let Some(ctx) = self.context {
            if prompt.len() >= ctx {
                return refuse(RequestError::prompt(format!(
                    "the prompt has {} tokens; the model's context is {ctx} (prompt and generated tokens)",
                    prompt.len()
                )));
            }
            params.max_new_tokens = params.max_new_tokens.min(ctx - prompt.len());
        }
        let vocab = self.tokenizer.vocab_size();
        if vocab > 0 {
            if let Some(bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
                return refuse(RequestError::prompt(format!(
                    "token id {bad} is outside the vocabulary of {vocab}"
                )));
            }
            if let Some((bad, _)) = params
                .penalties
                .logit_bias
                .iter()
                .find(|&&(t, _)| t as usize >= vocab)
            {
                return refuse(RequestError::param(
                    "logit_bias",
                    format!("token id {bad} is outside the vocabulary of {vocab}"),
                ));
            }
        }
        let prompt_tokens = if params.penalties.uses_prompt() {
            let mut p = prompt.clone();
            p.sort_unstable();
            p.dedup();
            p
        } else {
            Vec::new()
        };
        let seq = self.next_seq;
        let prompt_len = prompt.len();
        self.sched
            .add_request(Request {
                id: seq,
                prompt,
                max_new_tokens: params.max_new_tokens,
                priority: 0,
            })
            .map_err(|e| EngineError::Request(RequestError::prompt(e.to_string())))?;
        self.next_seq += 1;
        let seed = params.seed.unwrap_or_else(fresh_seed);
        let stop_ids = match (&params.stop_token_ids, params.ignore_eos) {
            (Some(ids), _) => ids.clone(),
            (None, true) => Vec::new(),
            (None, false) => self.eos.clone(),
        };
        // Output 0 is the scheduled sequence; the others get their sequence ids when forked.
        let outputs = (0..params.n)
            .map(|i| Output {
                seq: if i == 0 { seq } else { SeqId::MAX },
                rng: SplitMix64::new(seed.wrapping_add(i as u64)),
                text: OutputText::default(),
            })
            .collect();
        self.seqs.insert(seq, (id, 0));
        self.stats.prompt_tokens += prompt_len as u64;
        self.requests.insert(
            id,
            RequestState {
                params,
                stop_ids,
                prompt_tokens,
                outputs,
            },
        );
        Ok(())
    }

    /// Aborts a request (waiting or running): its blocks are freed at once; each of its unfinished
    /// outputs gets a `Finished` event with reason `abort`.
    pub fn abort(&mut self, request: RequestId) -> Result<Vec<Event>> {
        let Some(state) = self.requests.get(&request) else {
            return Err(EngineError::Request(RequestError::prompt(format!(
                "no request {request}"
            ))));
        };
        let live: Vec<SeqId> = state
            .outputs
            .iter()
            .filter(|o| !o.text.done && o.seq != SeqId::MAX)
            .map(|o| o.seq)
            .collect();
        for seq in live {
            self.sched.abort(seq)?;
        }
        let mut events = Vec::new();
        self.drain_finished(&mut events)?;
        // Outputs never forked (the prompt was still prefilling) end with the request.
        if let Some(state) = self.requests.get_mut(&request) {
            for (i, o) in state.outputs.iter_mut().enumerate() {
                if !o.text.done {
                    o.text.done = true;
                    events.push(Event::Finished {
                        request,
                        index: i,
                        reason: FinishReason::Abort,
                        token_ids: o.text.generated.clone(),
                        text: String::new(),
                    });
                }
            }
        }
        self.forget_if_done(request);
        Ok(events)
    }

    /// One step: schedule, run, sample, update. Returns its events (nothing when idle).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        if self.sched.is_idle() {
            return Ok(events);
        }
        let t0 = Instant::now();
        self.propose_drafts()?;
        let step = self.schedule()?;
        if let Err(e) = self.run(&step) {
            // The step's tokens were not computed: end its requests with the error rather than
            // leave the scheduler in flight.
            let _ = self.sched.complete_step(&[]);
            return Err(e);
        }
        let (accepted, forks) = self.sample(&step)?;
        self.update(&accepted, forks, &mut events)?;
        self.stats.step_time += t0.elapsed();
        Ok(events)
    }

    fn schedule(&mut self) -> Result<Step> {
        let step = self.sched.schedule()?;
        if step.seqs.is_empty() {
            self.sched.complete_step(&[])?;
            return Err(EngineError::Config(format!(
                "no request could be scheduled ({} waiting, {} running, {} free blocks)",
                self.sched.num_waiting(),
                self.sched.num_running(),
                self.sched.manager().available_blocks()
            )));
        }
        Ok(step)
    }

    fn run(&mut self, step: &Step) -> Result<()> {
        self.runner.execute(step)?;
        if let Some(scores) = self.runner.scores() {
            self.sched.accumulate_scores(step, scores)?;
        }
        Ok(())
    }

    /// Drafts for every decoding sequence (speculative decoding), sized by the batch.
    fn propose_drafts(&mut self) -> Result<()> {
        let Some(spec) = self.speculative else {
            return Ok(());
        };
        let decoding: Vec<SeqId> = self
            .seqs
            .keys()
            .copied()
            .filter(|&s| self.sched.is_decoding(s))
            .collect();
        let k = spec.draft_len(decoding.len());
        if k == 0 {
            return Ok(());
        }
        let mut draft = Vec::with_capacity(k);
        for seq in decoding {
            draft.clear();
            draft.extend_from_slice(speculative::propose(
                self.sched.tokens(seq)?,
                spec.max_ngram,
                k,
            ));
            if !draft.is_empty() {
                self.sched.set_draft(seq, &draft)?;
            }
        }
        Ok(())
    }

    /// The accepted tokens of each emitting sequence, in batch order: one sampled token, or
    /// with drafts the longest verified prefix of them plus the model's own next token (cut at
    /// a stop id and at `max_new_tokens`); and for an n > 1 request sampling its first token
    /// now, the first tokens of its other outputs (from the same logits row, each with its own
    /// seed): (parent sequence, output index, token).
    #[allow(clippy::type_complexity)]
    fn sample(
        &mut self,
        step: &Step,
    ) -> Result<(Vec<(SeqId, Vec<u32>)>, Vec<(SeqId, usize, u32)>)> {
        let (logits, ranges) = self.runner.logits(step)?;
        let mut accepted = Vec::with_capacity(ranges.len());
        let mut forks = Vec::new();
        for (i, (s, rows)) in step.seqs.iter().zip(ranges).enumerate() {
            if !s.emits {
                continue;
            }
            let Some(&(req, index)) = self.seqs.get(&s.id) else {
                return Err(EngineError::Config(format!(
                    "sequence {} has no request",
                    s.id
                )));
            };
            let state = self
                .requests
                .get_mut(&req)
                .ok_or_else(|| EngineError::Config(format!("request {req} is gone")))?;
            let sampling = state.params.sampling;
            let first = index == 0 && state.outputs[0].text.generated.is_empty();
            let end = step.subsequence_begins[i + 1] as usize;
            let drafts = &step.token_ids[end - s.draft_len..end];
            let room = state
                .params
                .max_new_tokens
                .saturating_sub(state.outputs[index].text.generated.len())
                .max(1);
            let mut toks = Vec::with_capacity(1 + s.draft_len);
            // The sampled rows end the sequence's rows (prompt rows may come before them).
            for (j, r) in (rows.end - 1 - s.draft_len..rows.end).enumerate() {
                let mut row = logits.row(r);
                if !state.params.penalties.is_neutral() {
                    self.so_far.clear();
                    self.so_far
                        .extend_from_slice(&state.outputs[index].text.generated);
                    self.so_far.extend_from_slice(&toks);
                    self.penalized.clear();
                    self.penalized.extend_from_slice(row);
                    state.params.penalties.apply(
                        &mut self.penalized,
                        &state.prompt_tokens,
                        &self.so_far,
                        &mut self.counts,
                    );
                    row = &self.penalized;
                }
                let rng = &mut state.outputs[index].rng;
                let (token, agreed) = match drafts.get(j) {
                    Some(&d) => match verify_draft(row, &sampling, d, rng, &mut self.scratch) {
                        None => (d, true),
                        Some(t) => (t, false),
                    },
                    None => (sample(row, &sampling, rng, &mut self.scratch), false),
                };
                toks.push(token);
                if first {
                    for (i, o) in state.outputs.iter_mut().enumerate().skip(1) {
                        forks.push((
                            s.id,
                            i,
                            sample(row, &sampling, &mut o.rng, &mut self.scratch),
                        ));
                    }
                }
                if !agreed || toks.len() >= room || state.stop_ids.contains(&token) {
                    break;
                }
            }
            self.stats.draft_tokens += s.draft_len as u64;
            self.stats.accepted_draft_tokens += (toks.len() - 1) as u64;
            accepted.push((s.id, toks));
        }
        Ok((accepted, forks))
    }

    fn update(
        &mut self,
        accepted: &[(SeqId, Vec<u32>)],
        forks: Vec<(SeqId, usize, u32)>,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let refs: Vec<(SeqId, &[u32])> = accepted.iter().map(|(s, t)| (*s, &t[..])).collect();
        self.sched.complete_step_accepted(&refs)?;
        self.stats.steps += 1;
        // Forks of n > 1 requests at their first token, before their parent can end.
        for (parent, child_index, token) in forks {
            self.fork(parent, child_index, token, events)?;
        }
        for (seq, toks) in accepted {
            for &token in toks {
                self.accept(*seq, token, events)?;
            }
        }
        self.drain_finished(events)
    }

    fn fork(
        &mut self,
        parent: SeqId,
        index: usize,
        token: u32,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let (req, _) = self.seqs[&parent];
        let max_new = self.requests[&req].params.max_new_tokens;
        let child = self.next_seq;
        self.next_seq += 1;
        if let Some(state) = self.requests.get_mut(&req) {
            state.outputs[index].seq = child;
        }
        self.seqs.insert(child, (req, index));
        if max_new > 1 {
            self.sched.fork(parent, child, token, max_new)?;
        }
        self.accept(child, token, events)?;
        if max_new == 1 {
            self.end_output(req, index, FinishReason::Length, events)?;
        }
        Ok(())
    }

    /// Records a sampled token with the output processor; ends the output at a stop.
    fn accept(&mut self, seq: SeqId, token: u32, events: &mut Vec<Event>) -> Result<()> {
        let (req, index) = self.seqs[&seq];
        let Some(state) = self.requests.get_mut(&req) else {
            return Ok(());
        };
        let o = &mut state.outputs[index].text;
        if o.done {
            return Ok(());
        }
        let is_stop_id = state.stop_ids.contains(&token);
        let a = o.accept(&self.tokenizer, token, is_stop_id, &state.params.stop)?;
        self.stats.generated_tokens += 1;
        events.push(Event::Token {
            request: req,
            index,
            token,
            text: a.text,
        });
        if a.stop {
            if self.sched.tokens(seq).is_ok() {
                self.sched.finish(seq)?;
            } else {
                self.end_output(req, index, FinishReason::Stop, events)?;
            }
        }
        Ok(())
    }

    /// Turns the scheduler's finished sequences into `Finished` events.
    fn drain_finished(&mut self, events: &mut Vec<Event>) -> Result<()> {
        for (seq, reason) in self.sched.take_finished() {
            if let Some(&(req, index)) = self.seqs.get(&seq) {
                self.end_output(req, index, reason, events)?;
            }
        }
        Ok(())
    }

    fn end_output(
        &mut self,
        req: RequestId,
        index: usize,
        reason: FinishReason,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let Some(state) = self.requests.get_mut(&req) else {
            return Ok(());
        };
        let o = &mut state.outputs[index];
        if o.text.done {
            return Ok(());
        }
        o.text.finish(&self.tokenizer, req, index, reason, events)?;
        self.seqs.remove(&o.seq);
        self.forget_if_done(req);
        Ok(())
    }

    fn forget_if_done(&mut self, req: RequestId) {
        if self
            .requests
            .get(&req)
            .is_some_and(|s| s.outputs.iter().all(|o| o.text.done))
        {
            if let Some(state) = self.requests.remove(&req) {
                for o in state.outputs {
                    self.seqs.remove(&o.seq);
                }
            }
        }
    }

    /// Runs every request to its end, handing each event to `on_event`.
    pub fn run_to_completion(&mut self, mut on_event: impl FnMut(&Event)) -> Result<()> {
        while !self.is_idle() {
            for e in self.step()? {
                on_event(&e);
            }
        }
        Ok(())
    }
}

fn fresh_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    h.finish()
}
