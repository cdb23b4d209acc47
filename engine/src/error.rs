//! The engine's errors. None panics: every failure of a model directory, the tokenizer,
//! OpenVINO, the op or a request comes back as one of these.

use std::path::{Path, PathBuf};

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// The model directory or its graph cannot be used; names the file (and the graph input).
    #[error("{}: {detail}", path.display())]
    Model { path: PathBuf, detail: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// OpenVINO refused or failed (conversion, compilation, inference).
    #[error("OpenVINO: {0}")]
    OpenVino(String),
    /// A request that cannot run (too long for the context or the KV cache, bad parameters);
    /// the engine and its other requests go on.
    #[error("request refused: {0}")]
    Request(crate::request::RequestError),
    /// A step's model run failed: the requests in it were ended (their blocks freed, nothing
    /// of the step cached); the engine and its other requests go on.
    #[error("the model run failed (requests {requests:?} ended): {message}")]
    StepFailed {
        requests: Vec<crate::request::RequestId>,
        message: String,
    },
    /// The engine's configuration.
    #[error("engine configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Cache(#[from] paged_attention::PaError),
}

impl EngineError {
    pub(crate) fn io(path: &Path, source: std::io::Error) -> EngineError {
        EngineError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}

impl From<cxx::Exception> for EngineError {
    fn from(e: cxx::Exception) -> EngineError {
        EngineError::OpenVino(e.what().to_string())
    }
}

/// A JSON file of the model directory, parsed; errors name the file.
pub(crate) fn read_json(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path).map_err(|e| EngineError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| EngineError::Model {
        path: path.to_path_buf(),
        detail: format!("not valid JSON: {e}"),
    })
}
