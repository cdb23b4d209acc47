//! Tensors the IR executor owns (Const data, Convert results, outputs) and the ones callers hand
//! to [`super::Model::run`]; views into them are the op's [`Tensor`]/[`TensorMut`].

use half::{bf16, f16};

use paged_attention::dtype::ElemType;
use paged_attention::tensor::{shape_elems, Elems, ElemsMut, Tensor, TensorMut};

/// Typed storage of an [`OwnedTensor`].
#[derive(Clone, Debug, PartialEq)]
pub enum OwnedData {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    U8(Vec<u8>),
    /// Packed u4 elements (two per byte, the even one in the high nibble).
    U4(Vec<u8>),
}

/// A row-major tensor that owns its elements. `data.len()` always equals the shape's product.
#[derive(Clone, Debug, PartialEq)]
pub struct OwnedTensor {
    shape: Vec<usize>,
    data: OwnedData,
}

/// Why an [`OwnedTensor`] could not be built.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TensorError {
    #[error("shape {shape:?} holds {expected} elements, but {found} were given")]
    Len {
        shape: Vec<usize>,
        expected: String,
        found: usize,
    },
    #[error("shape {0:?} is too large to allocate")]
    TooLarge(Vec<usize>),
    #[error("{0} bytes do not divide into elements of {1}")]
    Bytes(usize, ElemType),
    #[error("conversion from {0} to {1} is not supported")]
    Convert(ElemType, ElemType),
}

fn data_len(d: &OwnedData) -> usize {
    match d {
        OwnedData::F32(v) => v.len(),
        OwnedData::F16(v) => v.len(),
        OwnedData::BF16(v) => v.len(),
        OwnedData::I32(v) => v.len(),
        OwnedData::U8(v) => v.len(),
        OwnedData::U4(v) => v.len().saturating_mul(2),
    }
}

/// A zero-filled vector of `n` elements, allocated fallibly (a hostile size reports an error
/// instead of aborting the process).
fn try_zeroed<T: Clone + Default>(n: usize, shape: &[usize]) -> Result<Vec<T>, TensorError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| TensorError::TooLarge(shape.to_vec()))?;
    v.resize(n, T::default());
    Ok(v)
}

impl OwnedTensor {
    /// A tensor of `shape` holding `data` (row-major); the lengths must agree.
    pub fn new(shape: Vec<usize>, data: OwnedData) -> Result<OwnedTensor, TensorError> {
        let found = data_len(&data);
        match shape_elems(&shape) {
            Some(n) if n == found => Ok(OwnedTensor { shape, data }),
            n => Err(TensorError::Len {
                expected: n.map_or_else(|| "too many".to_string(), |n| n.to_string()),
                shape,
                found,
            }),
        }
    }

    pub fn from_f32(shape: Vec<usize>, v: Vec<f32>) -> Result<OwnedTensor, TensorError> {
        Self::new(shape, OwnedData::F32(v))
    }
    pub fn from_i32(shape: Vec<usize>, v: Vec<i32>) -> Result<OwnedTensor, TensorError> {
        Self::new(shape, OwnedData::I32(v))
    }

    /// A zero-filled tensor; the allocation is checked and fallible.
    pub fn zeros(elem: ElemType, shape: Vec<usize>) -> Result<OwnedTensor, TensorError> {
        let n = shape_elems(&shape).ok_or_else(|| TensorError::TooLarge(shape.clone()))?;
        let data = match elem {
            ElemType::F32 => OwnedData::F32(try_zeroed(n, &shape)?),
            ElemType::F16 => OwnedData::F16(try_zeroed(n, &shape)?),
            ElemType::BF16 => OwnedData::BF16(try_zeroed(n, &shape)?),
            ElemType::I32 => OwnedData::I32(try_zeroed(n, &shape)?),
            ElemType::U8 => OwnedData::U8(try_zeroed(n, &shape)?),
            ElemType::U4 => OwnedData::U4(try_zeroed(n.div_ceil(2), &shape)?),
        };
        Ok(OwnedTensor { shape, data })
    }

