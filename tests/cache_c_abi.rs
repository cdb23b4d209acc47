//! Compiles `tests/c/cache_smoke.c` against `include/paged_attention_cache.h` with
//! `cc -Wall -Wextra -Werror`, links it to the cdylib that `cargo test` builds, and runs it.
//! Also checks that the header compiles as C++. A missing compiler fails the test.

mod support;

#[test]
fn c_program_drives_the_manager_and_scheduler_through_the_header() {
    let out = support::build_and_run_c(
        &[support::root().join("tests/c/cache_smoke.c")],
        "cache_smoke_c",
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "ok");
}

#[test]
fn cache_header_compiles_as_cpp() {
    support::header_compiles_as_cpp("include/paged_attention_cache.h");
}
