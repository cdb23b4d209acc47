//! `.npy` files (format 1.0, 2.0 and 3.0), little-endian, C order. Element types: `<f4`, `<f2`,
//! `<i4`, `<u2` (bf16 as raw bits, the golden suite's convention), `|u1` and `|b1` (masks), and,
//! read only, `<f8` and `<i8`. Sizes are checked against the file before anything is allocated.

//!
//! The golden suite's harness and `pa run` read and write them; the u8-cache fixtures are `.npy`
//! too. Errors are messages naming the file.

use std::path::Path;

use crate::ir::{OwnedData, OwnedTensor};
use paged_attention::dtype::ElemType;
use paged_attention::tensor::shape_elems;

const MAGIC: &[u8] = b"\x93NUMPY";

/// Element type of a `.npy` file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NpyDtype {
    F64,
    F32,
    F16,
    I64,
    I32,
    /// bf16 raw bits.
    U16,
    U8,
    Bool,
}

impl NpyDtype {
    fn parse(descr: &str) -> Option<NpyDtype> {
        // By chars, not bytes: the header is arbitrary text ('é4' must not split a char).
        let mut chars = descr.chars();
        let order = chars.next();
        let code = chars.as_str();
        let little = matches!(order, Some('<' | '|' | '='));
        Some(match (code, little) {
            ("f8", true) => NpyDtype::F64,
            ("f4", true) => NpyDtype::F32,
            ("f2", true) => NpyDtype::F16,
            ("i8", true) => NpyDtype::I64,
            ("i4", true) => NpyDtype::I32,
            ("u2", true) => NpyDtype::U16,
            ("u1", true) => NpyDtype::U8,
            ("b1", true) => NpyDtype::Bool,
            _ => return None,
        })
    }
    pub fn size(self) -> usize {
        match self {
            NpyDtype::F64 | NpyDtype::I64 => 8,
            NpyDtype::F32 | NpyDtype::I32 => 4,
            NpyDtype::F16 | NpyDtype::U16 => 2,
            NpyDtype::U8 | NpyDtype::Bool => 1,
        }
    }
    pub fn descr(self) -> &'static str {
        match self {
            NpyDtype::F64 => "<f8",
            NpyDtype::F32 => "<f4",
            NpyDtype::F16 => "<f2",
            NpyDtype::I64 => "<i8",
            NpyDtype::I32 => "<i4",
            NpyDtype::U16 => "<u2",
            NpyDtype::U8 => "|u1",
            NpyDtype::Bool => "|b1",
        }
    }
}

/// The contents of a `.npy` file: its type, shape and raw little-endian data.
#[derive(Clone, Debug, PartialEq)]
pub struct NpyArray {
    pub dtype: NpyDtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// A tiny reader of the header's Python literal: `{'descr': '<f4', 'fortran_order': False,
/// 'shape': (2, 3), }`.
struct Header<'a> {
    s: &'a str,
}

impl<'a> Header<'a> {
    /// The text after `'key':`, trimmed.
    fn value(&self, key: &str) -> Option<&'a str> {
        for q in ['\'', '"'] {
            let pat = format!("{q}{key}{q}");
            if let Some(at) = self.s.find(&pat) {
                let rest = self.s[at + pat.len()..].trim_start();
                return rest.strip_prefix(':').map(str::trim_start);
            }
        }
        None
    }
    fn string(&self, key: &str) -> Option<&'a str> {
        let v = self.value(key)?;
        let q = v.chars().next().filter(|c| *c == '\'' || *c == '"')?;
        let v = &v[1..];
        v.find(q).map(|end| &v[..end])
    }
    fn shape(&self) -> Option<Vec<usize>> {
        let v = self.value("shape")?.strip_prefix('(')?;
        let inner = &v[..v.find(')')?];
        inner
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| p.trim_end_matches('L').parse::<usize>().ok())
            .collect()
    }
}

