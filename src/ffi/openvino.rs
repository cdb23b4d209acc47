//! The OpenVINO extension's entry point (feature `openvino`).
//!
//! OpenVINO finds an extension library's `create_extensions` with `dlsym`. The op class and its
//! registration are C++ (`cpp/`), but rustc's export list for a cdylib only keeps symbols
//! defined in Rust, so a `create_extensions` defined in C++ would be hidden. This Rust function
//! is the exported symbol and forwards to the C++ registration.

use std::ffi::c_void;

extern "C" {
    /// `cpp/extension.cpp`: fills the `std::vector<ov::Extension::Ptr>` at `ext`; catches every
    /// C++ exception and returns non-zero instead.
    fn pa_ov_fill_extensions(ext: *mut c_void) -> i32;
}

/// OpenVINO's extension entry point, `void create_extensions(std::vector<ov::Extension::Ptr>&)`
/// (what `OPENVINO_CREATE_EXTENSIONS` defines, `extern "C"`). A C++ reference is passed as a
/// pointer, so `ext` is the address of the caller's vector.
///
/// # Safety
/// `ext` must point to a live `std::vector<ov::Extension::Ptr>` of the OpenVINO build the shim
/// was compiled against; OpenVINO's `add_extension` guarantees this.
#[no_mangle]
pub unsafe extern "C" fn create_extensions(ext: *mut c_void) {
    if ext.is_null() {
        return;
    }
    // On failure the callee leaves the vector unchanged (OpenVINO then reports that the library
    // holds no extensions): the signature has no error channel.
    // SAFETY: `ext` is the caller's vector (contract above); the callee is noexcept and catches
    // every exception, so nothing unwinds into Rust.
    let _ = unsafe { pa_ov_fill_extensions(ext) };
}
