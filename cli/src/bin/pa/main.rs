//! `pa`: run PagedAttention IR models, the golden conformance suite, and the KV-cache
//! simulator. The argument parser is clap's (per-command help, `--opt=value`, `--version`);
//! usage errors exit 2 (clap's code), runtime failures and failed cases exit 1.
//!
//! The IR executor, the conformance harness and the simulator are this crate's library
//! (`paged_attention_cli`), not the C library or the OpenVINO extension.

mod chart;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Args, Parser, Subcommand};

use paged_attention::dtype::ElemType;
use paged_attention_cli::case::{find_cases, Actual, Case, OvEnv, Verdict, COMPARED};
use paged_attention_cli::ir::{CacheLocation, Model};
use paged_attention_cli::npy::{read_npy, write_npy};
use paged_attention_cli::simulate::{simulate, LengthDist, SimConfig, SimReport};

#[derive(Parser)]
#[command(
    name = "pa",
    version,
    about = "PagedAttention (OpenVINO ie_internal_opset, 17 inputs / 2 outputs) for CPUs: generate \
             and serve text from a model directory, run IR models and the golden suite, simulate \
             the KV cache",
    after_help = ".npy element types: <f4 (f32), <f2 (f16), <u2 (bf16 raw bits), <i4 (i32), \
                  |u1 (u8 cache bytes); masks |b1 or |u1.\n\
                  Exit status: 0 success, 1 a failure (failed case, unreadable file, model \
                  error), 2 a usage error."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the golden suite (or one case) through our executor and through OpenVINO.
    #[command(long_about = CONFORMANCE_ABOUT)]
    Conformance(ConformanceArgs),
    /// Run one IR model on .npy inputs and write its outputs and caches.
    #[command(long_about = RUN_ABOUT)]
    Run(RunArgs),
    /// KV-cache manager simulation: paged vs contiguous allocation on the same memory.
    #[command(long_about = SIMULATE_ABOUT)]
    Simulate(SimulateArgs),
    /// Generate text from a model directory (runs pa-engine; `pa generate --help` shows its options).
    #[command(long_about = ENGINE_ABOUT, disable_help_flag = true)]
    Generate(EngineArgs),
    /// Convert a stateful LLM IR to a paged IR on our op (runs pa-engine).
    #[command(long_about = ENGINE_ABOUT, disable_help_flag = true)]
    Convert(EngineArgs),
    /// Serve a model directory over an OpenAI-compatible HTTP API (runs pa-engine).
    #[command(long_about = ENGINE_ABOUT, disable_help_flag = true)]
    Serve(EngineArgs),
}

const ENGINE_ABOUT: &str = "\
Runs `pa-engine` with the same arguments (`pa generate ARGS` is `pa-engine generate ARGS`).
The engine links OpenVINO, which this binary and the C library do not; it is its own workspace
crate. Get it with `scripts/setup.sh && cargo build --release -p paged_attention_engine`
(target/release/pa-engine, found beside `pa` or on PATH; $PA_ENGINE names another).
pa-engine has no RUNPATH: `pa` finds OpenVINO ($OpenVINO_DIR, the active Python's openvino
package, $LD_LIBRARY_PATH, the system's libraries; `pa --version` says which) and runs the
engine with LD_LIBRARY_PATH pointing there.";

/// The arguments of a command `pa-engine` runs, passed through untouched.
#[derive(Args)]
struct EngineArgs {
    #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
    args: Vec<std::ffi::OsString>,
}

const CONFORMANCE_ABOUT: &str = "\
Runs every case directory under PATH (one with a case.json; format in models/README.md), or PATH
itself if it is a case directory, through this crate's IR executor and through OpenVINO with
this crate's extension loaded (tools/ov_run_case.py under the repository's .venv/bin/python).
Prints one row per case and path: max abs error of output, scores, key cache and value cache
(caches only on the slots cache_mask.npy selects) against the expected files, the case's
tolerances, PASS/FAIL and the time of the call. Ends with \"N passed, M failed\"; the exit status
is 1 if any case failed on any path. Progress goes to stderr.