/// Parses a whole `.npy` file held in memory.
pub fn parse_npy(file: &[u8]) -> Result<NpyArray, String> {
    if file.len() < 10 || &file[..6] != MAGIC {
        return Err("not a .npy file (bad magic)".into());
    }
    let (major, minor) = (file[6], file[7]);
    let (hlen, start): (usize, usize) = match major {
        1 => (u16::from_le_bytes([file[8], file[9]]) as usize, 10),
        2 | 3 => {
            if file.len() < 12 {
                return Err("truncated header".into());
            }
            (
                u32::from_le_bytes([file[8], file[9], file[10], file[11]]) as usize,
                12,
            )
        }
        _ => {
            return Err(format!(
                ".npy format version {major}.{minor} is not supported"
            ))
        }
    };
    let end = start
        .checked_add(hlen)
        .filter(|&e| e <= file.len())
        .ok_or("header runs past the end of the file")?;
    let text = std::str::from_utf8(&file[start..end]).map_err(|_| "header is not text")?;
    let h = Header { s: text };
    let descr = h.string("descr").ok_or("header has no 'descr'")?;
    let dtype = NpyDtype::parse(descr).ok_or_else(|| {
        format!("element type '{descr}' is not supported (little-endian <f4, <f2, <i4, <u2 (bf16 bits), |u1, |b1, <f8, <i8 are)")
    })?;
    match h.value("fortran_order") {
        Some(v) if v.starts_with("False") => {}
        Some(_) => return Err("Fortran-order arrays are not supported (C order only)".into()),
        None => return Err("header has no 'fortran_order'".into()),
    }
    let shape = h
        .shape()
        .ok_or("header's 'shape' is not a tuple of integers")?;
    let data = &file[end..];
    let need = shape_elems(&shape).and_then(|n| n.checked_mul(dtype.size()));
    if need != Some(data.len()) {
        return Err(format!(
            "shape {shape:?} of {descr} needs {} bytes of data, but the file holds {}",
            need.map_or_else(|| "more than addressable".to_string(), |n| n.to_string()),
            data.len()
        ));
    }
    Ok(NpyArray {
        dtype,
        shape,
        bytes: data.to_vec(),
    })
}

pub fn read_npy(path: &Path) -> Result<NpyArray, String> {
    let file = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_npy(&file).map_err(|e| format!("{}: {e}", path.display()))
}

impl NpyArray {
    /// As an executor tensor: `<f4` f32, `<f2` f16, `<u2` bf16, `<i4` i32, `|u1` u8 (cache bytes).
    pub fn into_tensor(self) -> Result<OwnedTensor, String> {
        let elem = match self.dtype {
            NpyDtype::F32 => ElemType::F32,
            NpyDtype::F16 => ElemType::F16,
            NpyDtype::U16 => ElemType::BF16,
            NpyDtype::I32 => ElemType::I32,
            NpyDtype::U8 => ElemType::U8,
            d => {
                return Err(format!(
                "element type '{}' cannot be a model input (<f4, <f2, <u2 for bf16, <i4, |u1 can)",
                d.descr()
            ))
            }
        };
        OwnedTensor::from_le_bytes(elem, self.shape, &self.bytes).map_err(|e| e.to_string())
    }

    /// Every element widened to f64 (`<u2` read as bf16).
    pub fn to_f64(&self) -> Vec<f64> {
        let b = &self.bytes;
        match self.dtype {
            NpyDtype::F64 => b
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))
                .collect(),
            NpyDtype::I64 => b
                .chunks_exact(8)
                .map(|c| i64::from_le_bytes(c.try_into().unwrap_or([0; 8])) as f64)
                .collect(),
            NpyDtype::F32 => b
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect(),
            NpyDtype::I32 => b
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f64)
                .collect(),
            NpyDtype::F16 => b
                .chunks_exact(2)
                .map(|c| half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
                .collect(),
            NpyDtype::U16 => b
                .chunks_exact(2)
                .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f64())
                .collect(),
            NpyDtype::U8 | NpyDtype::Bool => b.iter().map(|&x| x as f64).collect(),
        }
    }

    /// Non-zero elements as `true` (for `|b1` / `|u1` masks).
    pub fn to_mask(&self) -> Result<Vec<bool>, String> {
        match self.dtype {
            NpyDtype::U8 | NpyDtype::Bool => Ok(self.bytes.iter().map(|&x| x != 0).collect()),
            d => Err(format!("a mask must be |b1 or |u1, not '{}'", d.descr())),
        }
    }
}

