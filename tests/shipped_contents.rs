//! What ships holds the op alone: the C library (`libpaged_attention.so` and `.a`) and the
//! OpenVINO extension (`libpaged_attention_openvino.so`) carry neither the IR loader and executor
//! nor the cache simulator (both are the `pa` command's, in cli/), and neither depends on
//! quick-xml or on what only the command needs (clap, serde).
//!
//! Checked two ways, so that neither a new dependency nor code pulled in some other way goes
//! unnoticed: the normal dependency graph of both crates (`cargo tree -e normal`), and the
//! symbols of the built files (`nm -D` for what they export, `nm` for what they contain; the
//! release profile keeps symbol names). The extension is the one `cargo build --release
//! --workspace --lib` leaves in target/release/ (scripts/test.sh builds it first); a missing file
//! is a failure, not a skip.

mod support;

use std::path::{Path, PathBuf};
use std::process::Command;

/// Crates only the `pa` command may depend on.
const COMMAND_ONLY_CRATES: [&str; 4] = ["quick-xml", "clap", "serde", "serde_json"];

/// Symbol fragments of the command's code: quick-xml, and the modules that moved to cli/
/// (`paged_attention::ir`, `paged_attention::cache::simulate`, `paged_attention_cli`), in
/// legacy (`_ZN15paged_attention2ir...`) and v0 (`15paged_attention2ir`) mangling alike.
const COMMAND_ONLY_SYMBOLS: [&str; 4] = [
    "quick_xml",
    "15paged_attention2ir",
    "5cache8simulate",
    "paged_attention_cli",
];

fn cargo_tree(package: &str) -> Vec<String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = support::run(
        Command::new(cargo)
            .current_dir(support::root())
            .args([
                "tree",
                "--offline",
                "--locked",
                "-e",
                "normal",
                "--prefix",
                "none",
            ])
            .args(["--format", "{p}", "-p", package]),
    );
    let text = String::from_utf8(out.stdout).expect("cargo tree output is UTF-8");
    let names: Vec<String> = text
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect();
    assert!(
        names.iter().any(|n| n == package),
        "cargo tree -p {package} did not list the package itself:\n{text}"
    );
    names
}

fn symbols(file: &Path, dynamic: bool) -> Vec<String> {
    assert!(
        file.is_file(),
        "{} missing: build with cargo build --release --workspace --lib",
        file.display()
    );
    let mut cmd = Command::new("nm");
    if dynamic {
        cmd.args(["-D", "--defined-only"]);
    }
    let out = support::run(cmd.arg(file));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().last())
        .map(str::to_string)
        .collect()
}

fn command_only(symbols: &[String]) -> Vec<&String> {
    symbols
        .iter()
        .filter(|s| COMMAND_ONLY_SYMBOLS.iter().any(|f| s.contains(f)))
        .collect()
}

/// target/<profile>/, where `cargo build` leaves the extension (this test runs from deps/).
fn profile_dir() -> PathBuf {
    support::lib_dir()
        .parent()
        .expect("target/<profile>/deps has a parent")
        .to_path_buf()
}

#[test]
fn library_and_extension_depend_on_no_command_only_crate() {
    for package in ["paged_attention", "paged_attention_openvino"] {
        let names = cargo_tree(package);
        let found: Vec<&String> = names
            .iter()
            .filter(|n| COMMAND_ONLY_CRATES.contains(&n.as_str()))
            .collect();
        assert!(
            found.is_empty(),
            "{package} depends on {found:?}, which only the pa command (cli/) may use"
        );
    }
}

#[test]
fn library_and_extension_export_only_the_c_api() {
    let files = [
        support::lib_dir().join("libpaged_attention.so"),
        profile_dir().join("libpaged_attention_openvino.so"),
    ];
    for file in &files {
        let exported = symbols(file, true);
        assert!(
            exported.iter().any(|s| s == "pa_execute"),
            "{}: pa_execute not exported; nm -D listed {exported:?}",
            file.display()
        );
        let stray: Vec<&String> = exported
            .iter()
            .filter(|s| !s.starts_with("pa_") && s.as_str() != "create_extensions")
            .collect();
        assert!(
            stray.is_empty(),
            "{} exports symbols outside the C API: {stray:?}",
            file.display()
        );
        let found = command_only(&exported);
        assert!(found.is_empty(), "{} exports {found:?}", file.display());
    }
}

#[test]
fn library_and_extension_contain_no_ir_loader_or_simulator_code() {
    let files = [
        support::lib_dir().join("libpaged_attention.so"),
        support::lib_dir().join("libpaged_attention.a"),
        profile_dir().join("libpaged_attention_openvino.so"),
    ];
    for file in &files {
        let all = symbols(file, false);
        assert!(
            all.iter().any(|s| s.contains("pa_validate")),
            "{}: no symbol table to check (pa_validate not found)",
            file.display()
        );
        let found = command_only(&all);
        assert!(
            found.is_empty(),
            "{} holds {} symbols of the pa command's code, e.g. {:?}",
            file.display(),
            found.len(),
            &found[..found.len().min(5)]
        );
    }
}
