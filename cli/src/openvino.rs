//! Where OpenVINO's libraries are at run time. `pa-engine` links `libopenvino.so.<N>` with no
//! RUNPATH (a path into a build or a virtual environment would not survive an install), so `pa`
//! finds OpenVINO where the user has it and runs the engine with `LD_LIBRARY_PATH` pointing
//! there. The first of these wins:
//!
//! 1. `$OpenVINO_DIR`, `$OPENVINO_DIR` or `$INTEL_OPENVINO_DIR`: the wheel's `openvino` package or
//!    its `cmake` directory, or an install root (`libs/`, `lib/` or `runtime/lib/intel64/`). A
//!    variable that is set and holds no library is an error, not a fall-back;
//! 2. the `openvino` package of the active Python: `$PYTHON`, `$VIRTUAL_ENV/bin/python`, then
//!    `python3` on `PATH` (`python -c 'import openvino'`);
//! 3. a directory of `$LD_LIBRARY_PATH` that holds `libopenvino.so.*` (OpenVINO's `setupvars.sh`);
//! 4. the system's libraries (`ldconfig -p`), which the loader finds with no help.
//!
//! The directory search is the build scripts' (`openvino/locate.rs`), written once.

use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

#[allow(dead_code)]
mod locate {
    use super::*;
    include!("../../openvino/locate.rs");
    pub(super) fn libs_under(dir: &Path) -> Option<(PathBuf, String)> {
        runtime_libs(dir)
    }
    pub(super) fn core_library_in(dir: &Path) -> Option<String> {
        core_library(dir)
    }
}

/// The OpenVINO `pa` found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OpenVino {
    /// The directory holding the core library.
    pub libs: PathBuf,
    /// Its file name, e.g. `libopenvino.so.2641`.
    pub lib_name: String,
    /// How it was found (the variable, the Python, `ldconfig`).
    pub origin: String,
    /// The loader finds it without `LD_LIBRARY_PATH` (the system's libraries).
    pub system: bool,
}

impl OpenVino {
    /// The release, from the library's version suffix: `libopenvino.so.2641` is 2026.4.1
    /// (OpenVINO's SOVERSION is the year's last two digits, the minor and the patch release).
    pub fn version(&self) -> Option<String> {
        let v = self.lib_name.strip_prefix("libopenvino.so.")?;
        let b = v.as_bytes();
        (b.len() == 4 && b.iter().all(u8::is_ascii_digit))
            .then(|| format!("20{}.{}.{}", &v[..2], &v[2..3], &v[3..]))
    }

    /// The environment the engine runs with: `LD_LIBRARY_PATH` with the libraries first (none
    /// added for the system's).
    pub fn library_path(&self) -> Option<std::ffi::OsString> {
        if self.system {
            return None;
        }
        let mut dirs = vec![self.libs.clone()];
        if let Some(old) = env::var_os("LD_LIBRARY_PATH") {
            dirs.extend(env::split_paths(&old).filter(|d| d != &self.libs));
        }
        env::join_paths(dirs).ok()
    }
}

impl std::fmt::Display for OpenVino {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "OpenVINO {} ({}) in {}, found through {}",
            self.version().as_deref().unwrap_or("(version unknown)"),
            self.lib_name,
            self.libs.display(),
            self.origin
        )
    }
}

