//! x86_64 micro-kernels, one file (or one file per trait) per instruction-set tier; each tier's
//! scalar twin lives in the parent module.
//!
//! - `avx2`: AVX2 + FMA + F16C [`Micro`], chosen only after runtime detection.
//! - `avx2_decode`: its [`DecodeMicro`] loops (decode tiles, with software prefetch).
//! - `avx2_tile`: its [`TileMicro`] loops (prefill tiles on transposed logits).

// The tier files name the traits as `super::Micro` etc., as they did beside them.
pub(crate) use super::{DecodeMicro, Micro, TileMicro};

pub(crate) mod avx2;
pub(crate) mod avx2_decode;
mod avx2_tile;
