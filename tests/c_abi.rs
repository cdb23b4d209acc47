//! The C ABI through the built shared library (loaded with `libloading`), and C / C++ programs
//! compiled against `include/paged_attention.h` with `-Wall -Wextra -Werror`, linked to the
//! library and run.

mod common;
mod support;

use common::call::{Call, Runner};
use common::ref64::{gen_case, Features, Geometry, SeqKind};
use libloading::{Library, Symbol};
use paged_attention::ElemType::{self, F16, F32};
use std::ffi::{c_char, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

const OK: i32 = 0;
const NULL_POINTER: i32 = 1;
const INVALID_ARGUMENT: i32 = 2;
const INPUT_COUNT: i32 = 3;
const SHAPE: i32 = 6;
const VALUE: i32 = 7;
const BUFFER_SIZE: i32 = 8;
const ALIGNMENT: i32 = 9;

/// `pa_tensor` of the header.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
struct CTensor {
    elem_type: i32,
    rank: i32,
    dims: [i64; 8],
    data: *mut c_void,
}

/// `pa_partial_shape` of the header.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
struct CShape {
    elem_type: i32,
    rank: i32,
    dims: [i64; 8],
}

impl CShape {
    fn new(elem: i32, dims: &[i64]) -> CShape {
        let mut d = [0; 8];
        d[..dims.len()].copy_from_slice(dims);
        CShape {
            elem_type: elem,
            rank: dims.len() as i32,
            dims: d,
        }
    }
    fn dims(&self) -> &[i64] {
        &self.dims[..self.rank.max(0) as usize]
    }
}

/// `target/<profile>/deps`, where `cargo test` builds the cdylib this test loads.
fn lib_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(support::lib_dir)
}

fn lib() -> &'static Library {
    static LIB: OnceLock<Library> = OnceLock::new();
    LIB.get_or_init(|| {
        let path = lib_dir().join("libpaged_attention.so");
        // SAFETY: loading our own cdylib runs no initialisers beyond Rust's std ones; it stays
        // loaded for the life of the process (the static is never dropped).
        unsafe { Library::new(&path) }.unwrap_or_else(|e| panic!("loading {}: {e}", path.display()))
    })
}

type InferFn = unsafe extern "C" fn(*const CShape, usize, *mut CShape) -> i32;
type ValidateFn = unsafe extern "C" fn(*const CTensor, usize, *mut CShape) -> i32;
type ExecuteFn = unsafe extern "C" fn(*const CTensor, usize, *const CTensor, usize) -> i32;
type ErrorFn = unsafe extern "C" fn(*mut c_char, usize) -> usize;

/// Looks up `name` with the signature `T`.
fn sym<T>(name: &str) -> Symbol<'static, T> {
    // SAFETY: every `T` used below is the exact signature the header declares for `name`.
    unsafe { lib().get(name.as_bytes()) }.unwrap_or_else(|e| panic!("symbol {name}: {e}"))
}

fn last_error() -> String {
    let f = sym::<ErrorFn>("pa_last_error_message");
    // SAFETY: NULL with len 0 is allowed (returns the length); then a buffer of len + 1 bytes.
    let n = unsafe { f(std::ptr::null_mut(), 0) };
    let mut buf = vec![0u8; n + 1];
    // SAFETY: `buf` has n + 1 writable bytes.
    let m = unsafe { f(buf.as_mut_ptr().cast(), buf.len()) };
    assert_eq!(m, n);
    CStr::from_bytes_until_nul(&buf)
        .unwrap()
        .to_string_lossy()
        .into_owned()
}

fn code(t: ElemType) -> i32 {
    t as i32
}

