//! The engine: a paged model compiled on our op, its KV caches, and the continuous-batching
//! scheduler and block manager of `paged_attention::cache` driving it step by step.
//!
//! One [`Engine::step`] is one scheduler step and one `infer()`: the scheduler picks the chunk of
//! every running sequence (chunked prefill under a token budget, decodes, preemption when blocks
//! run out, prefix-cache hits), the engine performs the step's block copies on every layer's
//! caches, binds the step's inputs as OpenVINO tensors over its own memory, runs the model, samples
//! one token per sequence that reached its end, and ends sequences on an end-of-sequence id, a stop
//! string or `max_new_tokens`. A request with `n` > 1 prefills once; its other outputs are forks
//! of the first (sharing its blocks, copy-on-write) from its first token on.

use crate::error::{EngineError, Result};
use crate::model_dir::ModelDir;
use crate::ov::{ConvertOptions, Property, Session};
use crate::sampling::{sample, Sampling};
use crate::tokenizer::{ChatMessage, StreamDecoder, TextTokenizer};
use paged_attention::cache::{
    copy_blocks_kv, rotation_lut, CacheStats, EvictionPolicy, FinishReason, Request,
    RotationDirection, Scheduler, SchedulerConfig, SchedulerCounters, SeqId, SplitMix64, Step,
};
use paged_attention::ElemType;
use std::collections::HashMap;
use std::path::Path;
use std::str::FromStr;
use std::time::{Duration, Instant};

/// Element type of the KV caches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheType {
    F32,
    F16,
    Bf16,
    /// OpenVINO's u8 layout (per-block key and per-token value scale and zero point).
    U8,
    /// OpenVINO's u4 layout: u8's with every quantized value a nibble, two per byte.
    U4,
}

impl CacheType {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheType::F32 => "f32",
            CacheType::F16 => "f16",
            CacheType::Bf16 => "bf16",
            CacheType::U8 => "u8",
            CacheType::U4 => "u4",
        }
    }
    /// The op's element type of the cache buffers, which sizes them.
    pub fn elem(self) -> ElemType {
        match self {
            CacheType::F32 => ElemType::F32,
            CacheType::F16 => ElemType::F16,
            CacheType::Bf16 => ElemType::BF16,
            CacheType::U8 => ElemType::U8,
            CacheType::U4 => ElemType::U4,
        }
    }
}

impl FromStr for CacheType {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<CacheType, String> {
        match s {
            "f32" => Ok(CacheType::F32),
            "f16" => Ok(CacheType::F16),
            "bf16" => Ok(CacheType::Bf16),
            "u8" => Ok(CacheType::U8),
            "u4" => Ok(CacheType::U4),
            _ => Err(format!(
                "unknown cache type `{s}` (f32, f16, bf16, u8 or u4)"
            )),
        }
    }
}

/// OpenVINO's inference precision hint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl FromStr for Precision {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Precision, String> {
        match s {
            "f32" => Ok(Precision::F32),
            "bf16" => Ok(Precision::Bf16),
            "f16" => Ok(Precision::F16),
            _ => Err(format!("unknown precision `{s}` (f32, bf16 or f16)")),
        }
    }
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::Bf16 => "bf16",
            Precision::F16 => "f16",
        }
    }
}

/// How the engine is set up.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub cache_type: CacheType,
    /// Bytes of KV cache over all layers (keys and values); the block count follows.
    pub kv_cache_bytes: usize,
    pub block_size: usize,
    /// Token rows per step (a long prompt is prefilled in chunks of at most this many).
    pub max_batched_tokens: usize,
    /// Sequences per step.
    pub max_seqs: usize,
    pub prefix_caching: bool,
    /// OpenVINO's `INFERENCE_PRECISION_HINT`; `None`: OpenVINO's default for the CPU.
    pub precision: Option<Precision>,
    /// OpenVINO's `INFERENCE_NUM_THREADS`; `None`: all cores.
    pub threads: Option<usize>,
    pub device: String,
    /// Score-driven cache eviction: a sequence holding more than `budget` blocks drops its
    /// lowest-scored middle blocks (the op's attention scores, summed over layers and steps),
    /// keeping `start` leading and `recent` trailing ones; kept keys that move are re-rotated
    /// by the op. The graph then also has the scores outputs and the rotation inputs.
    pub eviction: Option<EvictionPolicy>,
}

