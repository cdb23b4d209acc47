//! The validated call bound to typed slices ([`Bound`]), and the one place the plan's
//! (query type, cache type) pair picks a monomorphised kernel ([`dispatch`]): a new cache type
//! plugs in as one arm of [`with_cache`] (u8 caches, in OpenVINO's layout, through
//! [`TypedOp::run_quant`]).

use crate::dtype::Float;
use crate::error::{PaError, Result};
use crate::op::quant_layout::QuantLayout;
use crate::op::{PaInputs, PaOutputs, Plan};
use crate::tensor::{ElemsMut, Tensor};
use std::borrow::Cow;

/// The rotation inputs of a call that re-rotates cached keys.
pub(crate) struct BoundRotation<'a> {
    /// `rotated_block_indices`
    pub blocks: &'a [i32],
    /// `rotation_deltas`
    pub deltas: &'a [i32],
    /// Columns of `rotation_deltas` (1 or BS).
    pub delta_cols: usize,
    /// `rotation_trig_lut` as f32 (borrowed when it is f32).
    pub lut: Cow<'a, [f32]>,
}

impl BoundRotation<'_> {
    /// The inputs as u8 key rotation takes them.
    pub fn keys(&self) -> crate::kernel::quant::KeyRotation<'_> {
        crate::kernel::quant::KeyRotation {
            blocks: self.blocks,
            deltas: self.deltas,
            delta_cols: self.delta_cols,
            lut: &self.lut,
        }
    }
}

/// An element type a cache may have: a [`Float`], or u8 (quantized bytes).
pub(crate) trait CacheElem: Copy + Send + Sync + 'static {
    /// The elements if they are of this type.
    fn cache_mut<'s>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [Self]>;
}

impl<F: Float> CacheElem for F {
    fn cache_mut<'s>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [Self]> {
        F::elems_mut(e)
    }
}

impl CacheElem for u8 {
    fn cache_mut<'s>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [Self]> {
        match e {
            // u8 caches, and u4 caches as their packed bytes (the plan's layout says which).
            ElemsMut::U8(s) | ElemsMut::U4(s) => Some(s),
            _ => None,
        }
    }
}

/// Every slice a kernel reads or writes, at the types validation established.
pub(crate) struct Bound<'a, Q, C> {
    pub query: &'a [Q],
    pub key: &'a [Q],
    pub value: &'a [Q],
    pub key_cache: &'a mut [C],
    pub value_cache: &'a mut [C],
    pub block_indices: &'a [i32],
    pub rotation: Option<BoundRotation<'a>>,
    pub output: &'a mut [Q],
    pub scores: &'a mut [Q],
}

fn missing(what: &str) -> PaError {
    PaError::InvalidArgument {
        detail: format!("{what} does not have the validated element type"),
    }
}

/// Any float tensor widened to f32 (small inputs: LUT, slopes).
pub(crate) fn widen(t: &Tensor<'_>) -> Vec<f32> {
    (0..t.data.len())
        .map(|i| t.data.get_f64(i).unwrap_or(0.0) as f32)
        .collect()
}

impl<'a, Q: Float, C: CacheElem> Bound<'a, Q, C> {
    /// Binds a call `plan` was validated from; an input that does not have the type the plan
    /// says is an error (never reached after validation).
    pub fn new(
        plan: &Plan,
        inputs: &'a mut PaInputs<'_>,
        outputs: &'a mut PaOutputs<'_>,
    ) -> Result<Bound<'a, Q, C>> {
        let rotation = match &plan.rotation {
            None => None,
            Some(rot) => {
                let i32s = |t: &Option<Tensor<'a>>, what| {
                    t.as_ref()
                        .and_then(|t| t.as_i32())
                        .ok_or_else(|| missing(what))
                };
                let lut = inputs
                    .rotation_trig_lut
                    .as_ref()
                    .ok_or_else(|| missing("rotation_trig_lut"))?;
                Some(BoundRotation {
                    blocks: i32s(&inputs.rotated_block_indices, "rotated_block_indices")?,
                    deltas: i32s(&inputs.rotation_deltas, "rotation_deltas")?,
                    delta_cols: rot.delta_cols,
                    lut: match lut.as_float::<f32>() {
                        Some(l) => Cow::Borrowed(l),
                        None => Cow::Owned(widen(lut)),
                    },
                })
            }
        };
        Ok(Bound {
            query: inputs.query.as_float().ok_or_else(|| missing("query"))?,
            key: inputs.key.as_float().ok_or_else(|| missing("key"))?,
            value: inputs.value.as_float().ok_or_else(|| missing("value"))?,
            key_cache: C::cache_mut(&mut inputs.key_cache.data)
                .ok_or_else(|| missing("key_cache"))?,
            value_cache: C::cache_mut(&mut inputs.value_cache.data)
                .ok_or_else(|| missing("value_cache"))?,
            block_indices: inputs
                .block_indices
                .as_i32()
                .ok_or_else(|| missing("block_indices"))?,
            rotation,
            output: outputs
                .output
                .as_float_mut()
                .ok_or_else(|| missing("output"))?,
            scores: outputs
                .scores
                .as_float_mut()
                .ok_or_else(|| missing("scores"))?,
        })
    }
}

/// A kernel family, run at the plan's types.
pub(crate) trait TypedOp {
    fn run<Q: Float, C: Float>(self, plan: &Plan, b: Bound<'_, Q, C>) -> Result<()>;
    /// The call on u8 caches of `layout` (the plan's).
    fn run_quant<Q: Float>(
        self,
        plan: &Plan,
        layout: &QuantLayout,
        b: Bound<'_, Q, u8>,
    ) -> Result<()>;
}

/// Binds the call at the plan's (query type, cache type) and runs `op` on it.
pub(crate) fn dispatch<O: TypedOp>(
    op: O,
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    use crate::dtype::ElemType as E;
    match plan.query_type {
        E::F32 => with_cache::<O, f32>(op, plan, inputs, outputs),
        E::F16 => with_cache::<O, half::f16>(op, plan, inputs, outputs),
        E::BF16 => with_cache::<O, half::bf16>(op, plan, inputs, outputs),
        q => Err(no_kernel(q, plan)),
    }
}

/// [`dispatch`] for a query type `Q`: the cache type's arm.
fn with_cache<O: TypedOp, Q: Float>(
    op: O,
    plan: &Plan,
    inputs: &mut PaInputs<'_>,
    outputs: &mut PaOutputs<'_>,
) -> Result<()> {
    use crate::dtype::ElemType as E;
    match plan.cache_type {
        E::F32 => op.run(plan, Bound::<Q, f32>::new(plan, inputs, outputs)?),
        E::F16 => op.run(plan, Bound::<Q, half::f16>::new(plan, inputs, outputs)?),
        E::BF16 => op.run(plan, Bound::<Q, half::bf16>::new(plan, inputs, outputs)?),
        E::U8 | E::U4 => match &plan.u8 {
            Some(layout) => op.run_quant(plan, layout, Bound::<Q, u8>::new(plan, inputs, outputs)?),
            None => Err(missing("the quantized cache layout")),
        },
        _ => Err(no_kernel(plan.query_type, plan)),
    }
}

fn no_kernel(q: crate::dtype::ElemType, plan: &Plan) -> PaError {
    PaError::InvalidArgument {
        detail: format!(
            "no kernel for query type {q} with cache type {}",
            plan.cache_type
        ),
    }
}