/// C descriptors pointing into `call`'s buffers (valid while `call` is not moved or resized).
fn describe(call: &mut Call) -> (Vec<CTensor>, Vec<CTensor>) {
    let conv = |t: &mut common::call::Owned| {
        let mut dims = [0i64; 8];
        for (i, &d) in t.shape.iter().enumerate() {
            dims[i] = d as i64;
        }
        CTensor {
            elem_type: code(t.data.elem_type()),
            rank: t.shape.len() as i32,
            dims,
            data: t.data.as_mut_ptr(),
        }
    };
    let ins = call.inputs.iter_mut().map(conv).collect();
    let outs = call.outputs.iter_mut().map(conv).collect();
    (ins, outs)
}

fn c_execute(ins: &[CTensor], outs: &[CTensor]) -> i32 {
    let f = sym::<ExecuteFn>("pa_execute");
    // SAFETY: the descriptors point into live buffers of the right sizes (or deliberately
    // describe wrong sizes, which the library must reject before touching memory).
    unsafe { f(ins.as_ptr(), ins.len(), outs.as_ptr(), outs.len()) }
}

fn c_validate(ins: &[CTensor], shapes: Option<&mut [CShape; 2]>) -> i32 {
    let f = sym::<ValidateFn>("pa_validate");
    let p = shapes.map_or(std::ptr::null_mut(), |s| s.as_mut_ptr());
    // SAFETY: as in `c_execute`; `p` is NULL or two writable shapes.
    unsafe { f(ins.as_ptr(), ins.len(), p) }
}

fn c_infer(ins: &[CShape]) -> (i32, [CShape; 2]) {
    let f = sym::<InferFn>("pa_infer_shapes");
    let mut out = [CShape::new(-1, &[]); 2];
    // SAFETY: `ins` is a valid array; `out` holds two writable shapes.
    let st = unsafe { f(ins.as_ptr(), ins.len(), out.as_mut_ptr()) };
    (st, out)
}

fn sample_case(seed: u64, qt: ElemType, ct: ElemType) -> common::ref64::Case {
    let mut c = gen_case(
        seed,
        &Geometry::new(qt, ct, 2, 2, 16, 4),
        &Features {
            seqs: Some(vec![
                SeqKind::ChunkedPrefill,
                SeqKind::Decode,
                SeqKind::Empty,
            ]),
            nan_garbage: Some(false),
            ..Features::default()
        },
    );
    c.all_16 = seed.is_multiple_of(2);
    c
}

#[test]
fn version_matches_the_crate_and_the_header() {
    // SAFETY: `pa_version() -> uint32_t`, `pa_version_string() -> const char *` (static).
    let (v, s) = unsafe {
        let v = sym::<unsafe extern "C" fn() -> u32>("pa_version")();
        let s = sym::<unsafe extern "C" fn() -> *const c_char>("pa_version_string")();
        (v, CStr::from_ptr(s).to_str().unwrap().to_owned())
    };
    assert_eq!(s, env!("CARGO_PKG_VERSION"));
    let parts: Vec<u32> = s.split('.').map(|p| p.parse().unwrap()).collect();
    assert_eq!(v, (parts[0] << 16) | (parts[1] << 8) | parts[2]);
    let header = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/include/paged_attention.h"
    ))
    .unwrap();
    for (name, val) in ["MAJOR", "MINOR", "PATCH"].iter().zip(&parts) {
        assert!(
            header.contains(&format!("#define PA_VERSION_{name} {val}\n")),
            "header PA_VERSION_{name} should be {val}"
        );
    }
}