impl Default for EngineConfig {
    fn default() -> EngineConfig {
        EngineConfig {
            cache_type: CacheType::F32,
            kv_cache_bytes: 1 << 30,
            block_size: 32,
            max_batched_tokens: 512,
            max_seqs: 256,
            prefix_caching: true,
            precision: None,
            threads: None,
            device: "CPU".into(),
            eviction: None,
        }
    }
}

/// What one request asks for.
#[derive(Clone, Debug)]
pub struct GenerationParams {
    pub max_new_tokens: usize,
    pub sampling: Sampling,
    /// Seed of the sampler (output `i` of the request draws from `seed + i`); `None`: a fresh one.
    pub seed: Option<u64>,
    /// Text that ends an output; it is not part of the text returned.
    pub stop: Vec<String>,
    /// Ids that end an output; `None`: the model's end-of-sequence ids.
    pub stop_token_ids: Option<Vec<u32>>,
    /// Generate `max_new_tokens` even past an end-of-sequence id.
    pub ignore_eos: bool,
    /// Outputs of the request (parallel samples sharing the prompt's blocks).
    pub n: usize,
}

impl Default for GenerationParams {
    fn default() -> GenerationParams {
        GenerationParams {
            max_new_tokens: 64,
            sampling: Sampling::default(),
            seed: None,
            stop: Vec::new(),
            stop_token_ids: None,
            ignore_eos: false,
            n: 1,
        }
    }
}

pub type RequestId = u64;

/// What a step produced, per output of a request.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// New text for output `index` of `request` (empty while a character or a possible stop
    /// string is incomplete), and the token sampled.
    Token {
        request: RequestId,
        index: usize,
        token: u32,
        text: String,
    },
    /// Output `index` of `request` ended; its generated ids (the stop token included, text after
    /// a stop string cut) and full text.
    Finished {
        request: RequestId,
        index: usize,
        reason: FinishReason,
        token_ids: Vec<u32>,
        text: String,
    },
}

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
}

/// One output of a request.
struct Output {
    seq: SeqId,
    rng: SplitMix64,
    generated: Vec<u32>,
    decoder: StreamDecoder,
    /// Decoded text so far, and how much of it was emitted (the rest may start a stop string).
    text: String,
    emitted: usize,
    done: bool,
}

struct RequestState {
    params: GenerationParams,
    stop_ids: Vec<u32>,
    outputs: Vec<Output>,
}

/// Which model input an index of the compiled model is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Feed {
    InputIds,
    PositionIds,
    PastLens,
    SubsequenceBegins,
    BlockIndices,
    BlockIndicesBegins,
    MaxContextLen,
    SampledTokensIndices,
    KeyCache(usize),
    ValueCache(usize),
    /// Cache eviction's inputs (a graph converted for serving).
    ScoreWindow,
    RotatedBlocks,
    RotationDeltas,
    RotationLut,
}

/// A cache buffer: zeroed, 8-byte aligned bytes.
struct CacheBuf {
    words: Vec<u64>,
    /// `[num_blocks, Hkv, rows, cols]`.
    shape: [usize; 4],
    block_bytes: usize,
}

impl CacheBuf {
    fn bytes_mut(&mut self) -> &mut [u8] {
        let len = self.words.len() * 8;
        // SAFETY: u64 storage viewed as its bytes: same allocation and length in bytes, u8 has no
        // alignment or validity requirement, and the borrow of `self.words` covers the result.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr().cast::<u8>(), len) }
    }
}

#[derive(Default)]
struct StepBuffers {
    input_ids: Vec<i64>,
    position_ids: Vec<i64>,
    sampled: Vec<i64>,
    past_lens: Vec<i32>,
    begins: Vec<i32>,
    block_indices: Vec<i32>,
    block_indices_begins: Vec<i32>,
    max_context_len: [i32; 1],
    score_window: Vec<i32>,
    rotated_blocks: Vec<i32>,
    rotation_deltas: Vec<i32>,
    rotation_lut: Vec<f32>,
    scores: Vec<f32>,
}

pub struct Engine {
    tokenizer: TextTokenizer,
    eos: Vec<u32>,
    context: Option<usize>,
    session: cxx::UniquePtr<Session>,
    feeds: Vec<Feed>,
    logits_output: usize,
    /// Outputs `scores.N` (with eviction).
    score_outputs: Vec<usize>,
    gathered: bool,
    /// RoPE base and key head size, for the rotation LUT of eviction.
    rope_theta: f64,
    head_size: usize,
    caches: Vec<(CacheBuf, CacheBuf)>,
    cache_type: CacheType,
    sched: Scheduler,
    requests: HashMap<RequestId, RequestState>,
    /// Scheduler sequence -> (request, output index).
    seqs: HashMap<SeqId, (RequestId, usize)>,
    next_request: RequestId,
    next_seq: SeqId,
    buf: StepBuffers,
    /// The cache tensors are set once: the caches never move, and the request keeps them.
    caches_bound: bool,
    scratch: Vec<(f32, u32)>,
    stats: EngineStats,
}

