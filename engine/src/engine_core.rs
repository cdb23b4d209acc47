//! The engine core: requests in, events out, one [`EngineCore::step`] at a time. A step is
//! schedule (the project's continuous-batching scheduler and block manager: chunked prefill
//! under a token budget, decodes, preemption when blocks run out, prefix-cache hits), run (the
//! model runner), sample (one token per sequence that reached its end), update (the scheduler,
//! forks of n > 1 requests, and the output processor, which ends outputs on an end-of-sequence
//! id, a stop string or `max_new_tokens`). A request with `n` > 1 prefills once; its other
//! outputs are forks of the first (sharing its blocks, copy-on-write) from its first token on.
//!
//! With speculative decoding, each decoding sequence first proposes draft tokens (prompt
//! lookup, `speculative`, or a draft model, `draft_model`), the step verifies them with its other work, and the update applies
//! the accepted tokens one at a time through the same path as a sampled token.
//!
//! The core knows no threads, channels or HTTP: an engine client drives it.

use crate::config::EngineConfig;
use crate::draft_model::DraftModel;
use crate::error::{EngineError, Result};
use crate::kv_cache::KvCachePlan;
use crate::model_dir::ModelDir;
use crate::model_runner::ModelRunner;
use crate::output_processor::OutputText;
use crate::request::{Event, GenerationParams, RequestError, RequestId};
use crate::sampling::{logprobs, sample, verify_draft, TokenLogprobs};
use crate::speculative::{self, Acceptance, DraftLength, SpeculativeConfig, SpeculativeMethod};
use crate::structured::{Grammars, TokenMatcher};
use crate::tokenizer::TextTokenizer;
use paged_attention::cache::{
    CacheEvent, CacheStats, FinishReason, Request, Scheduler, SchedulerConfig, SchedulerCounters,
    SeqId, SplitMix64, Step,
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
    /// Computing structured output's token masks (on the thread beside `infer()`, or inline).
    pub mask_time: Duration,
    /// What masks cost the step itself: waiting for them after `infer()`, and applying them.
    pub mask_critical_time: Duration,
    /// Speculative decoding: draft tokens verified, and those accepted.
    pub draft_tokens: u64,
    pub accepted_draft_tokens: u64,
    /// In the draft model's `infer()` (`--speculative draft`).
    pub draft_infer_time: Duration,
}

/// One output of a request.
struct Output {
    seq: SeqId,
    rng: SplitMix64,
    text: OutputText,
    /// Its place in the request's constraint (structured output).
    matcher: Option<TokenMatcher>,
    /// The class of its draft being verified (`speculative::class_of`).
    draft_class: usize,
}

/// A token sampled for a sequence in a step.
struct Sampled {
    seq: SeqId,
    /// Its accepted tokens (one, or more with drafts), each with its log-probabilities.
    tokens: Vec<(u32, Option<TokenLogprobs>)>,
}

/// The first token of output `index` (> 0) of an n > 1 request, forked from `parent`'s row.
struct Fork {
    parent: SeqId,
    index: usize,
    token: u32,
    logprobs: Option<TokenLogprobs>,
}

struct RequestState {
    params: GenerationParams,
    stop_ids: Vec<u32>,
    /// The prompt's distinct tokens, sorted, when a penalty counts them (else empty).
    prompt_tokens: Vec<u32>,
    /// The prompt, when its tokens' logprobs are asked for (else empty), and theirs so far
    /// (`prompt_logprobs[i]` is token `i + 1`'s).
    prompt: Vec<u32>,
    prompt_logprobs: Vec<TokenLogprobs>,
    outputs: Vec<Output>,
}