#[test]
fn status_names_are_stable() {
    let f = sym::<unsafe extern "C" fn(i32) -> *const c_char>("pa_status_name");
    for (c, n) in [
        (0, "PA_STATUS_OK"),
        (1, "PA_STATUS_NULL_POINTER"),
        (2, "PA_STATUS_INVALID_ARGUMENT"),
        (3, "PA_STATUS_INPUT_COUNT"),
        (4, "PA_STATUS_RANK"),
        (5, "PA_STATUS_ELEMENT_TYPE"),
        (6, "PA_STATUS_SHAPE"),
        (7, "PA_STATUS_VALUE"),
        (8, "PA_STATUS_BUFFER_SIZE"),
        (9, "PA_STATUS_ALIGNMENT"),
        (10, "PA_STATUS_PANIC"),
        (11, "PA_STATUS_OUT_OF_BLOCKS"),
        (12, "PA_STATUS_UNKNOWN_SEQUENCE"),
        (13, "PA_STATUS_INVALID_STATE"),
        (14, "PA_STATUS_OUT_OF_MEMORY"),
        (-1, "PA_STATUS_UNKNOWN"),
        (1000, "PA_STATUS_UNKNOWN"),
    ] {
        // SAFETY: returns a static NUL-terminated string.
        let s = unsafe { CStr::from_ptr(f(c)) };
        assert_eq!(s.to_str().unwrap(), n);
    }
}

#[test]
fn infer_shapes_through_the_c_abi() {
    let (t, h, hkv, d) = (-1, 8, 2, 16);
    let mut ins = vec![
        CShape::new(1, &[t, h * d]),
        CShape::new(1, &[t, hkv * d]),
        CShape::new(1, &[t, hkv * d]),
        CShape::new(0, &[10, hkv, 32, d]),
        CShape::new(0, &[10, hkv, 32, d]),
        CShape::new(3, &[3]),
        CShape::new(3, &[4]),
        CShape::new(3, &[-1]),
        CShape::new(3, &[4]),
    ];
    let (st, out) = c_infer(&ins);
    assert_eq!(st, OK, "{}", last_error());
    assert_eq!((out[0].elem_type, out[0].dims()), (1, &[-1, h * d][..]));
    assert_eq!((out[1].elem_type, out[1].dims()), (1, &[-1][..]));
    assert_eq!(last_error(), "");
    // Dynamic rank everywhere, dynamic types.
    let dynamic: Vec<CShape> = (0..16)
        .map(|_| CShape {
            elem_type: -1,
            rank: -1,
            dims: [0; 8],
        })
        .collect();
    let (st, out) = c_infer(&dynamic);
    assert_eq!(st, OK, "{}", last_error());
    assert_eq!(out[0].elem_type, -1);
    assert_eq!(out[0].dims(), &[-1, -1]);
    // A contradiction, with the message.
    ins[1].dims[1] = 48;
    let (st, _) = c_infer(&ins);
    assert_eq!(st, SHAPE);
    let msg = last_error();
    assert!(msg.contains("key") && msg.contains("48"), "{msg}");
    ins[1].dims[1] = hkv * d;
    // Bad enums, bad ranks, dims below -1, input counts.
    for (i, f) in [
        (
            0usize,
            (|s: &mut CShape| s.elem_type = 7) as fn(&mut CShape),
        ),
        (5, |s| s.rank = 9),
        (5, |s| s.rank = -2),
        (6, |s| s.dims[0] = -5),
    ] {
        let mut bad = ins.clone();
        f(&mut bad[i]);
        assert_eq!(c_infer(&bad).0, INVALID_ARGUMENT);
        assert!(!last_error().is_empty());
    }
    assert_eq!(c_infer(&ins[..8]).0, INPUT_COUNT);
    let f = sym::<InferFn>("pa_infer_shapes");
    let mut out = [CShape::new(-1, &[]); 2];
    // SAFETY: NULL pointers must be reported, not dereferenced.
    unsafe {
        assert_eq!(f(std::ptr::null(), 9, out.as_mut_ptr()), NULL_POINTER);
        assert_eq!(f(ins.as_ptr(), 9, std::ptr::null_mut()), NULL_POINTER);
    }
}

