//! `pa-engine`: the engine's command line (`pa generate` and `pa convert` run it). It links
//! OpenVINO, which the C library and the `pa` binary do not.

use clap::{Args, Parser, Subcommand};
use paged_attention::cache::EvictionPolicy;
use paged_attention::ElemType;
use paged_attention_engine::kv_events::{KvEventsConfig, Shape};
use paged_attention_engine::metrics::Naming;
use paged_attention_engine::tools::ToolParser;
use paged_attention_engine::{
    convert_ir, Constraint, Conversion, DraftLength, EngineClient, EngineConfig, Event,
    FinishReason, GenerationParams, KvCacheSize, ModelDir, Penalties, Precision, Prompt, Reply,
    Sampling, SpeculativeConfig, SpeculativeMethod, TokenLogprobs, Update, VERIFY_ROWS,
};
use serde_json::json;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Parser)]
#[command(
    name = "pa-engine",
    version,
    about = "Text generation on the paged_attention op (an optimum-intel model directory in, text out)",
    after_help = "Exit status: 0 success, 1 a failure (model directory, OpenVINO, a refused request), 2 a usage error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a model directory.
    #[command(long_about = GENERATE_ABOUT)]
    Generate(GenerateArgs),
    /// Convert a stateful LLM IR to a paged IR on our op (what `generate` does in memory).
    Convert(ConvertArgs),
    /// Serve the model over an OpenAI-compatible HTTP API.
    #[command(long_about = SERVE_ABOUT)]
    Serve(ServeArgs),
}

const SERVE_ABOUT: &str = "\
Serves MODEL_DIR over an OpenAI-compatible HTTP API: POST /v1/completions and \
/v1/chat/completions (streaming as server-sent events with \"stream\": true), GET /v1/models, \
GET /health (200 once the model is compiled), GET /metrics (Prometheus text; docs/api.md lists \
the names), and with --kv-events-endpoint GET /debug/kv-cache-blocks. The engine runs \
on its own thread; a client that disconnects has its request aborted and its KV blocks freed \
before the next engine step. Every error is OpenAI's error JSON. A request's head and its body \
must each arrive within --read-timeout, or the connection is closed (a body gets 408). \
SIGINT/SIGTERM: new requests (on open or new connections) get 503 with OpenAI's error JSON, \
in-flight ones finish, or are ended after --shutdown-timeout; then the process exits 0, whatever \
clients still hold open.";

#[derive(Args)]
struct ServeArgs {
    model_dir: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Bearer key every /v1/ request must carry (default: $PA_API_KEY; none when unset).
    #[arg(long)]
    api_key: Option<String>,
    /// Name requests use in `model` (default: the model directory's name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Requests admitted at once; more get 503 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Largest request body in bytes.
    #[arg(long, default_value_t = 1 << 20)]
    max_body_bytes: usize,
    /// Seconds in-flight requests may run on after SIGINT/SIGTERM.
    #[arg(long, default_value = "30", value_parser = seconds)]
    shutdown_timeout: Duration,
    /// Seconds a request's head, and then its body, may take to arrive.
    #[arg(long, default_value = "30", value_parser = positive_seconds)]
    read_timeout: Duration,
    /// How the model writes tool calls: hermes (<tool_call> JSON, Qwen2.5, SmolLM2) or
    /// llama3_json (Llama 3.x). Default: as the chat template writes them, else hermes.
    #[arg(long, value_name = "NAME", value_parser = ToolParser::from_name)]
    tool_call_parser: Option<ToolParser>,
    /// How /metrics spells the names vLLM also has: `pa` (pa_num_requests_waiting; passes
    /// promtool) or `vllm` (vllm:num_requests_waiting, what routers read by default).
    #[arg(long, default_value = "pa")]
    metric_names: Naming,
    /// Publish KV-cache events (blocks stored, removed, all cleared) in vLLM's format on a
    /// ZeroMQ PUB socket: `tcp://*:PORT` binds, `tcp://HOST:PORT` connects to a subscriber.
    #[arg(long, value_name = "ENDPOINT")]
    kv_events_endpoint: Option<String>,
    /// First frame of every KV-event message (llm-d reads `kv@POD@MODEL`).
    #[arg(long, default_value = "", requires = "kv_events_endpoint")]
    kv_events_topic: String,
    /// Events as positional arrays (vLLM up to 0.23, which every subscriber reads) or as maps
    /// (vLLM since 0.24).
    #[arg(long, default_value = "array", requires = "kv_events_endpoint")]
    kv_events_format: Shape,
    #[command(flatten)]
    engine: EngineArgs,
}

