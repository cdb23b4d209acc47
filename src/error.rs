//! The one error type of the op, and the status codes it maps to at the C ABI.
//!
//! Every message names the input (or output) concerned and the value found, so a caller can fix
//! the call from the message alone.

use crate::dtype::ElemType;

/// Defines [`Status`] and its C names from one table, so a code, its variant and its
/// `PA_STATUS_*` name cannot drift apart (tests/header_abi.rs checks the table against the header).
macro_rules! status_table {
    ($($variant:ident = $code:literal => $name:literal,)*) => {
        /// Status codes of the C ABI (`PA_STATUS_*` in `include/paged_attention.h`). The numbers
        /// never change meaning and are never reused.
        #[repr(i32)]
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Status {
            $($variant = $code,)*
        }

        impl Status {
            /// Every status, in code order.
            pub const ALL: &'static [Status] = &[$(Status::$variant,)*];

            /// The header's name of the code (`c"PA_STATUS_VALUE"`).
            pub const fn c_name(self) -> &'static std::ffi::CStr {
                match self {
                    $(Status::$variant => $name,)*
                }
            }
        }
    };
}

status_table! {
    Ok = 0 => c"PA_STATUS_OK",
    NullPointer = 1 => c"PA_STATUS_NULL_POINTER",
    InvalidArgument = 2 => c"PA_STATUS_INVALID_ARGUMENT",
    InputCount = 3 => c"PA_STATUS_INPUT_COUNT",
    Rank = 4 => c"PA_STATUS_RANK",
    ElementType = 5 => c"PA_STATUS_ELEMENT_TYPE",
    Shape = 6 => c"PA_STATUS_SHAPE",
    Value = 7 => c"PA_STATUS_VALUE",
    BufferSize = 8 => c"PA_STATUS_BUFFER_SIZE",
    Alignment = 9 => c"PA_STATUS_ALIGNMENT",
    Panic = 10 => c"PA_STATUS_PANIC",
    OutOfBlocks = 11 => c"PA_STATUS_OUT_OF_BLOCKS",
    UnknownSequence = 12 => c"PA_STATUS_UNKNOWN_SEQUENCE",
    InvalidState = 13 => c"PA_STATUS_INVALID_STATE",
    OutOfMemory = 14 => c"PA_STATUS_OUT_OF_MEMORY",
}

impl Status {
    /// The status with this code, if there is one.
    pub fn from_code(code: i32) -> Option<Status> {
        Status::ALL.iter().copied().find(|s| *s as i32 == code)
    }
}

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PaError {
    #[error("a NULL pointer was passed for {what}")]
    NullPointer { what: String },

    #[error("invalid argument: {detail}")]
    InvalidArgument { detail: String },

    #[error("PagedAttention takes 9 to 17 inputs, but {found} were given")]
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
