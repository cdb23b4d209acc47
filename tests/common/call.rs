//! Owned tensors and a complete op call, for tests to build, corrupt and run.

use half::{bf16, f16};
use paged_attention::op::InputArg;
use paged_attention::{ElemType, Elems, ElemsMut, PaError, PaInputs, PaOutputs, Tensor, TensorMut};

/// Owned, typed elements.
#[derive(Clone, Debug, PartialEq)]
pub enum Data {
    F32(Vec<f32>),
    F16(Vec<f16>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    /// u8 cache bytes.
    U8(Vec<u8>),
    /// u4 cache bytes (two elements each, the even one in the high nibble).
    U4(Vec<u8>),
}

/// Rounds `x` to the nearest value of float type `ty` (f64 -> storage type).
/// `x` rounded to the nearest bf16 (ties to even), in one rounding. Not `bf16::from_f64`:
/// half 2.x rounds some values just above a tie down (`0x3F028005` as f32 gives `0x3F02`, the
/// nearest is `0x3F03`), which made the reference disagree with a correct kernel by one unit.
/// Rounding to f32 with round-to-odd first keeps the second rounding exact (f32 has more than
/// two bits beyond bf16's), the classic fix for double rounding.
pub fn bf16_of(x: f64) -> bf16 {
    let mut f = x as f32;
    if f.is_finite() && f as f64 != x {
        // Inexact: take the f32 below |x| and make its last bit odd.
        if (f as f64).abs() > x.abs() {
            f = f32::from_bits(f.to_bits() - 1);
        }
        f = f32::from_bits(f.to_bits() | 1);
    }
    bf16::from_f32(f)
}

pub fn round_to(ty: ElemType, x: f64) -> f64 {
    match ty {
        ElemType::F32 => x as f32 as f64,
        ElemType::F16 => f16::from_f64(x).to_f64(),
        ElemType::BF16 => bf16_of(x).to_f64(),
        ElemType::I32 | ElemType::U8 | ElemType::U4 => panic!("round_to({ty})"),
    }
}

impl Data {
    pub fn from_f64(ty: ElemType, v: &[f64]) -> Data {
        match ty {
            ElemType::F32 => Data::F32(v.iter().map(|&x| x as f32).collect()),
            ElemType::F16 => Data::F16(v.iter().map(|&x| f16::from_f64(x)).collect()),
            ElemType::BF16 => Data::BF16(v.iter().map(|&x| bf16_of(x)).collect()),
            ElemType::I32 => Data::I32(v.iter().map(|&x| x as i32).collect()),
            ElemType::U8 => Data::U8(v.iter().map(|&x| x as u8).collect()),
            ElemType::U4 => Data::U4(
                v.chunks(2)
                    .map(|c| ((c[0] as u8 & 15) << 4) | c.get(1).map_or(0, |&x| x as u8 & 15))
                    .collect(),
            ),
        }
    }
    pub fn zeros(ty: ElemType, n: usize) -> Data {
        Data::from_f64(ty, &vec![0.0; n])
    }
    /// `n` NaNs (i32: `i32::MIN`), to see that every element gets written.
    pub fn poison(ty: ElemType, n: usize) -> Data {
        match ty {
            ElemType::I32 => Data::I32(vec![i32::MIN; n]),
            ElemType::U8 => Data::U8(vec![0xA5; n]),
            ElemType::U4 => Data::U4(vec![0xA5; n.div_ceil(2)]),
            _ => Data::from_f64(ty, &vec![f64::NAN; n]),
        }
    }
    pub fn elem_type(&self) -> ElemType {
        match self {
            Data::F32(_) => ElemType::F32,
            Data::F16(_) => ElemType::F16,
            Data::BF16(_) => ElemType::BF16,
            Data::I32(_) => ElemType::I32,
            Data::U8(_) => ElemType::U8,
            Data::U4(_) => ElemType::U4,
        }
    }
    pub fn len(&self) -> usize {
        match self {
            Data::F32(v) => v.len(),
            Data::F16(v) => v.len(),
            Data::BF16(v) => v.len(),
            Data::I32(v) => v.len(),
            Data::U8(v) => v.len(),
            Data::U4(v) => 2 * v.len(),
        }
    }
    pub fn to_f64(&self) -> Vec<f64> {
        match self {
            Data::F32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Data::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            Data::I32(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U8(v) => v.iter().map(|&x| x as f64).collect(),
            Data::U4(v) => v
                .iter()
                .flat_map(|&x| [(x >> 4) as f64, (x & 15) as f64])
                .collect(),
        }
    }
    /// The raw bits of every element, for bit-exact comparisons (NaN included).
    pub fn bits(&self) -> Vec<u32> {
        match self {
            Data::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
            Data::F16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            Data::BF16(v) => v.iter().map(|x| x.to_bits() as u32).collect(),
            Data::I32(v) => v.iter().map(|&x| x as u32).collect(),
            Data::U8(v) | Data::U4(v) => v.iter().map(|&x| x as u32).collect(),
        }
    }
    pub fn u8s(&self) -> &[u8] {
        match self {
            Data::U8(v) | Data::U4(v) => v,
            _ => panic!("not u8 or u4"),
        }
    }
    pub fn i32s(&self) -> &[i32] {
        match self {
            Data::I32(v) => v,
            _ => panic!("not i32"),
        }
    }
    pub fn i32s_mut(&mut self) -> &mut Vec<i32> {
        match self {
            Data::I32(v) => v,
            _ => panic!("not i32"),
        }
    }
    /// Sets element `i` from an f64 (rounded to the type).
    pub fn set_f64(&mut self, i: usize, x: f64) {
        match self {
            Data::F32(v) => v[i] = x as f32,
            Data::F16(v) => v[i] = f16::from_f64(x),
            Data::BF16(v) => v[i] = bf16_of(x),
            Data::I32(v) => v[i] = x as i32,
            Data::U8(v) => v[i] = x as u8,
            Data::U4(v) => {
                let shift = 4 * (1 - i % 2);
                v[i / 2] = (v[i / 2] & !(15 << shift)) | ((x as u8 & 15) << shift);
            }
        }
    }
    pub fn elems(&self) -> Elems<'_> {
        match self {
            Data::F32(v) => Elems::F32(v),
            Data::F16(v) => Elems::F16(v),
            Data::BF16(v) => Elems::BF16(v),
            Data::I32(v) => Elems::I32(v),
            Data::U8(v) => Elems::U8(v),
            Data::U4(v) => Elems::U4(v),
        }
    }
    pub fn elems_mut(&mut self) -> ElemsMut<'_> {
        match self {
            Data::F32(v) => ElemsMut::F32(v),
            Data::F16(v) => ElemsMut::F16(v),
            Data::BF16(v) => ElemsMut::BF16(v),
            Data::I32(v) => ElemsMut::I32(v),
            Data::U8(v) => ElemsMut::U8(v),
            Data::U4(v) => ElemsMut::U4(v),
        }
    }
    /// Address of the first element (for the C ABI).
    pub fn as_mut_ptr(&mut self) -> *mut std::ffi::c_void {
        match self {
            Data::F32(v) => v.as_mut_ptr().cast(),
            Data::F16(v) => v.as_mut_ptr().cast(),
            Data::BF16(v) => v.as_mut_ptr().cast(),
            Data::I32(v) => v.as_mut_ptr().cast(),
            Data::U8(v) | Data::U4(v) => v.as_mut_ptr().cast(),
        }
    }
}

