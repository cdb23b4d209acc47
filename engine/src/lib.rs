//! The engine around the `paged_attention` op: a model directory exported by optimum-intel in,
//! text out, in the shape of vLLM v1:
//!
//! - [`request`]: a request's prompt, parameters and events;
//! - [`input_processor`]: prompts to token ids, on the caller's thread;
//! - `model_runner` (with `kv_cache`): the OpenVINO session, the conversion to our op, the step's
//!   inputs and the cache tensors;
//! - `output_processor`: tokens to text, stop strings, finish reasons;
//! - `speculative`: prompt-lookup drafts and how many a step verifies; `draft_model`: drafts
//!   from a small model with its own runner and KV cache;
//! - [`engine_core`]: `add_request`, `abort`, `step` (schedule, run, sample, update);
//! - [`client`]: the one driver, which owns the engine thread; `pa generate` and `pa serve` use it;
//! - [`server`]: HTTP, OpenAI's API and server-sent events, on a client;
//! - [`metrics`]: the client's figures and their Prometheus text; [`kv_events`]: the prefix
//!   cache's changes published for routers in vLLM's format;
//! - [`tools`]: tool calls: the parsers of a model's calls, and the conversation a template gets.
//!
//! ```no_run
//! use paged_attention_engine::{EngineConfig, EngineCore, Event, GenerationParams};
//! let mut engine = EngineCore::load("model_dir", &EngineConfig::default())?;
//! let prompt = engine.tokenizer().encode("Hello", true)?;
//! engine.add_request(0, prompt, GenerationParams { max_new_tokens: 16, ..Default::default() })?;
//! engine.run_to_completion(|e| if let Event::Token { text, .. } = e { print!("{text}") })?;
//! # Ok::<(), paged_attention_engine::EngineError>(())
//! ```

pub mod client;
mod config;
mod convert;
mod draft_model;
pub mod engine_core;
mod error;
pub mod input_processor;
mod kv_cache;
pub mod kv_events;
pub mod memory;
pub mod metrics;
mod model_dir;
mod model_runner;
mod output_processor;
mod ov;
pub mod request;
mod sampling;
pub mod server;
mod speculative;
pub mod structured;
mod tokenizer;
pub mod tools;

pub use client::{CacheBlocks, EngineClient, Loading, Prepared, Reply};
pub use config::{EngineConfig, KvCacheSize, Precision, KV_AUTO_SHARE};
pub use convert::{convert_ir, Conversion};
pub use engine_core::{EngineCore, EngineStats};
pub use error::{EngineError, Result};
pub use input_processor::InputProcessor;
pub use kv_cache::KvCachePlan;
pub use model_dir::{GenerationDefaults, ModelConfig, ModelDir};
pub use paged_attention::cache::{EvictionPolicy, FinishReason};
pub use request::{
    ChatMessage, Constraint, Event, GenerationParams, Prompt, RequestError, RequestId, Update,
};
pub use sampling::{Penalties, Sampling, TokenLogprobs};
pub use speculative::{DraftLength, SpeculativeConfig, SpeculativeMethod, VERIFY_ROWS};
pub use tokenizer::{StreamDecoder, TextTokenizer};