OpenVINO is found under the repository root (--root, else $PA_ROOT, else the checkout this
binary was built from): ROOT/.venv/bin/python (--python or $PA_PYTHON instead),
ROOT/tools/ov_run_case.py, and the OpenVINO extension module built in ROOT/target/release/
(--extension or $PA_EXTENSION_LIB instead). If it cannot be run, the suite runs on our executor
only and says so on stderr and in the summary; with --require-openvino that is a failure.";

const RUN_ABOUT: &str = "\
Loads MODEL (and the .bin beside it), reads INPUTS/in_<i>_<name>.npy (file i goes to the
Parameter feeding the op's input i, else to the Parameter called <name>; two files for one
Parameter are an error) and runs it. Writes every Result as OUT/out_<k>_<result name>.npy
(characters other than ASCII letters, digits, - and . replaced by _) and the caches as
OUT/cache_key.npy and cache_value.npy. Caches fed directly by a Parameter are written in place;
through a Convert the op writes a copy, and that copy is what is written out.";

const SIMULATE_ABOUT: &str = "\
Runs a synthetic serving workload through the KV-cache manager and scheduler twice on the same
KV memory: paged blocks allocated on demand, and contiguous max-length reservations (docs/cache.md).
Arrivals are Poisson (--arrival-rate per step); prompt and output lengths come from
distributions given as lognormal:MEDIAN,SIGMA, exp:MEAN (1 + floor(Exp(MEAN - 1))),
uniform:MIN,MAX or fixed:N; all from one seeded stream. Prints KV memory utilization, waste,
peak and mean concurrent sequences, throughput, completed and dropped requests (with the reason
for each drop), time to first token and queueing delay (in steps: one step is one op call), and
the KV bytes per token of each cache type (u8 with its scale/zero-point rows). --trace writes
every step of both runs, --chart an SVG of utilization and occupancy over time.
Exits 1 if the paged run completes no request.";

#[derive(Args)]
struct ConformanceArgs {
    /// The models directory, or one case directory [default: ROOT/models]
    path: Option<PathBuf>,
    /// Only cases whose directory name contains this text (repeatable: any of them)
    #[arg(long, value_name = "TEXT")]
    case: Vec<String>,
    /// Skip OpenVINO even if it is available
    #[arg(long, conflicts_with = "require_openvino")]
    ours_only: bool,
    /// Fail (exit 1) if OpenVINO cannot be run
    #[arg(long)]
    require_openvino: bool,
    /// Repository root holding .venv, tools/ and target/
    #[arg(long, value_name = "DIR")]
    root: Option<PathBuf>,
    /// Python with openvino and numpy [default: ROOT/.venv/bin/python]
    #[arg(long, value_name = "FILE")]
    python: Option<PathBuf>,
    /// The OpenVINO extension module [default: the one built in ROOT/target/release/]
    #[arg(long, value_name = "FILE")]
    extension: Option<PathBuf>,
}

#[derive(Args)]
struct RunArgs {
    /// The model's .xml (its .bin beside it)
    model: PathBuf,
    /// Directory of in_<i>_<name>.npy files
    #[arg(long, value_name = "DIR")]
    inputs: PathBuf,
    /// Where to write the outputs and caches
    #[arg(long, value_name = "DIR", default_value = ".")]
    out: PathBuf,
}

