//! The PagedAttention op: its inputs and outputs, shape inference and validation (what a call
//! must satisfy). Execution is `kernel`'s ([`crate::execute`]), which reads the [`Plan`] made
//! here; nothing here depends on the kernels.
//!
//! - `contract`: the 17-input table every other part reads.
//! - `shape`: shape inference on partial shapes (also the shape rules of validation).
//! - `quant_layout`: the shapes of u8 caches in OpenVINO's layout, and how a call's shapes name one.
//! - `validate`: concrete checks of values, producing a [`Plan`] the kernels run from.

pub mod contract;
pub mod quant_layout;
pub mod shape;
pub mod validate;

pub use shape::{
    infer_shapes, infer_shapes_with_past_lens, OutputInfo, PartialInput, PartialShape, DYN,
};
pub use validate::{validate, Plan, Rotation, SeqPlan};

use crate::dtype::ElemType;
use crate::error::{PaError, Result};
use crate::tensor::{Tensor, TensorMut};
use contract::*;

/// The op's inputs by name. Optional inputs are `None` when not given; an empty tensor is
/// treated exactly like `None`. `key_cache` and `value_cache` are written in place.
#[derive(Debug)]
pub struct PaInputs<'a> {
    /// `[T, H*D]`
    pub query: Tensor<'a>,
    /// `[T, Hkv*D]`
    pub key: Tensor<'a>,
    /// `[T, Hkv*D]`
    pub value: Tensor<'a>,
    /// `[NB, Hkv, BS, D]`, written in place.
    pub key_cache: TensorMut<'a>,
    /// `[NB, Hkv, BS, D]`, written in place.
    pub value_cache: TensorMut<'a>,
    /// `[B]` i32
    pub past_lens: Tensor<'a>,
    /// `[B+1]` i32
    pub subsequence_begins: Tensor<'a>,
    /// `[N]` i32
    pub block_indices: Tensor<'a>,
    /// `[B+1]` i32
    pub block_indices_begins: Tensor<'a>,
    /// scalar
    pub scale: Option<Tensor<'a>>,
    /// scalar i32
    pub sliding_window: Option<Tensor<'a>>,
    /// `[H]`
    pub alibi_slopes: Option<Tensor<'a>>,
    /// `[R]` i32
    pub rotated_block_indices: Option<Tensor<'a>>,
    /// `[R, BS]`, `[R, 1]` or `[R]` i32
    pub rotation_deltas: Option<Tensor<'a>>,
    /// `[M, D]`
    pub rotation_trig_lut: Option<Tensor<'a>>,
    /// scalar or `[B]` i32
    pub score_aggregation_window: Option<Tensor<'a>>,
    /// `[H]` or `[1, H, 1, 1]`
    pub sinks: Option<Tensor<'a>>,
}

/// Where the op writes its two outputs.
#[derive(Debug)]
pub struct PaOutputs<'a> {
    /// `[T, H*D]`, query's type.
    pub output: TensorMut<'a>,
    /// `[sum(past_lens) + T]`, query's type.
    pub scores: TensorMut<'a>,
}

/// One input of the positional (list) form, as the C ABI and the IR executor hold them.
#[derive(Debug)]
pub enum InputArg<'a> {
    Ref(Tensor<'a>),
    Mut(TensorMut<'a>),
}

impl<'a> InputArg<'a> {
    fn into_ref(self) -> Tensor<'a> {
        match self {
            InputArg::Ref(t) => t,
            InputArg::Mut(t) => {
                let TensorMut { shape, data } = t;
                let data = match data {
                    crate::tensor::ElemsMut::F32(s) => crate::tensor::Elems::F32(s),
                    crate::tensor::ElemsMut::F16(s) => crate::tensor::Elems::F16(s),
                    crate::tensor::ElemsMut::BF16(s) => crate::tensor::Elems::BF16(s),
                    crate::tensor::ElemsMut::I32(s) => crate::tensor::Elems::I32(s),
                    crate::tensor::ElemsMut::U8(s) => crate::tensor::Elems::U8(s),
                    crate::tensor::ElemsMut::U4(s) => crate::tensor::Elems::U4(s),
                };
                Tensor { shape, data }
            }
        }
    }
}

