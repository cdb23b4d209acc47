//! Test-only helpers shared by the integration tests.
//!
//! - `call`: owned tensors and a whole op call (inputs + output buffers) that tests can mutate
//!   freely, run through the Rust API, and snapshot byte for byte.
//! - `ref64`: a float64 reference of the op written from SPEC.md, and the seeded random case
//!   generator. It shares no code with the crate's kernels.
//! - `host`: a host's parallel-for on scoped threads that records its regions and task
//!   threads, and a call run on a given runner.
//! - `u8`: u8 caches in OpenVINO's layout for a case (built with the crate's byte-checked
//!   quantizer), and the case seen through the dequantized caches.
#![allow(dead_code)]

pub mod call;
pub mod host;
pub mod ref64;
pub mod u8;