#[derive(Args)]
struct SimulateArgs {
    #[arg(long, default_value_t = 42)]
    seed: u64,
    #[arg(long, default_value_t = 1000, value_parser = positive)]
    requests: usize,
    /// KV memory in paged blocks (see also --kv-memory-mib)
    #[arg(long, default_value_t = 2048, value_parser = positive)]
    blocks: usize,
    #[arg(long, default_value_t = 16, value_parser = positive)]
    block_size: usize,
    /// Longest sequence: the contiguous reservation
    #[arg(long, default_value_t = 2048, value_parser = positive)]
    max_len: usize,
    /// Mean requests arriving per step (Poisson)
    #[arg(long, default_value_t = 1.0, value_parser = positive_real)]
    arrival_rate: f64,
    /// Prompt length distribution
    #[arg(long, default_value = "lognormal:200,0.8", value_name = "DIST")]
    prompt: LengthDist,
    /// Output length distribution
    #[arg(long, default_value = "exp:150", value_name = "DIST")]
    output: LengthDist,
    /// Token rows per step (op call)
    #[arg(long, default_value_t = 512, value_parser = positive)]
    max_batched_tokens: usize,
    /// Sequences per step
    #[arg(long, default_value_t = 256, value_parser = positive)]
    max_seqs: usize,
    /// Cache element type (memory figures; with --kv-memory-mib also the block count)
    #[arg(long, default_value = "f16", value_parser = ElemType::parse_cache_type)]
    cache_type: ElemType,
    #[arg(long, default_value_t = 8, value_parser = positive)]
    kv_heads: usize,
    #[arg(long, default_value_t = 128, value_parser = positive)]
    head_size: usize,
    #[arg(long, default_value_t = 32, value_parser = positive)]
    layers: usize,
    /// KV memory in MiB instead of --blocks: as many blocks of --cache-type as fit
    #[arg(long, value_name = "MIB", conflicts_with = "blocks", value_parser = positive_real)]
    kv_memory_mib: Option<f64>,
    /// Write every step of both runs (CSV, or JSON if FILE ends in .json)
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    /// Write utilization and occupancy over time, paged vs contiguous, as SVG
    #[arg(long, value_name = "FILE")]
    chart: Option<PathBuf>,
}

fn positive(s: &str) -> Result<usize, String> {
    s.parse::<usize>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| format!("needs a positive whole number, got `{s}`"))
}

fn positive_real(s: &str) -> Result<f64, String> {
    s.parse::<f64>()
        .ok()
        .filter(|&x| x.is_finite() && x > 0.0)
        .ok_or_else(|| format!("needs a positive number, got `{s}`"))
}