fn port_dims(name: &str, shape: &[i64], path: &Path) -> Result<[usize; 3]> {
    match shape {
        [_, h, r, c] if *h > 0 && *r > 0 && *c > 0 => Ok([*h as usize, *r as usize, *c as usize]),
        _ => Err(EngineError::Model {
            path: path.to_path_buf(),
            detail: format!("the converted graph's input `{name}` has shape {shape:?}, not [?, Hkv, rows, cols]"),
        }),
    }
}

impl Engine {
    /// Loads a model directory: reads its configuration and tokenizer, converts the stateful
    /// graph to our op in memory, compiles it and allocates the caches of `cfg`.
    pub fn load(dir: impl AsRef<Path>, cfg: &EngineConfig) -> Result<Engine> {
        let md = ModelDir::open(dir)?;
        Engine::from_model_dir(md, cfg)
    }

    pub fn from_model_dir(md: ModelDir, cfg: &EngineConfig) -> Result<Engine> {
        if cfg.block_size == 0 || cfg.max_batched_tokens == 0 || cfg.max_seqs == 0 {
            return Err(EngineError::Config(
                "block size, max batched tokens and max sequences must be positive".into(),
            ));
        }
        let xml = md.xml.to_str().ok_or_else(|| EngineError::Model {
            path: md.xml.clone(),
            detail: "path is not UTF-8".into(),
        })?;
        let opts = ConvertOptions {
            block_size: cfg.block_size as u32,
            cache_type: cfg.cache_type.as_str().into(),
            serving: cfg.eviction.is_some(),
            gather_logits: true,
            allow_xattention: false,
            allow_adaptive_rkv: false,
            allow_qq_bias: false,
        };
        let mut session =
            crate::ov::ffi::open_session(xml, &opts).map_err(|e| EngineError::Model {
                path: md.xml.clone(),
                detail: e.what().to_string(),
            })?;
        // What each input is, and the cache geometry of each layer.
        let mut feeds = Vec::new();
        let mut dims: HashMap<(bool, usize), [usize; 3]> = HashMap::new();
        for p in session.inputs() {
            let layer = |prefix: &str| {
                p.name
                    .strip_prefix(prefix)
                    .and_then(|n| n.parse::<usize>().ok())
            };
            let f = match p.name.as_str() {
                "input_ids" => Feed::InputIds,
                "position_ids" => Feed::PositionIds,
                "past_lens" => Feed::PastLens,
                "subsequence_begins" => Feed::SubsequenceBegins,
                "block_indices" => Feed::BlockIndices,
                "block_indices_begins" => Feed::BlockIndicesBegins,
                "max_context_len" => Feed::MaxContextLen,
                "sampled_tokens_indices" => Feed::SampledTokensIndices,
                "score_aggregation_window" => Feed::ScoreWindow,
                "model_rotation_trig_lut" => Feed::RotationLut,
                _ if layer("rotated_block_indices.").is_some() => Feed::RotatedBlocks,
                _ if layer("rotation_deltas.").is_some() => Feed::RotationDeltas,
                n => {
                    if let Some(l) = layer("key_cache.") {
                        dims.insert((true, l), port_dims(n, &p.shape, &md.xml)?);
                        Feed::KeyCache(l)
                    } else if let Some(l) = layer("value_cache.") {
                        dims.insert((false, l), port_dims(n, &p.shape, &md.xml)?);
                        Feed::ValueCache(l)
                    } else {
                        return Err(EngineError::Model {
                            path: md.xml.clone(),
                            detail: format!(
                                "the paged graph has an input `{n}` ({} {:?}) the engine does not feed \
                                 (a model with extra inputs, such as token_type_ids or images, is not a \
                                 text-generation model the engine runs)",
                                p.element_type, p.shape
                            ),
                        });
                    }
                }
            };
            feeds.push(f);
        }
        let layers = dims.len() / 2;
        if layers == 0
            || (0..layers)
                .any(|l| !dims.contains_key(&(true, l)) || !dims.contains_key(&(false, l)))
        {
            return Err(EngineError::Model {
                path: md.xml.clone(),
                detail: "the paged graph's key_cache.N / value_cache.N inputs are not numbered 0.. in pairs".into(),
            });
        }
        let logits_output = session
            .outputs()
            .iter()
            .position(|p| p.name == "logits")
            .ok_or_else(|| EngineError::Model {
                path: md.xml.clone(),
                detail: "the model has no output named `logits`".into(),
            })?;
        let gathered = session.gathered_logits();
        let score_outputs: Vec<usize> = session
            .outputs()
            .iter()
            .enumerate()
            .filter(|(_, p)| p.name.starts_with("scores."))
            .map(|(i, _)| i)
            .collect();
        if cfg.eviction.is_some() && score_outputs.len() != layers {
            return Err(EngineError::Model {
                path: md.xml.clone(),
                detail: format!(
                    "cache eviction needs a scores output per layer; the converted graph has {} for {layers} layers",
                    score_outputs.len()
                ),
            });
        }

        // The caches: as many blocks as the budget holds over all layers. A block of a cache is
        // the `[Hkv, rows, cols]` elements of its graph input (with u8 and u4 caches the rows or
        // columns of scales and zero points the converter added), sized by the op's element type.
        // A u4 block is whole bytes when D is even, which the op requires (it refuses the graph
        // otherwise); the check keeps block copies on byte boundaries whatever the shapes.
        let elem = cfg.cache_type.elem();
        let block_bytes = |key: bool, l: usize| -> Result<usize> {
            let [h, r, c] = dims[&(key, l)];
            let n = h.checked_mul(r).and_then(|hr| hr.checked_mul(c));
            match n.and_then(|n| elem.bytes_for(n).map(|b| (n, b))) {
                Some((n, b)) if (n % 8 * elem.bits()).is_multiple_of(8) => Ok(b),
                _ => Err(EngineError::Model {
                    path: md.xml.clone(),
                    detail: format!(
                        "a block of {}_cache.{l} ([{h}, {r}, {c}] {elem}) is not a whole number of bytes",
                        if key { "key" } else { "value" }
                    ),
                }),
            }
        };
        let mut layer_bytes = Vec::with_capacity(layers);
        for l in 0..layers {
            layer_bytes.push((block_bytes(true, l)?, block_bytes(false, l)?));
        }
        let per_block: usize = layer_bytes.iter().map(|(k, v)| k + v).sum();
        let num_blocks = cfg.kv_cache_bytes / per_block.max(1);
        if num_blocks == 0 {
            return Err(EngineError::Config(format!(
                "a KV cache of {} bytes holds no block: one block of {} tokens takes {per_block} bytes over {layers} layers",
                cfg.kv_cache_bytes, cfg.block_size
            )));
        }
        let mut caches = Vec::with_capacity(layers);
        for (l, &(kb, vb)) in layer_bytes.iter().enumerate() {
            let make = |[h, r, c]: [usize; 3], block_bytes: usize| -> Result<CacheBuf> {
                let bytes = num_blocks * block_bytes;
                let words = zeroed_words(bytes.div_ceil(8))?;
                Ok(CacheBuf {
                    words,
                    shape: [num_blocks, h, r, c],
                    block_bytes,
                })
            };
            caches.push((make(dims[&(true, l)], kb)?, make(dims[&(false, l)], vb)?));
        }

        let mut props = Vec::new();
        if let Some(p) = cfg.precision {
            props.push(Property {
                key: "INFERENCE_PRECISION_HINT".into(),
                value: p.as_str().into(),
            });
        }
        if let Some(t) = cfg.threads {
            props.push(Property {
                key: "INFERENCE_NUM_THREADS".into(),
                value: t.to_string(),
            });
        }
        session.pin_mut().compile(&cfg.device, &props)?;

        let sched = Scheduler::new(SchedulerConfig {
            num_blocks,
            block_size: cfg.block_size,
            prefix_caching: cfg.prefix_caching,
            max_batched_tokens: cfg.max_batched_tokens,
            max_seqs: cfg.max_seqs,
            eviction: cfg.eviction,
        })?;
        let eos = md.eos_token_ids();
        let head_size = dims[&(true, 0)][2];
        Ok(Engine {
            context: md.config.max_position_embeddings,
            tokenizer: md.tokenizer,
            eos,
            session,
            feeds,
            logits_output,
            score_outputs,
            gathered,
            rope_theta: md.config.rope_theta,
            head_size,
            caches,
            cache_type: cfg.cache_type,
            sched,
            requests: HashMap::new(),
            seqs: HashMap::new(),
            next_request: 0,
            next_seq: 0,
            buf: StepBuffers::default(),
            caches_bound: false,
            scratch: Vec::new(),
            stats: EngineStats::default(),
        })
    }