const GENERATE_ABOUT: &str = "\
Generates text from MODEL_DIR, a directory as `optimum-cli export openvino --task \
text-generation-with-past` writes it (openvino_model.xml/.bin, config.json, \
generation_config.json, tokenizer.json, tokenizer_config.json). The stateful graph is converted \
in memory to this project's PagedAttention op, compiled on the CPU, and served by the project's \
continuous-batching scheduler: all prompts of --prompts run as one continuous batch.

With one prompt the text is streamed to stdout as it is generated. With --json, one JSON object \
per prompt and line, in input order: index, prompt_tokens, token_ids (generated ids only), text, \
finish_reason (length, stop), and with --n > 1 `samples` (every output). Without --json, one \
prompt with --n 1 is streamed; otherwise every output is printed when done, tagged [PROMPT] \
(or [PROMPT.SAMPLE] with --n > 1).";

#[derive(Args)]
struct EngineArgs {
    /// KV cache element type: f32, f16, bf16, u8 or u4 (u8 and u4 are OpenVINO's quantized
    /// layouts, u4 two values a byte). Default u8, OpenVINO's own for the CPU.
    #[arg(long, default_value_t = DEFAULT_CACHE_TYPE, value_parser = ElemType::parse_cache_type)]
    cache_type: ElemType,
    /// KV cache size over all layers: GB (1e9 bytes), or `auto`: half of the memory available
    /// once the model is compiled (the smaller of MemAvailable and the cgroup's memory.max),
    /// at most the model's context times --max-seqs. The choice is printed at start-up.
    #[arg(long, default_value = "auto", value_parser = parse_kv_cache_size)]
    kv_cache_size: KvCacheSize,
    /// OpenVINO's inference precision hint (default: OpenVINO's for this CPU).
    #[arg(long, value_parser = parse_precision)]
    precision: Option<Precision>,
    /// Inference threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Token rows per step; longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 512)]
    max_batched_tokens: usize,
    /// Sequences per step (vLLM's name, --max-num-seqs, works too).
    #[arg(long, visible_alias = "max-num-seqs", default_value_t = 256)]
    max_seqs: usize,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Do not reuse the cached blocks of equal prompt prefixes.
    #[arg(long)]
    no_prefix_caching: bool,
    /// Score-driven cache eviction, START,RECENT,MAX in tokens (multiples of the block size): a
    /// sequence keeps at most MAX tokens of KV cache: its first START and last RECENT always,
    /// between them the blocks its attention scores rank highest (kept keys are re-rotated).
    #[arg(long, value_name = "START,RECENT,MAX")]
    cache_eviction: Option<String>,
    /// Speculative decoding: `prompt-lookup` drafts each sequence's next tokens from n-grams of
    /// its own prompt and output, `draft` has --draft-model draft them greedily; either way
    /// they are verified in one step (greedy output unchanged, sampling's distribution too).
    #[arg(long, value_parser = parse_speculative)]
    speculative: Option<SpeculativeMethod>,
    /// The draft model's directory (with --speculative draft): a smaller model with the same
    /// tokenizer, run with its own KV cache of as many blocks as the target's.
    #[arg(long, value_name = "DIR")]
    draft_model: Option<PathBuf>,
    /// Draft tokens per sequence and step at most (with --speculative).
    #[arg(long, default_value_t = 4)]
    num_speculative_tokens: usize,
    /// Longest n-gram prompt lookup matches (with --speculative prompt-lookup).
    #[arg(long, default_value_t = 3)]
    max_ngram_size: usize,
    /// Token rows a step verifies at most (decode tokens plus drafts). Within it each
    /// sequence's draft is as long as its expected acceptance pays for at the batch's size.
    #[arg(long, value_name = "ROWS", default_value_t = VERIFY_ROWS)]
    speculative_max_rows: usize,
    /// How long each sequence's draft is (with --speculative): `adaptive` drafts its d-th
    /// token only while the acceptance measured so far makes it likely to pay for its row at
    /// this batch size; `fixed` drafts the most each sequence may, min(k, ROWS / B - 1).
    #[arg(long, value_name = "MODE", default_value = "adaptive", value_parser = parse_draft_length)]
    speculative_draft_length: DraftLength,
}

