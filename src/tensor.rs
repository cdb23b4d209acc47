//! Borrowed tensor views: a shape (row-major, memory order) and typed element slices.
//!
//! The op never owns tensor memory: callers (Rust, the C ABI, the IR executor, OpenVINO) lend
//! it. Read-only inputs are [`Tensor`], buffers the op writes (caches, outputs) are [`TensorMut`].

use crate::dtype::{ElemType, Float};
use half::{bf16, f16};

pub use crate::dtype::{Elems, ElemsMut};

macro_rules! elems_common {
    ($t:ident) => {
        impl $t<'_> {
            pub fn elem_type(&self) -> ElemType {
                match self {
                    $t::F32(_) => ElemType::F32,
                    $t::F16(_) => ElemType::F16,
                    $t::BF16(_) => ElemType::BF16,
                    $t::I32(_) => ElemType::I32,
                    $t::U8(_) => ElemType::U8,
                    $t::U4(_) => ElemType::U4,
                }
            }
            /// Elements held (u4: two per byte).
            pub fn len(&self) -> usize {
                match self {
                    $t::F32(s) => s.len(),
                    $t::F16(s) => s.len(),
                    $t::BF16(s) => s.len(),
                    $t::I32(s) => s.len(),
                    $t::U8(s) => s.len(),
                    $t::U4(s) => s.len().saturating_mul(2),
                }
            }
            pub fn is_empty(&self) -> bool {
                self.len() == 0
            }
            /// Element `i` widened to f64 (for messages and small scalar inputs).
            pub fn get_f64(&self, i: usize) -> Option<f64> {
                Some(match self {
                    $t::F32(s) => *s.get(i)? as f64,
                    $t::F16(s) => s.get(i)?.to_f64(),
                    $t::BF16(s) => s.get(i)?.to_f64(),
                    $t::I32(s) => *s.get(i)? as f64,
                    $t::U8(s) => *s.get(i)? as f64,
                    $t::U4(s) => ((*s.get(i / 2)? >> (4 * (1 - i % 2))) & 15) as f64,
                })
            }
        }
    };
}
elems_common!(Elems);
elems_common!(ElemsMut);

/// A read-only tensor view.
#[derive(Clone, Debug)]
pub struct Tensor<'a> {
    pub shape: Vec<usize>,
    pub data: Elems<'a>,
}

/// A writable tensor view.
#[derive(Debug)]
pub struct TensorMut<'a> {
    pub shape: Vec<usize>,
    pub data: ElemsMut<'a>,
}

/// Number of elements a shape holds (`1` for rank 0), or `None` on overflow.
pub fn shape_elems(shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(1usize, |acc, &d| acc.checked_mul(d))
}

impl<'a> Tensor<'a> {
    pub fn new(shape: &[usize], data: impl Into<Elems<'a>>) -> Tensor<'a> {
        Tensor {
            shape: shape.to_vec(),
            data: data.into(),
        }
    }
    /// A rank-0 tensor holding one value.
    pub fn scalar(data: impl Into<Elems<'a>>) -> Tensor<'a> {
        Tensor {
            shape: vec![],
            data: data.into(),
        }
    }
    pub fn elem_type(&self) -> ElemType {
        self.data.elem_type()
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    /// Element count the shape promises (saturating, so a huge shape never matches a slice).
    pub fn numel(&self) -> usize {
        shape_elems(&self.shape).unwrap_or(usize::MAX)
    }
    pub fn as_i32(&self) -> Option<&'a [i32]> {
        match self.data {
            Elems::I32(s) => Some(s),
            _ => None,
        }
    }
    pub fn as_u8(&self) -> Option<&'a [u8]> {
        match self.data {
            Elems::U8(s) => Some(s),
            _ => None,
        }
    }
    /// The bytes of a u8 or u4 tensor.
    pub fn quant_bytes(&self) -> Option<&'a [u8]> {
        match self.data {
            Elems::U8(s) | Elems::U4(s) => Some(s),
            _ => None,
        }
    }
    /// The elements as `F` if that is their type.
    pub fn as_float<F: Float>(&self) -> Option<&'a [F]> {
        typed_ref::<F>(self.data)
    }
}

impl<'a> TensorMut<'a> {
    pub fn new(shape: &[usize], data: impl Into<ElemsMut<'a>>) -> TensorMut<'a> {
        TensorMut {
            shape: shape.to_vec(),
            data: data.into(),
        }
    }
    pub fn elem_type(&self) -> ElemType {
        self.data.elem_type()
    }
    pub fn rank(&self) -> usize {
        self.shape.len()
    }
    pub fn numel(&self) -> usize {
        shape_elems(&self.shape).unwrap_or(usize::MAX)
    }
    /// A read-only view of the same memory.
    pub fn as_ref(&self) -> Tensor<'_> {
        let data = match &self.data {
            ElemsMut::F32(s) => Elems::F32(s),
            ElemsMut::F16(s) => Elems::F16(s),
            ElemsMut::BF16(s) => Elems::BF16(s),
            ElemsMut::I32(s) => Elems::I32(s),
            ElemsMut::U8(s) => Elems::U8(s),
            ElemsMut::U4(s) => Elems::U4(s),
        };
        Tensor {
            shape: self.shape.clone(),
            data,
        }
    }
    /// The elements as `F` if that is their type.
    pub fn as_float_mut<F: Float>(&mut self) -> Option<&mut [F]> {
        typed_mut::<F>(&mut self.data)
    }
}

fn typed_ref<F: Float>(e: Elems<'_>) -> Option<&[F]> {
    F::elems(e)
}

fn typed_mut<'s, F: Float>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [F]> {
    F::elems_mut(e)
}

macro_rules! from_slices {
    ($ty:ty, $var:ident) => {
        impl<'a> From<&'a [$ty]> for Elems<'a> {
            fn from(s: &'a [$ty]) -> Self {
                Elems::$var(s)
            }
        }
        impl<'a> From<&'a Vec<$ty>> for Elems<'a> {
            fn from(s: &'a Vec<$ty>) -> Self {
                Elems::$var(s.as_slice())
            }
        }
        impl<'a> From<&'a mut [$ty]> for ElemsMut<'a> {
            fn from(s: &'a mut [$ty]) -> Self {
                ElemsMut::$var(s)
            }
        }
        impl<'a> From<&'a mut Vec<$ty>> for ElemsMut<'a> {
            fn from(s: &'a mut Vec<$ty>) -> Self {
                ElemsMut::$var(s.as_mut_slice())
            }
        }
    };
}
from_slices!(f32, F32);
from_slices!(f16, F16);
from_slices!(bf16, BF16);
from_slices!(i32, I32);
from_slices!(u8, U8);
