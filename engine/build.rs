//! Build script of the engine: compiles the C++ session (`cpp/session.cpp`, bridged by cxx in
//! `src/ov.rs`) with the project's converter and op class (`../cpp/convert.cpp`,
//! `../cpp/paged_attention_op.cpp`, `../cpp/cache_inputs.cpp`) against OpenVINO, found as the
//! extension module finds it (`../openvino/locate.rs`), and links `libopenvino.so.<version>`
//! without a RUNPATH: `pa` finds OpenVINO at run time (the test binaries alone keep an rpath).

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

include!("../openvino/locate.rs");

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=../openvino/locate.rs");
    for var in ["OPENVINO_DIR", "OPENVINO_ROOT", "PYTHON"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let manifest =
        PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let root = manifest
        .parent()
        .expect("engine/ is inside the repository")
        .to_path_buf();
    let ov = match find_openvino(&root) {
        Ok(ov) => ov,
        Err(tried) => {
            eprintln!(
                "error: paged_attention_engine: OpenVINO 2026.4.1 not found. Tried:\n{tried}"
            );
            eprintln!("Run scripts/setup.sh (installs it into .venv), or set OPENVINO_DIR to the wheel's `openvino` directory.");
            std::process::exit(1);
        }
    };
    let cpp = root.join("cpp");
    let sources = [
        manifest.join("cpp/session.cpp"),
        cpp.join("convert.cpp"),
        cpp.join("paged_attention_op.cpp"),
        cpp.join("cache_inputs.cpp"),
    ];
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    println!(
        "cargo:rerun-if-changed={}",
        manifest.join("cpp/session.hpp").display()
    );
    for h in ["convert.hpp", "paged_attention_op.hpp", "cache_inputs.hpp"] {
        println!("cargo:rerun-if-changed={}", cpp.join(h).display());
    }
    cxx_build::bridge("src/ov.rs")
        .files(&sources)
        .std("c++17")
        .define("_GLIBCXX_USE_CXX11_ABI", "1")
        .define("OV_THREAD", ov.thread.as_str())
        .include(manifest.join("cpp"))
        .include(&cpp)
        .include(root.join("include"))
        .flag("-isystem")
        .flag(
            ov.include
                .to_str()
                .expect("OpenVINO include path is not UTF-8"),
        )
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(true)
        .compile("pa_engine_session");
    println!("cargo:rustc-link-search=native={}", ov.libs.display());
    println!("cargo:rustc-link-lib=dylib:+verbatim={}", ov.lib_name);
    if let Some(tbb) = &ov.tbb_name {
        println!("cargo:rustc-link-lib=dylib:+verbatim={tbb}");
    }
    // No RUNPATH in `pa-engine`: a path into this build's OpenVINO would not survive an install
    // or a moved virtual environment. `pa` finds OpenVINO where the user has it and runs the
    // engine with LD_LIBRARY_PATH (cli/src/openvino.rs); the system's libraries need nothing.
    // The tests' binaries never leave the build tree, so they keep the path.
    println!(
        "cargo:rustc-link-arg-tests=-Wl,-rpath,{}",
        ov.libs.display()
    );
}
