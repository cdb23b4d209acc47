//! CPU kernels, in SPEC order: `rotate` (re-rotation of cached keys), `insert` (new K/V into
//! the caches), `attention` (causal attention with online softmax, GQA, window, ALiBi) and the
//! scores (summed softmax weights of the last new tokens).
//!
//! - `reference`: plain scalar code written straight from SPEC.md; the twin every fast path is
//!   tested against, and what [`run_reference`] runs.
//! - `quant`: u8 caches in OpenVINO's layout: quantization on insertion, dequantization of a row.
//! - `fast`: tiled, parallel, SIMD (AVX2+FMA+F16C when detected, else scalar) kernels; what
//!   [`run`] runs. Its `mod.rs` states its dispatch rule.
//!
//! The (query type, cache type) pair is resolved once, here, into a monomorphised kernel.

pub mod fast;
pub mod quant;
pub mod reference;

use crate::error::Result;
use crate::op::{PaInputs, PaOutputs, Plan};
use crate::threads::Runner;

/// Calls `$f::<Q, C>($args)` for the plan's (query type, cache type) pair.
macro_rules! dispatch_types {
    ($plan:expr, $f:ident ( $($args:expr),* )) => {{
        use crate::dtype::ElemType as E;
        use half::{bf16, f16};
        match ($plan.query_type, $plan.cache_type) {
            (E::F32, E::F32) => $f::<f32, f32>($($args),*),
            (E::F32, E::F16) => $f::<f32, f16>($($args),*),
            (E::F32, E::BF16) => $f::<f32, bf16>($($args),*),
            (E::F16, E::F32) => $f::<f16, f32>($($args),*),
            (E::F16, E::F16) => $f::<f16, f16>($($args),*),
            (E::F16, E::BF16) => $f::<f16, bf16>($($args),*),
            (E::BF16, E::F32) => $f::<bf16, f32>($($args),*),
            (E::BF16, E::F16) => $f::<bf16, f16>($($args),*),
            (E::BF16, E::BF16) => $f::<bf16, bf16>($($args),*),
            (q, c) => Err(crate::error::PaError::InvalidArgument {
                detail: format!("no kernel for query type {q} with cache type {c}"),
            }),
        }
    }};
}
#[allow(unused_imports)]
pub(crate) use dispatch_types;

/// Runs a validated plan with the fastest kernels available on this CPU, its parallel regions
/// on `runner`.
pub fn run(
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
    runner: Runner,
) -> Result<()> {
    let opts = fast::FastOptions {
        runner,
        ..fast::FastOptions::default()
    };
    fast::run(plan, inputs, outputs, opts)
}

/// Runs a validated plan with the scalar reference kernels.
pub fn run_reference(
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    use reference::run_typed;
    crate::threads::in_auto_pool(|| dispatch_types!(plan, run_typed(plan, inputs, outputs)))
}
