//! The `pa` command line (issue 14): per-command help, `--version`, `--opt=value`, exit status 2
//! for usage errors and 1 for failures, `pa conformance` run from outside the repository (venv
//! found or a loud failure), on one case directory and with `--case`, `pa simulate`'s report,
//! trace and chart, `case.json` read by a strict JSON parser, and `pa_machine --help`.
//!
//! And `pa run` on hostile files (issue 11): a `.npy` header that is not ASCII, Result names that
//! climb out of `--out`, two files for one input. Each must end in an error message (exit code
//! 1), never a panic (101) or a stray file.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The repository root (this crate is its cli/).
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
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
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
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
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let e = stderr(&o);
    assert!(
        e.contains("in_0_query.npy") && e.contains("in_0_query_extra.npy"),
        "{e}"
    );
}

/// `pa ARGS` run in `cwd` with `env` set.
fn pa_in(cwd: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_pa"));
    c.current_dir(cwd).args(args);
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

fn pa(args: &[&str]) -> Output {
    pa_in(&std::env::temp_dir(), args, &[])
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn each_command_has_its_own_help() {
    let mut texts = Vec::new();
    for (args, own) in [
        (&["run", "-h"][..], "--inputs"),
        (&["conformance", "--help"][..], "--require-openvino"),
        (&["simulate", "--help"][..], "--arrival-rate"),
        (&["--help"][..], "simulate"),
    ] {
        let o = pa(args);
        assert_eq!(o.status.code(), Some(0), "{args:?}: {}", stderr(&o));
        let t = stdout(&o);
        assert!(t.contains(own), "{args:?} help lacks {own}:\n{t}");
        texts.push(t);
    }
    // No two commands print the same text (the old parser printed one global help).
    for i in 0..texts.len() {
        for j in i + 1..texts.len() {
            assert_ne!(texts[i], texts[j]);
        }
    }
    assert!(!texts[0].contains("--arrival-rate") && !texts[2].contains("--inputs"));
}

#[test]
fn version_prints_the_crate_version_the_engine_and_openvino() {
    let o = pa(&["--version"]);
    assert_eq!(o.status.code(), Some(0));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(
        lines[0],
        format!("pa {}", env!("CARGO_PKG_VERSION")),
        "{out}"
    );
    assert!(lines[1].starts_with("engine: "), "{out}");
    // Found or not, the OpenVINO line says so.
    assert!(
        lines[2].starts_with("OpenVINO ")
            && (lines[2].contains(" found through ") || lines[2] == "OpenVINO not found. Tried:"),
        "{out}"
    );
}

#[test]
fn usage_errors_exit_2_and_failures_exit_1() {
    for args in [
        &["simulate", "--bogus"][..],
        &["simulate", "--requests", "0"],
        &["simulate", "--prompt", "exp:0.5"],
        &["simulate", "--cache-type", "i32"],
        &["run", "model.xml"],
        &["nonsense"],
        &[],
    ] {
        let o = pa(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", stderr(&o));
        assert!(!stderr(&o).is_empty(), "{args:?}");
    }
    let d = scratch("exit1");
    let o = pa(&[
        "run",
        d.join("missing.xml").to_str().unwrap(),
        "--inputs",
        d.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    assert!(stderr(&o).contains("missing.xml"), "{}", stderr(&o));
    let o = pa(&["conformance", d.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
}

#[test]
fn options_take_their_value_after_an_equals_sign() {
    let d = copy_case("alibi", "equals");
    let out = d.join("out");
    let o = pa(&[
        "run",
        d.join("model.xml").to_str().unwrap(),
        &format!("--inputs={}", d.display()),
        &format!("--out={}", out.display()),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(out.join("out_0_output.npy").is_file());
    assert!(out.join("cache_key.npy").is_file());
    let o = pa(&["simulate", "--requests=5", "--blocks=64", "--seed=7"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).contains("5 requests (seed 7)"), "{}", stdout(&o));
}

/// Case directories under models/ whose name contains `text`, counted here independently.
fn cases_named(text: &str) -> usize {
    std::fs::read_dir(root().join("models"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("case.json").is_file())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().contains(text))
        .count()
}

#[test]
fn conformance_runs_one_case_directory_from_anywhere() {
    let cwd = scratch("elsewhere");
    let case = root().join("models").join("alibi_gqa");
    let o = pa_in(
        &cwd,
        &["conformance", "--ours-only", case.to_str().unwrap()],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("1 passed, 0 failed (1 cases, ours only"),
        "{out}"
    );
    assert!(out.lines().any(|l| l.starts_with("alibi_gqa ")), "{out}");
}

#[test]
fn conformance_filters_cases_by_name() {
    let cwd = scratch("filter");
    let n = cases_named("alibi");
    assert!(n >= 2, "models/ should hold several alibi cases");
    // No PATH: the models of the checkout the binary was built from.
    let o = pa_in(
        &cwd,
        &["conformance", "--ours-only", "--case", "alibi"],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains(&format!("{n} passed, 0 failed ({n} cases")),
        "{out}"
    );
    let rows = out
        .lines()
        .filter(|l| l.contains(" ours ") && l.contains(" PASS "))
        .count();
    assert_eq!(rows, n, "{out}");
    let o = pa_in(
        &cwd,
        &["conformance", "--ours-only", "--case=no_such_case"],
        &[],
    );
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("matches --case no_such_case"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn conformance_never_skips_openvino_silently() {
    let cwd = scratch("no_openvino");
    let case = root().join("models").join("alibi");
    let case = case.to_str().unwrap();
    let bad = [("PA_PYTHON", "/nonexistent/python")];
    let o = pa_in(&cwd, &["conformance", "--require-openvino", case], &bad);
    assert_eq!(o.status.code(), Some(1), "{}", stdout(&o));
    let e = stderr(&o);
    assert!(
        e.contains("--require-openvino") && e.contains("/nonexistent/python"),
        "{e}"
    );
    // Without --require-openvino the suite still runs, and says that OpenVINO did not.
    let o = pa_in(&cwd, &["conformance", case], &bad);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stderr(&o).contains("OpenVINO skipped"), "{}", stderr(&o));
    assert!(stdout(&o).contains("ours only"), "{}", stdout(&o));
    assert!(stdout(&o).contains("openvino: not run"), "{}", stdout(&o));
}

/// With the extension built (the test command builds the workspace first), the venv and the
/// extension are found from another working directory.
#[test]
fn conformance_outside_the_repository_finds_openvino() {
    let ext = root().join("target/release/libpaged_attention_openvino.so");
    if !ext.exists() {
        eprintln!("{} not built: this test is not run", ext.display());
        return;
    }
    let cwd = scratch("outside_ov");
    let o = pa_in(
        &cwd,
        &["conformance", "--require-openvino", "--case", "alibi_gqa"],
        &[],
    );
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("ours + openvino"), "{out}");
    assert!(
        out.lines()
            .any(|l| l.starts_with("alibi_gqa ") && l.contains(" openvino ") && l.contains("PASS")),
        "{out}"
    );
}

/// A copy of case `alibi` whose case.json has `from` replaced by `to`.
fn case_with_json(name: &str, from: &str, to: &str) -> PathBuf {
    let d = copy_case("alibi", name);
    for f in [
        "case.json",
        "cache_mask.npy",
        "out_0_output.npy",
        "out_1_scores.npy",
    ] {
        std::fs::copy(root().join("models/alibi").join(f), d.join(f)).unwrap();
    }
    for f in ["cache_key.npy", "cache_value.npy"] {
        std::fs::copy(root().join("models/alibi").join(f), d.join(f)).unwrap();
    }
    let text = std::fs::read_to_string(d.join("case.json")).unwrap();
    assert!(text.contains(from), "{from}");
    std::fs::write(d.join("case.json"), text.replacen(from, to, 1)).unwrap();
    d
}

#[test]
fn case_json_is_parsed_strictly() {
    let ok = case_with_json("json_ok", "\"name\": \"alibi\"", "\"name\": \"alibi\"");
    let o = pa(&["conformance", "--ours-only", ok.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    for (name, from, to) in [
        (
            "json_leading_zero",
            "\"scores\": 2.06e-05",
            "\"scores\": 01",
        ),
        ("json_nan", "\"scores\": 2.06e-05", "\"scores\": NaN"),
        (
            "json_raw_tab",
            "\"name\": \"alibi\"",
            "\"name\": \"ali\tbi\"",
        ),
        (
            "json_lone_surrogate",
            "\"name\": \"alibi\"",
            "\"name\": \"\\ud83d\"",
        ),
    ] {
        let d = case_with_json(name, from, to);
        let o = pa(&["conformance", "--ours-only", d.to_str().unwrap()]);
        assert_eq!(
            o.status.code(),
            Some(1),
            "{name} was accepted: {}",
            stdout(&o)
        );
        assert!(stderr(&o).contains("case.json"), "{name}: {}", stderr(&o));
    }
    // A surrogate pair decodes to the one character it encodes.
    let d = case_with_json(
        "json_pair",
        "\"name\": \"alibi\"",
        "\"name\": \"pair\\ud83d\\ude00\"",
    );
    let o = pa(&["conformance", "--ours-only", d.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).lines().any(|l| l.starts_with("pair\u{1F600} ")),
        "{}",
        stdout(&o)
    );
}

#[test]
fn simulate_says_why_requests_were_dropped() {
    let o = pa(&["simulate", "--requests", "10", "--blocks", "4"]);
    let out = stdout(&o);
    // The paged run completes nothing: a failure, explained.
    assert_eq!(o.status.code(), Some(1), "{out}");
    assert!(
        stderr(&o).contains("completed no request"),
        "{}",
        stderr(&o)
    );
    let paged = out
        .lines()
        .find(|l| l.starts_with("dropped (paged): "))
        .unwrap_or_else(|| panic!("no drop reason:\n{out}"));
    assert!(
        paged.contains("10 requests")
            && paged.contains("longer than the whole KV memory (64 token slots)"),
        "{paged}"
    );
    assert!(
        out.contains("dropped (contiguous): 10 requests: no scheduler"),
        "{out}"
    );
}

/// The numbers after `key` on the line starting with `row` in `text`.
fn row_fields<'a>(text: &'a str, row: &str, skip_header: &str) -> Vec<&'a str> {
    text.lines()
        .skip_while(|l| !l.starts_with(skip_header))
        .find(|l| l.starts_with(row))
        .unwrap_or_else(|| panic!("no `{row}` row after `{skip_header}`:\n{text}"))
        .split_whitespace()
        .skip(1)
        .collect()
}

#[test]
fn simulate_reports_requests_memory_trace_and_chart() {
    let d = scratch("simulate");
    let (csv, json, svg) = (d.join("t.csv"), d.join("t.json"), d.join("u.svg"));
    let common = [
        "simulate",
        "--requests",
        "60",
        "--blocks",
        "256",
        "--max-len",
        "512",
        "--prompt",
        "uniform:20,120",
        "--output",
        "exp:40",
        "--arrival-rate",
        "0.5",
        "--cache-type",
        "u8",
    ];
    let mut args = common.to_vec();
    args.extend([
        "--trace",
        csv.to_str().unwrap(),
        "--chart",
        svg.to_str().unwrap(),
    ]);
    let o = pa(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("prompt uniform:20,120") && out.contains("0.5 arrivals/step"),
        "{out}"
    );
    // KV bytes per token, 32 layers x 8 heads x D 128: f16 2 x 2 bytes per element; u8 keys
    // carry 8 extra rows per block of 16, values 8 extra bytes per token; u4 the same layout in
    // nibbles with 16 extra rows and elements (docs/contract.md, "u4 caches").
    let per_tok = |t: &str| -> f64 {
        row_fields(&out, &format!("  {t} "), "KV bytes")[0]
            .parse()
            .unwrap()
    };
    assert_eq!(per_tok("f16"), (32 * 8 * 128 * 2 * 2) as f64);
    assert_eq!(per_tok("f32"), (32 * 8 * 128 * 4 * 2) as f64);
    assert_eq!(
        per_tok("u8"),
        (32 * 8 * ((16 + 8) * 128 + 16 * (128 + 8))) as f64 / 16.0
    );
    assert_eq!(
        per_tok("u4"),
        (32 * 8 * ((16 + 16) * 128 + 16 * (128 + 16)) / 2) as f64 / 16.0
    );
    assert!(out
        .lines()
        .any(|l| l.starts_with("  u8 ") && l.ends_with("<- --cache-type")));
    for run in ["paged", "contiguous"] {
        let f = row_fields(&out, run, "requests");
        assert_eq!(
            (f[0], f[1]),
            ("60", "0"),
            "{run}: completed, dropped\n{out}"
        );
        let ttft: Vec<f64> = f[2].split('/').map(|x| x.parse().unwrap()).collect();
        let queue: Vec<f64> = f[3].split('/').map(|x| x.parse().unwrap()).collect();
        assert!(ttft[0] >= queue[0] + 1.0 && ttft[1] >= 1.0, "{run}: {f:?}");
    }

    // The CSV trace: every step of both runs, consistent counts.
    let text = std::fs::read_to_string(&csv).unwrap();
    let mut lines = text.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = |n: &str| {
        header
            .iter()
            .position(|h| *h == n)
            .unwrap_or_else(|| panic!("{n}"))
    };
    let mut last_completed = std::collections::HashMap::new();
    let mut steps = std::collections::HashMap::new();
    for l in lines {
        let v: Vec<&str> = l.split(',').collect();
        assert_eq!(v.len(), header.len(), "{l}");
        let n = |c: &str| v[col(c)].parse::<usize>().unwrap();
        assert!(
            n("stored_slots") <= n("allocated_slots") && n("allocated_slots") <= n("pool_slots"),
            "{l}"
        );
        *steps.entry(v[0].to_string()).or_insert(0) += 1;
        last_completed.insert(v[0].to_string(), n("completed"));
    }
    assert_eq!(last_completed["paged"], 60);
    assert_eq!(last_completed["contiguous"], 60);
    for run in ["paged", "contiguous"] {
        let f = row_fields(&out, run, "allocation");
        assert_eq!(f[5].parse::<usize>().unwrap(), steps[run], "{run} steps");
    }

    // The JSON trace (same run, chosen by the extension).
    let mut args = common.to_vec();
    args.extend(["--trace", json.to_str().unwrap()]);
    let o = pa(&args);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["config"]["cache_type"], "u8");
    let paged = v["paged"].as_array().unwrap();
    assert_eq!(paged.len(), steps["paged"]);
    assert_eq!(paged.last().unwrap()["completed"], 60);

    // The chart: well-formed SVG with four lines (utilization and occupancy per run) inside it.
    let svg_text = std::fs::read_to_string(&svg).unwrap();
    let mut reader = quick_xml::Reader::from_str(&svg_text);
    let (mut root_name, mut polylines) = (None, Vec::new());
    loop {
        match reader.read_event().expect("chart is not well-formed XML") {
            quick_xml::events::Event::Eof => break,
            quick_xml::events::Event::Start(e) | quick_xml::events::Event::Empty(e) => {
                let name = String::from_utf8(e.name().as_ref().to_vec()).unwrap();
                if root_name.is_none() {
                    root_name = Some(name.clone());
                }
                if name == "polyline" {
                    let pts = e
                        .attributes()
                        .map(|a| a.unwrap())
                        .find(|a| a.key.as_ref() == b"points")
                        .map(|a| String::from_utf8(a.value.to_vec()).unwrap())
                        .unwrap();
                    polylines.push(pts);
                }
            }
            _ => {}
        }
    }
    assert_eq!(root_name.as_deref(), Some("svg"));
    assert_eq!(polylines.len(), 4);
    for pts in &polylines {
        let xy: Vec<(f64, f64)> = pts
            .split_whitespace()
            .map(|p| {
                let (x, y) = p.split_once(',').unwrap();
                (x.parse().unwrap(), y.parse().unwrap())
            })
            .collect();
        assert!(xy.len() >= 10, "{pts}");
        assert!(xy
            .iter()
            .all(|&(x, y)| (0.0..=800.0).contains(&x) && (0.0..=420.0).contains(&y)));
    }
    assert!(svg_text.contains("paged utilization") && svg_text.contains("contiguous occupancy"));
}

#[test]
fn pa_machine_help_starts_no_probe() {
    let t = std::time::Instant::now();
    let o = Command::new(env!("CARGO_BIN_EXE_pa_machine"))
        .arg("--help")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(0));
    let out = stdout(&o);
    assert!(out.contains("Usage: pa_machine"), "{out}");
    // The probe prints one JSON line and takes seconds; help does neither.
    assert!(!out.lines().any(|l| l.starts_with('{')), "{out}");
    assert!(t.elapsed().as_secs_f64() < 1.0, "{:?}", t.elapsed());
    let o = Command::new(env!("CARGO_BIN_EXE_pa_machine"))
        .arg("--threads=2")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
}