fn parse_speculative(s: &str) -> Result<SpeculativeMethod, String> {
    s.parse()
}

fn parse_draft_length(s: &str) -> Result<DraftLength, String> {
    s.parse()
}

#[derive(Args)]
struct GenerateArgs {
    model_dir: PathBuf,
    /// The prompt.
    #[arg(long, conflicts_with = "prompts", required_unless_present = "prompts")]
    prompt: Option<String>,
    /// A JSON file holding an array of prompts, run as one continuous batch: strings, or objects
    /// {"text": ..., "token_ids": [...] (instead of text), "arrival": seconds after the start}.
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Apply the model's chat template (the prompt is one user message).
    #[arg(long)]
    chat: bool,
    /// Most tokens generated per output (default: generation_config.json's, else 256).
    #[arg(long)]
    max_new_tokens: Option<usize>,
    /// 0: greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// 0: no limit.
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Divides a positive logit (multiplies a negative one) of each token of the prompt and the
    /// output so far, once per token; 1: none.
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Moves the logit of each token of the output so far toward 0, once per token (-2 to 2).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    presence_penalty: f32,
    /// Moves the logit of each token of the output so far toward 0 per occurrence (-2 to 2).
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    frequency_penalty: f32,
    /// Seed of the sampler (same seed, same tokens).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop string (repeatable); the text ends before it.
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past the end-of-sequence token.
    #[arg(long)]
    ignore_eos: bool,
    /// Outputs per prompt (parallel samples sharing the prompt's KV blocks).
    #[arg(long, default_value_t = 1)]
    n: usize,
    /// Structured output: the text is JSON that this JSON Schema file accepts.
    #[arg(long, value_name = "FILE", group = "constraint")]
    json_schema: Option<PathBuf>,
    /// Structured output: the text is a JSON object.
    #[arg(long, group = "constraint")]
    json_object: bool,
    /// Structured output: the text matches this regular expression as a whole.
    #[arg(long, group = "constraint")]
    regex: Option<String>,
    /// Structured output: the text follows this Lark grammar file (llguidance's Lark).
    #[arg(long, value_name = "FILE", group = "constraint")]
    grammar: Option<PathBuf>,
    /// One JSON object per prompt and line.
    #[arg(long)]
    json: bool,
    /// With --json: each output also gets `logprobs`, per generated token its id, its
    /// log-probability (the log-softmax of the model's logits, before penalties and
    /// temperature) and the N most likely tokens' (0-20).
    #[arg(long, value_name = "N", requires = "json")]
    logprobs: Option<usize>,
    /// Print the engine's figures to stderr at the end.
    #[arg(long)]
    stats: bool,
    /// With --json: each line also gets its request's times (arrival_s, ttft_ms, tpot_ms: mean
    /// time per output token after the first, e2e_ms).
    #[arg(long)]
    timings: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args)]
struct ConvertArgs {
    input: PathBuf,
    output: PathBuf,
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Element type of the cache inputs: f32, f16, bf16, u8 or u4. Default u8, as generate and
    /// serve (OpenVINO's own for the CPU).
    #[arg(long, default_value_t = DEFAULT_CACHE_TYPE, value_parser = ElemType::parse_cache_type)]
    cache_type: ElemType,
    /// Also give the graph what cache eviction needs: outputs scores.N, inputs
    /// score_aggregation_window and the rotation inputs.
    #[arg(long)]
    serving: bool,
    /// Ask OpenVINO's pass for one of xattention, adaptive_rkv, qq_bias too (repeatable): the
    /// conversion is then refused, naming the input our op lacks (to check the refusals).
    #[arg(long, value_name = "FEATURE", value_parser = ["xattention", "adaptive_rkv", "qq_bias"])]
    allow: Vec<String>,
}

