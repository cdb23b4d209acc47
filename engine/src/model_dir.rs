//! A model directory as `optimum-cli export openvino --task text-generation-with-past` writes it:
//! `openvino_model.xml/.bin` (stateful), `config.json`, `generation_config.json`, `tokenizer.json`
//! and `tokenizer_config.json` (its chat template, special tokens). The OpenVINO tokenizer IRs
//! (`openvino_tokenizer.xml`) may be there too; the engine tokenizes with `tokenizer.json`.

use crate::error::{read_json, EngineError, Result};
use crate::tokenizer::TextTokenizer;
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// What the engine reads of `config.json`.
#[derive(Clone, Debug, Default)]
pub struct ModelConfig {
    pub model_type: Option<String>,
    /// The model's context: prompt plus generated tokens at most.
    pub max_position_embeddings: Option<usize>,
    pub vocab_size: Option<usize>,
    /// RoPE base (`rope_theta`, default 10000): cache eviction re-rotates kept keys with it.
    pub rope_theta: f64,
    /// End-of-sequence ids of `config.json` (used when `generation_config.json` has none).
    pub eos_token_ids: Vec<u32>,
}

/// What the engine reads of `generation_config.json`.
#[derive(Clone, Debug, Default)]
pub struct GenerationDefaults {
    /// Token ids that end a sequence (`eos_token_id`, a number or a list).
    pub eos_token_ids: Vec<u32>,
    pub max_new_tokens: Option<usize>,
}

/// A loaded model directory.
pub struct ModelDir {
    pub path: PathBuf,
    /// `openvino_model.xml`.
    pub xml: PathBuf,
    pub config: ModelConfig,
    pub generation: GenerationDefaults,
    pub tokenizer: Arc<TextTokenizer>,
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|n| vec![n as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|n| n.as_u64().map(|n| n as u32))
            .collect(),
        _ => Vec::new(),
    }
}

fn usize_field(v: &Value, key: &str) -> Option<usize> {
    v.get(key).and_then(Value::as_u64).map(|n| n as usize)
}

impl ModelDir {
    /// Reads the directory's configuration and tokenizer. Every required file that is missing or
    /// unreadable is an error naming it.
    pub fn open(path: impl AsRef<Path>) -> Result<ModelDir> {
        let path = path.as_ref().to_path_buf();
        if !path.is_dir() {
            return Err(EngineError::Model {
                path,
                detail: "not a directory (expected a model directory exported by optimum-intel)"
                    .into(),
            });
        }
        let required = [
            "openvino_model.xml",
            "openvino_model.bin",
            "config.json",
            "tokenizer.json",
        ];
        for f in required {
            let p = path.join(f);
            if !p.is_file() {
                return Err(EngineError::Model {
                    path: p,
                    detail: "missing: a model directory needs openvino_model.xml/.bin (stateful, \
                             `optimum-cli export openvino --task text-generation-with-past`), \
                             config.json and tokenizer.json"
                        .into(),
                });
            }
        }
        let cfg = read_json(&path.join("config.json"))?;
        let config = ModelConfig {
            model_type: cfg
                .get("model_type")
                .and_then(Value::as_str)
                .map(str::to_owned),
            max_position_embeddings: usize_field(&cfg, "max_position_embeddings")
                .or_else(|| usize_field(&cfg, "n_positions"))
                .or_else(|| usize_field(&cfg, "max_sequence_length")),
            vocab_size: usize_field(&cfg, "vocab_size"),
            rope_theta: cfg
                .get("rope_theta")
                .and_then(Value::as_f64)
                .unwrap_or(10000.0),
            eos_token_ids: ids(cfg.get("eos_token_id")),
        };
        let gen_path = path.join("generation_config.json");
        let generation = if gen_path.is_file() {
            let g = read_json(&gen_path)?;
            GenerationDefaults {
                eos_token_ids: ids(g.get("eos_token_id")),
                max_new_tokens: usize_field(&g, "max_new_tokens"),
            }
        } else {
            GenerationDefaults::default()
        };
        let tokenizer = Arc::new(TextTokenizer::from_dir(&path)?);
        Ok(ModelDir {
            xml: path.join("openvino_model.xml"),
            path,
            config,
            generation,
            tokenizer,
        })
    }

    /// The ids that end a sequence: `generation_config.json`'s, else `config.json`'s, else the
    /// tokenizer's end-of-sequence token.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        if !self.generation.eos_token_ids.is_empty() {
            return self.generation.eos_token_ids.clone();
        }
        if !self.config.eos_token_ids.is_empty() {
            return self.config.eos_token_ids.clone();
        }
        self.tokenizer.eos_token_id().into_iter().collect()
    }
}
