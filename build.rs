//! Build script of the C library: gives the cdylib its SONAME. The OpenVINO extension is the
//! `paged_attention_openvino` crate (`openvino/`), with its own build script; this library never
//! links OpenVINO.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // The ABI major version: `libpaged_attention.so.0` stays loadable by programs built against
    // any 0.x release (scripts/install.sh installs the .so.0 link this names).
    let major =
        std::env::var("CARGO_PKG_VERSION_MAJOR").expect("cargo sets CARGO_PKG_VERSION_MAJOR");
    // `rustc-link-arg`, not `rustc-cdylib-link-arg`: cargo passes the latter on to the cdylibs of
    // dependent crates too (cargo#9562), which would give the OpenVINO module this SONAME. The
    // price: this package's executables (pa, tests, benches) carry the SONAME as well, which
    // the loader only consults for a library requested by that bare name.
    println!("cargo:rustc-link-arg=-Wl,-soname,libpaged_attention.so.{major}");
}