use paged_attention::dtype::DEFAULT_CACHE_TYPE;

/// Seconds >= 0 that a `Duration` holds (not NaN, not infinite, not 1e20).
fn seconds(s: &str) -> Result<Duration, String> {
    s.parse::<f64>()
        .ok()
        .and_then(|x| Duration::try_from_secs_f64(x).ok())
        .ok_or_else(|| format!("needs seconds >= 0 (at most about 1.8e19), got `{s}`"))
}

fn positive_seconds(s: &str) -> Result<Duration, String> {
    match seconds(s)? {
        Duration::ZERO => Err(format!("needs seconds > 0, got `{s}`")),
        d => Ok(d),
    }
}

fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

fn parse_kv_cache_size(s: &str) -> Result<KvCacheSize, String> {
    s.parse()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Convert(a) => convert(a),
        Command::Serve(a) => serve(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pa-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

fn serve(a: ServeArgs) -> Result<(), String> {
    let mut engine = engine_config(&a.engine)?;
    engine.kv_events = a.kv_events_endpoint.clone().map(|endpoint| KvEventsConfig {
        endpoint,
        topic: a.kv_events_topic.clone(),
        shape: a.kv_events_format,
    });
    let name = a.served_model_name.clone().unwrap_or_else(|| {
        a.model_dir
            .canonicalize()
            .ok()
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "model".into())
    });
    let api_key = a
        .api_key
        .clone()
        .or_else(|| std::env::var("PA_API_KEY").ok())
        .filter(|k| !k.is_empty());
    let cfg = paged_attention_engine::server::ServeConfig {
        host: a.host.clone(),
        port: a.port,
        api_key,
        max_queue: a.max_queue.max(1),
        max_body_bytes: a.max_body_bytes,
        read_timeout: a.read_timeout,
        shutdown_timeout: a.shutdown_timeout,
        model_name: name,
        tool_call_parser: a.tool_call_parser,
        metric_names: a.metric_names,
    };
    paged_attention_engine::server::serve(a.model_dir, engine, cfg)
}

fn convert(a: ConvertArgs) -> Result<(), String> {
    let how = Conversion {
        block_size: a.block_size,
        cache_type: a.cache_type,
        serving: a.serving,
        allow_xattention: a.allow.iter().any(|f| f == "xattention"),
        allow_adaptive_rkv: a.allow.iter().any(|f| f == "adaptive_rkv"),
        allow_qq_bias: a.allow.iter().any(|f| f == "qq_bias"),
    };
    let n = convert_ir(&a.input, &a.output, &how).map_err(|e| e.to_string())?;
    println!("{}: {n} PagedAttention node(s)", a.output.display());
    Ok(())
}

fn engine_config(a: &EngineArgs) -> Result<EngineConfig, String> {
    if let Some(t) = a.threads {
        warn_threads(t, paged_attention_engine::memory::cores());
    }
    let eviction = match &a.cache_eviction {
        None => None,
        Some(spec) => {
            let v: Vec<usize> = spec
                .split(',')
                .map(|x| x.trim().parse::<usize>())
                .collect::<Result<_, _>>()
                .map_err(|_| {
                    format!("--cache-eviction takes START,RECENT,MAX token counts, got `{spec}`")
                })?;
            let bs = a.block_size;
            if v.len() != 3 || v.iter().any(|x| x % bs != 0) || v[1] == 0 || v[2] < v[0] + v[1] {
                return Err(format!(
                    "--cache-eviction {spec}: three multiples of the block size {bs}, RECENT > 0 and MAX >= START + RECENT"
                ));
            }
            Some(EvictionPolicy {
                start: v[0] / bs,
                recent: v[1] / bs,
                budget: v[2] / bs,
            })
        }
    };
    if a.speculative.is_some() && (a.num_speculative_tokens == 0 || a.max_ngram_size == 0) {
        return Err("--num-speculative-tokens and --max-ngram-size must be positive".into());
    }
    if a.speculative.is_some() && eviction.is_some() {
        return Err("--speculative does not combine with --cache-eviction".into());
    }
    let drafting = a.speculative == Some(SpeculativeMethod::Draft);
    if drafting != a.draft_model.is_some() {
        return Err("--speculative draft and --draft-model DIR go together".into());
    }
    let speculative = a.speculative.map(|method| SpeculativeConfig {
        method,
        draft_model: a.draft_model.clone(),
        num_tokens: a.num_speculative_tokens,
        max_ngram: a.max_ngram_size,
        max_rows: a.speculative_max_rows,
        draft_length: a.speculative_draft_length,
    });
    Ok(EngineConfig {
        cache_type: a.cache_type,
        kv_cache: a.kv_cache_size,
        block_size: a.block_size,
        max_batched_tokens: a.max_batched_tokens,
        max_seqs: a.max_seqs,
        prefix_caching: !a.no_prefix_caching,
        precision: a.precision,
        threads: a.threads,
        device: "CPU".into(),
        eviction,
        kv_events: None,
        speculative,
    })
}

/// More inference threads than cores share the cores and slow every step: said on stderr.
fn warn_threads(threads: usize, cores: Option<usize>) {
    if let Some(cores) = cores.filter(|&c| threads > c) {
        eprintln!(
            "pa-engine: warning: --threads {threads} is more than the {cores} cores this process \
             may run on (its CPU affinity and cgroup quota); the threads will share cores, which \
             is slower than --threads {cores}"
        );
    }
}

/// One prompt of --prompts: what to run, and when (after the start).
struct PromptSpec {
    prompt: Prompt,
    arrival: Duration,
}

impl PromptSpec {
    fn parse(v: &serde_json::Value, chat: bool) -> Result<PromptSpec, String> {
        let text = |t: &str| PromptSpec::text(t, chat);
        if let Some(s) = v.as_str() {
            return Ok(text(s));
        }
        let arrival = match v.get("arrival") {
            None => Duration::ZERO,
            Some(x) => x
                .as_f64()
                .and_then(|a| Duration::try_from_secs_f64(a).ok())
                .ok_or("`arrival` must be seconds >= 0 (at most about 1.8e19)")?,
        };
        if let Some(t) = v.get("text").and_then(|t| t.as_str()) {
            return Ok(PromptSpec { arrival, ..text(t) });
        }
        if let Some(ids) = v.get("token_ids").and_then(|t| t.as_array()) {
            let ids = ids
                .iter()
                .map(|x| {
                    x.as_u64()
                        .and_then(|x| u32::try_from(x).ok())
                        .ok_or("token ids must be integers")
                })
                .collect::<Result<_, _>>()?;
            return Ok(PromptSpec {
                prompt: Prompt::Ids(ids),
                arrival,
            });
        }
        Err(
            "a prompt is a string or an object with `text` or `token_ids` (and optional `arrival`)"
                .into(),
        )
    }

    /// A text prompt (one user message through the chat template with `chat`), at the start.
    fn text(t: &str, chat: bool) -> PromptSpec {
        let prompt = if chat {
            Prompt::Chat {
                messages: vec![paged_attention_engine::ChatMessage {
                    role: "user".into(),
                    content: t.into(),
                    ..Default::default()
                }],
                tools: None,
            }
        } else {
            Prompt::Text(t.into())
        };
        PromptSpec {
            prompt,
            arrival: Duration::ZERO,
        }
    }
}

#[derive(Clone, Default)]
struct Times {
    arrival: Duration,
    first: Option<Duration>,
    last: Duration,
    tokens: usize,
}

struct Done {
    token_ids: Vec<u32>,
    text: String,
    reason: FinishReason,
    logprobs: Vec<TokenLogprobs>,
}

impl Done {
    /// `--json`'s object of this output.
    fn json(&self, logprobs: bool) -> serde_json::Value {
        let mut v = json!({"token_ids": self.token_ids, "text": self.text,
                           "finish_reason": self.reason.as_str()});
        if logprobs {
            v["logprobs"] = self
                .logprobs
                .iter()
                .map(|l| json!({"token": l.token, "logprob": l.logprob, "top_logprobs": l.top}))
                .collect();
        }
        v
    }
}

/// A prompt's request: its id once submitted, its prompt length once accepted, its outputs.
#[derive(Default)]
struct Run {
    id: Option<u64>,
    prompt_tokens: usize,
    times: Times,
    outputs: HashMap<usize, Done>,
    /// Each output's tokens' logprobs so far (with --logprobs).
    logprobs: HashMap<usize, Vec<TokenLogprobs>>,
}

/// The structured-output constraint the flags ask for.
fn constraint(a: &GenerateArgs) -> Result<Option<Constraint>, String> {
    let read =
        |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()));
    Ok(if let Some(p) = &a.json_schema {
        let schema = serde_json::from_str(&read(p)?)
            .map_err(|e| format!("{}: not JSON: {e}", p.display()))?;
        Some(Constraint::JsonSchema(schema))
    } else if a.json_object {
        Some(Constraint::JsonObject)
    } else if let Some(r) = &a.regex {
        Some(Constraint::Regex(r.clone()))
    } else if let Some(p) = &a.grammar {
        Some(Constraint::Lark(read(p)?))
    } else {
        None
    })
}

