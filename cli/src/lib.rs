//! What the `pa` and `pa_machine` commands run on top of the op crate (`paged_attention`), kept
//! out of the shipped C library and the OpenVINO extension:
//!
//! - [`ir`]: the OpenVINO IR reader (quick-xml) and the small executor that runs PagedAttention
//!   models through [`paged_attention::execute`]; `pa run` and the golden suite use it.
//! - [`npy`]: `.npy` files in and out.
//! - [`case`]: the golden suite's harness (`case.json`, expected files, tolerances, OpenVINO runs
//!   through `tools/ov_run_case.py`); `pa conformance`.
//! - [`openvino`]: where OpenVINO's libraries are at run time, for `pa generate` / `pa serve`,
//!   which run `pa-engine` (linked without a RUNPATH) with them.
//! - [`simulate`]: a synthetic serving workload through the library's KV-cache scheduler, paged
//!   against contiguous allocation; `pa simulate`.

pub mod case;
pub mod ir;
pub mod npy;
pub mod openvino;
pub mod simulate;
