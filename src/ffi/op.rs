//! `extern "C"` functions of the op: version, shape inference, validate, execute.

use super::{
    boundary, c_array, check_no_overlap, describe, env, PaPartialShape, PaTensor, MAX_RANK,
};
use crate::dtype::ElemType;
use crate::error::{PaError, Status};
use crate::kernel::fast::{self, Precision};
use crate::op::contract::{
    INPUTS, KEY_CACHE, MAX_INPUTS, MIN_INPUTS, NUM_OUTPUTS, OUTPUT_NAMES, VALUE_CACHE,
};
use crate::op::{InputArg, PaInputs, PaOutputs, PartialInput, PartialShape};
use crate::threads::{HostRunner, ParallelForFn, Runner};
use std::ffi::{c_char, c_void};
use std::panic::catch_unwind;

static VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), "\0");

#[no_mangle]
pub extern "C" fn pa_version() -> u32 {
    let p = |s: &str| s.parse::<u32>().unwrap_or(0);
    (p(env!("CARGO_PKG_VERSION_MAJOR")) << 16)
        | (p(env!("CARGO_PKG_VERSION_MINOR")) << 8)
        | p(env!("CARGO_PKG_VERSION_PATCH"))
}

#[no_mangle]
pub extern "C" fn pa_version_string() -> *const c_char {
    VERSION.as_ptr() as *const c_char
}

#[no_mangle]
pub extern "C" fn pa_status_name(status: i32) -> *const c_char {
    Status::from_code(status)
        .map_or(c"PA_STATUS_UNKNOWN", Status::c_name)
        .as_ptr()
}

/// # Safety
/// `buf` must point to `len` writable bytes when `len > 0`.
#[no_mangle]
pub unsafe extern "C" fn pa_last_error_message(buf: *mut c_char, len: usize) -> usize {
    super::LAST_ERROR.with(|e| {
        let e = e.borrow();
        let bytes = e.as_bytes();
        if !buf.is_null() && len > 0 {
            let n = bytes.len().min(len - 1);
            // SAFETY: the caller gives `len` writable bytes at `buf`; we write n + 1 <= len.
            unsafe {
                std::ptr::copy_nonoverlapping(bytes.as_ptr() as *const c_char, buf, n);
                *buf.add(n) = 0;
            }
        }
        bytes.len()
    })
}

fn partial_from_c(s: &PaPartialShape, i: usize) -> Result<PartialInput, PaError> {
    let name = INPUTS.get(i).map_or("input", |s| s.name);
    let elem = match s.elem_type {
        -1 => None,
        c => Some(
            ElemType::from_code(c).ok_or_else(|| PaError::InvalidArgument {
                detail: format!("`{name}` has unknown elem_type {c}"),
            })?,
        ),
    };
    let shape = match s.rank {
        -1 => PartialShape::dynamic(),
        r if (0..=MAX_RANK as i32).contains(&r) => {
            let dims = &s.dims[..r as usize];
            if let Some(d) = dims.iter().find(|&&d| d < -1) {
                return Err(PaError::InvalidArgument {
                    detail: format!("`{name}` has dimension {d}; use -1 for dynamic"),
                });
            }
            PartialShape::from_dims(dims)
        }
        r => {
            return Err(PaError::InvalidArgument {
                detail: format!("`{name}` has rank {r}, outside -1..={MAX_RANK}"),
            })
        }
    };
    Ok(PartialInput::new(elem, shape))
}

fn write_shapes(
    outputs: *mut PaPartialShape,
    infos: [(Option<ElemType>, PartialShape); 2],
) -> Result<(), PaError> {
    if outputs.is_null() {
        return Err(PaError::NullPointer {
            what: "outputs".into(),
        });
    }
    let converted = [
        PaPartialShape::from_rust(infos[0].0, &infos[0].1)?,
        PaPartialShape::from_rust(infos[1].0, &infos[1].1)?,
    ];
    // SAFETY: the caller provides an array of 2 writable pa_partial_shape at `outputs` (header).
    unsafe { std::ptr::copy_nonoverlapping(converted.as_ptr(), outputs, 2) };
    Ok(())
}

/// # Safety
/// `inputs` points to `n_inputs` valid structs; `outputs` to 2 writable ones.
#[no_mangle]
pub unsafe extern "C" fn pa_infer_shapes(
    inputs: *const PaPartialShape,
    n_inputs: usize,
    outputs: *mut PaPartialShape,
) -> i32 {
    boundary(|| {
        // SAFETY: the header's contract for `inputs`.
        let list = unsafe { c_array(inputs, n_inputs, "inputs")? };
        if !(MIN_INPUTS..=MAX_INPUTS).contains(&list.len()) {
            return Err(PaError::InputCount { found: list.len() });
        }
        let parts = list
            .iter()
            .enumerate()
            .map(|(i, s)| partial_from_c(s, i))
            .collect::<Result<Vec<_>, _>>()?;
        let [o, s] = crate::op::infer_shapes(&parts)?;
        write_shapes(outputs, [(o.elem, o.shape), (s.elem, s.shape)])
    })
}

