//! The one error type of the op, and the status codes it maps to at the C ABI.
//!
//! Every message names the input (or output) concerned and the value found, so a caller can fix
//! the call from the message alone.

use crate::dtype::ElemType;

/// Status codes of the C ABI (`PA_STATUS_*` in `include/paged_attention.h`). The numbers never
/// change meaning and are never reused.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Ok = 0,
    NullPointer = 1,
    InvalidArgument = 2,
    InputCount = 3,
    Rank = 4,
    ElementType = 5,
    Shape = 6,
    Value = 7,
    BufferSize = 8,
    Alignment = 9,
    Panic = 10,
    OutOfBlocks = 11,
    UnknownSequence = 12,
    InvalidState = 13,
    OutOfMemory = 14,
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PaError {
    #[error("a NULL pointer was passed for {what}")]
    NullPointer { what: String },

    #[error("invalid argument: {detail}")]
    InvalidArgument { detail: String },

    #[error("PagedAttention takes 9 to 16 inputs, but {found} were given")]
    InputCount { found: usize },

    #[error("rank of `{input}` should be {expected}, but it is {found}")]
    Rank {
        input: &'static str,
        expected: &'static str,
        found: usize,
    },

    #[error("element type of `{input}` should be {expected}, but it is {found}")]
    ElementType {
        input: &'static str,
        expected: String,
        found: ElemType,
    },

    #[error("{detail}")]
    Shape { input: &'static str, detail: String },

    #[error("{detail}")]
    Value { input: &'static str, detail: String },

    #[error("`{name}` buffer holds {found} elements, but {expected} are needed")]
    BufferSize {
        name: String,
        expected: usize,
        found: usize,
    },

    #[error("`{name}` data pointer is not aligned to {align} bytes")]
    Alignment { name: String, align: usize },

    #[error("internal error (panic caught at the C ABI): {0}")]
    Panic(String),

    #[error("out of KV-cache blocks: {detail}")]
    OutOfBlocks { detail: String },

    #[error("unknown sequence id {id}")]
    UnknownSequence { id: u64 },

    #[error("{detail}")]
    InvalidState { detail: String },

    #[error("out of memory: {what} needs {bytes} bytes, which could not be allocated")]
    OutOfMemory { what: String, bytes: usize },
}

impl PaError {
    pub fn status(&self) -> Status {
        match self {
            PaError::NullPointer { .. } => Status::NullPointer,
            PaError::InvalidArgument { .. } => Status::InvalidArgument,
            PaError::InputCount { .. } => Status::InputCount,
            PaError::Rank { .. } => Status::Rank,
            PaError::ElementType { .. } => Status::ElementType,
            PaError::Shape { .. } => Status::Shape,
            PaError::Value { .. } => Status::Value,
            PaError::BufferSize { .. } => Status::BufferSize,
            PaError::Alignment { .. } => Status::Alignment,
            PaError::Panic(_) => Status::Panic,
            PaError::OutOfBlocks { .. } => Status::OutOfBlocks,
            PaError::UnknownSequence { .. } => Status::UnknownSequence,
            PaError::InvalidState { .. } => Status::InvalidState,
            PaError::OutOfMemory { .. } => Status::OutOfMemory,
        }
    }

    pub(crate) fn shape(input: &'static str, detail: impl Into<String>) -> PaError {
        PaError::Shape {
            input,
            detail: detail.into(),
        }
    }

    pub(crate) fn value(input: &'static str, detail: impl Into<String>) -> PaError {
        PaError::Value {
            input,
            detail: detail.into(),
        }
    }
}

pub type Result<T, E = PaError> = std::result::Result<T, E>;
