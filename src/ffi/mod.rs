//! The `extern "C"` surface of `include/paged_attention.h`. Each function converts its
//! arguments, calls safe Rust, and maps the error: no kernel logic lives here.
//!
//! - this file: the panic-catching boundary, the per-thread last error, tensor conversion.
//! - `op`: the op's functions (version, shape inference, validate, execute).
//! - `cache`: the block manager and scheduler (`include/paged_attention_cache.h`).
//! - `env`: the environment variables (`PA_SIMD`, `PA_BF16_QUERY`), read at these edges only.

pub mod cache;
pub mod env;
pub mod op;

use crate::dtype::ElemType;
use crate::error::{PaError, Status};
use crate::tensor::{Elems, ElemsMut, Tensor, TensorMut};
use half::{bf16, f16};
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

pub(crate) const MAX_RANK: usize = 8;

thread_local! {
    static LAST_ERROR: RefCell<String> = const { RefCell::new(String::new()) };
}

/// Records `msg` as this thread's last error (empty clears it).
pub(crate) fn set_last_error(msg: &str) {
    LAST_ERROR.with(|e| {
        let mut e = e.borrow_mut();
        e.clear();
        e.push_str(msg);
    });
}

/// Runs `f` behind the C boundary: a panic becomes `Status::Panic`, an error becomes its status
/// code, and either way the message is kept for `pa_last_error_message`.
pub(crate) fn boundary(f: impl FnOnce() -> Result<(), PaError>) -> i32 {
    let r = catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|p| {
        let msg = p
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(PaError::Panic(msg))
    });
    match r {
        Ok(()) => {
            set_last_error("");
            Status::Ok as i32
        }
        Err(e) => {
            set_last_error(&e.to_string());
            e.status() as i32
        }
    }
}

/// The C `pa_tensor`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PaTensor {
    pub elem_type: i32,
    pub rank: i32,
    pub dims: [i64; MAX_RANK],
    pub data: *mut std::ffi::c_void,
}

/// The C `pa_partial_shape`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PaPartialShape {
    pub elem_type: i32,
    pub rank: i32,
    pub dims: [i64; MAX_RANK],
}

impl PaPartialShape {
    pub(crate) fn from_rust(
        elem: Option<ElemType>,
        shape: &crate::op::PartialShape,
    ) -> Result<Self, PaError> {
        let mut dims = [0i64; MAX_RANK];
        let rank = match &shape.0 {
            None => -1,
            Some(d) => {
                if d.len() > MAX_RANK {
                    return Err(PaError::InvalidArgument {
                        detail: format!("rank {} exceeds PA_MAX_RANK", d.len()),
                    });
                }
                dims[..d.len()].copy_from_slice(d);
                d.len() as i32
            }
        };
        Ok(PaPartialShape {
            elem_type: elem.map_or(-1, |e| e as i32),
            rank,
            dims,
        })
    }
}

/// Which kind of access a converted tensor gets.
pub(crate) struct Described {
    pub elem: ElemType,
    pub shape: Vec<usize>,
    pub numel: usize,
    pub ptr: *mut std::ffi::c_void,
    /// Byte range `[start, end)` the tensor covers (empty when it has no elements).
    pub range: (usize, usize),
}

/// Checks a `pa_tensor` (enum, rank, dims, size, pointer, alignment) without touching its data.
pub(crate) fn describe(t: &PaTensor, name: &str) -> Result<Described, PaError> {
    let elem = ElemType::from_code(t.elem_type).ok_or_else(|| PaError::InvalidArgument {
        detail: format!("`{name}` has unknown elem_type {}", t.elem_type),
    })?;
    if t.rank < 0 || t.rank as usize > MAX_RANK {
        return Err(PaError::InvalidArgument {
            detail: format!("`{name}` has rank {}, outside 0..={MAX_RANK}", t.rank),
        });
    }
    let mut shape = Vec::with_capacity(t.rank as usize);
    for (i, &d) in t.dims[..t.rank as usize].iter().enumerate() {
        if d < 0 {
            return Err(PaError::InvalidArgument {
                detail: format!("`{name}` has a negative dimension dims[{i}] = {d}"),
            });
        }
        shape.push(d as usize);
    }
    let too_big = || PaError::InvalidArgument {
        detail: format!("`{name}` shape {shape:?} is too large to address"),
    };
    let numel = crate::tensor::shape_elems(&shape).ok_or_else(too_big)?;
    let bytes = elem
        .bytes_for(numel)
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(too_big)?;
    let addr = t.data as usize;
    if numel > 0 {
        if t.data.is_null() {
            return Err(PaError::NullPointer {
                what: format!("`{name}` data ({numel} elements)"),
            });
        }
        if !addr.is_multiple_of(elem.align()) {
            return Err(PaError::Alignment {
                name: name.to_string(),
                align: elem.align(),
            });
        }
        addr.checked_add(bytes)
            .ok_or_else(|| PaError::InvalidArgument {
                detail: format!(
                    "`{name}` data at {:p} plus its {bytes} bytes runs past the end of the \
                     address space",
                    t.data
                ),
            })?;
    }
    let range = if numel > 0 {
        (addr, addr + bytes)
    } else {
        (0, 0)
    };
    Ok(Described {
        elem,
        shape,
        numel,
        ptr: t.data,
        range,
    })
}