#[test]
fn validate_reports_output_shapes_and_writes_nothing() {
    let case = sample_case(1, F32, F16);
    let mut call = case.to_call();
    let before = call.snapshot();
    let (ins, _) = describe(&mut call);
    let mut shapes = [CShape::new(-1, &[]); 2];
    assert_eq!(c_validate(&ins, Some(&mut shapes)), OK, "{}", last_error());
    assert_eq!(
        shapes[0].dims(),
        &[case.t() as i64, (case.h * case.d) as i64]
    );
    assert_eq!(shapes[1].dims(), &[case.scores_len() as i64]);
    assert_eq!(shapes[0].elem_type, 0);
    assert_eq!(c_validate(&ins, None), OK);
    assert!(call.snapshot() == before);
}

#[test]
fn execute_through_the_c_abi_matches_the_rust_api_bit_for_bit() {
    for (seed, (qt, ct)) in [(F32, F32), (F16, F32), (F32, F16), (F16, F16)]
        .into_iter()
        .enumerate()
    {
        let case = sample_case(10 + seed as u64, qt, ct);
        // pa_execute runs the fast kernels, pa_execute_reference the scalar twin: each must
        // match its own Rust entry point bit for bit (the two differ within tolerance only).
        for (name, runner) in [
            ("pa_execute", Runner::Execute),
            ("pa_execute_reference", Runner::Reference),
        ] {
            let mut rust = case.to_call();
            rust.run(runner).unwrap();
            let mut call = case.to_call();
            let (ins, outs) = describe(&mut call);
            let f = sym::<ExecuteFn>(name);
            // SAFETY: descriptors point into `call`'s live buffers.
            let st = unsafe { f(ins.as_ptr(), ins.len(), outs.as_ptr(), outs.len()) };
            assert_eq!(st, OK, "{name}: {}", last_error());
            assert!(
                call.snapshot() == rust.snapshot(),
                "{name} differs from the Rust API"
            );
        }
    }
}

/// Asserts a C call fails with `status`, a message containing `needle`, and no write.
#[track_caller]
fn assert_c_rejects(call: &mut Call, ins: &[CTensor], outs: &[CTensor], status: i32, needle: &str) {
    let before = call.snapshot();
    let st = c_execute(ins, outs);
    let msg = last_error();
    assert_eq!(st, status, "message: {msg}");
    assert!(
        msg.contains(needle),
        "message should contain `{needle}`: {msg}"
    );
    assert!(
        call.snapshot() == before,
        "a rejected call wrote into a buffer"
    );
}

#[test]
fn null_pointers_are_reported() {
    let mut call = sample_case(2, F32, F32).to_call();
    let (mut ins, outs) = describe(&mut call);
    let f = sym::<ExecuteFn>("pa_execute");
    // SAFETY: NULL arrays must be reported without dereferencing.
    unsafe {
        assert_eq!(f(std::ptr::null(), 9, outs.as_ptr(), 2), NULL_POINTER);
        assert_eq!(
            f(ins.as_ptr(), ins.len(), std::ptr::null(), 2),
            NULL_POINTER
        );
    }
    ins[0].data = std::ptr::null_mut();
    assert_c_rejects(&mut call, &ins, &outs, NULL_POINTER, "query");
    // NULL data is fine for a tensor with no elements (an optional input not provided).
    let mut call = sample_case(3, F32, F32).to_call();
    let (mut ins, outs) = describe(&mut call);
    while ins.len() < 16 {
        ins.push(CTensor {
            elem_type: 3,
            rank: 1,
            dims: [0; 8],
            data: std::ptr::null_mut(),
        });
    }
    assert_eq!(c_execute(&ins, &outs), OK, "{}", last_error());
}

#[test]
fn bad_enums_and_ranks_are_reported() {
    for (f, needle) in [
        (
            // 5 is PA_ELEM_U4; 6 is no element type
            (|t: &mut CTensor| t.elem_type = 6) as fn(&mut CTensor),
            "elem_type 6",
        ),
        (|t| t.elem_type = -1, "elem_type -1"),
        (|t| t.rank = 9, "rank 9"),
        (|t| t.rank = -1, "rank -1"),
    ] {
        let mut call = sample_case(3, F32, F32).to_call();
        let (mut ins, outs) = describe(&mut call);
        f(&mut ins[5]);
        assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, needle);
    }
}

