//! The README's examples work as written: every C block marked `<!-- readme-test: c -->` is
//! compiled with `cc -Wall -Wextra -Werror` against the headers, linked to the library and run
//! (exit status 0). The Rust blocks are doctests (`src/lib.rs` includes the README under
//! `cfg(doctest)`).

mod support;

#[test]
fn readme_c_examples_compile_with_warnings_as_errors_and_run() {
    let readme = std::fs::read_to_string(support::root().join("README.md")).expect("README.md");
    let blocks = support::marked_blocks(&readme, "c");
    assert!(
        blocks.len() >= 2,
        "expected the op and cache-manager C examples, found {} blocks",
        blocks.len()
    );
    for (i, code) in blocks.iter().enumerate() {
        let src = support::lib_dir().join(format!("readme_example_{i}.c"));
        std::fs::write(&src, code).expect("write example");
        support::build_and_run_c(&[src], &format!("readme_example_{i}"));
    }
}

#[test]
fn readme_rust_examples_are_doctests() {
    let readme = std::fs::read_to_string(support::root().join("README.md")).expect("README.md");
    assert!(support::marked_blocks(&readme, "rust").len() >= 2);
    let lib = std::fs::read_to_string(support::root().join("src/lib.rs")).expect("src/lib.rs");
    assert!(
        lib.contains("include_str!(\"../README.md\")"),
        "src/lib.rs must include the README as doctests"
    );
}
