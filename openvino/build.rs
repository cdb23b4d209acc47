//! Build script of the OpenVINO extension: compiles the C++ shim in `../cpp/` (the OpenVINO op
//! class and its registration) against OpenVINO's headers and links `libopenvino.so.<version>` by
//! that name, with no RUNPATH: the module is loaded by `add_extension` into a process that already
//! has that library mapped, and the loader matches NEEDED entries against loaded SONAMEs. A process
//! with another OpenVINO (another SONAME) gets a dlopen error naming the missing library instead of
//! a second OpenVINO mapped beside its own.
//!
//! OpenVINO is found, in this order, at:
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

struct OpenVino {
    include: PathBuf,
    libs: PathBuf,
    /// File name of the core library, e.g. `libopenvino.so.2641` (the wheel has no unversioned one).
    lib_name: String,
    /// `OV_THREAD` as OpenVINO's CMake package defines it (`OV_THREAD_TBB_ADAPTIVE` for the wheel).
    thread: String,
    /// File name of TBB beside the core library (`libtbb.so.12`), when the back end is TBB.
    tbb_name: Option<String>,
}

/// Returns the first location that has OpenVINO's headers and core library, or the list tried.
fn find_openvino(root: &Path) -> Result<OpenVino, String> {
    let mut tried = Vec::new();
    let mut candidates: Vec<(String, PathBuf)> = Vec::new();
    for var in ["OPENVINO_DIR", "OPENVINO_ROOT"] {
        if let Some(v) = env::var_os(var) {
            let p = PathBuf::from(v);
            candidates.push((format!("${var}"), p.clone()));
            // `OpenVINO_DIR`-style: the cmake directory inside the package.
            if let Some(parent) = p.parent() {
                candidates.push((format!("${var}/.."), parent.to_path_buf()));
            }
            // Only the variable is consulted when it is set: a wrong value is an error, not a
            // silent fallback to another installation.
            return pick(&candidates, &mut tried).ok_or_else(|| tried.join("\n"));
        }
    }
    if let Ok(lib) = std::fs::read_dir(root.join(".venv/lib")) {
        let mut pys: Vec<PathBuf> = lib.filter_map(|e| e.ok().map(|e| e.path())).collect();
        pys.sort();
        for py in pys.into_iter().rev() {
            candidates.push(("repo .venv".into(), py.join("site-packages/openvino")));
        }
    } else {
        tried.push(format!(
            "  {}: no such directory",
            root.join(".venv/lib").display()
        ));
    }
    if let Some(ov) = pick(&candidates, &mut tried) {
        return Ok(ov);
    }
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let asked = Command::new(&python)
        .args([
            "-c",
            "import os, openvino; print(os.path.dirname(openvino.__file__))",
        ])
        .output();
    match asked {
        Ok(out) if out.status.success() => {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if let Some(ov) = pick(
                &[(format!("`{python} -c 'import openvino'`"), dir)],
                &mut tried,
            ) {
                return Ok(ov);
            }
        }
        Ok(out) => tried.push(format!(
            "  `{python} -c 'import openvino'`: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => tried.push(format!("  `{python}`: {e}")),
    }
    Err(tried.join("\n"))
}

fn pick(candidates: &[(String, PathBuf)], tried: &mut Vec<String>) -> Option<OpenVino> {
    for (origin, dir) in candidates {
        let include = dir.join("include");
        if !include.join("openvino/core/op_extension.hpp").is_file() {
            tried.push(format!(
                "  {origin}: {}: no include/openvino/core/op_extension.hpp",
                dir.display()
            ));
            continue;
        }
        for libs in [
            dir.join("libs"),
            dir.join("lib"),
            dir.join("runtime/lib/intel64"),
        ] {
            if let Some(lib_name) = core_library(&libs) {
                let thread = threading(dir);
                let tbb_name = thread
                    .contains("TBB")
                    .then(|| versioned(&libs, "libtbb.so"))
                    .flatten();
                return Some(OpenVino {
                    include,
                    libs,
                    lib_name,
                    thread,
                    tbb_name,
                });
            }
        }
        tried.push(format!(
            "  {origin}: {}: no libopenvino.so* in libs/, lib/ or runtime/lib/intel64/",
            dir.display()
        ));
    }
    None
}

/// `libopenvino.so.<N>` (preferred: that is what the wheel ships) or `libopenvino.so` in `dir`.
fn core_library(dir: &Path) -> Option<String> {
    versioned(dir, "libopenvino.so")
}

/// `<stem>.<N>` (the longest version) or `<stem>` in `dir`.
fn versioned(dir: &Path, stem: &str) -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n == stem
                || n.strip_prefix(stem)
                    .and_then(|v| v.strip_prefix('.'))
                    .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
        })
        .collect();
    names.sort_by_key(|n| (n.len(), n.clone()));
    names.pop()
}

/// The `OV_THREAD=...` definition of OpenVINO's CMake targets under `dir` (the wheel's
/// `cmake/OpenVINOTargets.cmake`), else the wheel's value.
fn threading(dir: &Path) -> String {
    let targets = std::fs::read_to_string(dir.join("cmake/OpenVINOTargets.cmake"))
        .or_else(|_| std::fs::read_to_string(dir.join("runtime/cmake/OpenVINOTargets.cmake")))
        .unwrap_or_default();
    targets
        .split("OV_THREAD=")
        .nth(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|v| v.starts_with("OV_THREAD_"))
        .unwrap_or_else(|| "OV_THREAD_TBB_ADAPTIVE".into())
}
