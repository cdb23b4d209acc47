//! Shared by the tests that compile and run C/C++ programs against the built library.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Output};

/// The repository root (this file is also compiled into the tests of the `openvino/` crate).
pub fn root() -> PathBuf {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest
        .ancestors()
        .find(|d| d.join("include/paged_attention.h").is_file())
        .unwrap_or_else(|| panic!("no include/paged_attention.h above {}", manifest.display()))
        .to_path_buf()
}

/// `target/<profile>/deps`, where this test binary lives and where `cargo test` builds the
/// cdylib fresh (the copy in `target/<profile>/` is only refreshed by `cargo build`).
pub fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe
        .parent()
        .expect("test binary in target/<profile>/deps")
        .to_path_buf();
    assert!(
        dir.join("libpaged_attention.so").exists(),
        "libpaged_attention.so not found in {}",
        dir.display()
    );
    // Programs linked to the library need it by its SONAME, which only an install creates.
    let soname = dir.join("libpaged_attention.so.0");
    if let Err(e) = std::os::unix::fs::symlink("libpaged_attention.so", &soname) {
        // Another test of this run may have made it first.
        assert!(
            e.kind() == std::io::ErrorKind::AlreadyExists,
            "cannot create {}: {e}",
            soname.display()
        );
    }
    dir
}

/// Runs `cmd` and returns its output, failing the test (with both streams) if it fails or
/// cannot start: a missing compiler is a failure, not a skip.
pub fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("could not run {cmd:?}: {e} (a C compiler is required)"));
    assert!(
        out.status.success(),
        "{cmd:?} failed ({}):\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Compiles `sources` with `compiler`, `-Wall -Wextra -Werror` and `flags` against `include/`,
/// links the library built by `cargo test`, runs the program and returns its output (the test
/// fails if compiling or running fails).
pub fn build_and_run(
    compiler: &str,
    flags: &[&str],
    sources: &[PathBuf],
    exe_name: &str,
) -> Output {
    let exe = build(compiler, flags, sources, exe_name);
    run_program(&mut Command::new(&exe))
}

/// Runs a program built by [`build`] (`cmd` may wrap it, e.g. in valgrind) and returns its
/// output, failing the test if it fails.
pub fn run_program(cmd: &mut Command) -> Output {
    // Cargo's LD_LIBRARY_PATH lists target/<profile> (possibly a stale copy of the library)
    // ahead of the program's RUNPATH: drop it so the library just built is loaded.
    run(cmd.env_remove("LD_LIBRARY_PATH"))
}

/// The compile-and-link half of [`build_and_run`]; returns the program's path.
pub fn build(compiler: &str, flags: &[&str], sources: &[PathBuf], exe_name: &str) -> PathBuf {
    let lib = lib_dir();
    let exe = lib.join(exe_name);
    run(Command::new(compiler)
        .args(["-Wall", "-Wextra", "-Werror"])
        .args(flags)
        .arg("-I")
        .arg(root().join("include"))
        .args(sources)
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lpaged_attention", "-lm", "-o"])
        .arg(&exe));
    exe
}

/// [`build_and_run`] as C11.
pub fn build_and_run_c(sources: &[PathBuf], exe_name: &str) -> Output {
    build_and_run("cc", &["-std=c11"], sources, exe_name)
}

/// Checks that a header compiles as C++ with `-Wall -Wextra -Werror`.
pub fn header_compiles_as_cpp(header: &str) {
    run(Command::new("c++")
        .args([
            "-Wall",
            "-Wextra",
            "-Werror",
            "-fsyntax-only",
            "-x",
            "c++",
            "-I",
        ])
        .arg(root().join("include"))
        .arg(root().join(header)));
}

/// The fenced blocks that follow a `<!-- readme-test: LANG -->` marker.
pub fn marked_blocks(readme: &str, lang: &str) -> Vec<String> {
    let marker = format!("<!-- readme-test: {lang} ");
    let mut blocks = Vec::new();
    let mut lines = readme.lines();
    while let Some(line) = lines.next() {
        if !line.starts_with(&marker) {
            continue;
        }
        let fence = lines.next().unwrap_or_default();
        assert!(
            fence.starts_with("```"),
            "a readme-test marker must be followed by a fenced block, found {fence:?}"
        );
        let body: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        blocks.push(body.join("\n") + "\n");
    }
    blocks
}