/// An owned tensor: shape in memory order and data.
#[derive(Clone, Debug, PartialEq)]
pub struct Owned {
    pub shape: Vec<usize>,
    pub data: Data,
}

impl Owned {
    pub fn new(shape: &[usize], data: Data) -> Owned {
        Owned {
            shape: shape.to_vec(),
            data,
        }
    }
    pub fn i32s(shape: &[usize], v: Vec<i32>) -> Owned {
        Owned::new(shape, Data::I32(v))
    }
    /// A rank-1 tensor with no elements: "not provided" for an optional input.
    pub fn empty(ty: ElemType) -> Owned {
        Owned::new(&[0], Data::from_f64(ty, &[]))
    }
    pub fn view(&self) -> Tensor<'_> {
        Tensor {
            shape: self.shape.clone(),
            data: self.data.elems(),
        }
    }
    pub fn view_mut(&mut self) -> TensorMut<'_> {
        TensorMut {
            shape: self.shape.clone(),
            data: self.data.elems_mut(),
        }
    }
}

/// Index of each input in SPEC order.
pub mod idx {
    pub const QUERY: usize = 0;
    pub const KEY: usize = 1;
    pub const VALUE: usize = 2;
    pub const KEY_CACHE: usize = 3;
    pub const VALUE_CACHE: usize = 4;
    pub const PAST_LENS: usize = 5;
    pub const SUBSEQUENCE_BEGINS: usize = 6;
    pub const BLOCK_INDICES: usize = 7;
    pub const BLOCK_INDICES_BEGINS: usize = 8;
    pub const SCALE: usize = 9;
    pub const SLIDING_WINDOW: usize = 10;
    pub const ALIBI_SLOPES: usize = 11;
    pub const ROTATED_BLOCK_INDICES: usize = 12;
    pub const ROTATION_DELTAS: usize = 13;
    pub const ROTATION_TRIG_LUT: usize = 14;
    pub const SCORE_AGGREGATION_WINDOW: usize = 15;
}

