//! CPU kernels, in SPEC order: `rotate` (re-rotation of cached keys), `insert` (new K/V into
//! the caches), `attention` (causal attention with online softmax, GQA, window, ALiBi) and the
//! scores (summed softmax weights of the last new tokens), and the op's entry points
//! ([`execute`], [`execute_on`], [`execute_reference`]): validation (`op`), then the kernels.
//!
//! - `layout`: the index arithmetic of caches, tokens and windows both kernel families use.
//! - `prefetch`: cache-line prefetch hints.
//! - `rope`: the re-rotation of one cached key row (step 1), for every cache type.
//! - `softmax`: the online-softmax step every kernel takes (`softmax::OnlineSoftmax`).
//! - `bind`: the validated call bound to typed slices, and the one (query type, cache type)
//!   dispatch into a monomorphised kernel.
//! - `reference`: plain scalar code written straight from SPEC.md; the twin every fast path is
//!   tested against, and what [`execute_reference`] runs.
//! - `quant`: u8 caches in OpenVINO's layout: quantization on insertion, dequantization of a row.
//! - `fast`: tiled, parallel, SIMD kernels (the best level this CPU has, see its `mod.rs`);
//!   what [`execute`] runs.
//!
//! `kernel` depends on `op` (the plan and the inputs), never the other way round.

pub(crate) mod bind;
pub mod fast;
pub(crate) mod layout;
pub(crate) mod prefetch;
pub mod quant;
pub(crate) mod rope;
// Public only for the tests (`run_reference_u8`, feature `test-hooks`); the reference kernels
// reach users through `execute_reference`.
#[cfg(feature = "test-hooks")]
pub mod reference;
#[cfg(not(feature = "test-hooks"))]
pub(crate) mod reference;
pub(crate) mod softmax;

use crate::error::Result;
use crate::op::{validate, PaInputs, PaOutputs, Plan};
use crate::threads::Runner;

/// Validates the call, then runs rotation, insertion, attention and scores (SPEC order),
/// writing the caches in place and both outputs. A rejected call writes nothing.
pub fn execute(inputs: &mut PaInputs<'_>, outputs: &mut PaOutputs<'_>) -> Result<()> {
    execute_on(Runner::Auto, inputs, outputs)
}

/// [`execute`] with its parallel regions on `runner` (a host's threads, or none).
pub fn execute_on(
    runner: Runner,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    let opts = fast::FastOptions {
        runner,
        ..fast::FastOptions::default()
    };
    fast::execute_with(opts, inputs, outputs)
}

/// Like [`execute`] with the scalar reference kernels only (the twin of the fast paths).
pub fn execute_reference(inputs: &mut PaInputs<'_>, outputs: &mut PaOutputs<'_>) -> Result<()> {
    let Some(plan) = validated(inputs, outputs)? else {
        return Ok(());
    };
    run_reference(&plan, inputs, outputs)
}

/// The plan of a valid call, `None` when it writes nothing.
fn validated(inputs: &PaInputs<'_>, outputs: &PaOutputs<'_>) -> Result<Option<Plan>> {
    let plan = validate(inputs)?;
    crate::op::validate::check_outputs(&plan, outputs)?;
    Ok((!plan.writes_nothing()).then_some(plan))
}

/// Runs a validated plan with the scalar reference kernels.
pub(crate) fn run_reference(
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    crate::threads::in_auto_pool(|| bind::dispatch(reference::Reference, plan, inputs, outputs))
}