/// u8 caches (PA_ELEM_U8) through pa_execute: the same bytes and outputs as the Rust API, outputs
/// within 2e-5 of float64 attention over the dequantized caches, and a key cache with a wrong
/// extra-row count refused with PA_STATUS_SHAPE.
#[test]
fn u8_caches_run_through_the_c_abi() {
    use common::u8::{dequantized_case, layout_for, u8_call, LAYOUTS};
    let geo = Geometry::new(F32, F32, 2, 2, 64, 32);
    let f = Features {
        rotation: Some(false),
        ..Features::default()
    };
    for (seed, (key, value_group)) in LAYOUTS.into_iter().enumerate() {
        let c = gen_case(seed as u64 + 30, &geo, &f);
        let l = layout_for(&c, key, value_group);
        let mut via_c = u8_call(&c, &l);
        let mut via_rust = via_c.clone();
        via_rust.run(Runner::Execute).expect("Rust API");
        let (ins, outs) = describe(&mut via_c);
        assert_eq!(ins[3].elem_type, 4, "PA_ELEM_U8");
        assert_eq!(c_execute(&ins, &outs), OK, "{}", last_error());
        assert_eq!(via_c.snapshot(), via_rust.snapshot(), "{l:?}");
        let want = common::ref64::reference(&dequantized_case(
            &c,
            &l,
            via_c.inputs[3].data.u8s(),
            via_c.inputs[4].data.u8s(),
        ));
        for (got, want) in via_c.outputs.iter().zip([&want.output, &want.scores]) {
            let got = got.data.to_f64();
            assert_eq!(got.len(), want.len());
            for (g, w) in got.iter().zip(want) {
                assert!((g - w).abs() <= 2e-5 * (1.0 + w.abs()), "{l:?}: {g} vs {w}");
            }
        }
    }
    let c = gen_case(3, &geo, &f);
    let mut call = u8_call(&c, &layout_for(&c, common::u8::LAYOUTS[0].0, 0));
    let (mut ins, outs) = describe(&mut call);
    ins[3].dims[2] -= 1; // 39 rows of a bigger buffer: the shape, not the size, is wrong
    assert_c_rejects(&mut call, &ins, &outs, SHAPE, "block_size + 8");
}

#[test]
fn wrong_sizes_and_counts_are_reported() {
    let mut call = sample_case(4, F32, F32).to_call();
    let (ins, mut outs) = describe(&mut call);
    outs[1].dims[0] += 1;
    assert_c_rejects(&mut call, &ins, &outs, BUFFER_SIZE, "scores");
    let (ins, mut outs) = describe(&mut call);
    outs[0].dims[0] -= 1;
    assert_c_rejects(&mut call, &ins, &outs, BUFFER_SIZE, "output");
    let (ins, outs) = describe(&mut call);
    assert_c_rejects(
        &mut call,
        &ins,
        &outs[..1],
        INVALID_ARGUMENT,
        "n_outputs = 1",
    );
    assert_c_rejects(&mut call, &ins[..8], &outs, INPUT_COUNT, "8");
    // A block id out of range: the op's own validation, through the ABI.
    let case = sample_case(4, F32, F32);
    let mut call = case.to_call();
    call.inputs[7].data.i32s_mut()[0] = 1000;
    let (ins, outs) = describe(&mut call);
    assert_c_rejects(&mut call, &ins, &outs, VALUE, "block_indices[0] = 1000");
}