/// A whole call: 9..16 inputs in SPEC order and the two output buffers.
#[derive(Clone, Debug, PartialEq)]
pub struct Call {
    pub inputs: Vec<Owned>,
    pub outputs: [Owned; 2],
}

/// Which implementation runs a call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runner {
    /// `paged_attention::execute` (the fastest kernels available).
    Execute,
    /// `paged_attention::execute_reference` (the scalar twin).
    Reference,
}

pub const RUNNERS: [Runner; 2] = [Runner::Execute, Runner::Reference];

impl Call {
    /// Runs `f` with the call's inputs and outputs borrowed as the Rust API wants them.
    pub fn with_api<R>(
        &mut self,
        f: impl FnOnce(Result<PaInputs<'_>, PaError>, PaOutputs<'_>) -> R,
    ) -> R {
        let list: Vec<InputArg<'_>> = self
            .inputs
            .iter_mut()
            .enumerate()
            .map(|(i, t)| {
                if i == idx::KEY_CACHE || i == idx::VALUE_CACHE {
                    InputArg::Mut(t.view_mut())
                } else {
                    InputArg::Ref(t.view())
                }
            })
            .collect();
        let [o, s] = &mut self.outputs;
        let outputs = PaOutputs {
            output: o.view_mut(),
            scores: s.view_mut(),
        };
        f(PaInputs::from_list(list), outputs)
    }

    pub fn run(&mut self, runner: Runner) -> Result<(), PaError> {
        self.with_api(|inputs, mut outputs| {
            let mut inputs = inputs?;
            match runner {
                Runner::Execute => paged_attention::execute(&mut inputs, &mut outputs),
                Runner::Reference => paged_attention::execute_reference(&mut inputs, &mut outputs),
            }
        })
    }

    /// Runs the fast kernels at SIMD level `simd`, computing scores as `scores` says.
    pub fn run_fast(
        &mut self,
        simd: paged_attention::kernel::fast::SimdLevel,
        scores: paged_attention::kernel::fast::ScoresMode,
    ) -> Result<(), PaError> {
        use paged_attention::kernel::fast::{execute_with, FastOptions};
        let opts = FastOptions {
            simd,
            scores,
            ..FastOptions::default()
        };
        self.with_api(|inputs, mut outputs| execute_with(opts, &mut inputs?, &mut outputs))
    }

    pub fn validate(&mut self) -> Result<paged_attention::Plan, PaError> {
        self.with_api(|inputs, _| paged_attention::validate(&inputs?))
    }

    /// Bits of every buffer the op may write: key_cache, value_cache, output, scores.
    pub fn snapshot(&self) -> Vec<Vec<u32>> {
        let mut v = Vec::new();
        for i in [idx::KEY_CACHE, idx::VALUE_CACHE] {
            if let Some(t) = self.inputs.get(i) {
                v.push(t.data.bits());
            }
        }
        v.extend(self.outputs.iter().map(|o| o.data.bits()));
        v
    }
}
