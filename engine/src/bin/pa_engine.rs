//! `pa-engine`: the engine's command line (`pa generate` and `pa convert` run it). It links
//! OpenVINO, which the C library and the `pa` binary do not.

use clap::{Args, Parser, Subcommand};
use paged_attention_engine::{
    convert_ir, CacheType, Engine, EngineConfig, Event, FinishReason, GenerationParams, ModelDir,
    Precision, Sampling,
};
use serde_json::json;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

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
}

const GENERATE_ABOUT: &str = "\
Generates text from MODEL_DIR, a directory as `optimum-cli export openvino --task \
text-generation-with-past` writes it (openvino_model.xml/.bin, config.json, \
generation_config.json, tokenizer.json, tokenizer_config.json). The stateful graph is converted \
in memory to this project's PagedAttention op, compiled on the CPU, and served by the project's \
continuous-batching scheduler: all prompts of --prompts run as one continuous batch.

With one prompt the text is streamed to stdout as it is generated. With --json, one JSON object \
per prompt and line, in input order: index, prompt_tokens, token_ids (generated ids only), text, \
finish_reason (length, stop), and with --n > 1 `samples` (every output).";

#[derive(Args)]
struct EngineArgs {
    /// KV cache element type (u8 is OpenVINO's quantized layout, its CPU default).
    #[arg(long, default_value = "u8", value_parser = parse_cache_type)]
    cache_type: CacheType,
    /// KV cache size in GB, over all layers.
    #[arg(long, default_value_t = 1.0)]
    kv_cache_size: f64,
    /// OpenVINO's inference precision hint (default: OpenVINO's for this CPU).
    #[arg(long, value_parser = parse_precision)]
    precision: Option<Precision>,
    /// Inference threads (default: all cores).
    #[arg(long)]
    threads: Option<usize>,
    /// Token rows per step; longer prompts are prefilled in chunks.
    #[arg(long, default_value_t = 512)]
    max_batched_tokens: usize,
    /// Sequences per step.
    #[arg(long, default_value_t = 256)]
    max_seqs: usize,
    /// Tokens per KV cache block.
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    /// Do not reuse the cached blocks of equal prompt prefixes.
    #[arg(long)]
    no_prefix_caching: bool,
}

#[derive(Args)]
struct GenerateArgs {
    model_dir: PathBuf,
    /// The prompt.
    #[arg(long, conflicts_with = "prompts", required_unless_present = "prompts")]
    prompt: Option<String>,
    /// A JSON file holding an array of prompt strings, run as one continuous batch.
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
    /// One JSON object per prompt and line.
    #[arg(long)]
    json: bool,
    /// Print the engine's figures to stderr at the end.
    #[arg(long)]
    stats: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

#[derive(Args)]
struct ConvertArgs {
    input: PathBuf,
    output: PathBuf,
    #[arg(long, default_value_t = 32)]
    block_size: usize,
    #[arg(long, default_value = "f32", value_parser = parse_cache_type)]
    cache_type: CacheType,
}

fn parse_cache_type(s: &str) -> Result<CacheType, String> {
    s.parse()
}
fn parse_precision(s: &str) -> Result<Precision, String> {
    s.parse()
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Generate(a) => generate(a),
        Command::Convert(a) => convert(a),
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("pa-engine: {e}");
            ExitCode::FAILURE
        }
    }
}

fn convert(a: ConvertArgs) -> Result<(), String> {
    let n =
        convert_ir(&a.input, &a.output, a.block_size, a.cache_type).map_err(|e| e.to_string())?;
    println!("{}: {n} PagedAttention node(s)", a.output.display());
    Ok(())
}

fn engine_config(a: &EngineArgs) -> Result<EngineConfig, String> {
    if !(a.kv_cache_size > 0.0 && a.kv_cache_size.is_finite()) {
        return Err(format!(
            "--kv-cache-size must be a positive number of GB, got {}",
            a.kv_cache_size
        ));
    }
    Ok(EngineConfig {
        cache_type: a.cache_type,
        kv_cache_bytes: (a.kv_cache_size * 1e9) as usize,
        block_size: a.block_size,
        max_batched_tokens: a.max_batched_tokens,
        max_seqs: a.max_seqs,
        prefix_caching: !a.no_prefix_caching,
        precision: a.precision,
        threads: a.threads,
        device: "CPU".into(),
    })
}

struct Done {
    token_ids: Vec<u32>,
    text: String,
    reason: FinishReason,
}