pub struct EngineCore {
    tokenizer: Arc<TextTokenizer>,
    eos: Vec<u32>,
    context: Option<usize>,
    runner: ModelRunner,
    kv_plan: KvCachePlan,
    cache_type: ElemType,
    sched: Scheduler,
    requests: HashMap<RequestId, RequestState>,
    /// Scheduler sequence -> (request, output index).
    seqs: HashMap<SeqId, (RequestId, usize)>,
    next_seq: SeqId,
    scratch: Vec<(f32, u32)>,
    lp_scratch: Vec<(f32, u32)>,
    /// The `PromptLogprobs` events of the step being sampled.
    prompt_events: Vec<Event>,
    /// A logits row with the penalties applied, and the token counts they use.
    penalized: Vec<f32>,
    counts: Vec<(u32, u32)>,
    /// Structured output's compiler, built at the first constrained request (`Err`: it cannot
    /// be built for this tokenizer, and why).
    grammars: Option<std::result::Result<Grammars, String>>,
    /// An output's tokens so far plus those accepted in this step (for the penalties).
    so_far: Vec<u32>,
    speculative: Option<SpeculativeConfig>,
    /// Verified drafts' acceptance, which sizes the next drafts (with `speculative`).
    acceptance: Option<Acceptance>,
    /// The draft model (`SpeculativeMethod::Draft`).
    draft: Option<DraftModel>,
    stats: EngineStats,
    /// Fail the next run (see [`EngineCore::fail_next_run`]).
    fail_next_run: bool,
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
        let draft_dir = match &cfg.speculative {
            Some(s) => match (s.method, &s.draft_model) {
                (SpeculativeMethod::Draft, Some(d)) => Some(d.clone()),
                (SpeculativeMethod::Draft, None) => {
                    return Err(EngineError::Config(
                        "speculative decoding with a draft model needs its directory".into(),
                    ))
                }
                (m, Some(_)) => {
                    return Err(EngineError::Config(format!(
                        "a draft model is for `--speculative draft`, not `{}`",
                        m.as_str()
                    )))
                }
                (_, None) => None,
            },
            None => None,
        };
        // The draft's vocabulary is checked before either model is compiled.
        let draft_md = draft_dir.as_deref().map(ModelDir::open).transpose()?;
        if let Some(d) = &draft_md {
            crate::draft_model::check_compatible(&md, d)?;
        }
        // A draft-model call's cost relative to a target's step: their weights' sizes.
        let draft_cost = draft_md
            .as_ref()
            .map_or(0.0, |d| crate::draft_model::relative_cost(&md, d));
        let target = ModelRunner::compile(&md, cfg)?;
        let draft = draft_md
            .map(|d| ModelRunner::compile(&d, cfg))
            .transpose()?;
        // Sized once both models are compiled, so that `auto` sees the memory they left; the
        // draft's cache has as many blocks as the target's, and under `auto` both fit the share.
        let mut kv_plan = KvCachePlan::choose(
            cfg.kv_cache,
            target.block_bytes,
            cfg.block_size,
            md.config
                .max_position_embeddings
                .map(|c| c.saturating_mul(cfg.max_seqs)),
        )?;
        if let Some(d) = &draft {
            kv_plan = kv_plan.with_draft(d.block_bytes)?;
        }
        let runner = target.allocate(kv_plan.num_blocks)?;
        let draft = draft
            .map(|d| DraftModel::new(d.allocate(kv_plan.num_blocks)?, cfg, kv_plan.num_blocks))
            .transpose()?;
        let mut sched = Scheduler::new(SchedulerConfig {
            num_blocks: kv_plan.num_blocks,
            block_size: cfg.block_size,
            prefix_caching: cfg.prefix_caching,
            max_batched_tokens: cfg.max_batched_tokens,
            max_seqs: cfg.max_seqs,
            eviction: cfg.eviction,
        })?;
        sched.record_cache_events(cfg.kv_events.is_some());
        Ok(EngineCore {
            eos: md.eos_token_ids(),
            context: md.config.max_position_embeddings,
            tokenizer: md.tokenizer,
            runner,
            kv_plan,
            cache_type: cfg.cache_type,
            sched,
            requests: HashMap::new(),
            seqs: HashMap::new(),
            next_seq: 0,
            scratch: Vec::new(),
            lp_scratch: Vec::new(),
            prompt_events: Vec::new(),
            penalized: Vec::new(),
            counts: Vec::new(),
            grammars: None,
            so_far: Vec::new(),
            speculative: cfg.speculative.clone(),
            acceptance: cfg
                .speculative
                .as_ref()
                .map(|s| Acceptance::new(s.num_tokens, draft_cost)),
            draft,
            stats: EngineStats::default(),
            fail_next_run: false,
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
    pub fn prefix_caching(&self) -> bool {
        self.sched.config().prefix_caching
    }
    /// The KV cache's size and how it was chosen.
    pub fn kv_cache_plan(&self) -> &KvCachePlan {
        &self.kv_plan
    }
    pub fn cache_type(&self) -> ElemType {
        self.cache_type
    }
    pub fn cache_stats(&self) -> CacheStats {
        self.sched.manager().stats()
    }
    /// The draft model's block manager (`--speculative draft`).
    pub fn draft_cache_stats(&self) -> Option<CacheStats> {
        self.draft.as_ref().map(DraftModel::cache_stats)
    }
    pub fn counters(&self) -> SchedulerCounters {
        self.sched.counters()
    }
    pub fn stats(&self) -> EngineStats {
        EngineStats {
            infer_time: self.runner.infer_time,
            draft_infer_time: self
                .draft
                .as_ref()
                .map_or(Duration::ZERO, DraftModel::infer_time),
            ..self.stats
        }
    }
    /// The prefix cache's changes since the last call (recorded when `kv_events` is set).
    pub fn take_cache_events(&mut self) -> Vec<CacheEvent> {
        self.sched.take_cache_events()
    }
    /// Hashes of the blocks a prompt can reuse now, ascending.
    pub fn cached_block_hashes(&self) -> Vec<u64> {
        self.sched.manager().cached_hashes()
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
        // One matcher per output, each at the start of the constraint.
        let mut matchers = Vec::new();
        if let Some(c) = &params.constraint {
            let grammars = self
                .grammars
                .get_or_insert_with(|| Grammars::new(self.tokenizer.clone(), &self.eos));
            let g = match grammars {
                Ok(g) => g,
                Err(e) => {
                    return refuse(RequestError::param(
                        c.param(),
                        format!("structured output is not available for this model: {e}"),
                    ))
                }
            };
            for _ in 0..params.n {
                matchers.push(g.compile(c).map_err(EngineError::Request)?);
            }
        }
        let mut matchers = matchers.into_iter();
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
        let kept_prompt = if params.prompt_logprobs.is_some() {
            prompt.clone()
        } else {
            Vec::new()
        };
        self.sched
            .add_request(Request {
                id: seq,
                prompt,
                max_new_tokens: params.max_new_tokens,
                priority: 0,
            })
            .map_err(|e| EngineError::Request(RequestError::prompt(e.to_string())))?;
        if params.prompt_logprobs.is_some() {
            // Every prompt position gets its logits row (and the prefix cache is skipped).
            self.sched.set_prompt_logits(seq, true)?;
        }
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
                matcher: matchers.next(),
                draft_class: 0,
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
                prompt: kept_prompt,
                prompt_logprobs: Vec::new(),
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
        let ran = if std::mem::take(&mut self.fail_next_run) {
            Err(EngineError::OpenVino(
                "a run failed on purpose (test)".into(),
            ))
        } else {
            self.run_with_masks(&step)
        };
        let (sampled, forks) = match ran.and_then(|()| self.sample(&step)) {
            Ok(s) => s,
            Err(e) => return Err(self.fail_step(&e)),
        };
        self.update(sampled, forks, &mut events)?;
        self.stats.step_time += t0.elapsed();
        Ok(events)
    }

    /// Ends the requests of a step whose run (or sampling) failed with `e`: none of its tokens
    /// was computed, so the scheduler drops the step and frees their blocks, and their other
    /// outputs end too. Returns the error naming them; the other requests go on.
    fn fail_step(&mut self, e: &EngineError) -> EngineError {
        let seqs = match self.sched.fail_step() {
            Ok(seqs) => seqs,
            Err(f) => return f.into(),
        };
        self.prompt_events.clear();
        let mut requests: Vec<RequestId> = seqs
            .iter()
            .filter_map(|s| self.seqs.get(s).map(|&(r, _)| r))
            .collect();
        requests.sort_unstable();
        requests.dedup();
        for req in &requests {
            let Some(state) = self.requests.remove(req) else {
                continue;
            };
            for o in state.outputs {
                let live = !o.text.done && !seqs.contains(&o.seq);
                if live && self.sched.tokens(o.seq).is_ok() {
                    if let Err(f) = self.sched.abort(o.seq) {
                        return f.into();
                    }
                }
                self.seqs.remove(&o.seq);
            }
        }
        // Their aborted outputs' reports: the requests are gone, nothing to tell.
        let _ = self.sched.take_finished();
        if let Some(d) = self.draft.as_mut() {
            if let Err(f) = d.forget_ended(&self.sched) {
                return f;
            }
        }
        EngineError::StepFailed {
            requests,
            message: e.to_string(),
        }
    }

    /// Makes the next step's model run fail, as a failing `infer()` would (a test seam).
    #[doc(hidden)]
    pub fn fail_next_run(&mut self) {
        self.fail_next_run = true;
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

    fn run(runner: &mut ModelRunner, sched: &mut Scheduler, step: &Step) -> Result<()> {
        runner.execute(step)?;
        if let Some(scores) = runner.scores() {
            sched.accumulate_scores(step, scores)?;
        }
        Ok(())
    }

    /// Runs the step; the token masks of its constrained sequences are computed meanwhile, on a
    /// thread of their own (they depend on the tokens so far and the step's drafts only, not on
    /// its logits): one mask per row the step verifies.
    fn run_with_masks(&mut self, step: &Step) -> Result<()> {
        let constrained = self
            .requests
            .values()
            .any(|r| r.params.constraint.is_some());
        if !constrained {
            return Self::run(&mut self.runner, &mut self.sched, step);
        }
        // Each emitting sequence's drafts: the trailing tokens of its chunk.
        let drafts: HashMap<SeqId, &[u32]> = step
            .seqs
            .iter()
            .enumerate()
            .filter(|(_, s)| s.emits)
            .map(|(i, s)| {
                let end = step.subsequence_begins[i + 1] as usize;
                (s.id, &step.token_ids[end - s.draft_len..end])
            })
            .collect();
        let matchers: Vec<(&mut TokenMatcher, &[u32])> = self
            .requests
            .values_mut()
            .flat_map(|r| r.outputs.iter_mut())
            .filter(|o| !o.text.done)
            .filter_map(|o| Some((o.matcher.as_mut()?, *drafts.get(&o.seq)?)))
            .collect();
        if matchers.is_empty() {
            return Self::run(&mut self.runner, &mut self.sched, step);
        }
        let (runner, sched) = (&mut self.runner, &mut self.sched);
        let (ran, waited) = std::thread::scope(|scope| {
            let masks = scope.spawn(move || {
                for (m, d) in matchers {
                    m.prepare(d);
                }
            });
            let ran = Self::run(runner, sched, step);
            let t = Instant::now();
            // A mask that failed there is found missing when sampling (the output ends).
            let _ = masks.join();
            (ran, t.elapsed())
        });
        self.stats.mask_critical_time += waited;
        ran
    }

    /// Drafts for every decoding sequence (speculative decoding), each as long as its expected
    /// acceptance pays for at this batch (`speculative::Acceptance::allocate`). A constrained
    /// output's drafts are cut to the prefix its constraint allows.
    fn propose_drafts(&mut self) -> Result<()> {
        let (Some(spec), Some(acceptance)) = (&self.speculative, self.acceptance.as_mut()) else {
            return Ok(());
        };
        let mut decoding: Vec<(SeqId, RequestId, usize)> = self
            .seqs
            .iter()
            .filter(|(&s, _)| self.sched.is_decoding(s))
            .map(|(&s, &(r, i))| (s, r, i))
            .collect();
        // In a fixed order: which sequences draft must not vary by run.
        decoding.sort_unstable();
        // No more drafts than the output has room for after the target's own token.
        let room: Vec<(SeqId, usize)> = decoding
            .iter()
            .filter_map(|&(s, r, i)| {
                let st = self.requests.get(&r)?;
                let done = st.outputs.get(i)?.text.generated.len();
                let left = st.params.max_new_tokens.saturating_sub(done + 1);
                Some((s, spec.num_tokens.min(left))).filter(|w| w.1 > 0)
            })
            .collect();
        // Prompt lookup proposes first (a proposal's class is how far its match agrees); a
        // draft model drafts once the lengths are known (one class).
        let looked: Vec<(Vec<u32>, usize)> = match self.draft {
            None => room
                .iter()
                .map(|&(s, n)| {
                    let (d, context) =
                        speculative::propose(self.sched.tokens(s)?, spec.max_ngram, n);
                    Ok((d, speculative::class_of(context)))
                })
                .collect::<Result<_>>()?,
            Some(_) => room.iter().map(|_| (Vec::new(), 0)).collect(),
        };
        let proposals: Vec<(usize, usize)> = looked
            .iter()
            .zip(&room)
            .map(|((d, c), &(_, n))| (*c, if self.draft.is_some() { n } else { d.len() }))
            .collect();
        let lens = match spec.draft_length {
            DraftLength::Adaptive => acceptance.allocate(&proposals, decoding.len(), spec.max_rows),
            DraftLength::Fixed => {
                let most = spec.fixed_len(decoding.len());
                proposals.iter().map(|p| p.1.min(most)).collect()
            }
        };
        let drafts: Vec<(SeqId, Vec<u32>, usize)> = match self.draft.as_mut() {
            None => room
                .iter()
                .zip(looked)
                .zip(&lens)
                .map(|((&(s, _), (mut d, c)), &n)| {
                    d.truncate(n);
                    (s, d, c)
                })
                .collect(),
            Some(model) => {
                let wanted: Vec<(SeqId, usize)> = room
                    .iter()
                    .zip(&lens)
                    .filter(|(_, &n)| n > 0)
                    .map(|(&(s, _), &n)| (s, n))
                    .collect();
                if wanted.is_empty() {
                    Vec::new()
                } else {
                    let made = model.propose(&self.sched, &wanted)?;
                    made.into_iter().map(|(s, d)| (s, d, 0)).collect()
                }
            }
        };
        for (seq, mut draft, class) in drafts {
            if draft.is_empty() {
                continue;
            }
            let Some(output) = self
                .seqs
                .get(&seq)
                .and_then(|&(req, index)| self.requests.get_mut(&req)?.outputs.get_mut(index))
            else {
                continue;
            };
            if let Some(m) = output.matcher.as_mut() {
                let valid = m.valid_drafts(&draft);
                draft.truncate(valid);
            }
            output.draft_class = class;
            if !draft.is_empty() {
                self.sched.set_draft(seq, &draft)?;
            }
        }
        Ok(())
    }

    /// The accepted tokens of each emitting sequence, in batch order: one sampled token, or
    /// with drafts the longest verified prefix of them plus the model's own next token (cut at
    /// a stop id and at `max_new_tokens`), each with its log-probabilities (of the row before
    /// any penalty) when its request asks for them; and for an n > 1 request sampling its first
    /// token now, the first tokens of its other outputs (from the same logits row, each with its
    /// own seed).
    fn sample(&mut self, step: &Step) -> Result<(Vec<Sampled>, Vec<Fork>)> {
        let (logits, ranges) = self.runner.logits(step)?;
        let mut sampled = Vec::with_capacity(ranges.len());
        let mut forks = Vec::new();
        for (i, (s, rows)) in step.seqs.iter().zip(ranges).enumerate() {
            if !s.emits && rows.is_empty() {
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
            let first = index == 0 && state.outputs[0].text.generated.is_empty();
            if let (Some(n), true) = (state.params.prompt_logprobs, first) {
                // Rows at prompt positions: row j follows position `from + j` and predicts the
                // prompt token after it (each position's row comes once).
                let from = s.past_len + s.num_tokens - rows.len();
                for (j, r) in rows.clone().enumerate() {
                    let next = from + j + 1;
                    if next < state.prompt.len() && next == state.prompt_logprobs.len() + 1 {
                        let lp =
                            logprobs(logits.row(r), state.prompt[next], n, &mut self.lp_scratch);
                        state.prompt_logprobs.push(lp);
                    }
                }
                if s.emits {
                    self.prompt_events.push(Event::PromptLogprobs {
                        request: req,
                        first: state.prompt[0],
                        logprobs: std::mem::take(&mut state.prompt_logprobs),
                    });
                }
            }
            if !s.emits {
                continue;
            }
            let sampling = state.params.sampling;
            let top_n = state.params.logprobs;
            let end = step.subsequence_begins[i + 1] as usize;
            let drafts = &step.token_ids[end - s.draft_len..end];
            let room = state
                .params
                .max_new_tokens
                .saturating_sub(state.outputs[index].text.generated.len())
                .max(1);
            let mut toks: Vec<(u32, Option<TokenLogprobs>)> = Vec::with_capacity(1 + s.draft_len);
            // Whether the last row verified agreed with its draft.
            let mut last_agreed = false;
            // The sampled rows end the sequence's rows (prompt rows may come before them).
            for (j, r) in (rows.end - 1 - s.draft_len..rows.end).enumerate() {
                let raw = logits.row(r);
                let mut row = raw;
                let constrained = state.outputs[index].matcher.is_some();
                let modified = !state.params.penalties.is_neutral() || constrained;
                if modified {
                    self.so_far.clear();
                    self.so_far
                        .extend_from_slice(&state.outputs[index].text.generated);
                    self.so_far.extend(toks.iter().map(|t| t.0));
                    self.penalized.clear();
                    self.penalized.extend_from_slice(raw);
                    state.params.penalties.apply(
                        &mut self.penalized,
                        &state.prompt_tokens,
                        &self.so_far,
                        &mut self.counts,
                    );
                }
                // Structured output: only the tokens its constraint allows after the drafts
                // before this row (forks of an n > 1 request take their first token from this
                // row: every output starts at the same place, without drafts). None allowed
                // (the library failed): the output ends at a stop id.
                let mut forced = None;
                if let Some(m) = state.outputs[index].matcher.as_mut() {
                    let t = Instant::now();
                    if !m.apply(j, &mut self.penalized) {
                        forced = Some(state.stop_ids.first().copied().unwrap_or(0));
                    }
                    self.stats.mask_critical_time += t.elapsed();
                    self.stats.mask_time += m.take_mask_time();
                }
                if modified {
                    row = &self.penalized;
                }
                let rng = &mut state.outputs[index].rng;
                let (token, agreed) = match (forced, drafts.get(j)) {
                    (Some(t), _) => (t, false),
                    (None, Some(&d)) => {
                        match verify_draft(row, &sampling, d, rng, &mut self.scratch) {
                            None => (d, true),
                            Some(t) => (t, false),
                        }
                    }
                    (None, None) => (sample(row, &sampling, rng, &mut self.scratch), false),
                };
                toks.push((
                    token,
                    top_n.map(|n| logprobs(raw, token, n, &mut self.lp_scratch)),
                ));
                if first {
                    for (i, o) in state.outputs.iter_mut().enumerate().skip(1) {
                        let token = sample(row, &sampling, &mut o.rng, &mut self.scratch);
                        forks.push(Fork {
                            parent: s.id,
                            index: i,
                            token,
                            logprobs: top_n.map(|n| logprobs(raw, token, n, &mut self.lp_scratch)),
                        });
                    }
                }
                // An accepted draft that completes the constraint ends the output, as the
                // same token sampled would.
                let complete = state.outputs[index]
                    .matcher
                    .as_ref()
                    .is_some_and(|m| m.done_after(j + 1));
                last_agreed = agreed;
                if !agreed || toks.len() >= room || state.stop_ids.contains(&token) || complete {
                    break;
                }
            }
            let accepted = toks.len() - 1;
            if let (Some(a), true) = (self.acceptance.as_mut(), s.draft_len > 0) {
                let class = state.outputs[index].draft_class;
                a.record(class, s.draft_len, accepted, !last_agreed);
            }
            self.stats.draft_tokens += s.draft_len as u64;
            self.stats.accepted_draft_tokens += accepted as u64;
            sampled.push(Sampled {
                seq: s.id,
                tokens: toks,
            });
        }
        Ok((sampled, forks))
    }

    fn update(
        &mut self,
        sampled: Vec<Sampled>,
        forks: Vec<Fork>,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        // A request's prompt logprobs come before its first token.
        events.append(&mut self.prompt_events);
        let ids: Vec<(SeqId, Vec<u32>)> = sampled
            .iter()
            .map(|s| (s.seq, s.tokens.iter().map(|t| t.0).collect()))
            .collect();
        let refs: Vec<(SeqId, &[u32])> = ids.iter().map(|(s, t)| (*s, &t[..])).collect();
        self.sched.complete_step_accepted(&refs)?;
        self.stats.steps += 1;
        // Forks of n > 1 requests at their first token, before their parent can end.
        for f in forks {
            self.fork(f, events)?;
        }
        for s in sampled {
            for (token, lp) in s.tokens {
                self.accept(s.seq, token, lp, events)?;
            }
        }
        self.drain_finished(events)
    }

    fn fork(&mut self, f: Fork, events: &mut Vec<Event>) -> Result<()> {
        let Fork {
            parent,
            index,
            token,
            logprobs,
        } = f;
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
        self.accept(child, token, logprobs, events)?;
        if max_new == 1 {
            self.end_output(req, index, FinishReason::Length, events)?;
        }
        Ok(())
    }

    /// Records a sampled token with the output processor; ends the output at a stop.
    fn accept(
        &mut self,
        seq: SeqId,
        token: u32,
        logprobs: Option<TokenLogprobs>,
        events: &mut Vec<Event>,
    ) -> Result<()> {
        let (req, index) = self.seqs[&seq];
        let Some(state) = self.requests.get_mut(&req) else {
            return Ok(());
        };
        let out = &mut state.outputs[index];
        if out.text.done {
            return Ok(());
        }
        let is_stop_id = state.stop_ids.contains(&token);
        // A constraint that is complete (nothing more may follow) ends the output.
        let complete = out.matcher.as_mut().is_some_and(|m| m.consume(token));
        let a = out
            .text
            .accept(&self.tokenizer, token, is_stop_id, &state.params.stop)?;
        self.stats.generated_tokens += 1;
        events.push(Event::Token {
            request: req,
            index,
            token,
            text: a.text,
            logprobs,
        });
        if a.stop || complete {
            if self.sched.tokens(seq).is_ok() {
                self.sched.finish(seq)?;
            } else {
                self.end_output(req, index, FinishReason::Stop, events)?;
            }
        }
        Ok(())
    }

    /// Turns the scheduler's finished sequences into `Finished` events (and frees their draft
    /// caches).
    fn drain_finished(&mut self, events: &mut Vec<Event>) -> Result<()> {
        for (seq, reason) in self.sched.take_finished() {
            if let Some(&(req, index)) = self.seqs.get(&seq) {
                self.end_output(req, index, reason, events)?;
            }
        }
        if let Some(d) = self.draft.as_mut() {
            d.forget_ended(&self.sched)?;
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