    pub fn tokenizer(&self) -> &TextTokenizer {
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
    pub fn cache_type(&self) -> CacheType {
        self.cache_type
    }
    pub fn cache_stats(&self) -> CacheStats {
        self.sched.manager().stats()
    }
    pub fn counters(&self) -> SchedulerCounters {
        self.sched.counters()
    }
    pub fn stats(&self) -> EngineStats {
        self.stats
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

    /// Prompt ids of `text` (the chat template applied to one user message when `chat`).
    pub fn encode_prompt(&self, text: &str, chat: bool) -> Result<Vec<u32>> {
        if chat {
            let msgs = [ChatMessage {
                role: "user".into(),
                content: text.into(),
            }];
            self.encode_chat(&msgs)
        } else {
            self.tokenizer.encode(text, true)
        }
    }

    /// Prompt ids of a conversation through the chat template.
    pub fn encode_chat(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let text = self.tokenizer.apply_chat_template(messages, true)?;
        self.tokenizer.encode(&text, false)
    }

    /// Queues a request. Refuses it alone (nothing else changes) when the prompt is empty or does
    /// not fit the model's context or the whole KV cache, or the parameters are out of range.
    /// `max_new_tokens` is cut to what the context leaves.
    pub fn add_request(&mut self, prompt: Vec<u32>, params: GenerationParams) -> Result<RequestId> {
        let mut params = params;
        if prompt.is_empty() {
            return Err(EngineError::Request(
                "the prompt is empty (no tokens)".into(),
            ));
        }
        if params.n == 0 || params.max_new_tokens == 0 {
            return Err(EngineError::Request(format!(
                "n and max_new_tokens must be at least 1, got {} and {}",
                params.n, params.max_new_tokens
            )));
        }
        let s = &params.sampling;
        if !(s.temperature >= 0.0 && s.temperature.is_finite())
            || !(s.top_p > 0.0 && s.top_p <= 1.0)
        {
            return Err(EngineError::Request(format!(
                "temperature must be >= 0 and top_p in (0, 1], got {} and {}",
                s.temperature, s.top_p
            )));
        }
        if let Some(ctx) = self.context {
            if prompt.len() >= ctx {
                return Err(EngineError::Request(format!(
                    "the prompt has {} tokens; the model's context is {ctx} (prompt and generated tokens)",
                    prompt.len()
                )));
            }
            params.max_new_tokens = params.max_new_tokens.min(ctx - prompt.len());
        }
        if let Some(v) = self.tokenizer_vocab_bound() {
            if let Some(bad) = prompt.iter().find(|&&t| t as usize >= v) {
                return Err(EngineError::Request(format!(
                    "token id {bad} is outside the vocabulary of {v}"
                )));
            }
        }
        let id = self.next_request;
        let seq = self.next_seq;
        self.sched
            .add_request(Request {
                id: seq,
                prompt: prompt.clone(),
                max_new_tokens: params.max_new_tokens,
                priority: 0,
            })
            .map_err(|e| EngineError::Request(format!("{e}")))?;
        self.next_request += 1;
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
                generated: Vec::new(),
                decoder: StreamDecoder::default(),
                text: String::new(),
                emitted: 0,
                done: false,
            })
            .collect();
        self.seqs.insert(seq, (id, 0));
        self.stats.prompt_tokens += prompt.len() as u64;
        self.requests.insert(
            id,
            RequestState {
                params,
                stop_ids,
                outputs,
            },
        );
        Ok(id)
    }