#[test]
fn negative_dims_are_reported() {
    let mut call = sample_case(5, F32, F32).to_call();
    let (mut ins, outs) = describe(&mut call);
    ins[3].dims[0] = -3;
    assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, "dims[0] = -3");
    let (ins, mut outs) = describe(&mut call);
    outs[1].dims[0] = -1;
    assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, "scores");
    // Huge dims whose product overflows.
    let (mut ins, outs) = describe(&mut call);
    ins[0].dims = [i64::MAX / 2, 4, 0, 0, 0, 0, 0, 0];
    assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, "query");
}

#[test]
fn overlapping_buffers_are_reported() {
    let mut call = sample_case(6, F32, F32).to_call();
    // Output written over key_cache.
    let (ins, mut outs) = describe(&mut call);
    outs[0].data = ins[3].data;
    assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, "overlap");
    // Scores over the query (read-only input): the op would read what it writes.
    let (ins, mut outs) = describe(&mut call);
    outs[1].data = ins[0].data;
    assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, "overlap");
    // Both caches in one buffer.
    let (mut ins, outs) = describe(&mut call);
    ins[4].data = ins[3].data;
    assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, "overlap");
    // Partial overlap: output starts inside value_cache.
    let (ins, mut outs) = describe(&mut call);
    // SAFETY: pointer arithmetic within the value cache allocation (1 element in).
    outs[0].data = unsafe { ins[4].data.cast::<f32>().add(1).cast() };
    assert_c_rejects(&mut call, &ins, &outs, INVALID_ARGUMENT, "overlap");
    // Read-only inputs may alias each other (key and value from one buffer).
    let (mut ins, outs) = describe(&mut call);
    ins[2].data = ins[1].data;
    assert_eq!(c_execute(&ins, &outs), OK, "{}", last_error());
}

#[test]
fn unaligned_pointers_are_reported() {
    let mut call = sample_case(7, F32, F32).to_call();
    let mut raw = vec![0u8; call.inputs[0].data.len() * 4 + 8];
    let (mut ins, outs) = describe(&mut call);
    // SAFETY: 2 bytes into a buffer with room for the whole query after the offset.
    ins[0].data = unsafe { raw.as_mut_ptr().add(2).cast() };
    assert_c_rejects(&mut call, &ins, &outs, ALIGNMENT, "query");
    let (ins, mut outs) = describe(&mut call);
    // SAFETY: as above, one byte into the output buffer's own allocation is not dereferenced.
    outs[0].data = unsafe { outs[0].data.cast::<u8>().add(1).cast() };
    assert_c_rejects(&mut call, &ins, &outs, ALIGNMENT, "output");
    // f16 needs 2-byte alignment only.
    let mut call = sample_case(7, F16, F16).to_call();
    let (mut ins, outs) = describe(&mut call);
    // SAFETY: one byte into the key cache's allocation; the library must not dereference it.
    ins[3].data = unsafe { ins[3].data.cast::<u8>().add(1).cast() };
    assert_c_rejects(&mut call, &ins, &outs, ALIGNMENT, "key_cache");
}

#[test]
fn last_error_is_per_thread() {
    let barrier = std::sync::Barrier::new(2);
    std::thread::scope(|s| {
        let a = s.spawn(|| {
            let mut call = sample_case(8, F32, F32).to_call();
            call.inputs[5].data.i32s_mut()[0] = -9;
            let (ins, outs) = describe(&mut call);
            assert_eq!(c_execute(&ins, &outs), VALUE);
            barrier.wait(); // both threads have failed before either reads
            barrier.wait();
            last_error()
        });
        let b = s.spawn(|| {
            let mut call = sample_case(9, F32, F32).to_call();
            let (ins, mut outs) = describe(&mut call);
            outs[1].dims[0] += 3;
            assert_eq!(c_execute(&ins, &outs), BUFFER_SIZE);
            barrier.wait();
            barrier.wait();
            last_error()
        });
        let (ma, mb) = (a.join().unwrap(), b.join().unwrap());
        assert!(ma.contains("past_lens[0] = -9"), "thread A got: {ma}");
        assert!(mb.contains("scores"), "thread B got: {mb}");
    });
    // A success clears the calling thread's message.
    let mut call = sample_case(8, F32, F32).to_call();
    call.inputs[5].data.i32s_mut()[0] = -9;
    let (ins, outs) = describe(&mut call);
    assert_eq!(c_execute(&ins, &outs), VALUE);
    assert!(!last_error().is_empty());
    let mut call = sample_case(8, F32, F32).to_call();
    let (ins, outs) = describe(&mut call);
    assert_eq!(c_execute(&ins, &outs), OK);
    assert_eq!(last_error(), "");
}