fn generate(a: GenerateArgs) -> Result<(), String> {
    let prompts: Vec<String> = match (&a.prompt, &a.prompts) {
        (Some(p), _) => vec![p.clone()],
        (None, Some(f)) => {
            let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
            serde_json::from_str(&text).map_err(|e| {
                format!(
                    "{}: expected a JSON array of prompt strings: {e}",
                    f.display()
                )
            })?
        }
        (None, None) => unreachable!("clap requires --prompt or --prompts"),
    };
    let cfg = engine_config(&a.engine)?;
    let t_load = Instant::now();
    let md = ModelDir::open(&a.model_dir).map_err(|e| e.to_string())?;
    let max_new = a
        .max_new_tokens
        .or(md.generation.max_new_tokens)
        .unwrap_or(256);
    let mut engine = Engine::from_model_dir(md, &cfg).map_err(|e| e.to_string())?;
    let load_time = t_load.elapsed();
    let params = GenerationParams {
        max_new_tokens: max_new,
        sampling: Sampling {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
        },
        seed: a.seed,
        stop: a.stop.clone(),
        stop_token_ids: None,
        ignore_eos: a.ignore_eos,
        n: a.n,
    };
    // Requests in input order; a refused prompt fails alone.
    let mut ids = Vec::with_capacity(prompts.len());
    let mut prompt_lens = Vec::with_capacity(prompts.len());
    let mut failed = 0;
    for (i, p) in prompts.iter().enumerate() {
        let r = engine.encode_prompt(p, a.chat).and_then(|toks| {
            let n = toks.len();
            engine.add_request(toks, params.clone()).map(|id| (id, n))
        });
        match r {
            Ok((id, n)) => {
                ids.push(Some(id));
                prompt_lens.push(n);
            }
            Err(e) => {
                eprintln!("pa-engine: prompt {i}: {e}");
                failed += 1;
                ids.push(None);
                prompt_lens.push(0);
            }
        }
    }
    let stream = prompts.len() == 1 && !a.json;
    let mut results: std::collections::HashMap<(u64, usize), Done> = Default::default();
    let stdout = std::io::stdout();
    let t_gen = Instant::now();
    let mut first_token: Option<std::time::Duration> = None;
    engine
        .run_to_completion(|e| match e {
            Event::Token { index, text, .. } => {
                first_token.get_or_insert_with(|| t_gen.elapsed());
                if stream && *index == 0 && !text.is_empty() {
                    let mut out = stdout.lock();
                    let _ = out.write_all(text.as_bytes());
                    let _ = out.flush();
                }
            }
            Event::Finished {
                request,
                index,
                reason,
                token_ids,
                text,
            } => {
                results.insert(
                    (*request, *index),
                    Done {
                        token_ids: token_ids.clone(),
                        text: text.clone(),
                        reason: *reason,
                    },
                );
            }
        })
        .map_err(|e| e.to_string())?;
    let gen_time = t_gen.elapsed();
    let mut out = stdout.lock();
    if stream {
        let _ = writeln!(out);
    }
    for (i, id) in ids.iter().enumerate() {
        let Some(id) = *id else { continue };
        let outputs: Vec<&Done> = (0..a.n).filter_map(|k| results.get(&(id, k))).collect();
        let Some(first) = outputs.first() else {
            continue;
        };
        if a.json {
            let mut obj = json!({
                "index": i,
                "prompt_tokens": prompt_lens[i],
                "token_ids": first.token_ids,
                "text": first.text,
                "finish_reason": first.reason.as_str(),
            });
            if a.n > 1 {
                obj["samples"] = outputs
                    .iter()
                    .map(|d| json!({"token_ids": d.token_ids, "text": d.text, "finish_reason": d.reason.as_str()}))
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
        let s = engine.stats();
        let c = engine.counters();
        let secs = gen_time.as_secs_f64();
        eprintln!(
            "load {:.2} s; {} prompts, {} prompt tokens, {} generated in {:.3} s ({:.1} tokens/s), first token after {:.1} ms; \
             {} steps, {:.1}% of step time in infer(); {} blocks of {} ({}), {} preemptions, {} prefix hits ({} tokens), {} forks",
            load_time.as_secs_f64(),
            prompts.len(),
            s.prompt_tokens,
            s.generated_tokens,
            secs,
            s.generated_tokens as f64 / secs.max(1e-9),
            first_token.map_or(0.0, |d| d.as_secs_f64() * 1e3),
            s.steps,
            100.0 * s.infer_time.as_secs_f64() / s.step_time.as_secs_f64().max(1e-9),
            engine.num_blocks(),
            engine.block_size(),
            engine.cache_type().as_str(),
            c.preemptions,
            c.prefix_hits,
            c.prefix_hit_tokens,
            c.forks,
        );
    }
    if failed > 0 {
        return Err(format!(
            "{failed} of {} prompts were refused",
            prompts.len()
        ));
    }
    Ok(())
}
