//! `pa`: run PagedAttention IR models and the golden conformance suite.
//!
//! Subcommands are one match arm each in `main` (a `simulate` arm for the cache manager's
//! simulator goes there too).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use paged_attention::ir::case::{find_cases, Actual, Case, OvEnv, Verdict, COMPARED};
use paged_attention::ir::npy::{read_npy, write_npy};
use paged_attention::ir::{CacheLocation, Model};

const HELP: &str = "\
pa: PagedAttention (OpenVINO ie_internal_opset, 16 inputs / 2 outputs) on IR models

USAGE:
    pa conformance [DIR]                 run the golden suite (default DIR: models/)
    pa run MODEL.xml --inputs DIR [--out DIR]
                                         run one model
    pa simulate [--seed N] [--requests N] [--blocks N] [--block-size N] [--max-len N]
                                         KV-cache manager simulation: paged vs contiguous
    pa help | --help                     this text

pa conformance [DIR]
    Runs every case directory under DIR (one with a case.json; format in models/README.md)
    through this crate's IR executor and, when available, through OpenVINO with this crate's
    extension loaded (tools/ov_run_case.py under .venv/bin/python, extension
    target/release/libpaged_attention_openvino.so or $PA_EXTENSION_LIB; $PA_PYTHON overrides the Python).
    Prints one row per case and path: max abs error of output, scores, key cache and value cache
    (caches only on the slots cache_mask.npy selects) against the expected files, the case's
    tolerances, PASS/FAIL and the time of the call. Ends with \"N passed, M failed\"; the exit
    status is 1 if any case failed on any path. Progress goes to stderr.
    Options: --ours-only   skip OpenVINO even if it is available
             --require-openvino   fail if OpenVINO cannot be run

pa run MODEL.xml --inputs DIR [--out DIR]
    Loads MODEL.xml (and the .bin beside it), reads DIR/in_<i>_<name>.npy (file i goes to the
    Parameter feeding the op's input i, else to the Parameter called <name>; two files for one
    Parameter are an error) and runs it. Writes every Result as <out>/out_<k>_<result name>.npy
    (characters other than ASCII letters, digits, - and . replaced by _) and the caches as
    <out>/cache_key.npy and cache_value.npy (default --out: the current directory). Caches fed
    directly by a Parameter are written in place; through a Convert the op writes a copy, and that
    copy is what is written out.

pa simulate
    Runs a synthetic serving workload through the KV-cache manager and scheduler twice on the
    same KV memory: paged blocks allocated on demand, and contiguous max-length reservations.
    Prompt lengths are log-normal (median 200, sigma 0.8), output lengths exponential (mean 150),
    Poisson arrivals (1 per step), all from one seeded stream (docs/cache.md). Prints KV memory
    utilization, waste, peak and mean concurrent sequences and throughput for both.
    Options: --seed N (42), --requests N (1000), --blocks N (2048 paged blocks),
             --block-size N (16), --max-len N (2048: the contiguous reservation)

.npy element types: <f4 (f32), <f2 (f16), <u2 (bf16 raw bits), <i4 (i32); masks |b1 or |u1.
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let res = match args.first().map(String::as_str) {
        None | Some("help" | "--help" | "-h") => {
            print!("{HELP}");
            Ok(true)
        }
        Some("conformance") => conformance(&args[1..]),
        Some("run") => run(&args[1..]),
        Some("simulate") => simulate(&args[1..]),
        Some(other) => Err(format!("unknown subcommand `{other}` (try `pa --help`)")),
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("pa: {e}");
            ExitCode::from(2)
        }
    }
}

/// Splits `args` into flags (`--x` and `--x VALUE` for the names in `with_value`) and positionals.
fn parse_args(
    args: &[String],
    with_value: &[&str],
    flags: &[&str],
) -> Result<(HashMap<String, String>, Vec<String>), String> {
    let mut opts = HashMap::new();
    let mut pos = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if with_value.contains(&a.as_str()) {
            let v = it.next().ok_or_else(|| format!("{a} needs a value"))?;
            opts.insert(a.clone(), v.clone());
        } else if flags.contains(&a.as_str()) {
            opts.insert(a.clone(), String::new());
        } else if a == "--help" || a == "-h" {
            print!("{HELP}");
            std::process::exit(0);
        } else if a.starts_with("--") {
            return Err(format!("unknown option {a} (try `pa --help`)"));
        } else {
            pos.push(a.clone());
        }
    }
    Ok((opts, pos))
}