/// Finds OpenVINO (module docs), or says where it looked.
pub fn find() -> Result<OpenVino, String> {
    let found = |libs: PathBuf, lib_name: String, origin: String| OpenVino {
        libs,
        lib_name,
        origin,
        system: false,
    };
    for var in ["OpenVINO_DIR", "OPENVINO_DIR", "INTEL_OPENVINO_DIR"] {
        if let Some(dir) = env::var_os(var).filter(|v| !v.is_empty()) {
            let dir = PathBuf::from(dir);
            return locate::libs_under(&dir)
                .map(|(libs, name)| found(libs, name, format!("${var}")))
                .ok_or_else(|| {
                    format!(
                        "${var} is {}, which holds no libopenvino.so* (in libs/, lib/ or \
                         runtime/lib/intel64/, or beside its cmake/ directory)",
                        dir.display()
                    )
                });
        }
    }
    let mut tried = Vec::new();
    let mut pythons: Vec<PathBuf> = Vec::new();
    if let Some(p) = env::var_os("PYTHON").filter(|v| !v.is_empty()) {
        pythons.push(p.into());
    }
    if let Some(v) = env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        pythons.push(Path::new(&v).join("bin/python"));
    }
    pythons.push("python3".into());
    for py in &pythons {
        match python_openvino(py) {
            Ok(dir) => match locate::libs_under(&dir) {
                Some((libs, name)) => {
                    return Ok(found(
                        libs,
                        name,
                        format!("the Python package of `{}`", py.display()),
                    ))
                }
                None => tried.push(format!(
                    "`{}`: its openvino package ({}) holds no libopenvino.so*",
                    py.display(),
                    dir.display()
                )),
            },
            Err(e) => tried.push(format!("`{}`: {e}", py.display())),
        }
    }
    if let Some(path) = env::var_os("LD_LIBRARY_PATH") {
        for dir in env::split_paths(&path) {
            if let Some(name) = locate::core_library_in(&dir) {
                return Ok(found(dir, name, "$LD_LIBRARY_PATH".into()));
            }
        }
        tried.push("$LD_LIBRARY_PATH: no libopenvino.so* in its directories".into());
    }
    match system_library() {
        Some((libs, lib_name)) => Ok(OpenVino {
            libs,
            lib_name,
            origin: "the system's libraries (ldconfig)".into(),
            system: true,
        }),
        None => {
            tried.push("the system's libraries (ldconfig -p): no libopenvino.so*".into());
            Err(format!(
                "OpenVINO not found. Tried:\n  {}\nInstall it (`pip install openvino==2026.4.1` in \
                 the active environment), or set OpenVINO_DIR to its directory.",
                tried.join("\n  ")
            ))
        }
    }
}

/// The directory of the `openvino` package `python` imports.
fn python_openvino(python: &Path) -> Result<PathBuf, String> {
    // From `/`: Python puts the working directory on its path, and a directory named `openvino`
    // there (this repository's extension crate) would shadow the package.
    let out = Command::new(python)
        .current_dir("/")
        .args([
            "-c",
            "import os, openvino; print(os.path.dirname(openvino.__file__))",
        ])
        .output()
        .map_err(|e| e.to_string())?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(err.lines().last().unwrap_or("failed").trim().to_string());
    }
    Ok(PathBuf::from(String::from_utf8_lossy(&out.stdout).trim()))
}

/// `libopenvino.so.<N>` in the loader's cache, and its directory.
fn system_library() -> Option<(PathBuf, String)> {
    let out = Command::new("ldconfig")
        .arg("-p")
        .output()
        .or_else(|_| Command::new("/sbin/ldconfig").arg("-p").output())
        .ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        // "\tlibopenvino.so.2541 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libopenvino.so.2541"
        let (name, path) = l.trim().split_once(" => ")?;
        let name = name.split_whitespace().next()?;
        let rest = name.strip_prefix("libopenvino.so.")?;
        (!rest.is_empty() && rest.bytes().all(|c| c.is_ascii_digit() || c == b'.')).then(|| {
            let dir = Path::new(path)
                .parent()
                .unwrap_or(Path::new("/"))
                .to_path_buf();
            (dir, name.to_string())
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(lib_name: &str) -> OpenVino {
        OpenVino {
            libs: "/x".into(),
            lib_name: lib_name.into(),
            origin: "test".into(),
            system: false,
        }
    }

    #[test]
    fn the_release_is_read_from_the_soversion() {
        assert_eq!(
            at("libopenvino.so.2641").version().as_deref(),
            Some("2026.4.1")
        );
        assert_eq!(
            at("libopenvino.so.2530").version().as_deref(),
            Some("2025.3.0")
        );
        assert_eq!(at("libopenvino.so").version(), None);
    }

    #[test]
    fn a_wheel_directory_and_its_cmake_directory_give_its_libs() {
        let root = env::temp_dir().join(format!("pa-ov-find-{}", std::process::id()));
        let libs = root.join("openvino/libs");
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::create_dir_all(root.join("openvino/cmake")).unwrap();
        std::fs::write(libs.join("libopenvino.so.2641"), b"").unwrap();
        for dir in [root.join("openvino"), root.join("openvino/cmake")] {
            let (found, name) = locate::libs_under(&dir).expect("found");
            assert_eq!(
                (found, name.as_str()),
                (libs.clone(), "libopenvino.so.2641"),
                "{dir:?}"
            );
        }
        assert_eq!(locate::libs_under(&root), None);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
