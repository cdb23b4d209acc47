//! One golden case directory (`models/<case>/`, format in `models/README.md`): its description,
//! its inputs, a run through our executor or through OpenVINO (`tools/ov_run_case.py`, a Python
//! process this binary starts: never the library, which OpenVINO loads), and the comparison with
//! the expected outputs and caches.
//!
//! `pa conformance` and tests/conformance.rs run it.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::ir::{Model, OwnedTensor};
use crate::npy::{read_npy, NpyArray};
use paged_attention::op::contract::{KEY_CACHE, VALUE_CACHE};

/// The four compared tensors, in table order.
pub const COMPARED: [&str; 4] = ["output", "scores", "cache_key", "cache_value"];
/// The files holding them (expected values, and what a run writes).
pub const FILES: [&str; 4] = [
    "out_0_output.npy",
    "out_1_scores.npy",
    "cache_key.npy",
    "cache_value.npy",
];

/// A case's description from `case.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct Case {
    pub dir: PathBuf,
    pub name: String,
    pub features: Vec<String>,
    /// Where the expected values come from (`openvino-builtin`, `float64-reference`).
    pub truth: String,
    /// Absolute tolerance per compared tensor, in [`COMPARED`] order.
    pub tol: [f64; 4],
}

/// A tensor reduced to what comparison needs.
#[derive(Clone, Debug, PartialEq)]
pub struct Values {
    pub shape: Vec<usize>,
    pub data: Vec<f64>,
}

impl From<&OwnedTensor> for Values {
    fn from(t: &OwnedTensor) -> Values {
        Values {
            shape: t.shape().to_vec(),
            data: t.to_f64_vec(),
        }
    }
}

impl From<&NpyArray> for Values {
    fn from(a: &NpyArray) -> Values {
        Values {
            shape: a.shape.clone(),
            data: a.to_f64(),
        }
    }
}

/// What one path produced: the tensors in [`COMPARED`] order (`None`: not available, with the
/// reason in `note`), and the time of the call itself.
#[derive(Clone, Debug, PartialEq)]
pub struct Actual {
    pub values: [Option<Values>; 4],
    pub time: Duration,
    pub note: Option<String>,
}

/// The comparison of one path with the expected values.
#[derive(Clone, Debug, PartialEq)]
pub struct Verdict {
    /// Max abs error per compared tensor (`None`: not compared; infinite for a shape mismatch
    /// or a NaN).
    pub max_err: [Option<f64>; 4],
    pub pass: bool,
    /// Why it failed, or what was not compared.
    pub notes: Vec<String>,
}

/// `dir` itself if it holds a `case.json` (one case), else its subdirectories holding one,
/// sorted by name.
pub fn find_cases(dir: &Path) -> Result<Vec<PathBuf>, String> {
    if dir.join("case.json").is_file() {
        return Ok(vec![dir.to_path_buf()]);
    }
    let rd = std::fs::read_dir(dir).map_err(|e| format!("cannot list {}: {e}", dir.display()))?;
    let mut v: Vec<PathBuf> = rd
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("case.json").is_file())
        .collect();
    v.sort();
    Ok(v)
}

/// What `pa` reads of `case.json` (other keys are the generator's notes and are ignored).
#[derive(Deserialize)]
struct CaseFile {
    name: Option<String>,
    #[serde(default)]
    features: Vec<String>,
    truth: Option<String>,
    tolerance: Tolerance,
}

/// Field names in [`COMPARED`] order.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Tolerance {
    output: f64,
    scores: f64,
    cache_key: f64,
    cache_value: f64,
}

/// What `tools/ov_run_case.py` writes beside its results.
#[derive(Deserialize)]
struct OvInfo {
    #[serde(default = "yes")]
    caches_in_place: bool,
    #[serde(default)]
    infer_ms: f64,
    #[serde(default)]
    note: Option<String>,
}

fn yes() -> bool {
    true
}

