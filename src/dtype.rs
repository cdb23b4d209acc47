//! Element types the op handles, and the conversions the kernels use.
//!
//! f16 and bf16 values are widened to f32 for every arithmetic step (dot products, softmax,
//! accumulation) and rounded once when stored: summing in half precision would lose the
//! small softmax weights of long contexts.

use half::{bf16, f16};

/// Element type of a tensor. The discriminants are the `PA_*` codes of the C header and never
/// change meaning.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ElemType {
    F32 = 0,
    F16 = 1,
    BF16 = 2,
    I32 = 3,
    /// Quantized cache bytes (u8 caches in OpenVINO's layout, see `op::quant`).
    U8 = 4,
    /// Quantized cache nibbles (u4 caches in OpenVINO's layout), packed two per byte: element
    /// `2i` in the high nibble of byte `i`. Shapes count nibbles; the data is the bytes.
    U4 = 5,
}

impl ElemType {
    /// Parses a C ABI code.
    pub fn from_code(code: i32) -> Option<ElemType> {
        Some(match code {
            0 => ElemType::F32,
            1 => ElemType::F16,
            2 => ElemType::BF16,
            3 => ElemType::I32,
            4 => ElemType::U8,
            5 => ElemType::U4,
            _ => return None,
        })
    }

    /// Bits per element.
    pub fn bits(self) -> usize {
        match self {
            ElemType::F32 | ElemType::I32 => 32,
            ElemType::F16 | ElemType::BF16 => 16,
            ElemType::U8 => 8,
            ElemType::U4 => 4,
        }
    }

    /// Bytes `n` elements take (u4: two per byte, rounded up, as OpenVINO sizes a u4 tensor);
    /// `None` on overflow. Every buffer size goes through here, never `n * size`.
    pub fn bytes_for(self, n: usize) -> Option<usize> {
        match self {
            ElemType::U4 => Some(n.div_ceil(2)),
            e => n.checked_mul(e.bits() / 8),
        }
    }

    /// The alignment a pointer to the elements needs (1 for u8 and u4 bytes).
    pub fn align(self) -> usize {
        self.bits().div_ceil(8)
    }

    pub fn is_float(self) -> bool {
        !matches!(self, ElemType::I32 | ElemType::U8 | ElemType::U4)
    }

    /// Whether this is a quantized cache type (u8 or u4, in OpenVINO's layout).
    pub fn is_quantized(self) -> bool {
        matches!(self, ElemType::U8 | ElemType::U4)
    }

    /// The lower-case name used in messages, on command lines and in OpenVINO's element types
    /// (`f32`, `bf16`...): [`NAMES`]' entry.
    pub fn name(self) -> &'static str {
        NAMES
            .iter()
            .find(|(t, _)| *t == self)
            .map_or("?", |(_, n)| n)
    }

    /// The type a name of [`NAMES`] spells.
    pub fn from_name(name: &str) -> Option<ElemType> {
        NAMES.iter().find(|(_, n)| *n == name).map(|(t, _)| *t)
    }

    /// A KV cache type by name (one of [`CACHE_TYPES`]); the error lists them.
    pub fn parse_cache_type(name: &str) -> Result<ElemType, String> {
        ElemType::from_name(name)
            .filter(|t| CACHE_TYPES.contains(t))
            .ok_or_else(|| {
                let names: Vec<&str> = CACHE_TYPES.iter().map(|t| t.name()).collect();
                let (last, rest) = names.split_last().unwrap_or((&"", &[]));
                format!(
                    "unknown cache type `{name}` ({} or {last})",
                    rest.join(", ")
                )
            })
    }
}

/// The one name table of the element types: what messages print and command lines parse (the
/// engine, both binaries and the converter), and OpenVINO's names for the same types.
pub const NAMES: [(ElemType, &str); 6] = [
    (ElemType::F32, "f32"),
    (ElemType::F16, "f16"),
    (ElemType::BF16, "bf16"),
    (ElemType::I32, "i32"),
    (ElemType::U8, "u8"),
    (ElemType::U4, "u4"),
];

/// The KV cache types: the float ones and the quantized ones (u8, u4 in OpenVINO's layouts).
pub const CACHE_TYPES: [ElemType; 5] = [
    ElemType::F32,
    ElemType::F16,
    ElemType::BF16,
    ElemType::U8,
    ElemType::U4,
];

/// The KV cache type when none is given: u8, OpenVINO's own default for the CPU (a quarter of
/// f32's memory; greedy ids then follow OpenVINO's u8 cache, not f32's).
pub const DEFAULT_CACHE_TYPE: ElemType = ElemType::U8;

impl std::fmt::Display for ElemType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The elements as f32 when `C` is f32 (a cache then read in place, a row copied as is).
pub(crate) fn as_f32<C: Float>(s: &[C]) -> Option<&[f32]> {
    if std::any::TypeId::of::<C>() == std::any::TypeId::of::<f32>() {
        // SAFETY: C is f32 (same TypeId), so the slice is reinterpreted as its own type.
        Some(unsafe { std::slice::from_raw_parts(s.as_ptr() as *const f32, s.len()) })
    } else {
        None
    }
}

/// Read-only typed elements (a tensor's data, `crate::tensor`).
#[derive(Clone, Copy, Debug)]
pub enum Elems<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
    BF16(&'a [bf16]),
    I32(&'a [i32]),
    U8(&'a [u8]),
    /// Packed u4 elements: the bytes (two elements each).
    U4(&'a [u8]),
}

/// Writable typed elements.
#[derive(Debug)]
pub enum ElemsMut<'a> {
    F32(&'a mut [f32]),
    F16(&'a mut [f16]),
    BF16(&'a mut [bf16]),
    I32(&'a mut [i32]),
    U8(&'a mut [u8]),
    /// Packed u4 elements: the bytes (two elements each).
    U4(&'a mut [u8]),
}

/// A floating-point storage type: f32, f16 or bf16.
pub trait Float: Copy + Send + Sync + Default + PartialEq + std::fmt::Debug + 'static {
    const TYPE: ElemType;
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    /// The elements if they are of this type.
    fn elems(e: Elems<'_>) -> Option<&[Self]>;
    /// The elements if they are of this type.
    fn elems_mut<'s>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [Self]>;
}

impl Float for f32 {
    const TYPE: ElemType = ElemType::F32;
    fn elems(e: Elems<'_>) -> Option<&[Self]> {
        match e {
            Elems::F32(s) => Some(s),
            _ => None,
        }
    }
    fn elems_mut<'s>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [Self]> {
        match e {
            ElemsMut::F32(s) => Some(s),
            _ => None,
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
}

impl Float for f16 {
    const TYPE: ElemType = ElemType::F16;
    fn elems(e: Elems<'_>) -> Option<&[Self]> {
        match e {
            Elems::F16(s) => Some(s),
            _ => None,
        }
    }
    fn elems_mut<'s>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [Self]> {
        match e {
            ElemsMut::F16(s) => Some(s),
            _ => None,
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Float for bf16 {
    const TYPE: ElemType = ElemType::BF16;
    fn elems(e: Elems<'_>) -> Option<&[Self]> {
        match e {
            Elems::BF16(s) => Some(s),
            _ => None,
        }
    }
    fn elems_mut<'s>(e: &'s mut ElemsMut<'_>) -> Option<&'s mut [Self]> {
        match e {
            ElemsMut::BF16(s) => Some(s),
            _ => None,
        }
    }
    #[inline(always)]
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        bf16::from_f32(v)
    }
}
