//! The OpenVINO extension module (`libpaged_attention_openvino.so`): its entry point
//! `create_extensions` and the OpenVINO version check. The op class and its registration are C++
//! (`../cpp/`), compiled by build.rs; the op's work is the `paged_attention` library's C ABI,
//! linked into this module.
//!
//! OpenVINO finds `create_extensions` with `dlsym`. rustc's export list for a cdylib only keeps
//! symbols defined in Rust, so a `create_extensions` defined in C++ would be hidden: the exported
//! symbol is this Rust function, which forwards to the C++ registration.

// The C ABI functions the C++ shim calls (pa_infer_shapes, pa_execute_ex, ...) are in this crate;
// naming it keeps it linked.
pub use paged_attention;

mod version;

use std::ffi::{c_char, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Only tests set it: the running OpenVINO version to report instead of the real one, so the
/// refusal of a mismatched OpenVINO can be checked in a process that has the right one.
const TEST_RUNNING_VERSION_VAR: &str = "PA_TEST_OPENVINO_RUNNING_VERSION";

extern "C-unwind" {
    /// `cpp/extension.cpp`: checks the OpenVINO version (through [`pa_ov_check_version`]) and
    /// fills the `std::vector<ov::Extension::Ptr>` at `ext`. Throws `ov::Exception` on a
    /// mismatch or a failure, which OpenVINO's `add_extension` reports to its caller.
    fn pa_ov_create_extensions(ext: *mut c_void);
}

/// OpenVINO's extension entry point, `void create_extensions(std::vector<ov::Extension::Ptr>&)`
/// (what `OPENVINO_CREATE_EXTENSIONS` defines, `extern "C"`). A C++ reference is passed as a
/// pointer, so `ext` is the address of the caller's vector.
///
/// `C-unwind`: the C++ exception that reports a failure passes through this frame (which owns
/// nothing to drop) back to `add_extension`, as it would from a C++ `create_extensions`.
///
/// # Safety
/// `ext` must point to a live `std::vector<ov::Extension::Ptr>` of the OpenVINO build the shim
/// was compiled against; OpenVINO's `add_extension` guarantees this.
#[no_mangle]
pub unsafe extern "C-unwind" fn create_extensions(ext: *mut c_void) {
    if ext.is_null() {
        return;
    }
    // SAFETY: `ext` is the caller's vector (contract above); the callee only throws C++
    // exceptions, which `C-unwind` lets pass to the caller.
    unsafe { pa_ov_create_extensions(ext) }
}

/// Called by the C++ registration with OpenVINO's running build number and the version of the
/// headers it was compiled against (both NUL-terminated). Returns 0 if they match; otherwise
/// writes the message, NUL-terminated and truncated to `len` bytes, into `buf` and returns 1.
///
/// # Safety
/// `running` and `built` are NUL-terminated strings; `buf` has `len` (>= 1) writable bytes.
#[no_mangle]
pub unsafe extern "C" fn pa_ov_check_version(
    running: *const c_char,
    built: *const c_char,
    buf: *mut c_char,
    len: usize,
) -> i32 {
    // SAFETY: both are NUL-terminated strings (contract above).
    let (running, built) = unsafe { (CStr::from_ptr(running), CStr::from_ptr(built)) };
    let checked = catch_unwind(AssertUnwindSafe(|| {
        let running = std::env::var(TEST_RUNNING_VERSION_VAR)
            .unwrap_or_else(|_| running.to_string_lossy().into_owned());
        version::check(&running, &built.to_string_lossy())
    }))
    .unwrap_or_else(|_| {
        Err("paged_attention_openvino: the OpenVINO version check panicked".into())
    });
    let Err(msg) = checked else {
        return 0;
    };
    if len > 0 && !buf.is_null() {
        let n = msg.len().min(len - 1);
        // SAFETY: `buf` has `len` writable bytes (contract above) and n + 1 <= len; the message
        // is a Rust string, which cannot overlap the caller's buffer.
        unsafe {
            std::ptr::copy_nonoverlapping(msg.as_ptr(), buf.cast::<u8>(), n);
            *buf.add(n) = 0;
        }
    }
    1
}
