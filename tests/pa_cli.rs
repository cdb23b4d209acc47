//! `pa run` on hostile files (issue 11): a `.npy` header that is not ASCII, Result names that
//! climb out of `--out`, two files for one input, and a model whose cache is a Const. Each
//! must end in an error message (exit code 2), never a panic (101) or a stray file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// A fresh scratch directory under the target directory, removed first if it exists.
fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("pa_cli_{name}"));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A copy of the golden case `case` (model and inputs) in a scratch directory.
fn copy_case(case: &str, name: &str) -> PathBuf {
    let dst = scratch(name);
    for e in std::fs::read_dir(root().join("models").join(case)).unwrap() {
        let p = e.unwrap().path();
        let f = p.file_name().unwrap().to_str().unwrap().to_string();
        if f.starts_with("in_") || f.starts_with("model.") {
            std::fs::copy(&p, dst.join(&f)).unwrap();
        }
    }
    dst
}

fn pa_run(model: &Path, inputs: &Path, out: &Path) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pa"))
        .arg("run")
        .arg(model)
        .arg("--inputs")
        .arg(inputs)
        .arg("--out")
        .arg(out)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Every file under `dir`, recursively.
fn files_under(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            v.extend(files_under(&p));
        } else {
            v.push(p);
        }
    }
    v
}

#[test]
fn a_multibyte_descr_is_an_error_not_a_panic() {
    let d = copy_case("alibi", "multibyte_descr");
    let f = d.join("in_5_past_lens.npy");
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.windows(3).position(|w| w == b"<i4").unwrap();
    // 'é4' is three bytes in UTF-8, like '<i4': the header keeps its length.
    bytes[at..at + 3].copy_from_slice("é4".as_bytes());
    std::fs::write(&f, bytes).unwrap();
    let o = pa_run(&d.join("model.xml"), &d, &d.join("out"));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("é4"), "{}", stderr(&o));
}

#[test]
fn result_names_cannot_write_outside_the_output_directory() {
    let d = copy_case("alibi", "traversal");
    let xml = std::fs::read_to_string(d.join("model.xml")).unwrap();
    let evil = "x/../../../ESCAPED";
    let xml = xml.replacen(
        "name=\"output\" type=\"Result\"",
        &format!("name=\"{evil}\" type=\"Result\""),
        1,
    );
    assert!(xml.contains(evil));
    std::fs::write(d.join("model.xml"), xml).unwrap();
    let out = d.join("a").join("b").join("out");
    // With this directory present the raw name resolves to d/a/ESCAPED.npy.
    std::fs::create_dir_all(out.join("out_0_x")).unwrap();
    let o = pa_run(&d.join("model.xml"), &d, &out);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    // Nothing may appear outside `out`: the only new files are under it.
    for f in files_under(&d) {
        let name = f.file_name().unwrap().to_str().unwrap();
        assert!(
            f.starts_with(&out) || name.starts_with("in_") || name.starts_with("model."),
            "stray file {}",
            f.display()
        );
    }
    let written: Vec<String> = files_under(&out)
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap().to_string())
        .collect();
    assert!(
        written
            .iter()
            .any(|n| n.starts_with("out_0_") && n.contains("ESCAPED")),
        "{written:?}"
    );
}

#[test]
fn two_files_for_one_input_are_an_error() {
    let d = copy_case("alibi", "ambiguous");
    std::fs::copy(d.join("in_0_query.npy"), d.join("in_0_query_extra.npy")).unwrap();
    let o = pa_run(&d.join("model.xml"), &d, &d.join("out"));
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("in_0_query.npy") && e.contains("in_0_query_extra.npy"),
        "{e}"
    );
}