impl Case {
    pub fn load(dir: &Path) -> Result<Case, String> {
        let path = dir.join("case.json");
        let text = std::fs::read_to_string(&path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let j: CaseFile =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let t = &j.tolerance;
        let tol = [t.output, t.scores, t.cache_key, t.cache_value];
        for (k, name) in COMPARED.iter().enumerate() {
            // JSON has no NaN or infinity, so a negative number is the only bad value.
            if tol[k] < 0.0 {
                return Err(format!(
                    "{}: `tolerance.{name}` must be a non-negative number, got {}",
                    path.display(),
                    tol[k]
                ));
            }
        }
        let dir_name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        Ok(Case {
            dir: dir.to_path_buf(),
            name: j.name.unwrap_or(dir_name),
            features: j.features,
            truth: j.truth.unwrap_or_else(|| "?".into()),
            tol,
        })
    }

    /// The model's inputs from the `in_<i>_<name>.npy` files: file `i` goes to the Parameter
    /// feeding PagedAttention input `i` (directly or through a Convert), else to the Parameter
    /// called `name`.
    pub fn inputs(&self, model: &Model) -> Result<HashMap<String, OwnedTensor>, String> {
        let rd = std::fs::read_dir(&self.dir)
            .map_err(|e| format!("cannot list {}: {e}", self.dir.display()))?;
        let mut files: Vec<PathBuf> = rd.filter_map(|e| e.ok().map(|e| e.path())).collect();
        files.sort();
        let mut out = HashMap::new();
        let mut source: HashMap<String, PathBuf> = HashMap::new();
        for f in files {
            let Some(stem) = f
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("in_"))
                .and_then(|n| n.strip_suffix(".npy"))
            else {
                continue;
            };
            let (idx, name) = stem.split_once('_').unwrap_or((stem, ""));
            let idx: Option<usize> = idx.parse().ok();
            let param = model
                .parameters()
                .iter()
                .find(|p| p.feeds.iter().any(|f| Some(f.input) == idx))
                .or_else(|| model.parameters().iter().find(|p| p.name == name))
                .ok_or_else(|| {
                    format!("{}: no Parameter feeds input {stem} of the op", f.display())
                })?;
            let t = read_npy(&f)?
                .into_tensor()
                .map_err(|e| format!("{}: {e}", f.display()))?;
            // Two files for one Parameter (`in_0_query.npy` and `in_0_query_extra.npy`) would
            // let sort order pick the data: refuse instead.
            if let Some(prev) = source.insert(param.name.clone(), f.clone()) {
                return Err(format!(
                    "{} and {} both give Parameter `{}`: keep one",
                    prev.display(),
                    f.display(),
                    param.name
                ));
            }
            out.insert(param.name.clone(), t);
        }
        Ok(out)
    }

    /// Runs the case through our executor.
    pub fn run_ours(&self) -> Result<Actual, String> {
        let model = Model::load(self.dir.join("model.xml")).map_err(|e| e.to_string())?;
        let mut inputs = self.inputs(&model)?;
        let t0 = Instant::now();
        let out = model.run(&mut inputs).map_err(|e| e.to_string())?;
        let time = t0.elapsed();
        let pick = |t: Option<&OwnedTensor>| t.map(Values::from);
        Ok(Actual {
            values: [
                pick(out.pa_output(0)),
                pick(out.pa_output(1)),
                pick(out.cache(KEY_CACHE, &inputs)),
                pick(out.cache(VALUE_CACHE, &inputs)),
            ],
            time,
            note: None,
        })
    }

    /// Compares a run with the expected files.
    pub fn compare(&self, actual: &Actual) -> Result<Verdict, String> {
        let read = |f: &str| read_npy(&self.dir.join(f));
        let mask = read("cache_mask.npy")?;
        let mask_bits = mask.to_mask().map_err(|e| format!("cache_mask.npy: {e}"))?;
        let mut v = Verdict {
            max_err: [None; 4],
            pass: true,
            notes: Vec::new(),
        };
        for k in 0..4 {
            let expected = Values::from(&read(FILES[k])?);
            let Some(got) = &actual.values[k] else {
                v.notes.push(format!(
                    "{}: not compared ({})",
                    COMPARED[k],
                    actual.note.as_deref().unwrap_or("not produced")
                ));
                if k < 2 {
                    v.pass = false;
                }
                continue;
            };
            let err = if k < 2 {
                max_abs_err(got, &expected, None)
            } else {
                max_abs_err(got, &expected, Some((&mask.shape, &mask_bits)))
            };
            let err = match err {
                Ok(e) => e,
                Err(msg) => {
                    v.notes.push(format!("{}: {msg}", COMPARED[k]));
                    f64::INFINITY
                }
            };
            if err.is_nan() || err > self.tol[k] {
                v.pass = false;
                if err.is_finite() {
                    v.notes.push(format!(
                        "{}: max abs error {err:.3e} > tolerance {:.3e}",
                        COMPARED[k], self.tol[k]
                    ));
                }
            }
            v.max_err[k] = Some(err);
        }
        Ok(v)
    }
}