    fn tokenizer_vocab_bound(&self) -> Option<usize> {
        Some(self.tokenizer.vocab_size()).filter(|&v| v > 0)
    }

    /// Aborts a request (waiting or running): its blocks are freed at once; each of its unfinished
    /// outputs gets a `Finished` event with reason `abort`.
    pub fn abort(&mut self, request: RequestId) -> Result<Vec<Event>> {
        let Some(state) = self.requests.get(&request) else {
            return Err(EngineError::Request(format!("no request {request}")));
        };
        let live: Vec<SeqId> = state
            .outputs
            .iter()
            .filter(|o| !o.done && o.seq != SeqId::MAX)
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
                if !o.done {
                    o.done = true;
                    events.push(Event::Finished {
                        request,
                        index: i,
                        reason: FinishReason::Abort,
                        token_ids: o.generated.clone(),
                        text: o.text.clone(),
                    });
                }
            }
        }
        self.forget_if_done(request);
        Ok(events)
    }

    /// Runs one step. Returns its events (nothing when idle).
    pub fn step(&mut self) -> Result<Vec<Event>> {
        let mut events = Vec::new();
        if self.sched.is_idle() {
            return Ok(events);
        }
        let t0 = Instant::now();
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
        match self.run_model(&step) {
            Ok(()) => {}
            Err(e) => {
                // The step's tokens were not computed: end its requests with the error rather
                // than leave the scheduler in flight.
                let _ = self.sched.complete_step(&[]);
                return Err(e);
            }
        }
        let sampled = self.sample_step(&step)?;
        let forks = self.pending_forks(&sampled);
        let plain: Vec<(SeqId, u32)> = sampled.iter().map(|&(s, t, _)| (s, t)).collect();
        self.sched.complete_step(&plain)?;
        self.stats.steps += 1;
        self.stats.generated_tokens += plain.len() as u64;
        // Forks of n > 1 requests at their first token, before their parent can end.
        for (parent, child_index, token) in forks {
            self.fork(parent, child_index, token, &mut events)?;
        }
        for &(seq, token, _) in &sampled {
            self.accept(seq, token, &mut events)?;
        }
        self.drain_finished(&mut events)?;
        self.stats.step_time += t0.elapsed();
        Ok(events)
    }

    /// Binds the step's inputs and runs `infer()`.
    fn run_model(&mut self, step: &Step) -> Result<()> {
        for (k, v) in &mut self.caches {
            let (kb, vb) = (k.block_bytes, v.block_bytes);
            copy_blocks_kv(k.bytes_mut(), v.bytes_mut(), kb, vb, &step.copies)?;
        }
        let b = &mut self.buf;
        b.input_ids.clear();
        b.input_ids.extend(step.token_ids.iter().map(|&t| t as i64));
        b.position_ids.clear();
        b.position_ids
            .extend(step.token_pos.iter().map(|&p| p as i64));
        b.past_lens.clone_from(&step.past_lens);
        b.begins.clone_from(&step.subsequence_begins);
        b.block_indices.clone_from(&step.block_indices);
        b.block_indices_begins
            .clone_from(&step.block_indices_begins);
        b.max_context_len[0] = step
            .seqs
            .iter()
            .map(|s| (s.past_len + s.num_tokens) as i32)
            .max()
            .unwrap_or(0);
        b.sampled.clear();
        for (i, s) in step.seqs.iter().enumerate() {
            if s.emits {
                b.sampled.push(step.subsequence_begins[i + 1] as i64 - 1);
            }
        }
        if b.sampled.is_empty() {
            // The LM head still needs a row; nothing reads it.
            b.sampled.push(0);
        }
        if !self.score_outputs.is_empty() {
            // Each sequence's scores sum the attention of its new tokens (the window n_s).
            b.score_window.clear();
            b.score_window
                .extend(step.seqs.iter().map(|s| s.num_tokens as i32));
            b.rotated_blocks.clear();
            b.rotation_deltas.clear();
            b.rotation_lut.clear();
            if let Some(r) = &step.rotation {
                b.rotated_blocks.extend_from_slice(&r.block_indices);
                b.rotation_deltas.extend_from_slice(&r.deltas);
                b.rotation_lut = rotation_lut(
                    r.lut_rows(),
                    self.head_size,
                    self.rope_theta,
                    RotationDirection::Backward,
                )?;
            }
        }
        let block_size = self.sched.config().block_size;
        for (index, feed) in self.feeds.iter().enumerate() {
            let mut dims = [0usize; 4];
            let (rank, data): (usize, &[u8]) = match *feed {
                Feed::InputIds => vec_arg(&mut dims, &b.input_ids),
                Feed::PositionIds => vec_arg(&mut dims, &b.position_ids),
                Feed::SampledTokensIndices => vec_arg(&mut dims, &b.sampled),
                Feed::PastLens => vec_arg(&mut dims, &b.past_lens),
                Feed::SubsequenceBegins => vec_arg(&mut dims, &b.begins),
                Feed::BlockIndices => vec_arg(&mut dims, &b.block_indices),
                Feed::BlockIndicesBegins => vec_arg(&mut dims, &b.block_indices_begins),
                Feed::MaxContextLen => (0, as_bytes(&b.max_context_len)),
                Feed::ScoreWindow => vec_arg(&mut dims, &b.score_window),
                Feed::RotatedBlocks => vec_arg(&mut dims, &b.rotated_blocks),
                Feed::RotationDeltas => {
                    dims[..2].copy_from_slice(&[b.rotated_blocks.len(), block_size]);
                    (2, as_bytes(&b.rotation_deltas))
                }
                Feed::RotationLut => {
                    let rows = b.rotation_lut.len() / self.head_size;
                    dims[..2].copy_from_slice(&[rows, if rows == 0 { 0 } else { self.head_size }]);
                    (2, as_bytes(&b.rotation_lut))
                }
                Feed::KeyCache(_) | Feed::ValueCache(_) if self.caches_bound => continue,
                Feed::KeyCache(l) | Feed::ValueCache(l) => {
                    let c = match *feed {
                        Feed::KeyCache(_) => &mut self.caches[l].0,
                        _ => &mut self.caches[l].1,
                    };
                    // SAFETY: the cache's words hold its `shape` of `cache_type` elements, owned
                    // by `self`. The caches are set once and never move (their vectors are never
                    // resized), and `session` is declared before them in `Engine`, so it is
                    // dropped first: the request's tensor never outlives the memory.
                    unsafe {
                        self.session.pin_mut().set_input(
                            index,
                            self.cache_type.as_str(),
                            &c.shape,
                            c.words.as_mut_ptr().cast(),
                        )?
                    };
                    continue;
                }
            };
            // The small per-step inputs are copied into the request's own tensors.
            self.session
                .pin_mut()
                .copy_input(index, &dims[..rank], data)?;
        }
        self.caches_bound = true;
        let t = Instant::now();
        self.session.pin_mut().infer()?;
        self.stats.infer_time += t.elapsed();
        if !self.score_outputs.is_empty() {
            // Eviction ranks blocks by the scores summed over the layers.
            let n = step.scores_len();
            self.buf.scores.clear();
            self.buf.scores.resize(n, 0.0);
            for &o in &self.score_outputs {
                let layer = self.session.output_f32(o)?;
                if layer.len() != n {
                    return Err(EngineError::OpenVino(format!(
                        "scores output of {} values, {n} expected",
                        layer.len()
                    )));
                }
                for (acc, v) in self.buf.scores.iter_mut().zip(layer) {
                    *acc += v;
                }
            }
            self.sched.accumulate_scores(step, &self.buf.scores)?;
        }
        Ok(())
    }

    /// One token per emitting sequence: (sequence, token, logits row), in batch order.
    fn sample_step(&mut self, step: &Step) -> Result<Vec<(SeqId, u32, usize)>> {
        let logits = self.session.output_f32(self.logits_output)?;
        let rows_total = if self.gathered {
            self.buf.sampled.len()
        } else {
            step.num_tokens()
        };
        if rows_total == 0 || logits.len() % rows_total != 0 {
            return Err(EngineError::OpenVino(format!(
                "logits of {} values for {rows_total} rows",
                logits.len()
            )));
        }
        let vocab = logits.len() / rows_total;
        let mut out = Vec::new();
        let mut k = 0;
        for (i, s) in step.seqs.iter().enumerate() {
            if !s.emits {
                continue;
            }
            let row = if self.gathered {
                k
            } else {
                step.subsequence_begins[i + 1] as usize - 1
            };
            k += 1;
            let Some(&(req, index)) = self.seqs.get(&s.id) else {
                return Err(EngineError::Config(format!(
                    "sequence {} has no request",
                    s.id
                )));
            };
            let state = self
                .requests
                .get_mut(&req)
                .expect("a mapped sequence has its request");
            let o = &mut state.outputs[index];
            let token = sample(
                &logits[row * vocab..(row + 1) * vocab],
                &state.params.sampling,
                &mut o.rng,
                &mut self.scratch,
            );
            out.push((s.id, token, row));
        }
        Ok(out)
    }

    /// For sequences that are output 0 of an n > 1 request and sample their first token now: the
    /// first tokens of the other outputs, drawn from the same logits row with their own seeds.
    fn pending_forks(&mut self, sampled: &[(SeqId, u32, usize)]) -> Vec<(SeqId, usize, u32)> {
        let mut forks = Vec::new();
        for &(seq, _, row) in sampled {
            let (req, index) = self.seqs[&seq];
            let state = &self.requests[&req];
            if index != 0 || state.outputs.len() == 1 || !state.outputs[0].generated.is_empty() {
                continue;
            }
            let Ok(logits) = self.session.output_f32(self.logits_output) else {
                continue;
            };
            let rows = if self.gathered {
                self.buf.sampled.len()
            } else {
                self.buf.input_ids.len()
            };
            let vocab = logits.len() / rows.max(1);
            let state = self.requests.get_mut(&req).expect("mapped");
            let sampling = state.params.sampling;
            for i in 1..state.outputs.len() {
                let o = &mut state.outputs[i];
                let t = sample(
                    &logits[row * vocab..(row + 1) * vocab],
                    &sampling,
                    &mut o.rng,
                    &mut self.scratch,
                );
                forks.push((seq, i, t));
            }
        }
        forks
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
        self.requests.get_mut(&req).expect("mapped").outputs[index].seq = child;
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

    /// Records a sampled token: text, stop ids and stop strings.
    fn accept(&mut self, seq: SeqId, token: u32, events: &mut Vec<Event>) -> Result<()> {
        let (req, index) = self.seqs[&seq];
        let state = self.requests.get_mut(&req).expect("mapped");
        let stop_strings = &state.params.stop;
        let o = &mut state.outputs[index];
        if o.done {
            return Ok(());
        }
        o.generated.push(token);
        let is_stop_id = state.stop_ids.contains(&token);
        if !is_stop_id {
            let piece = o.decoder.push(&self.tokenizer, token)?;
            o.text.push_str(&piece);
        }
        // A stop string ends the output; its text ends before it.
        let mut cut = None;
        if !stop_strings.is_empty() {
            let from = o
                .emitted
                .saturating_sub(stop_strings.iter().map(|s| s.len()).max().unwrap_or(0));
            let from = (0..=from)
                .rev()
                .find(|&i| o.text.is_char_boundary(i))
                .unwrap_or(0);
            cut = stop_strings
                .iter()
                .filter(|s| !s.is_empty())
                .filter_map(|s| o.text[from..].find(s.as_str()).map(|p| from + p))
                .min();
        }
        if let Some(at) = cut {
            o.text.truncate(at);
        }
        // Emit what can no longer start a stop string.
        let hold = if cut.is_some() || is_stop_id {
            0
        } else {
            stop_strings
                .iter()
                .map(|s| s.len().saturating_sub(1))
                .max()
                .unwrap_or(0)
        };
        let mut upto = o.text.len().saturating_sub(hold).max(o.emitted);
        while !o.text.is_char_boundary(upto) {
            upto -= 1;
        }
        let text = o.text[o.emitted..upto.max(o.emitted)].to_string();
        o.emitted = upto.max(o.emitted);
        events.push(Event::Token {
            request: req,
            index,
            token,
            text,
        });
        if cut.is_some() || is_stop_id {
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
        if o.done {
            return Ok(());
        }
        o.done = true;
        if reason != FinishReason::Stop {
            let rest = o.decoder.flush(&self.tokenizer)?;
            o.text.push_str(&rest);
        }
        if o.emitted < o.text.len() {
            let text = o.text[o.emitted..].to_string();
            o.emitted = o.text.len();
            events.push(Event::Token {
                request: req,
                index,
                token: *o.generated.last().unwrap_or(&0),
                text,
            });
        }
        self.seqs.remove(&o.seq);
        events.push(Event::Finished {
            request: req,
            index,
            reason,
            token_ids: o.generated.clone(),
            text: o.text.clone(),
        });
        self.forget_if_done(req);
        Ok(())
    }

    fn forget_if_done(&mut self, req: RequestId) {
        if self
            .requests
            .get(&req)
            .is_some_and(|s| s.outputs.iter().all(|o| o.done))
        {
            if let Some(state) = self.requests.remove(&req) {
                for o in state.outputs {
                    self.seqs.remove(&o.seq);
                }
            }
        }
    }

    /// Runs every request to its end: the outputs of each, by request and output index.
    pub fn run_to_completion(&mut self, mut on_event: impl FnMut(&Event)) -> Result<()> {
        while !self.is_idle() {
            for e in self.step()? {
                on_event(&e);
            }
        }
        Ok(())
    }
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

/// A step buffer as a 1-D input: rank 1 with its length in `dims[0]`, its bytes.
fn vec_arg<'a, T: Plain>(dims: &mut [usize; 4], v: &'a [T]) -> (usize, &'a [u8]) {
    dims[0] = v.len();
    (1, as_bytes(v))
}

/// Element types whose values are plain bytes (no padding, every bit pattern valid).
trait Plain: Copy {}
impl Plain for i32 {}
impl Plain for i64 {}
impl Plain for f32 {}

fn as_bytes<T: Plain>(v: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain number type (no padding), so its memory is `size_of_val(v)`
    // initialised bytes; the result borrows `v`.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
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