    /// Decodes little-endian bytes (f16/bf16 as their raw 16-bit patterns). The caller has
    /// already bounded `bytes` by a file's length, so the allocation is as large as the data.
    pub fn from_le_bytes(
        elem: ElemType,
        shape: Vec<usize>,
        bytes: &[u8],
    ) -> Result<OwnedTensor, TensorError> {
        let w = elem.bits().div_ceil(8);
        if !bytes.len().is_multiple_of(w) {
            return Err(TensorError::Bytes(bytes.len(), elem));
        }
        let data = match elem {
            ElemType::F32 => OwnedData::F32(
                bytes
                    .chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            ElemType::I32 => OwnedData::I32(
                bytes
                    .chunks_exact(4)
                    .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect(),
            ),
            ElemType::F16 => OwnedData::F16(
                bytes
                    .chunks_exact(2)
                    .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            ElemType::BF16 => OwnedData::BF16(
                bytes
                    .chunks_exact(2)
                    .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                    .collect(),
            ),
            ElemType::U8 => OwnedData::U8(bytes.to_vec()),
            ElemType::U4 => OwnedData::U4(bytes.to_vec()),
        };
        Self::new(shape, data)
    }

    /// An owned copy of a view.
    pub fn from_view(t: &Tensor<'_>) -> Result<OwnedTensor, TensorError> {
        let data = match t.data {
            Elems::F32(s) => OwnedData::F32(s.to_vec()),
            Elems::F16(s) => OwnedData::F16(s.to_vec()),
            Elems::BF16(s) => OwnedData::BF16(s.to_vec()),
            Elems::I32(s) => OwnedData::I32(s.to_vec()),
            Elems::U8(s) => OwnedData::U8(s.to_vec()),
            Elems::U4(s) => OwnedData::U4(s.to_vec()),
        };
        Self::new(t.shape.clone(), data)
    }

    /// The elements as little-endian bytes (f16/bf16 as raw bits).
    pub fn to_le_bytes(&self) -> Vec<u8> {
        match &self.data {
            OwnedData::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            OwnedData::I32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            OwnedData::F16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            OwnedData::BF16(v) => v.iter().flat_map(|x| x.to_bits().to_le_bytes()).collect(),
            OwnedData::U8(v) | OwnedData::U4(v) => v.clone(),
        }
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }
    pub fn data(&self) -> &OwnedData {
        &self.data
    }
    pub fn len(&self) -> usize {
        data_len(&self.data)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn elem_type(&self) -> ElemType {
        match self.data {
            OwnedData::F32(_) => ElemType::F32,
            OwnedData::F16(_) => ElemType::F16,
            OwnedData::BF16(_) => ElemType::BF16,
            OwnedData::I32(_) => ElemType::I32,
            OwnedData::U8(_) => ElemType::U8,
            OwnedData::U4(_) => ElemType::U4,
        }
    }

    pub fn view(&self) -> Tensor<'_> {
        let data = match &self.data {
            OwnedData::F32(v) => Elems::F32(v),
            OwnedData::F16(v) => Elems::F16(v),
            OwnedData::BF16(v) => Elems::BF16(v),
            OwnedData::I32(v) => Elems::I32(v),
            OwnedData::U8(v) => Elems::U8(v),
            OwnedData::U4(v) => Elems::U4(v),
        };
        Tensor {
            shape: self.shape.clone(),
            data,
        }
    }

    pub fn view_mut(&mut self) -> TensorMut<'_> {
        let data = match &mut self.data {
            OwnedData::F32(v) => ElemsMut::F32(v),
            OwnedData::F16(v) => ElemsMut::F16(v),
            OwnedData::BF16(v) => ElemsMut::BF16(v),
            OwnedData::I32(v) => ElemsMut::I32(v),
            OwnedData::U8(v) => ElemsMut::U8(v),
            OwnedData::U4(v) => ElemsMut::U4(v),
        };
        TensorMut {
            shape: self.shape.clone(),
            data,
        }
    }

    /// Element `i` widened to f64 (comparisons, messages).
    pub fn get_f64(&self, i: usize) -> Option<f64> {
        self.view().data.get_f64(i)
    }

    /// All elements widened to f64.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match &self.data {
            OwnedData::F32(v) => v.iter().map(|&x| x as f64).collect(),
            OwnedData::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            OwnedData::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            OwnedData::I32(v) => v.iter().map(|&x| x as f64).collect(),
            OwnedData::U8(v) => v.iter().map(|&x| x as f64).collect(),
            OwnedData::U4(v) => v
                .iter()
                .flat_map(|&x| [(x >> 4) as f64, (x & 15) as f64])
                .collect(),
        }
    }

    /// OpenVINO's `Convert` between float types (round to nearest even through f32, which is
    /// exact for every source type here) and the i32 identity.
    pub fn convert(&self, to: ElemType) -> Result<OwnedTensor, TensorError> {
        let from = self.elem_type();
        if from == to {
            return Ok(self.clone());
        }
        if !from.is_float() || !to.is_float() {
            return Err(TensorError::Convert(from, to));
        }
        let wide: Vec<f32> = match &self.data {
            OwnedData::F32(v) => v.clone(),
            OwnedData::F16(v) => v.iter().map(|x| x.to_f32()).collect(),
            OwnedData::BF16(v) => v.iter().map(|x| x.to_f32()).collect(),
            OwnedData::I32(_) | OwnedData::U8(_) | OwnedData::U4(_) => {
                return Err(TensorError::Convert(from, to))
            }
        };
        let data = match to {
            ElemType::F32 => OwnedData::F32(wide),
            ElemType::F16 => OwnedData::F16(wide.iter().map(|&x| f16::from_f32(x)).collect()),
            ElemType::BF16 => OwnedData::BF16(wide.iter().map(|&x| bf16::from_f32(x)).collect()),
            ElemType::I32 | ElemType::U8 | ElemType::U4 => {
                return Err(TensorError::Convert(from, to))
            }
        };
        Ok(OwnedTensor {
            shape: self.shape.clone(),
            data,
        })
    }
}