/// Runs `f` on the op's inputs (and outputs, when given) built from C descriptors.
///
/// # Safety
/// The pointers follow the header's contract for pa_validate / pa_execute.
unsafe fn with_call<R>(
    inputs: *const PaTensor,
    n_inputs: usize,
    outputs: Option<(*const PaTensor, usize)>,
    f: impl FnOnce(&mut PaInputs<'_>, Option<&mut PaOutputs<'_>>) -> Result<R, PaError>,
) -> Result<R, PaError> {
    // SAFETY: the header's contract for `inputs`.
    let list = unsafe { c_array(inputs, n_inputs, "inputs")? };
    if !(MIN_INPUTS..=MAX_INPUTS).contains(&list.len()) {
        return Err(PaError::InputCount { found: list.len() });
    }
    let descs = list
        .iter()
        .enumerate()
        .map(|(i, t)| describe(t, INPUTS[i].name))
        .collect::<Result<Vec<_>, _>>()?;
    let out_descs = match outputs {
        None => vec![],
        Some((p, n)) => {
            // SAFETY: the header's contract for `outputs`.
            let outs = unsafe { c_array(p, n, "outputs")? };
            if outs.len() != NUM_OUTPUTS {
                return Err(PaError::InvalidArgument {
                    detail: format!(
                        "pa_execute takes {NUM_OUTPUTS} outputs, but n_outputs = {}",
                        outs.len()
                    ),
                });
            }
            outs.iter()
                .enumerate()
                .map(|(i, t)| describe(t, OUTPUT_NAMES[i]))
                .collect::<Result<Vec<_>, _>>()?
        }
    };
    let writable = |i: usize| i == KEY_CACHE || i == VALUE_CACHE;
    let mut all: Vec<(&str, &super::Described, bool)> = descs
        .iter()
        .enumerate()
        .map(|(i, d)| (INPUTS[i].name, d, writable(i)))
        .collect();
    all.extend(
        out_descs
            .iter()
            .enumerate()
            .map(|(i, d)| (OUTPUT_NAMES[i], d, true)),
    );
    check_no_overlap(&all)?;

    let args = descs
        .iter()
        .enumerate()
        .map(|(i, d)| {
            // SAFETY: pointers valid per the header; writable buffers do not overlap anything
            // (checked above), so the `&mut` views are exclusive.
            unsafe {
                if writable(i) {
                    InputArg::Mut(d.as_tensor_mut())
                } else {
                    InputArg::Ref(d.as_tensor())
                }
            }
        })
        .collect();
    let mut pa = PaInputs::from_list(args)?;
    if out_descs.is_empty() {
        return f(&mut pa, None);
    }
    // SAFETY: as above; outputs were checked not to overlap any buffer.
    let (output, scores) = unsafe { (out_descs[0].as_tensor_mut(), out_descs[1].as_tensor_mut()) };
    f(&mut pa, Some(&mut PaOutputs { output, scores }))
}

/// # Safety
/// See the header: `inputs` points to `n_inputs` valid tensors; `output_shapes` is NULL or 2.
#[no_mangle]
pub unsafe extern "C" fn pa_validate(
    inputs: *const PaTensor,
    n_inputs: usize,
    output_shapes: *mut PaPartialShape,
) -> i32 {
    boundary(|| {
        // SAFETY: the header's contract.
        let plan = unsafe { with_call(inputs, n_inputs, None, |pa, _| crate::op::validate(pa))? };
        if !output_shapes.is_null() {
            let [o, s] = plan.output_shapes();
            let ty = Some(plan.query_type);
            write_shapes(
                output_shapes,
                [
                    (ty, PartialShape::from_static(&o)),
                    (ty, PartialShape::from_static(&s)),
                ],
            )?;
        }
        Ok(())
    })
}

unsafe fn execute_with(
    inputs: *const PaTensor,
    n_inputs: usize,
    outputs: *const PaTensor,
    n_outputs: usize,
    run: impl FnOnce(&mut PaInputs<'_>, &mut PaOutputs<'_>) -> Result<(), PaError>,
) -> i32 {
    boundary(|| {
        // SAFETY: the header's contract.
        unsafe {
            with_call(
                inputs,
                n_inputs,
                Some((outputs, n_outputs)),
                |pa, out| match out {
                    Some(out) => run(pa, out),
                    None => Err(PaError::NullPointer {
                        what: "outputs".into(),
                    }),
                },
            )
        }
    })
}