impl<'a> PaInputs<'a> {
    /// Builds the inputs from the positional form (9 to 17 entries, in SPEC order). Entries 3 and
    /// 4 (the caches) must be [`InputArg::Mut`].
    pub fn from_list(list: Vec<InputArg<'a>>) -> Result<PaInputs<'a>> {
        if list.len() < MIN_INPUTS || list.len() > MAX_INPUTS {
            return Err(PaError::InputCount { found: list.len() });
        }
        let mut it = list.into_iter().enumerate();
        let next_ref = |it: &mut dyn Iterator<Item = (usize, InputArg<'a>)>| {
            it.next().map(|(_, a)| a.into_ref())
        };
        let query = next_ref(&mut it).unwrap_or_else(|| unreachable!());
        let key = next_ref(&mut it).unwrap_or_else(|| unreachable!());
        let value = next_ref(&mut it).unwrap_or_else(|| unreachable!());
        let cache = |it: &mut dyn Iterator<Item = (usize, InputArg<'a>)>| match it.next() {
            Some((_, InputArg::Mut(t))) => Ok(t),
            Some((i, InputArg::Ref(_))) => Err(PaError::InvalidArgument {
                detail: format!(
                    "input {i} (`{}`) is written in place and must be given as a writable tensor",
                    INPUTS[i].name
                ),
            }),
            None => unreachable!(),
        };
        let key_cache = cache(&mut it)?;
        let value_cache = cache(&mut it)?;
        let past_lens = next_ref(&mut it).unwrap_or_else(|| unreachable!());
        let subsequence_begins = next_ref(&mut it).unwrap_or_else(|| unreachable!());
        let block_indices = next_ref(&mut it).unwrap_or_else(|| unreachable!());
        let block_indices_begins = next_ref(&mut it).unwrap_or_else(|| unreachable!());
        let mut opt = || next_ref(&mut it);
        Ok(PaInputs {
            query,
            key,
            value,
            key_cache,
            value_cache,
            past_lens,
            subsequence_begins,
            block_indices,
            block_indices_begins,
            scale: opt(),
            sliding_window: opt(),
            alibi_slopes: opt(),
            rotated_block_indices: opt(),
            rotation_deltas: opt(),
            rotation_trig_lut: opt(),
            score_aggregation_window: opt(),
            sinks: opt(),
        })
    }

    /// Input `i` (SPEC order) as a read-only view; `None` when an optional input is not given.
    pub fn get(&self, i: usize) -> Option<Tensor<'_>> {
        match i {
            KEY_CACHE => Some(self.key_cache.as_ref()),
            VALUE_CACHE => Some(self.value_cache.as_ref()),
            _ => self.read_only(i).cloned(),
        }
    }

    /// The element type, shape and element count of input `i` (SPEC order), read in place:
    /// validation reads these of every input on every call, which [`PaInputs::get`]'s copies
    /// of the shapes made slower (a copy is an allocation, and a call starts with its caches
    /// cold). `None` when an optional input is not given.
    pub fn meta(&self, i: usize) -> Option<(ElemType, &[usize], usize)> {
        fn cache<'s>(t: &'s TensorMut<'_>) -> (ElemType, &'s [usize], usize) {
            (t.elem_type(), &t.shape, t.data.len())
        }
        match i {
            KEY_CACHE => Some(cache(&self.key_cache)),
            VALUE_CACHE => Some(cache(&self.value_cache)),
            _ => self
                .read_only(i)
                .map(|t| (t.elem_type(), &t.shape[..], t.data.len())),
        }
    }

    /// Input `i` when it is one of the read-only inputs and given.
    pub(crate) fn read_only(&self, i: usize) -> Option<&Tensor<'a>> {
        match i {
            QUERY => Some(&self.query),
            KEY => Some(&self.key),
            VALUE => Some(&self.value),
            PAST_LENS => Some(&self.past_lens),
            SUBSEQUENCE_BEGINS => Some(&self.subsequence_begins),
            BLOCK_INDICES => Some(&self.block_indices),
            BLOCK_INDICES_BEGINS => Some(&self.block_indices_begins),
            SCALE => self.scale.as_ref(),
            SLIDING_WINDOW => self.sliding_window.as_ref(),
            ALIBI_SLOPES => self.alibi_slopes.as_ref(),
            ROTATED_BLOCK_INDICES => self.rotated_block_indices.as_ref(),
            ROTATION_DELTAS => self.rotation_deltas.as_ref(),
            ROTATION_TRIG_LUT => self.rotation_trig_lut.as_ref(),
            SCORE_AGGREGATION_WINDOW => self.score_aggregation_window.as_ref(),
            SINKS => self.sinks.as_ref(),
            _ => None,
        }
    }

    /// Number of inputs in the positional form: 9 plus the optional ones up to the last given.
    pub fn count(&self) -> usize {
        (MIN_INPUTS..MAX_INPUTS)
            .rev()
            .find(|&i| self.read_only(i).is_some())
            .map_or(MIN_INPUTS, |i| i + 1)
    }
}
