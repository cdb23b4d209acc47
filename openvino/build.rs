//! Build script of the OpenVINO extension: compiles the C++ shim in `../cpp/` (the OpenVINO op
//! class and its registration) against OpenVINO's headers and links `libopenvino.so.<version>` by
//! that name, with no RUNPATH: the module is loaded by `add_extension` into a process that already
//! has that library mapped, and the loader matches NEEDED entries against loaded SONAMEs. A process
//! with another OpenVINO (another SONAME) gets a dlopen error naming the missing library instead of
//! a second OpenVINO mapped beside its own.
//!
//! OpenVINO is found as `locate.rs` says (shared with the engine's build script), at:
//! 1. `$OPENVINO_DIR` or `$OPENVINO_ROOT`: the wheel's `openvino` package directory, its `cmake`
//!    directory, or an install root holding `include/` and `libs/`, `lib/` or `runtime/lib/intel64`;
//! 2. `<repo>/.venv/lib/python3*/site-packages/openvino` (what `scripts/setup.sh` installs);
//! 3. the `openvino` package of `python3` (`$PYTHON` if set).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    for var in ["OPENVINO_DIR", "OPENVINO_ROOT", "PYTHON"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest_dir =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    // The repository root: cpp/, include/ and .venv live there.
    let root = manifest_dir
        .parent()
        .expect("openvino/ is inside the repository")
        .to_path_buf();
    let ov = match find_openvino(&root) {
        Ok(ov) => ov,
        Err(tried) => {
            eprintln!(
                "error: paged_attention_openvino: OpenVINO 2026.4.1 not found. Tried:\n{tried}"
            );
            eprintln!("Run scripts/setup.sh (installs it into .venv), or set OPENVINO_DIR to the wheel's `openvino` directory.");
            std::process::exit(1);
        }
    };

    let cpp_dir = root.join("cpp");
    let mut sources: Vec<PathBuf> = std::fs::read_dir(&cpp_dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cpp_dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| matches!(p.extension().and_then(|e| e.to_str()), Some("cpp" | "hpp")))
        .collect();
    sources.sort();
    println!("cargo:rerun-if-changed={}", cpp_dir.display());
    println!(
        "cargo:rerun-if-changed={}",
        root.join("include/paged_attention.h").display()
    );
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        // The wheel is built with the new libstdc++ ABI; ABI 0 links but fails at load time.
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .include(root.join("include"))
        // -isystem: OpenVINO's own headers are not held to our warning flags.
        .flag("-isystem")
        .flag(
            ov.include
                .to_str()
                .expect("OpenVINO include path is not UTF-8"),
        )
        // openvino/core/parallel.hpp picks its threading back end from OV_THREAD, which
        // OpenVINO's CMake package sets for its users; the shim runs our work on that back end.
        .define("OV_THREAD", ov.thread.as_str())
        .warnings(true)
        .extra_warnings(true)
        .warnings_into_errors(true);
    for s in sources
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cpp"))
    {
        build.file(s);
    }
    build.compile("pa_openvino_shim");

    println!("cargo:rustc-link-search=native={}", ov.libs.display());
    println!("cargo:rustc-link-lib=dylib:+verbatim={}", ov.lib_name);
    if let Some(tbb) = &ov.tbb_name {
        // The same TBB the CPU plugin runs on, so `ov::parallel_nt` joins the caller's arena.
        println!("cargo:rustc-link-lib=dylib:+verbatim={tbb}");
    }
    // No rpath (module docs). -Bsymbolic: the shim's calls into the library (pa_execute_ex, ...)
    // bind to this module's own copy even when the C library is loaded in the same process, so
    // the thread pool and last-error state the op uses are this module's.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libpaged_attention_openvino.so");
    // Read by openvino/tests/openvino_cpp.rs to compile the C++ host program against the same OpenVINO.
    println!(
        "cargo:rustc-env=PA_OPENVINO_INCLUDE={}",
        ov.include.display()
    );
    println!("cargo:rustc-env=PA_OPENVINO_LIBS={}", ov.libs.display());
    println!("cargo:rustc-env=PA_OPENVINO_LIB_NAME={}", ov.lib_name);
}

include!("locate.rs");
