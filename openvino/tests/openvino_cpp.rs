//! The extension in a C++ host: compiles tests/cpp/host.cpp with g++ against the same OpenVINO
//! the library was built with (the paths build.rs found), then runs it on the release cdylib and
//! an IR with the seed example's shapes (tests/cpp/host_model.xml). host.cpp checks the results
//! against its own double-precision reference; see its header comment.
//!
//! After `cargo build --release -p paged_attention_openvino`:
//! `cargo test --release -p paged_attention_openvino --test openvino_cpp`.

#[path = "../../tests/support/mod.rs"]
mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

/// The release extension module the README's test command builds first
/// (`cargo build --release -p paged_attention_openvino`), or `$PA_EXTENSION_LIB`. `cargo test` does not
/// produce the cdylib itself, and a nested `cargo build` would wait on the lock this run holds,
/// so the test checks the library exists and is not older than the sources it is built from.
fn extension_library(root: &Path) -> PathBuf {
    if let Some(p) = std::env::var_os("PA_EXTENSION_LIB") {
        return PathBuf::from(p);
    }
    let lib = root.join("target/release/libpaged_attention_openvino.so");
    let build = "build it with `cargo build --release -p paged_attention_openvino` (or set PA_EXTENSION_LIB)";
    let built = std::fs::metadata(&lib)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| panic!("{} not found: {build}", lib.display()));
    let mut newest = (std::time::SystemTime::UNIX_EPOCH, PathBuf::new());
    for p in [
        "src",
        "cpp",
        "include",
        "build.rs",
        "Cargo.toml",
        "openvino/src",
        "openvino/build.rs",
        "openvino/Cargo.toml",
    ] {
        newest_file(&root.join(p), &mut newest);
    }
    assert!(
        built >= newest.0,
        "{} is older than {}: re{build}",
        lib.display(),
        newest.1.display()
    );
    lib
}

fn newest_file(p: &Path, newest: &mut (std::time::SystemTime, PathBuf)) {
    if p.is_dir() {
        for e in std::fs::read_dir(p).into_iter().flatten().flatten() {
            newest_file(&e.path(), newest);
        }
    } else if let Ok(t) = std::fs::metadata(p).and_then(|m| m.modified()) {
        if t > newest.0 {
            *newest = (t, p.to_path_buf());
        }
    }
}

/// Compiles a C++ program against OpenVINO (the paths build.rs found) with warnings as errors.
fn compile_cpp(source: &Path, exe: &Path) {
    let root = &support::root();
    let ov_libs = env!("PA_OPENVINO_LIBS");
    let compile = Command::new("g++")
        .args([
            "-std=c++17",
            "-D_GLIBCXX_USE_CXX11_ABI=1",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-O1",
        ])
        .arg(format!("-I{}", root.join("include").display()))
        .args(["-isystem", env!("PA_OPENVINO_INCLUDE")])
        .arg(source)
        .arg("-o")
        .arg(exe)
        .arg(format!("-L{ov_libs}"))
        .arg(format!("-l:{}", env!("PA_OPENVINO_LIB_NAME")))
        .arg(format!("-Wl,-rpath,{ov_libs}"))
        .output()
        .expect("running g++");
    assert!(
        compile.status.success(),
        "g++ failed on {}:\n{}",
        source.display(),
        String::from_utf8_lossy(&compile.stderr)
    );
}

#[test]
fn cpp_host_loads_extension_and_matches_its_reference() {
    let root = &support::root();
    let exe = Path::new(env!("CARGO_TARGET_TMPDIR")).join("pa_openvino_host");
    compile_cpp(&root.join("tests/cpp/host.cpp"), &exe);

    let run = Command::new(&exe)
        .arg(extension_library(root))
        .arg(root.join("tests/cpp/host_model.xml"))
        .output()
        .expect("running the host");
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(
        run.status.success() && stdout.contains("host: all checks passed"),
        "the C++ host failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
}

/// The README's C++ loading example works as written, run from the checkout's root (it names
/// `target/release/libpaged_attention_openvino.so` and `models/seed_example/model.xml`).
#[test]
fn readme_cpp_example_loads_the_extension_as_written() {
    let root = &support::root();
    extension_library(root);
    let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
    let blocks = support::marked_blocks(&readme, "cpp");
    assert_eq!(
        blocks.len(),
        1,
        "expected one C++ example marked in the README"
    );
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let src = dir.join("readme_load.cpp");
    std::fs::write(&src, &blocks[0]).expect("write example");
    let exe = dir.join("readme_load");
    compile_cpp(&src, &exe);
    let run = Command::new(&exe)
        .current_dir(root)
        .output()
        .expect("running the example");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success() && stdout.trim() == "16 inputs",
        "the README's C++ example failed ({}):\n{stdout}\n{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
}
