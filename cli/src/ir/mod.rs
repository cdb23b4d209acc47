//! OpenVINO IR (v10/v11 XML with its `.bin`) for PagedAttention models: a reader, a checker and a
//! small executor. (The golden suite's harness, its `.npy` files and `case.json`, are
//! [`crate::case`] and [`crate::npy`].)
//!
//! - `xml`: the document into layers, ports and edges (`rt_info` skipped), nothing interpreted.
//! - `types`: precision strings and dimensions.
//! - `graph`: layer kinds, Const data from the `.bin`, edge checks, shape inference: [`Model`].
//! - `exec`: [`Model::run`], caches written in place in the caller's tensors.
//! - `owned`: [`OwnedTensor`], the tensors the executor and its callers own.
//!
//! Supported layers: `Parameter`, `Const`, `Convert` (f32/f16/bf16 among themselves, i32 to
//! i32), `PagedAttention` (version `ie_internal_opset`, 9 to 17 inputs) and `Result`.

pub mod error;
pub mod exec;
pub mod graph;
pub mod owned;
pub mod types;
pub mod xml;

pub use error::IrError;
pub use exec::{CacheAfter, CacheLocation, Outputs, ResultTensor};
pub use graph::{Kind, Layer, Model, PaFeed, ParamInfo, Port};
pub use owned::{OwnedData, OwnedTensor, TensorError};
pub use types::IrType;