/// Max |got - expected| over all elements, or over the cache slots `mask` (`[NB, Hkv, BS]`,
/// broadcast over the last dimension) selects. NaN anywhere compared counts as infinite.
pub fn max_abs_err(
    got: &Values,
    expected: &Values,
    mask: Option<(&Vec<usize>, &Vec<bool>)>,
) -> Result<f64, String> {
    if got.shape != expected.shape {
        return Err(format!(
            "shape {:?}, expected {:?}",
            got.shape, expected.shape
        ));
    }
    let mut worst = 0.0f64;
    let mut take = |a: f64, b: f64| {
        let d = (a - b).abs();
        worst = if d.is_nan() {
            f64::INFINITY
        } else {
            worst.max(d)
        };
    };
    match mask {
        None => {
            for (a, b) in got.data.iter().zip(&expected.data) {
                take(*a, *b);
            }
        }
        Some((mshape, bits)) => {
            let rank = expected.shape.len();
            let rows = u8_key_rows(mshape, bits, &expected.shape);
            let (mshape, bits) = match &rows {
                Some((s, b)) => (s, b),
                None => (mshape, bits),
            };
            if rank == 0 || mshape[..] != expected.shape[..rank - 1] {
                return Err(format!(
                    "cache_mask shape {mshape:?} does not match the cache shape {:?} without its last dimension",
                    expected.shape
                ));
            }
            let d = expected.shape[rank - 1];
            for (slot, &on) in bits.iter().enumerate() {
                if on {
                    let r = slot * d..(slot + 1) * d;
                    for (a, b) in got.data[r.clone()].iter().zip(&expected.data[r]) {
                        take(*a, *b);
                    }
                }
            }
        }
    }
    Ok(worst)
}

/// A u8 key cache quantized by channel is `[NB, Hkv, BS + 8, D]`: per (block, head), 8 rows of
/// per-channel scales and zero points, then the BS token rows. Its row mask from the slot mask
/// `[NB, Hkv, BS]`: a token row as its slot, the parameter rows when any slot of the block is
/// compared. `None` for any other shape.
fn u8_key_rows(
    mshape: &[usize],
    bits: &[bool],
    shape: &[usize],
) -> Option<(Vec<usize>, Vec<bool>)> {
    let [nb, hkv, bs] = *mshape else { return None };
    if bs == 0 || shape.len() != 4 || shape[..2] != [nb, hkv] || shape[2] != bs + 8 {
        return None;
    }
    let mut rows = Vec::with_capacity(nb * hkv * (bs + 8));
    for slots in bits.chunks(bs) {
        rows.extend(std::iter::repeat_n(slots.iter().any(|&b| b), 8));
        rows.extend_from_slice(slots);
    }
    Some((vec![nb, hkv, bs + 8], rows))
}

/// How to run cases through OpenVINO: the venv's Python, the helper script and our extension.
#[derive(Clone, Debug, PartialEq)]
pub struct OvEnv {
    pub python: PathBuf,
    pub script: PathBuf,
    pub extension: PathBuf,
}

/// The OpenVINO extension module built in the checkout at `root`: the one place that names
/// the file.
pub fn extension_path(root: &Path) -> PathBuf {
    root.join("target/release/libpaged_attention_openvino.so")
}