/// Encodes an array as a format-1.0 `.npy` file (header padded to 64 bytes, as numpy does).
pub fn encode_npy(dtype: NpyDtype, shape: &[usize], data: &[u8]) -> Vec<u8> {
    let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
    let tuple = match dims.len() {
        1 => format!("({},)", dims[0]),
        _ => format!("({})", dims.join(", ")),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {tuple}, }}",
        dtype.descr()
    );
    let unpadded = MAGIC.len() + 4 + header.len() + 1;
    header.push_str(&" ".repeat((64 - unpadded % 64) % 64));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// The `.npy` encoding of a tensor (bf16 as `<u2`; u4 as its packed bytes, `|u1` with the last
/// dimension halved, as OpenVINO's Python API shows a u4 tensor's data).
pub fn tensor_npy(t: &OwnedTensor) -> Vec<u8> {
    if let OwnedData::U4(bytes) = t.data() {
        let mut shape = t.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = last.div_ceil(2);
        }
        return encode_npy(NpyDtype::U8, &shape, bytes);
    }
    let dtype = match t.data() {
        OwnedData::F32(_) => NpyDtype::F32,
        OwnedData::F16(_) => NpyDtype::F16,
        OwnedData::BF16(_) => NpyDtype::U16,
        OwnedData::I32(_) => NpyDtype::I32,
        OwnedData::U8(_) | OwnedData::U4(_) => NpyDtype::U8,
    };
    encode_npy(dtype, t.shape(), &t.to_le_bytes())
}

pub fn write_npy(path: &Path, t: &OwnedTensor) -> Result<(), String> {
    std::fs::write(path, tensor_npy(t)).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_keeps_type_shape_and_bits() {
        let t = OwnedTensor::new(
            vec![2, 3],
            OwnedData::BF16(
                (0..6)
                    .map(|i| half::bf16::from_f32(i as f32 - 2.5))
                    .collect(),
            ),
        )
        .unwrap();
        let bytes = tensor_npy(&t);
        assert_eq!(
            (bytes.len() - 12) % 64,
            0,
            "data must start 64-byte aligned"
        );
        let back = parse_npy(&bytes).unwrap();
        assert_eq!(back.dtype, NpyDtype::U16);
        assert_eq!(back.into_tensor().unwrap(), t);
    }

    #[test]
    fn scalar_and_1d_headers_parse() {
        for shape in [vec![], vec![5]] {
            let n = shape_elems(&shape).unwrap();
            let f = encode_npy(NpyDtype::I32, &shape, &vec![0u8; 4 * n]);
            assert_eq!(parse_npy(&f).unwrap().shape, shape);
        }
    }

    /// `file` with the first `from` in its header replaced by `to` (same length).
    fn patch(file: &[u8], from: &str, to: &str) -> Vec<u8> {
        assert_eq!(from.len(), to.len());
        let at = file
            .windows(from.len())
            .position(|w| w == from.as_bytes())
            .unwrap();
        let mut f = file.to_vec();
        f[at..at + to.len()].copy_from_slice(to.as_bytes());
        f
    }

    /// A file with a hand-written header.
    fn raw(header: &str, data: &[u8]) -> Vec<u8> {
        let mut f = MAGIC.to_vec();
        f.extend_from_slice(&[1, 0]);
        f.extend_from_slice(&(header.len() as u16).to_le_bytes());
        f.extend_from_slice(header.as_bytes());
        f.extend_from_slice(data);
        f
    }

    #[test]
    fn huge_shape_is_refused_without_allocating() {
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 8), }";
        let err = parse_npy(&raw(h, &[0; 16])).unwrap_err();
        assert!(err.contains("more than addressable"), "{err}");
        let h = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000,), }";
        let err = parse_npy(&raw(h, &[0; 16])).unwrap_err();
        assert!(err.contains("needs 4000000000 bytes"), "{err}");
    }

    #[test]
    fn a_descr_starting_with_a_multibyte_char_is_refused() {
        let h = "{'descr': 'é4', 'fortran_order': False, 'shape': (1,), }";
        let err = parse_npy(&raw(h, &[0; 4])).unwrap_err();
        assert!(err.contains("'é4' is not supported"), "{err}");
    }

    #[test]
    fn big_endian_and_fortran_order_are_refused() {
        let f = encode_npy(NpyDtype::F32, &[1], &[0; 4]);
        let err = parse_npy(&patch(&f, "<f4", ">f4")).unwrap_err();
        assert!(err.contains(">f4"), "{err}");
        let err = parse_npy(&patch(&f, "False", "True ")).unwrap_err();
        assert!(err.contains("Fortran"), "{err}");
    }
}
