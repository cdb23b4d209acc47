//! The engine around the `paged_attention` op: a model directory exported by optimum-intel in,
//! text out. [`Engine`] converts the stateful graph to our op in memory (OpenVINO's
//! `SDPAToPagedAttention`, then every `PagedAttentionExtension` replaced by our `PagedAttention`),
//! owns one KV cache pair per layer, and serves requests with the project's continuous-batching
//! scheduler and block manager.
//!
//! ```no_run
//! use paged_attention_engine::{Engine, EngineConfig, Event, GenerationParams};
//! let mut engine = Engine::load("model_dir", &EngineConfig::default())?;
//! let prompt = engine.encode_prompt("Hello", false)?;
//! engine.add_request(prompt, GenerationParams { max_new_tokens: 16, ..Default::default() })?;
//! engine.run_to_completion(|e| if let Event::Token { text, .. } = e { print!("{text}") })?;
//! # Ok::<(), paged_attention_engine::EngineError>(())
//! ```

mod engine;
mod error;
mod model_dir;
mod ov;
mod sampling;
pub mod server;
mod tokenizer;

pub use engine::{
    CacheType, Engine, EngineConfig, EngineStats, Event, GenerationParams, Precision, RequestId,
};
pub use error::{EngineError, Result};
pub use model_dir::{GenerationDefaults, ModelConfig, ModelDir};
pub use paged_attention::cache::{EvictionPolicy, FinishReason};
pub use sampling::Sampling;
pub use tokenizer::{ChatMessage, StreamDecoder, TextTokenizer};

/// How [`convert_ir`] converts.
#[derive(Clone, Debug)]
pub struct Conversion {
    pub block_size: usize,
    pub cache_type: CacheType,
    /// Also the scores outputs, score window and rotation inputs (what cache eviction feeds).
    pub serving: bool,
    /// Ask OpenVINO's pass for xattention, adaptive R-KV or qq_bias inputs too; the converter
    /// then refuses the graph (our op has none of them), naming the input.
    pub allow_xattention: bool,
    pub allow_adaptive_rkv: bool,
    pub allow_qq_bias: bool,
}

impl Default for Conversion {
    fn default() -> Conversion {
        Conversion {
            block_size: 32,
            cache_type: CacheType::F32,
            serving: false,
            allow_xattention: false,
            allow_adaptive_rkv: false,
            allow_qq_bias: false,
        }
    }
}

/// Converts a stateful LLM IR to a paged IR on our op (`xml_out` and its `.bin`), as the engine
/// does in memory. Returns the number of attention layers converted.
pub fn convert_ir(
    xml_in: &std::path::Path,
    xml_out: &std::path::Path,
    how: &Conversion,
) -> Result<usize> {
    let s = |p: &std::path::Path| {
        p.to_str()
            .map(str::to_owned)
            .ok_or_else(|| EngineError::Model {
                path: p.to_path_buf(),
                detail: "path is not UTF-8".into(),
            })
    };
    let opts = ov::ConvertOptions {
        block_size: how.block_size as u32,
        cache_type: how.cache_type.as_str().into(),
        serving: how.serving,
        gather_logits: false,
        allow_xattention: how.allow_xattention,
        allow_adaptive_rkv: how.allow_adaptive_rkv,
        allow_qq_bias: how.allow_qq_bias,
    };
    let session = ov::ffi::open_session(&s(xml_in)?, &opts).map_err(|e| EngineError::Model {
        path: xml_in.to_path_buf(),
        detail: e.what().to_string(),
    })?;
    session.save(&s(xml_out)?)?;
    Ok(session.converted_layers())
}