impl OvEnv {
    /// Finds the Python (`python`, else `$PA_PYTHON`, else `root/.venv/bin/python`; it must
    /// import openvino and numpy), `root/tools/ov_run_case.py` and the extension (`extension`,
    /// else `$PA_EXTENSION_LIB`, else [`extension_path`]). `Err` says what is missing.
    pub fn detect(
        root: &Path,
        python: Option<PathBuf>,
        extension: Option<PathBuf>,
    ) -> Result<OvEnv, String> {
        let python = python
            .or_else(|| std::env::var_os("PA_PYTHON").map(PathBuf::from))
            .unwrap_or_else(|| root.join(".venv/bin/python"));
        let script = root.join("tools/ov_run_case.py");
        let extension = extension
            .or_else(|| std::env::var_os("PA_EXTENSION_LIB").map(PathBuf::from))
            .unwrap_or_else(|| extension_path(root));
        if !python.is_file() {
            return Err(format!("no {} (run scripts/setup.sh)", python.display()));
        }
        if !script.is_file() {
            return Err(format!("no {}", script.display()));
        }
        if !extension.is_file() {
            return Err(format!(
                "no {} (cargo build --release -p paged_attention_openvino)",
                extension.display()
            ));
        }
        let ok = std::process::Command::new(&python)
            .args(["-c", "import openvino, numpy"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            return Err(format!(
                "{} cannot import openvino and numpy",
                python.display()
            ));
        }
        Ok(OvEnv {
            python,
            script,
            extension,
        })
    }

    /// Runs every case through OpenVINO in one Python process (its progress goes to stderr),
    /// then reads what it wrote. One result per case, in order.
    pub fn run(&self, cases: &[Case]) -> Vec<Result<Actual, String>> {
        let out = std::env::temp_dir().join(format!("pa-conformance-ov-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        let status = std::process::Command::new(&self.python)
            .arg(&self.script)
            .arg("--ext")
            .arg(&self.extension)
            .arg("--out")
            .arg(&out)
            .args(cases.iter().map(|c| &c.dir))
            .status();
        let results = match status {
            Ok(s) if s.success() => cases
                .iter()
                .map(|c| read_ov_result(&out.join(c.dir.file_name().unwrap_or_default())))
                .collect(),
            Ok(s) => vec![Err(format!("{} exited with {s}", self.script.display())); cases.len()],
            Err(e) => {
                vec![Err(format!("cannot start {}: {e}", self.python.display())); cases.len()]
            }
        };
        let _ = std::fs::remove_dir_all(&out);
        results
    }
}

fn read_ov_result(dir: &Path) -> Result<Actual, String> {
    if let Ok(e) = std::fs::read_to_string(dir.join("error.txt")) {
        let last = e.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or("");
        return Err(format!("OpenVINO: {}", last.trim()));
    }
    let info = std::fs::read_to_string(dir.join("info.json"))
        .map_err(|e| format!("no info.json from the OpenVINO run: {e}"))?;
    let info: OvInfo =
        serde_json::from_str(&info).map_err(|e| format!("info.json from the OpenVINO run: {e}"))?;
    let (in_place, ms) = (info.caches_in_place, info.infer_ms);
    let mut values: [Option<Values>; 4] = [None, None, None, None];
    for k in 0..4 {
        if k >= 2 && !in_place {
            continue;
        }
        values[k] = Some(Values::from(&read_npy(&dir.join(FILES[k]))?));
    }
    Ok(Actual {
        values,
        time: Duration::from_secs_f64(ms.max(0.0) / 1e3),
        note: info.note.filter(|s| !s.is_empty()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A by-channel u8 key cache `[1, 2, 2 + 8, 1]` under a slot mask `[1, 2, 2]` where head 0
    /// holds slot 0 only and head 1 nothing: a changed parameter byte or held row of head 0
    /// counts, a changed free row of head 0 or any byte of head 1 does not.
    #[test]
    fn u8_key_cache_parameter_rows_follow_their_block() {
        let (mshape, bits) = (vec![1, 2, 2], vec![true, false, false, false]);
        let shape = vec![1, 2, 10, 1];
        let base = Values {
            shape: shape.clone(),
            data: vec![0.0; 20],
        };
        let err = |at: usize| {
            let mut got = base.clone();
            got.data[at] = 1.0;
            max_abs_err(&got, &base, Some((&mshape, &bits))).unwrap()
        };
        assert_eq!(err(3), 1.0, "head 0 parameter row");
        assert_eq!(err(8), 1.0, "head 0 slot 0");
        assert_eq!(err(9), 0.0, "head 0 free slot 1");
        assert_eq!(err(10 + 3), 0.0, "head 1 parameters (no slot held)");
        let float = Values {
            shape: vec![1, 2, 2, 1],
            data: vec![0.0; 4],
        };
        assert_eq!(max_abs_err(&float, &float, Some((&mshape, &bits))), Ok(0.0));
        let wrong = Values {
            shape: vec![1, 2, 9, 1],
            data: vec![0.0; 18],
        };
        assert!(max_abs_err(&wrong, &wrong, Some((&mshape, &bits))).is_err());
    }
}