/// Rejects a writable buffer that overlaps any other buffer of the call: the op would otherwise
/// read what it writes (or Rust would hold two `&mut` to one place).
pub(crate) fn check_no_overlap(all: &[(&str, &Described, bool)]) -> Result<(), PaError> {
    for (i, (name_a, a, writable_a)) in all.iter().enumerate() {
        for (name_b, b, writable_b) in &all[i + 1..] {
            if !(*writable_a || *writable_b) || a.range.0 == a.range.1 || b.range.0 == b.range.1 {
                continue;
            }
            if a.range.0 < b.range.1 && b.range.0 < a.range.1 {
                return Err(PaError::InvalidArgument {
                    detail: format!(
                        "buffers `{name_a}` and `{name_b}` overlap, and one of them is written"
                    ),
                });
            }
        }
    }
    Ok(())
}

impl Described {
    /// A read-only view.
    ///
    /// # Safety
    /// `self.ptr` must point to `self.numel` initialised elements of `self.elem` that stay valid
    /// and are not written by anyone else for `'a`.
    pub(crate) unsafe fn as_tensor<'a>(&self) -> Tensor<'a> {
        let n = self.numel;
        // SAFETY: `describe` checked non-NULL (when n > 0), alignment and that n elements fit
        // in isize; the caller guarantees validity and no concurrent writes. For n == 0 we use
        // an empty slice and never touch the pointer.
        let data = unsafe {
            match self.elem {
                ElemType::F32 => Elems::F32(raw_slice::<f32>(self.ptr, n)),
                ElemType::F16 => Elems::F16(raw_slice::<f16>(self.ptr, n)),
                ElemType::BF16 => Elems::BF16(raw_slice::<bf16>(self.ptr, n)),
                ElemType::I32 => Elems::I32(raw_slice::<i32>(self.ptr, n)),
                ElemType::U8 => Elems::U8(raw_slice::<u8>(self.ptr, n)),
                ElemType::U4 => Elems::U4(raw_slice::<u8>(self.ptr, n.div_ceil(2))),
            }
        };
        Tensor {
            shape: self.shape.clone(),
            data,
        }
    }

    /// A writable view.
    ///
    /// # Safety
    /// As [`Described::as_tensor`], and no other reference to this memory may exist for `'a`
    /// (checked for the call's own buffers by [`check_no_overlap`]).
    pub(crate) unsafe fn as_tensor_mut<'a>(&self) -> TensorMut<'a> {
        let n = self.numel;
        // SAFETY: as in `as_tensor`; exclusivity is the caller's guarantee.
        let data = unsafe {
            match self.elem {
                ElemType::F32 => ElemsMut::F32(raw_slice_mut::<f32>(self.ptr, n)),
                ElemType::F16 => ElemsMut::F16(raw_slice_mut::<f16>(self.ptr, n)),
                ElemType::BF16 => ElemsMut::BF16(raw_slice_mut::<bf16>(self.ptr, n)),
                ElemType::I32 => ElemsMut::I32(raw_slice_mut::<i32>(self.ptr, n)),
                ElemType::U8 => ElemsMut::U8(raw_slice_mut::<u8>(self.ptr, n)),
                ElemType::U4 => ElemsMut::U4(raw_slice_mut::<u8>(self.ptr, n.div_ceil(2))),
            }
        };
        TensorMut {
            shape: self.shape.clone(),
            data,
        }
    }
}

/// # Safety
/// For n > 0: `p` non-NULL, aligned for T, pointing to n valid T for `'a`.
unsafe fn raw_slice<'a, T>(p: *mut std::ffi::c_void, n: usize) -> &'a [T] {
    if n == 0 {
        return &[];
    }
    // SAFETY: guaranteed by the caller (see the function's contract).
    unsafe { std::slice::from_raw_parts(p as *const T, n) }
}

/// # Safety
/// As [`raw_slice`], and the memory must not be aliased for `'a`.
unsafe fn raw_slice_mut<'a, T>(p: *mut std::ffi::c_void, n: usize) -> &'a mut [T] {
    if n == 0 {
        return &mut [];
    }
    // SAFETY: guaranteed by the caller (see the function's contract).
    unsafe { std::slice::from_raw_parts_mut(p as *mut T, n) }
}

/// Reads a C array argument.
///
/// # Safety
/// For n > 0 and non-NULL `p`: `p` points to n valid, aligned T.
pub(crate) unsafe fn c_array<'a, T>(p: *const T, n: usize, what: &str) -> Result<&'a [T], PaError> {
    if p.is_null() {
        return Err(PaError::NullPointer {
            what: what.to_string(),
        });
    }
    if n == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-NULL checked; validity and length are the caller's contract.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}
