//! PagedAttention for CPUs: the 17-input / 2-output op of OpenVINO's `ie_internal_opset`
//! (contract: `docs/contract.md`), with a C ABI (`include/paged_attention.h`) and a KV-cache
//! manager. The OpenVINO extension module (C++ shim in `cpp/`) is the `paged_attention_openvino`
//! crate in `openvino/`, which links this one; the `pa` command, the IR loader and the cache
//! simulator are the `paged_attention_cli` crate in `cli/`.
//!
//! - [`op`]: the contract, shape inference and validation.
//! - [`kernel`]: the CPU kernels (scalar reference and fast paths) and [`execute`].
//! - [`cache`]: the KV-cache block manager and scheduler that feed the op.
//! - [`ffi`]: the `extern "C"` functions of the header; conversion and error mapping only.
//! - [`alloc`]: fallible allocation of caller-sized buffers.

pub mod alloc;
pub mod cache;
pub mod dtype;
pub mod error;
pub mod ffi;
pub mod kernel;
pub mod op;
pub mod tensor;
pub mod threads;

pub use dtype::{ElemType, Float};
pub use error::{PaError, Status};
pub use kernel::{execute, execute_on, execute_reference};
pub use op::{infer_shapes, validate, PaInputs, PaOutputs, Plan};
pub use tensor::{Elems, ElemsMut, Tensor, TensorMut};
pub use threads::Runner;

/// The README's Rust examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

/// The cache manager's Rust example (docs/cache.md), compiled and run as a doctest.
#[cfg(doctest)]
#[doc = include_str!("../docs/cache.md")]
pub struct CacheDocDoctests;
