//! IR element types (port `precision` and `element_type` strings) and dimensions.

use paged_attention::dtype::ElemType;
use paged_attention::op::{PartialShape, DYN};

/// An element type as an IR may name it. Only f32, f16, bf16 and i32 can be executed; the rest
/// are recognised so that a message can say "unsupported" rather than "unknown".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IrType {
    F64,
    F32,
    F16,
    BF16,
    I64,
    I32,
    I16,
    I8,
    U64,
    U32,
    U16,
    U8,
    U4,
    I4,
    U1,
    Boolean,
    F8E4M3,
    F8E5M2,
    /// `dynamic` / `undefined`: not known in the IR.
    Dynamic,
}

const NAMES: &[(IrType, &[&str])] = &[
    (IrType::F64, &["FP64", "f64"]),
    (IrType::F32, &["FP32", "f32"]),
    (IrType::F16, &["FP16", "f16"]),
    (IrType::BF16, &["BF16", "bf16"]),
    (IrType::I64, &["I64", "i64"]),
    (IrType::I32, &["I32", "i32"]),
    (IrType::I16, &["I16", "i16"]),
    (IrType::I8, &["I8", "i8"]),
    (IrType::U64, &["U64", "u64"]),
    (IrType::U32, &["U32", "u32"]),
    (IrType::U16, &["U16", "u16"]),
    (IrType::U8, &["U8", "u8"]),
    (IrType::U4, &["U4", "u4"]),
    (IrType::I4, &["I4", "i4"]),
    (IrType::U1, &["U1", "u1", "BIN"]),
    (IrType::Boolean, &["BOOL", "BOOLEAN", "boolean"]),
    (IrType::F8E4M3, &["F8E4M3", "f8e4m3"]),
    (IrType::F8E5M2, &["F8E5M2", "f8e5m2"]),
    (
        IrType::Dynamic,
        &["DYNAMIC", "UNSPECIFIED", "dynamic", "undefined"],
    ),
];

impl IrType {
    /// Parses a port `precision` (`FP32`, `I32`, `BOOL`...) or a `<data>` element type (`f32`,
    /// `i32`, `boolean`...). Case-insensitive, as OpenVINO's reader is.
    pub fn parse(s: &str) -> Option<IrType> {
        let s = s.trim();
        NAMES
            .iter()
            .find(|(_, names)| names.iter().any(|n| n.eq_ignore_ascii_case(s)))
            .map(|(t, _)| *t)
    }

    /// The executable element type, if this is one.
    pub fn elem(self) -> Option<ElemType> {
        Some(match self {
            IrType::F32 => ElemType::F32,
            IrType::F16 => ElemType::F16,
            IrType::BF16 => ElemType::BF16,
            IrType::I32 => ElemType::I32,
            IrType::U8 => ElemType::U8,
            IrType::U4 => ElemType::U4,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        NAMES
            .iter()
            .find(|(t, _)| *t == self)
            .map_or("?", |(_, n)| n[0])
    }
}

impl From<ElemType> for IrType {
    fn from(e: ElemType) -> IrType {
        match e {
            ElemType::F32 => IrType::F32,
            ElemType::F16 => IrType::F16,
            ElemType::BF16 => IrType::BF16,
            ElemType::I32 => IrType::I32,
            ElemType::U8 => IrType::U8,
            ElemType::U4 => IrType::U4,
        }
    }
}

impl std::fmt::Display for IrType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Parses one dimension: a non-negative integer, or `-1` / `?` / an interval `a..b` (dynamic).
pub fn parse_dim(s: &str) -> Option<i64> {
    let s = s.trim();
    if s == "?" || s == "-1" || s.contains("..") {
        return Some(DYN);
    }
    s.parse::<i64>().ok().filter(|&v| v >= 0)
}

/// Parses a `shape` attribute (`"2,?,128"`, `""` for a scalar, `"..."` for a dynamic rank).
pub fn parse_shape_attr(s: &str) -> Option<PartialShape> {
    let s = s.trim();
    if s == "..." {
        return Some(PartialShape::dynamic());
    }
    if s.is_empty() {
        return Some(PartialShape::from_dims(&[]));
    }
    s.split(',')
        .map(parse_dim)
        .collect::<Option<Vec<i64>>>()
        .map(|d| PartialShape(Some(d)))
}

/// True when two partial shapes can describe the same tensor.
pub fn compatible(a: &PartialShape, b: &PartialShape) -> bool {
    match (&a.0, &b.0) {
        (Some(x), Some(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(&p, &q)| p < 0 || q < 0 || p == q)
        }
        _ => true,
    }
}

/// True when a concrete shape fits a partial one.
pub fn fits(shape: &[usize], p: &PartialShape) -> bool {
    compatible(&PartialShape::from_static(shape), p)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_strings_of_both_spellings_parse() {
        assert_eq!(IrType::parse("FP32"), Some(IrType::F32));
        assert_eq!(IrType::parse("f16"), Some(IrType::F16));
        assert_eq!(IrType::parse("BOOLEAN"), Some(IrType::Boolean));
        assert_eq!(IrType::parse("bf16"), Some(IrType::BF16));
        assert_eq!(IrType::parse("FP33"), None);
    }

    #[test]
    fn shapes_parse_with_dynamic_dims() {
        assert_eq!(
            parse_shape_attr("?,128"),
            Some(PartialShape(Some(vec![-1, 128])))
        );
        assert_eq!(parse_shape_attr(""), Some(PartialShape(Some(vec![]))));
        assert_eq!(parse_shape_attr("..."), Some(PartialShape(None)));
        assert_eq!(parse_shape_attr("2,-3"), None);
    }
}
