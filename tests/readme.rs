//! The examples of the README and of docs/cache.md work as written: every C block marked
//! `<!-- readme-test: c ... -->` is compiled with `cc -Wall -Wextra -Werror` against the headers,
//! linked to the library and run (exit status 0). The Rust blocks are doctests (`src/lib.rs`
//! includes both files under `cfg(doctest)`).

mod support;

/// The documents whose marked examples run, with the C and Rust examples each must hold: the
/// README the op's, docs/cache.md the cache manager's.
const DOCS: [(&str, usize, usize); 2] = [("README.md", 1, 1), ("docs/cache.md", 1, 1)];

fn read(doc: &str) -> String {
    std::fs::read_to_string(support::root().join(doc)).unwrap_or_else(|e| panic!("{doc}: {e}"))
}

#[test]
fn marked_c_examples_compile_with_warnings_as_errors_and_run() {
    let mut n = 0;
    for (doc, min_c, _) in DOCS {
        let blocks = support::marked_blocks(&read(doc), "c");
        assert!(
            blocks.len() >= min_c,
            "expected at least {min_c} marked C example(s) in {doc}, found {}",
            blocks.len()
        );
        for code in &blocks {
            let src = support::lib_dir().join(format!("readme_example_{n}.c"));
            std::fs::write(&src, code).expect("write example");
            support::build_and_run_c(&[src], &format!("readme_example_{n}"));
            n += 1;
        }
    }
}

#[test]
fn marked_rust_examples_are_doctests() {
    let lib = std::fs::read_to_string(support::root().join("src/lib.rs")).expect("src/lib.rs");
    for (doc, _, min_rust) in DOCS {
        let blocks = support::marked_blocks(&read(doc), "rust");
        assert!(
            blocks.len() >= min_rust,
            "expected at least {min_rust} marked Rust example(s) in {doc}, found {}",
            blocks.len()
        );
        let include = format!("include_str!(\"../{doc}\")");
        assert!(
            lib.contains(&include),
            "src/lib.rs must include {doc} as doctests ({include})"
        );
    }
}