fn main() -> ExitCode {
    let mut args = std::env::args_os().skip(1);
    if let (Some(a), None) = (args.next(), args.next()) {
        if a == "--version" || a == "-V" {
            print_version();
            return ExitCode::SUCCESS;
        }
    }
    // clap prints help (exit 0) and usage errors (exit 2) itself.
    let cli = Cli::parse();
    let res = match cli.command {
        Command::Conformance(a) => conformance(a),
        Command::Run(a) => run(a),
        Command::Simulate(a) => simulate_cmd(a),
        Command::Generate(a) => engine_cmd("generate", a),
        Command::Convert(a) => engine_cmd("convert", a),
        Command::Serve(a) => engine_cmd("serve", a),
    };
    match res {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("pa: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `pa --version`: this binary's version, the engine it runs and the OpenVINO it found.
fn print_version() {
    println!("pa {}", env!("CARGO_PKG_VERSION"));
    println!("engine: {}", engine_path().display());
    match paged_attention_cli::openvino::find() {
        Ok(ov) => println!("{ov}"),
        Err(e) => println!("{e}"),
    }
}

/// `pa-engine`: $PA_ENGINE, else beside this binary, else on PATH.
fn engine_path() -> PathBuf {
    let beside = std::env::current_exe()
        .ok()
        .and_then(|p| p.parent().map(|d| d.join("pa-engine")))
        .filter(|p| p.is_file());
    std::env::var_os("PA_ENGINE")
        .map(PathBuf::from)
        .or(beside)
        .unwrap_or_else(|| PathBuf::from("pa-engine"))
}

/// Replaces this process by `pa-engine COMMAND ARGS`, with OpenVINO's libraries on
/// LD_LIBRARY_PATH (`paged_attention_cli::openvino`). Returns only when it cannot be started.
fn engine_cmd(command: &str, a: EngineArgs) -> Result<bool, String> {
    use std::os::unix::process::CommandExt;
    let exe = engine_path();
    let ov = paged_attention_cli::openvino::find()?;
    let mut cmd = std::process::Command::new(&exe);
    if let Some(path) = ov.library_path() {
        cmd.env("LD_LIBRARY_PATH", path);
    }
    let err = cmd.arg(command).args(&a.args).exec();
    Err(format!(
        "`pa {command}` runs the engine, `{}`, which could not be started ({err}). The engine \
         links OpenVINO, which `pa` and the C library do not: build it with \
         `scripts/setup.sh && cargo build --release -p paged_attention_engine`, or set PA_ENGINE",
        exe.display()
    ))
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

/// The repository root `pa conformance` takes OpenVINO's venv, the runner script and the
/// extension from: `--root`, else `$PA_ROOT`, else the checkout this binary was built from, so
/// that running it from another directory still finds them.
fn repo_root(flag: Option<PathBuf>) -> PathBuf {
    flag.or_else(|| std::env::var_os("PA_ROOT").map(PathBuf::from))
        .unwrap_or_else(|| {
            // This crate is cli/ of the repository.
            let cli = Path::new(env!("CARGO_MANIFEST_DIR"));
            cli.parent().unwrap_or(cli).to_path_buf()
        })
}

fn conformance(a: ConformanceArgs) -> Result<bool, String> {
    let root = repo_root(a.root);
    let dir = a.path.unwrap_or_else(|| root.join("models"));
    let mut dirs = find_cases(&dir)?;
    let listed = dirs.len();
    dirs.retain(|d| {
        let name = d
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        a.case.is_empty() || a.case.iter().any(|c| name.contains(c.as_str()))
    });
    if dirs.is_empty() {
        return Err(if listed == 0 {
            format!(
                "no case directories (with case.json) at or under {}",
                dir.display()
            )
        } else {
            format!(
                "none of the {listed} cases under {} matches --case {}",
                dir.display(),
                a.case.join(", --case ")
            )
        });
    }
    let cases = dirs
        .iter()
        .map(|d| Case::load(d))
        .collect::<Result<Vec<_>, _>>()?;
    let ov = if a.ours_only {
        Err("skipped (--ours-only)".to_string())
    } else {
        OvEnv::detect(&root, a.python, a.extension)
    };
    if let Err(why) = &ov {
        if a.require_openvino {
            return Err(format!(
                "--require-openvino: OpenVINO cannot be run: {why} (repository root {}; \
                 set --root, --python or --extension)",
                root.display()
            ));
        }
        if !a.ours_only {
            eprintln!("pa conformance: OpenVINO skipped, running our executor only: {why}");
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
        if case_ok {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    if let Err(why) = &ov {
        println!("openvino: not run ({why})");
    }
    for note in &notes {
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

fn run(a: RunArgs) -> Result<bool, String> {
    let model = Model::load(&a.model).map_err(|e| e.to_string())?;
    let case = Case {
        dir: a.inputs,
        name: String::new(),
        features: Vec::new(),
        truth: String::new(),
        tol: [0.0; 4],
    };
    let mut inputs = case.inputs(&model)?;
    let t0 = Instant::now();
    let out = model.run(&mut inputs).map_err(|e| e.to_string())?;
    let ms = t0.elapsed().as_secs_f64() * 1e3;
    let out_dir = a.out;
    std::fs::create_dir_all(&out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let mut written = Vec::new();
    for (k, r) in out.results.iter().enumerate() {
        let p = out_dir.join(format!("out_{k}_{}.npy", file_name_part(&r.name)));
        write_npy(&p, &r.tensor)?;
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
            write_npy(&p, t)?;
            written.push(p);
        }
    }
    // Sanity: every written file reads back.
    for p in &written {
        read_npy(p)?;
        println!("wrote {}", p.display());
    }
    println!("ran {} in {ms:.2} ms", Path::new(&a.model).display());
    Ok(true)
}

fn simulate_cmd(a: SimulateArgs) -> Result<bool, String> {
    let mut cfg = SimConfig {
        seed: a.seed,
        num_requests: a.requests,
        num_blocks: a.blocks,
        block_size: a.block_size,
        max_model_len: a.max_len,
        prompt: a.prompt,
        output: a.output,
        arrival_rate: a.arrival_rate,
        max_batched_tokens: a.max_batched_tokens,
        max_seqs: a.max_seqs,
        cache: a.cache_type,
        kv_heads: a.kv_heads,
        head_size: a.head_size,
        layers: a.layers,
    };
    if let Some(mib) = a.kv_memory_mib {
        let block = paged_attention_cli::simulate::block_bytes(
            cfg.cache,
            cfg.kv_heads,
            cfg.head_size,
            cfg.block_size,
            cfg.layers,
        )
        .ok_or("the block size in bytes overflows")?;
        cfg.num_blocks = (mib * (1u64 << 20) as f64 / block as f64) as usize;
        if cfg.num_blocks == 0 {
            return Err(format!(
                "--kv-memory-mib {mib} holds no block of {} bytes",
                block
            ));
        }
    }
    let report = simulate(&cfg);
    print!("{report}");
    if let Some(p) = &a.trace {
        write_trace(p, &report)?;
        println!("wrote {}", p.display());
    }
    if let Some(p) = &a.chart {
        std::fs::write(p, chart::utilization_svg(&report))
            .map_err(|e| format!("{}: {e}", p.display()))?;
        println!("wrote {}", p.display());
    }
    if report.paged.completed == 0 {
        eprintln!("pa simulate: the paged run completed no request (see `dropped` above)");
        return Ok(false);
    }
    Ok(true)
}

/// Both runs' per-step records: CSV (one row per run and step) or, for a `.json` path, a JSON
/// object with the configuration and one array per run.
fn write_trace(path: &Path, r: &SimReport) -> Result<(), String> {
    let runs = [("paged", &r.paged), ("contiguous", &r.contiguous)];
    let json = path.extension().is_some_and(|e| e == "json");
    let text = if json {
        let run = |s: &paged_attention_cli::simulate::SimRun| {
            s.trace
                .iter()
                .map(|t| {
                    serde_json::json!({
                        "step": t.step,
                        "scheduled": t.scheduled,
                        "batched_tokens": t.batched_tokens,
                        "running": t.running,
                        "waiting": t.waiting,
                        "stored_slots": t.stored_slots,
                        "allocated_slots": t.allocated_slots,
                        "pool_slots": t.pool_slots,
                        "utilization": t.utilization(),
                        "occupancy": t.occupancy(),
                        "preemptions": t.preemptions,
                        "completed": t.completed,
                    })
                })
                .collect::<Vec<_>>()
        };
        let c = &r.config;
        let v = serde_json::json!({
            "config": {
                "seed": c.seed,
                "requests": c.num_requests,
                "blocks": c.num_blocks,
                "block_size": c.block_size,
                "max_len": c.max_model_len,
                "prompt": c.prompt.to_string(),
                "output": c.output.to_string(),
                "arrival_rate": c.arrival_rate,
                "cache_type": c.cache.name(),
            },
            "paged": run(&r.paged),
            "contiguous": run(&r.contiguous),
        });
        serde_json::to_string(&v).map_err(|e| e.to_string())?
    } else {
        let mut s = String::from(
            "run,step,scheduled,batched_tokens,running,waiting,stored_slots,allocated_slots,\
             pool_slots,utilization,occupancy,preemptions,completed\n",
        );
        for (name, run) in runs {
            for t in &run.trace {
                let util = t.utilization().map_or(String::new(), |u| format!("{u:.6}"));
                s.push_str(&format!(
                    "{name},{},{},{},{},{},{},{},{},{util},{:.6},{},{}\n",
                    t.step,
                    t.scheduled,
                    t.batched_tokens,
                    t.running,
                    t.waiting,
                    t.stored_slots,
                    t.allocated_slots,
                    t.pool_slots,
                    t.occupancy(),
                    t.preemptions,
                    t.completed
                ));
            }
        }
        s
    };
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))
}