#[test]
fn many_threads_executing_at_once_on_different_buffers_agree_with_one_thread() {
    let cases: Vec<_> = (0..8)
        .map(|i| {
            sample_case(
                100 + i,
                [F32, F16][i as usize % 2],
                [F32, F16][i as usize / 2 % 2],
            )
        })
        .collect();
    let expected: Vec<Vec<Vec<u32>>> = cases
        .iter()
        .map(|c| {
            let mut call = c.to_call();
            call.run(Runner::Execute).unwrap();
            call.snapshot()
        })
        .collect();
    std::thread::scope(|s| {
        for (c, exp) in cases.iter().zip(&expected) {
            s.spawn(move || {
                for _ in 0..3 {
                    let mut call = c.to_call();
                    let (ins, outs) = describe(&mut call);
                    assert_eq!(c_execute(&ins, &outs), OK, "{}", last_error());
                    assert!(
                        &call.snapshot() == exp,
                        "a concurrent call gave another result"
                    );
                }
            });
        }
    });
}

/// Compiles `sources` with `compiler` and `flags` against the header (`-Wall -Wextra
/// -Werror`; a missing compiler is a failure), links the library, runs the program and asserts
/// it exits 0.
///
/// With the feature `test-hooks` the programs also see tests/c/pa_test_hooks.h (`PA_TEST_HOOKS`
/// defined), and smoke.c checks `pa_item_counts_get`, which only such a library exports.
fn compile_and_run(compiler: &str, flags: &[&str], sources: &[&str], exe: &str) {
    let sources: Vec<PathBuf> = sources.iter().map(|s| support::root().join(s)).collect();
    let hooks_dir = format!("-I{}", support::root().join("tests/c").display());
    let mut flags = flags.to_vec();
    if cfg!(feature = "test-hooks") {
        flags.extend(["-DPA_TEST_HOOKS", hooks_dir.as_str()]);
    }
    support::build_and_run(compiler, &flags, &sources, exe);
}

/// The library exports the test hook `pa_item_counts_get` exactly when it is built with the
/// feature `test-hooks`: the library users get keeps no per-item counters.
#[test]
fn the_test_hook_is_exported_only_with_the_test_hooks_feature() {
    // SAFETY: the symbol is only looked up, never called.
    let found = unsafe { lib().get::<unsafe extern "C" fn()>(b"pa_item_counts_get") }.is_ok();
    assert_eq!(
        found,
        cfg!(feature = "test-hooks"),
        "pa_item_counts_get exported: {found}; feature test-hooks: {}",
        cfg!(feature = "test-hooks")
    );
}

#[test]
fn c_smoke_program_compiles_warning_free_and_runs() {
    compile_and_run("cc", &["-std=c11"], &["tests/c/smoke.c"], "smoke_c");
}

#[test]
fn c_abi_check_program_compiles_warning_free_and_runs() {
    compile_and_run("cc", &["-std=c11"], &["tests/c/abi_check.c"], "abi_check_c");
}

#[test]
fn header_and_programs_compile_as_cpp_and_run() {
    compile_and_run("c++", &["-x", "c++"], &["tests/c/smoke.c"], "smoke_cpp");
    compile_and_run(
        "c++",
        &["-x", "c++"],
        &["tests/c/abi_check.c"],
        "abi_check_cpp",
    );
}
