//! Runs the C smoke programs (tests/c/smoke.c: the op through the C ABI; tests/c/cache_smoke.c:
//! the cache manager and scheduler feeding pa_execute) under valgrind's memcheck with
//! `--error-exitcode=1 --leak-check=full`: an invalid read or write, a use of uninitialised
//! memory or a leak in the library fails the test. valgrind is required (scripts/setup.sh
//! installs it); a missing valgrind is a failure, not a skip.
//!
//! One suppression file, tests/valgrind.supp, covers what is not ours: the thread-local storage
//! glibc allocates for the library's rayon pool workers, which are still running (parked) when
//! the program exits, so their blocks are reported as "possibly lost".

mod support;

use std::process::Command;

fn under_valgrind(source: &str, exe_name: &str) {
    let exe = support::build(
        "cc",
        &["-std=c11", "-g"],
        &[support::root().join(source)],
        exe_name,
    );
    let out = support::run_program(
        Command::new("valgrind")
            .args([
                "--error-exitcode=1",
                "--leak-check=full",
                "--show-leak-kinds=definite,indirect,possible",
                "--errors-for-leak-kinds=definite,indirect,possible",
            ])
            .arg(format!(
                "--suppressions={}",
                support::root().join("tests/valgrind.supp").display()
            ))
            .arg(&exe)
            // Two pool workers keep the run short while still starting threads.
            .env("PA_NUM_THREADS", "2"),
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.starts_with("ok"), "program output: {stdout}");
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(
        log.contains("ERROR SUMMARY: 0 errors"),
        "valgrind reported errors:\n{log}"
    );
}

#[test]
fn c_smoke_program_is_clean_under_valgrind() {
    under_valgrind("tests/c/smoke.c", "smoke_valgrind");
}

#[test]
fn cache_smoke_program_is_clean_under_valgrind() {
    under_valgrind("tests/c/cache_smoke.c", "cache_smoke_valgrind");
}
