//! The IR loader's and executor's error type. Every message names the layer (by its IR id and
//! name), the edge, the file or the input concerned, and what was found.

use std::path::PathBuf;

use paged_attention::error::PaError;

#[derive(Debug, thiserror::Error)]
pub enum IrError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("malformed XML at byte {pos}: {detail}")]
    Xml { pos: u64, detail: String },

    /// The document is XML but not the shape of an IR (no `<net>`, a layer without an id...).
    #[error("not a valid IR: {detail}")]
    Structure { detail: String },

    #[error("layer {id} (`{name}`): unknown layer type `{ty}` (version `{version}`); supported: Parameter, Const, Convert, PagedAttention (ie_internal_opset), Result")]
    UnknownType {
        id: u64,
        name: String,
        ty: String,
        version: String,
    },

    #[error("layer {id} port {port}: unknown precision `{found}`")]
    Precision {
        id: u64,
        port: String,
        found: String,
    },

    #[error("layer {id} (`{name}`): {detail}")]
    Layer {
        id: u64,
        name: String,
        detail: String,
    },

    #[error("weights file {path} is missing or unreadable (needed by Const layer {id}): {source}")]
    MissingBin {
        path: PathBuf,
        id: u64,
        #[source]
        source: std::io::Error,
    },

    #[error("layer {id} (`{name}`): Const data at offset {offset}, size {size} lies outside the weights file ({bin_len} bytes)")]
    ConstOutOfBounds {
        id: u64,
        name: String,
        offset: u64,
        size: u64,
        bin_len: u64,
    },

    #[error("layer {id} (`{name}`): Const size {size} bytes does not match shape {shape:?} of {elem} ({expected} bytes)")]
    ConstSize {
        id: u64,
        name: String,
        size: u64,
        shape: Vec<usize>,
        elem: String,
        expected: String,
    },

    #[error("edge {from_layer}:{from_port} -> {to_layer}:{to_port}: {detail}")]
    Edge {
        from_layer: u64,
        from_port: u64,
        to_layer: u64,
        to_port: u64,
        detail: String,
    },

    #[error("layer {id} (`{name}`): {source}")]
    Op {
        id: u64,
        name: String,
        #[source]
        source: PaError,
    },

    #[error("input `{name}`: {detail}")]
    Input { name: String, detail: String },
}

impl IrError {
    pub(crate) fn layer(id: u64, name: &str, detail: impl Into<String>) -> IrError {
        IrError::Layer {
            id,
            name: name.to_string(),
            detail: detail.into(),
        }
    }
}

/// Where IR errors cross into the op's error type (the C ABI, callers holding `PaError`): the op's
/// own error is kept; everything else becomes an invalid argument carrying the full message.
impl From<IrError> for PaError {
    fn from(e: IrError) -> PaError {
        match e {
            IrError::Op { source, .. } => source,
            other => PaError::InvalidArgument {
                detail: other.to_string(),
            },
        }
    }
}
