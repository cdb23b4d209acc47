// Where OpenVINO is, for the build scripts of the crates that link it (the extension module and
// the engine): `include!`d by both, so the search order is written once. Order:
// 1. `$OPENVINO_DIR` or `$OPENVINO_ROOT`: the wheel's `openvino` package directory, its `cmake`
//    directory, or an install root holding `include/` and `libs/`, `lib/` or `runtime/lib/intel64`;
// 2. `<repo>/.venv/lib/python3*/site-packages/openvino` (what `scripts/setup.sh` installs);
// 3. the `openvino` package of `python3` (`$PYTHON` if set).

struct OpenVino {
    include: PathBuf,
    libs: PathBuf,
    /// File name of the core library, e.g. `libopenvino.so.2641` (the wheel has no unversioned one).
    lib_name: String,
    /// `OV_THREAD` as OpenVINO's CMake package defines it (`OV_THREAD_TBB_ADAPTIVE` for the wheel).
    thread: String,
    /// File name of TBB beside the core library (`libtbb.so.12`), when the back end is TBB.
    tbb_name: Option<String>,
}

/// Returns the first location that has OpenVINO's headers and core library, or the list tried.
fn find_openvino(root: &Path) -> Result<OpenVino, String> {
    let mut tried = Vec::new();
    let mut candidates: Vec<(String, PathBuf)> = Vec::new();
    for var in ["OPENVINO_DIR", "OPENVINO_ROOT"] {
        if let Some(v) = env::var_os(var) {
            let p = PathBuf::from(v);
            candidates.push((format!("${var}"), p.clone()));
            // `OpenVINO_DIR`-style: the cmake directory inside the package.
            if let Some(parent) = p.parent() {
                candidates.push((format!("${var}/.."), parent.to_path_buf()));
            }
            // Only the variable is consulted when it is set: a wrong value is an error, not a
            // silent fallback to another installation.
            return pick(&candidates, &mut tried).ok_or_else(|| tried.join("\n"));
        }
    }
    if let Ok(lib) = std::fs::read_dir(root.join(".venv/lib")) {
        let mut pys: Vec<PathBuf> = lib.filter_map(|e| e.ok().map(|e| e.path())).collect();
        pys.sort();
        for py in pys.into_iter().rev() {
            candidates.push(("repo .venv".into(), py.join("site-packages/openvino")));
        }
    } else {
        tried.push(format!(
            "  {}: no such directory",
            root.join(".venv/lib").display()
        ));
    }
    if let Some(ov) = pick(&candidates, &mut tried) {
        return Ok(ov);
    }
    let python = env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let asked = Command::new(&python)
        .args([
            "-c",
            "import os, openvino; print(os.path.dirname(openvino.__file__))",
        ])
        .output();
    match asked {
        Ok(out) if out.status.success() => {
            let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
            if let Some(ov) = pick(
                &[(format!("`{python} -c 'import openvino'`"), dir)],
                &mut tried,
            ) {
                return Ok(ov);
            }
        }
        Ok(out) => tried.push(format!(
            "  `{python} -c 'import openvino'`: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        Err(e) => tried.push(format!("  `{python}`: {e}")),
    }
    Err(tried.join("\n"))
}

fn pick(candidates: &[(String, PathBuf)], tried: &mut Vec<String>) -> Option<OpenVino> {
    for (origin, dir) in candidates {
        let include = dir.join("include");
        if !include.join("openvino/core/op_extension.hpp").is_file() {
            tried.push(format!(
                "  {origin}: {}: no include/openvino/core/op_extension.hpp",
                dir.display()
            ));
            continue;
        }
        if let Some((libs, lib_name)) = runtime_libs(dir) {
            let thread = threading(dir);
            let tbb_name = thread
                .contains("TBB")
                .then(|| versioned(&libs, "libtbb.so"))
                .flatten();
            return Some(OpenVino {
                include,
                libs,
                lib_name,
                thread,
                tbb_name,
            });
        }
        tried.push(format!(
            "  {origin}: {}: no libopenvino.so* in libs/, lib/ or runtime/lib/intel64/",
            dir.display()
        ));
    }
    None
}

/// The directory of OpenVINO's libraries under `dir` (the wheel's `openvino` package, an install
/// root, or the wheel's `cmake` directory), and the core library's file name. `pa` uses this at
/// run time too, to find the libraries `pa-engine` needs.
fn runtime_libs(dir: &Path) -> Option<(PathBuf, String)> {
    let mut roots = vec![dir.to_path_buf()];
    if let Some(parent) = dir.parent() {
        roots.push(parent.to_path_buf());
    }
    roots.iter().find_map(|root| {
        ["libs", "lib", "runtime/lib/intel64"]
            .iter()
            .map(|sub| root.join(sub))
            .find_map(|libs| core_library(&libs).map(|name| (libs, name)))
    })
}

/// `libopenvino.so.<N>` (preferred: that is what the wheel ships) or `libopenvino.so` in `dir`.
fn core_library(dir: &Path) -> Option<String> {
    versioned(dir, "libopenvino.so")
}

/// `<stem>.<N>` (the longest version) or `<stem>` in `dir`.
fn versioned(dir: &Path, stem: &str) -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n == stem
                || n.strip_prefix(stem)
                    .and_then(|v| v.strip_prefix('.'))
                    .is_some_and(|v| v.chars().all(|c| c.is_ascii_digit() || c == '.'))
        })
        .collect();
    names.sort_by_key(|n| (n.len(), n.clone()));
    names.pop()
}

/// The `OV_THREAD=...` definition of OpenVINO's CMake targets under `dir` (the wheel's
/// `cmake/OpenVINOTargets.cmake`), else the wheel's value.
fn threading(dir: &Path) -> String {
    let targets = std::fs::read_to_string(dir.join("cmake/OpenVINOTargets.cmake"))
        .or_else(|_| std::fs::read_to_string(dir.join("runtime/cmake/OpenVINOTargets.cmake")))
        .unwrap_or_default();
    targets
        .split("OV_THREAD=")
        .nth(1)
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|v| v.starts_with("OV_THREAD_"))
        .unwrap_or_else(|| "OV_THREAD_TBB_ADAPTIVE".into())
}