fn fmt_err(e: Option<f64>) -> String {
    match e {
        None => "-".into(),
        Some(v) if v.is_infinite() => "inf".into(),
        Some(v) => format!("{v:.2e}"),
    }
}

fn row(name: &str, features: &str, path: &str, v: &Verdict, tol: &[f64; 4], ms: f64) {
    let errs: Vec<String> = v.max_err.iter().map(|e| fmt_err(*e)).collect();
    let tols: Vec<String> = tol.iter().map(|t| format!("{t:.1e}")).collect();
    println!(
        "{name:<30} {features:<34} {path:<9} {:>9} {:>9} {:>9} {:>9}  {:<31} {:<4} {ms:>8.2}",
        errs[0],
        errs[1],
        errs[2],
        errs[3],
        tols.join("/"),
        if v.pass { "PASS" } else { "FAIL" },
    );
}

fn conformance(args: &[String]) -> Result<bool, String> {
    let (opts, pos) = parse_args(args, &[], &["--ours-only", "--require-openvino"])?;
    let dir = PathBuf::from(pos.first().map_or("models", String::as_str));
    let dirs = find_cases(&dir)?;
    if dirs.is_empty() {
        return Err(format!(
            "no case directories (with case.json) under {}",
            dir.display()
        ));
    }
    let cases = dirs
        .iter()
        .map(|d| Case::load(d))
        .collect::<Result<Vec<_>, _>>()?;
    let ov = if opts.contains_key("--ours-only") {
        Err("skipped (--ours-only)".to_string())
    } else {
        OvEnv::detect(Path::new("."))
    };
    if let Err(why) = &ov {
        if opts.contains_key("--require-openvino") {
            return Err(format!("openvino: not available: {why}"));
        }
    }
    let ov_results: Vec<Result<Actual, String>> = match &ov {
        Ok(env) => {
            eprintln!(
                "running {} cases through OpenVINO with {}",
                cases.len(),
                env.extension.display()
            );
            env.run(&cases)
        }
        Err(_) => Vec::new(),
    };
    println!(
        "{:<30} {:<34} {:<9} {:>9} {:>9} {:>9} {:>9}  {:<31} {:<4} {:>8}",
        "case",
        "features",
        "path",
        "output",
        "scores",
        "key$",
        "value$",
        "tolerance (out/sc/k$/v$)",
        "",
        "ms"
    );
    let (mut passed, mut failed) = (0usize, 0usize);
    let mut notes = Vec::new();
    let n = cases.len();
    for (k, case) in cases.iter().enumerate() {
        eprintln!("[{}/{n}] {}", k + 1, case.name);
        let mut features = case.features.join(",");
        if features.len() > 34 {
            features.truncate(33);
            features.push('+');
        }
        let mut case_ok = true;
        let mut report = |path: &str, res: Result<Actual, String>| {
            let verdict = res.and_then(|a| case.compare(&a).map(|v| (v, a.time)));
            match verdict {
                Ok((v, t)) => {
                    row(
                        &case.name,
                        &features,
                        path,
                        &v,
                        &case.tol,
                        t.as_secs_f64() * 1e3,
                    );
                    case_ok &= v.pass;
                    for note in &v.notes {
                        notes.push(format!("{} [{path}]: {note}", case.name));
                    }
                }
                Err(e) => {
                    println!("{:<30} {features:<34} {path:<9} error: {e}", case.name);
                    notes.push(format!("{} [{path}]: {e}", case.name));
                    case_ok = false;
                }
            }
        };
        report("ours", case.run_ours());
        if let (Ok(_), Some(r)) = (&ov, ov_results.get(k)) {
            report("openvino", r.clone());
        }
        if let Err(why) = &ov {
            if k == 0 {
                notes.push(format!("openvino: not available: {why}"));
            }
        }
        if case_ok {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    if ov.is_err() {
        println!(
            "openvino: not available ({})",
            ov.as_ref().err().map_or("", String::as_str)
        );
    }
    for note in notes
        .iter()
        .filter(|n| !n.starts_with("openvino: not available"))
    {
        println!("note: {note}");
    }
    let paths = if ov.is_ok() {
        "ours + openvino"
    } else {
        "ours only"
    };
    println!(
        "{passed} passed, {failed} failed ({n} cases, {paths}; columns: {})",
        COMPARED.join(", ")
    );
    Ok(failed == 0)
}

/// `name` (a Result's name, from the model file) made safe as part of one file name: anything
/// but ASCII letters, digits, `-` and `.` becomes `_`, so no separator can take the path out
/// of `--out` (`x/../../ESCAPED` becomes `x_.._.._ESCAPED`).
fn file_name_part(name: &str) -> String {
    name.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

fn run(args: &[String]) -> Result<bool, String> {
    let (opts, pos) = parse_args(args, &["--inputs", "--out"], &[])?;
    let [xml] = pos.as_slice() else {
        return Err("usage: pa run MODEL.xml --inputs DIR [--out DIR]".into());
    };
    let inputs_dir = opts.get("--inputs").ok_or("pa run needs --inputs DIR")?;
    let out_dir = PathBuf::from(opts.get("--out").map_or(".", String::as_str));
    let model = Model::load(xml).map_err(|e| e.to_string())?;
    let case = Case {
        dir: PathBuf::from(inputs_dir),
        name: String::new(),
        features: Vec::new(),
        truth: String::new(),
        tol: [0.0; 4],
    };
    let mut inputs = case.inputs(&model)?;
    let t0 = Instant::now();
    let out = model.run(&mut inputs).map_err(|e| e.to_string())?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let mut written = Vec::new();
    for (k, r) in out.results.iter().enumerate() {
        let p = out_dir.join(format!("out_{k}_{}.npy", file_name_part(&r.name)));
        write_npy(&p, &r.tensor).map_err(|e| e.to_string())?;
        written.push(p);
    }
    for c in &out.caches {
        let name = if c.input == 3 {
            "cache_key.npy"
        } else {
            "cache_value.npy"
        };
        let t = match &c.location {
            CacheLocation::Parameter(p) => inputs.get(p),
            CacheLocation::Copy(t) => Some(t),
        };
        if let Some(t) = t {
            let p = out_dir.join(name);
            write_npy(&p, t).map_err(|e| e.to_string())?;
            written.push(p);
        }
    }
    // Sanity: every written file reads back.
    for p in &written {
        read_npy(p).map_err(|e| e.to_string())?;
        println!("wrote {}", p.display());
    }
    println!("ran {} in {ms:.2} ms", Path::new(xml).display());
    Ok(true)
}

fn simulate(args: &[String]) -> Result<bool, String> {
    use paged_attention::cache::simulate::{simulate, SimConfig};
    let names = [
        "--seed",
        "--requests",
        "--blocks",
        "--block-size",
        "--max-len",
    ];
    let (opts, pos) = parse_args(args, &names, &[])?;
    if let Some(p) = pos.first() {
        return Err(format!(
            "pa simulate takes no positional argument, got `{p}`"
        ));
    }
    let num = |name: &str, default: u64| -> Result<u64, String> {
        match opts.get(name) {
            None => Ok(default),
            Some(v) => v
                .parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| format!("{name} needs a positive whole number, got `{v}`")),
        }
    };
    let d = SimConfig::default();
    let cfg = SimConfig {
        seed: num("--seed", d.seed)?,
        num_requests: num("--requests", d.num_requests as u64)? as usize,
        num_blocks: num("--blocks", d.num_blocks as u64)? as usize,
        block_size: num("--block-size", d.block_size as u64)? as usize,
        max_model_len: num("--max-len", d.max_model_len as u64)? as usize,
        ..d
    };
    print!("{}", simulate(&cfg));
    Ok(true)
}