fn generate(a: GenerateArgs) -> Result<(), String> {
    let prompts: Vec<PromptSpec> = match (&a.prompt, &a.prompts) {
        (Some(p), _) => vec![PromptSpec::text(p, a.chat)],
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            let v: Vec<serde_json::Value> = serde_json::from_str(&text)
                .map_err(|e| format!("{}: expected a JSON array of prompts: {e}", f.display()))?;
            v.iter()
                .enumerate()
                .map(|(i, p)| {
                    PromptSpec::parse(p, a.chat)
                        .map_err(|e| format!("{}: prompt {i}: {e}", f.display()))
                })
                .collect::<Result<_, _>>()?
        }
        (None, None) => unreachable!("clap requires --prompt or --prompts"),
    };
    let constraint = constraint(&a)?;
    let cfg = engine_config(&a.engine)?;
    let t_load = Instant::now();
    let md = ModelDir::open(&a.model_dir).map_err(|e| e.to_string())?;
    let max_new = a
        .max_new_tokens
        .or(md.generation.max_new_tokens)
        .unwrap_or(256);
    let (client, loading) = EngineClient::from_model_dir(md, cfg).map_err(|e| e.to_string())?;
    loading.wait()?;
    let load_time = t_load.elapsed();
    eprintln!("pa-engine: KV cache: {}", client.snapshot().kv_cache);
    let params = GenerationParams {
        max_new_tokens: max_new,
        sampling: Sampling {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
        },
        penalties: Penalties {
            repetition: a.repetition_penalty,
            presence: a.presence_penalty,
            frequency: a.frequency_penalty,
            logit_bias: Vec::new(),
        },
        seed: a.seed,
        stop: a.stop.clone(),
        stop_token_ids: None,
        ignore_eos: a.ignore_eos,
        n: a.n,
        logprobs: a.logprobs,
        prompt_logprobs: None,
        constraint,
    };
    // Requests in input order, each at its arrival time (tokenized on this thread); a refused
    // prompt fails alone.
    let n = prompts.len();
    let mut runs: Vec<Run> = (0..n).map(|_| Run::default()).collect();
    let mut by_request: HashMap<u64, usize> = HashMap::new();
    let mut order: Vec<usize> = (0..n).collect();
    order.sort_by_key(|&i| prompts[i].arrival);
    let mut prompts: Vec<Option<PromptSpec>> = prompts.into_iter().map(Some).collect();
    let (mut next, mut failed, mut pending) = (0, 0, 0);
    let stream = n == 1 && a.n == 1 && !a.json;
    let stdout = std::io::stdout();
    let (tx, rx) = mpsc::channel::<Update>();
    let t_gen = Instant::now();
    let mut first_token: Option<Duration> = None;
    loop {
        // The prompts due now, tokenized first and submitted together: the engine adds them
        // before its next step, so the schedule does not depend on tokenizing speed.
        let mut due = Vec::new();
        while next < n
            && prompts[order[next]]
                .as_ref()
                .is_some_and(|p| p.arrival <= t_gen.elapsed())
        {
            let i = order[next];
            next += 1;
            let Some(p) = prompts[i].take() else { continue };
            match client.prepare(p.prompt, params.clone()) {
                Ok(prepared) => due.push((i, prepared)),
                Err(e) => {
                    eprintln!("pa-engine: prompt {i}: request refused: {e}");
                    failed += 1;
                }
            }
        }
        if !due.is_empty() {
            let (idx, batch): (Vec<usize>, Vec<_>) = due
                .into_iter()
                .map(|(i, p)| (i, (p, Box::new(tx.clone()) as Box<dyn Reply>)))
                .unzip();
            let ids = client.submit_prepared(batch).map_err(|e| e.to_string())?;
            for (i, id) in idx.into_iter().zip(ids) {
                runs[i].id = Some(id);
                runs[i].times.arrival = t_gen.elapsed();
                by_request.insert(id, i);
                pending += 1;
            }
        }
        if next == n && pending == 0 {
            break;
        }
        let update = match prompts
            .get(*order.get(next).unwrap_or(&0))
            .and_then(Option::as_ref)
        {
            Some(p) if next < n => {
                match rx.recv_timeout(p.arrival.saturating_sub(t_gen.elapsed())) {
                    Ok(u) => u,
                    Err(mpsc::RecvTimeoutError::Timeout) => continue,
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        return Err("the engine stopped".into())
                    }
                }
            }
            _ => rx.recv().map_err(|_| "the engine stopped".to_string())?,
        };
        let at = t_gen.elapsed();
        let event = match update {
            Update::Accepted {
                request,
                prompt_tokens,
            } => {
                runs[by_request[&request]].prompt_tokens = prompt_tokens;
                continue;
            }
            Update::Refused { request, error } => {
                let i = by_request[&request];
                runs[i].id = None;
                eprintln!("pa-engine: prompt {i}: request refused: {error}");
                failed += 1;
                pending -= 1;
                continue;
            }
            Update::Failed { message, .. } => return Err(message),
            Update::Event(e) => e,
        };
        let run = &mut runs[by_request[&event.request()]];
        match event {
            Event::PromptLogprobs { .. } => {}
            Event::Token {
                index,
                text,
                logprobs,
                ..
            } => {
                if let Some(l) = logprobs {
                    run.logprobs.entry(index).or_default().push(l);
                }
                first_token.get_or_insert(at);
                if index == 0 {
                    let t = &mut run.times;
                    t.first.get_or_insert(at);
                    t.last = at;
                    t.tokens += 1;
                }
                if stream && !text.is_empty() {
                    let mut out = stdout.lock();
                    let _ = out.write_all(text.as_bytes());
                    let _ = out.flush();
                }
            }
            Event::Finished {
                index,
                reason,
                token_ids,
                text,
                ..
            } => {
                run.outputs.insert(
                    index,
                    Done {
                        token_ids,
                        text,
                        reason,
                        logprobs: run.logprobs.remove(&index).unwrap_or_default(),
                    },
                );
                if run.outputs.len() == a.n {
                    pending -= 1;
                }
            }
        }
    }
    let gen_time = t_gen.elapsed();
    let mut out = stdout.lock();
    if stream {
        let _ = writeln!(out);
    }
    for (i, run) in runs.iter().enumerate() {
        if run.id.is_none() {
            continue;
        }
        let outputs: Vec<&Done> = (0..a.n).filter_map(|k| run.outputs.get(&k)).collect();
        let Some(first) = outputs.first() else {
            continue;
        };
        if a.json {
            let mut obj = first.json(a.logprobs.is_some());
            obj["index"] = json!(i);
            obj["prompt_tokens"] = json!(run.prompt_tokens);
            if a.timings {
                let t = &run.times;
                let ms = |d: Duration| d.as_secs_f64() * 1e3;
                let first = t.first.unwrap_or(t.arrival);
                obj["arrival_s"] = json!(t.arrival.as_secs_f64());
                obj["ttft_ms"] = json!(ms(first.saturating_sub(t.arrival)));
                obj["tpot_ms"] = json!(if t.tokens > 1 {
                    ms(t.last - first) / (t.tokens - 1) as f64
                } else {
                    0.0
                });
                obj["e2e_ms"] = json!(ms(t.last.saturating_sub(t.arrival)));
            }
            if a.n > 1 {
                obj["samples"] = outputs
                    .iter()
                    .map(|d| d.json(a.logprobs.is_some()))
                    .collect();
            }
            let _ = writeln!(out, "{obj}");
        } else if !stream {
            for (k, d) in outputs.iter().enumerate() {
                let tag = if a.n > 1 {
                    format!("[{i}.{k}]")
                } else {
                    format!("[{i}]")
                };
                let _ = writeln!(out, "{tag} {}", d.text);
            }
        }
    }
    if a.stats {
        // The engine publishes its figures after a step's events: stopping it waits for those
        // of the last step.
        client.stop();
        let m = client.snapshot();
        let (s, c) = (m.stats, m.counters);
        let secs = gen_time.as_secs_f64();
        eprintln!(
            "load {:.2} s; {} prompts, {} prompt tokens, {} generated in {:.3} s ({:.1} tokens/s), first token after {:.1} ms; \
             {} steps, {:.1}% of step time in infer() ({:.1} us a step outside it); {} blocks of {} ({}), {} preemptions, {} prefix hits ({} tokens), {} forks, \
             {} evictions ({} blocks), {} blocks rotated; {} draft tokens, {} accepted ({:.1}%); \
             after the run {} blocks used, prefix cache {} blocks (digest {:016x})",
            load_time.as_secs_f64(),
            n,
            s.prompt_tokens,
            s.generated_tokens,
            secs,
            s.generated_tokens as f64 / secs.max(1e-9),
            first_token.map_or(0.0, |d| d.as_secs_f64() * 1e3),
            s.steps,
            100.0 * s.infer_time.as_secs_f64() / s.step_time.as_secs_f64().max(1e-9),
            1e6 * s.step_time.saturating_sub(s.infer_time).as_secs_f64() / (s.steps.max(1) as f64),
            m.num_blocks,
            m.block_size,
            m.cache_type.map_or("?", ElemType::name),
            c.preemptions,
            c.prefix_hits,
            c.prefix_hit_tokens,
            c.forks,
            c.evictions,
            c.evicted_blocks,
            c.rotated_blocks,
            s.draft_tokens,
            s.accepted_draft_tokens,
            100.0 * s.accepted_draft_tokens as f64 / s.draft_tokens.max(1) as f64,
            m.cache.used_blocks,
            m.cache.prefix_blocks,
            m.cache.prefix_digest,
        );
        if s.draft_infer_time > Duration::ZERO {
            eprintln!(
                "draft model: {:.1}% of step time in its infer() ({:.1} us a step)",
                100.0 * s.draft_infer_time.as_secs_f64() / s.step_time.as_secs_f64().max(1e-9),
                1e6 * s.draft_infer_time.as_secs_f64() / (s.steps.max(1) as f64),
            );
        }
        if s.mask_time > Duration::ZERO {
            eprintln!(
                "structured output: {:.1} us of mask computation a step ({:.1}% of step time), \
                 {:.1} us a step on the step's own path ({:.1}%)",
                1e6 * s.mask_time.as_secs_f64() / (s.steps.max(1) as f64),
                100.0 * s.mask_time.as_secs_f64() / s.step_time.as_secs_f64().max(1e-9),
                1e6 * s.mask_critical_time.as_secs_f64() / (s.steps.max(1) as f64),
                100.0 * s.mask_critical_time.as_secs_f64() / s.step_time.as_secs_f64().max(1e-9),
            );
        }
    }
    if failed > 0 {
        return Err(format!("{failed} of {n} prompts were refused"));
    }
    Ok(())
}