/// # Safety
/// See the header.
#[no_mangle]
pub unsafe extern "C" fn pa_execute(
    inputs: *const PaTensor,
    n_inputs: usize,
    outputs: *const PaTensor,
    n_outputs: usize,
) -> i32 {
    let opts = env::fast_options(Runner::Auto, Precision::F32);
    // SAFETY: forwarded contract.
    unsafe {
        execute_with(inputs, n_inputs, outputs, n_outputs, |i, o| {
            fast::execute_with(opts, i, o)
        })
    }
}

/// The C `pa_runner`: a host's parallel-for.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PaRunner {
    pub parallel_for: Option<ParallelForFn>,
    pub ctx: *mut c_void,
    pub max_threads: usize,
}

fn host_runner(r: &PaRunner) -> Result<Runner, PaError> {
    let parallel_for = r.parallel_for.ok_or_else(|| PaError::NullPointer {
        what: "runner->parallel_for".into(),
    })?;
    if r.max_threads == 0 {
        return Err(PaError::InvalidArgument {
            detail:
                "runner->max_threads is 0; give the number of threads the runner may use (>= 1)"
                    .into(),
        });
    }
    Ok(Runner::Host(HostRunner {
        parallel_for,
        ctx: r.ctx,
        threads: r.max_threads,
    }))
}

/// The C `pa_precision` codes (`PA_PRECISION_<NAME>`), one table.
pub const PRECISIONS: [(i32, Precision); 2] = [(0, Precision::F32), (1, Precision::Bf16)];

fn precision_of(code: i32) -> Result<Precision, PaError> {
    PRECISIONS
        .iter()
        .find(|(c, _)| *c == code)
        .map(|&(_, p)| p)
        .ok_or_else(|| PaError::InvalidArgument {
            detail: format!(
                "precision {code} is not a pa_precision (PA_PRECISION_F32 = 0, PA_PRECISION_BF16 = 1)"
            ),
        })
}

/// # Safety
/// See the header: as `pa_execute`; `runner` is NULL or points to a valid `pa_runner`.
#[no_mangle]
pub unsafe extern "C" fn pa_execute_ex(
    inputs: *const PaTensor,
    n_inputs: usize,
    outputs: *const PaTensor,
    n_outputs: usize,
    runner: *const PaRunner,
    precision: i32,
) -> i32 {
    let precision = match precision_of(precision) {
        Ok(p) => p,
        Err(e) => return boundary(|| Err(e)),
    };
    // SAFETY: the header's contract for `runner` (NULL or valid for the call).
    let runner = match unsafe { runner.as_ref() } {
        None => Ok(Runner::Auto),
        Some(r) => host_runner(r),
    };
    let runner = match runner {
        Ok(r) => r,
        Err(e) => return boundary(|| Err(e)),
    };
    let opts = env::fast_options(runner, precision);
    // SAFETY: forwarded contract.
    unsafe {
        execute_with(inputs, n_inputs, outputs, n_outputs, |i, o| {
            fast::execute_with(opts, i, o)
        })
    }
}

#[no_mangle]
pub extern "C" fn pa_set_num_threads(n: usize) -> i32 {
    boundary(|| crate::threads::set_num_threads(n))
}

#[no_mangle]
pub extern "C" fn pa_get_num_threads() -> usize {
    catch_unwind(crate::threads::num_threads).unwrap_or(1)
}

/// The C `pa_item_counts` (tests/c/pa_test_hooks.h). Feature `test-hooks` only.
#[cfg(feature = "test-hooks")]
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PaItemCounts {
    pub pool: u64,
    pub host: u64,
    pub other: u64,
}

/// The test hook `pa_item_counts_get` (tests/c/pa_test_hooks.h): exported only by builds with
/// the feature `test-hooks`.
///
/// # Safety
/// `out` is NULL or points to a writable `pa_item_counts`.
#[cfg(feature = "test-hooks")]
#[no_mangle]
pub unsafe extern "C" fn pa_item_counts_get(out: *mut PaItemCounts) -> i32 {
    boundary(|| {
        let c = crate::threads::item_counts();
        let v = PaItemCounts {
            pool: c.pool,
            host: c.host,
            other: c.other,
        };
        // SAFETY: the header's contract: NULL or one writable struct.
        match unsafe { out.as_mut() } {
            Some(o) => {
                *o = v;
                Ok(())
            }
            None => Err(PaError::NullPointer { what: "out".into() }),
        }
    })
}

/// # Safety
/// See the header.
#[no_mangle]
pub unsafe extern "C" fn pa_execute_reference(
    inputs: *const PaTensor,
    n_inputs: usize,
    outputs: *const PaTensor,
    n_outputs: usize,
) -> i32 {
    // SAFETY: forwarded contract.
    unsafe {
        execute_with(
            inputs,
            n_inputs,
            outputs,
            n_outputs,
            crate::execute_reference,
        )
    }
}
