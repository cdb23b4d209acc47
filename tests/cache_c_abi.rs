//! Compiles `tests/c/cache_smoke.c` against `include/paged_attention_cache.h` with
//! `cc -Wall -Wextra -Werror`, links it to the cdylib that `cargo test` builds, and runs it.
//! Also checks that the header compiles as C++. A missing compiler fails the test.

use std::path::PathBuf;
use std::process::Command;

/// `target/<profile>/deps`, where this test binary lives and where `cargo test` builds the
/// cdylib fresh (the copy in `target/<profile>/` is only refreshed by `cargo build`).
fn lib_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    exe.parent()
        .expect("test binary in target/<profile>/deps")
        .to_path_buf()
}

fn run(cmd: &mut Command) -> std::process::Output {
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

#[test]
fn c_program_drives_the_manager_and_scheduler_through_the_header() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let lib = lib_dir();
    assert!(
        lib.join("libpaged_attention.so").exists(),
        "libpaged_attention.so not found in {}",
        lib.display()
    );
    let exe = lib.join("cache_smoke_c");
    run(Command::new("cc")
        .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-I"])
        .arg(root.join("include"))
        .arg(root.join("tests/c/cache_smoke.c"))
        .arg("-L")
        .arg(&lib)
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .args(["-lpaged_attention", "-lm", "-o"])
        .arg(&exe));
    // Cargo's LD_LIBRARY_PATH lists target/<profile> (possibly a stale copy of the library)
    // ahead of the program's RUNPATH: drop it so the library just built is loaded.
    let out = run(Command::new(&exe).env_remove("LD_LIBRARY_PATH"));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
}

#[test]
fn cache_header_compiles_as_cpp() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
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
        .arg(root.join("include"))
        .arg(root.join("include/paged_attention_cache.h")));
}
