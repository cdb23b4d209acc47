"""scripts/install.sh as a C/C++ user runs it: the README's install command and its build command for
the C example, run as written (HOME pointed at a temporary directory, so the prefix is
$HOME/.local), then the installed tree moved elsewhere and used from there by pkg-config and by a
CMake project with find_package(PagedAttention), linked both shared and static. Every program runs
with LD_LIBRARY_PATH unset. Checks the installed files: SONAME, symlinks, no OpenVINO dependency
of the C library, debug info stripped."""
import os
import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def readme_block(kind, label):
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"<!-- readme-test: %s \((.*?)\) -->\n```[a-z]*\n(.*?)```" % kind, text, re.S)
    blocks = [body for lab, body in found if lab == label]
    assert len(blocks) == 1, f"expected one README block marked '{kind} ({label})', found {len(blocks)}"
    return blocks[0]


def readme_c_example():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- readme-test: c -->\n```c\n(.*?)```", text, re.S)
    assert blocks, "no C example marked in the README"
    return blocks[0]  # the op's example, the one the build command names example.c


def env_for(home):
    """The test's environment with HOME moved (cargo and rustup keep their real homes)."""
    e = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PKG_CONFIG_PATH")}
    real_home = Path(os.environ["HOME"])
    e.setdefault("CARGO_HOME", str(real_home / ".cargo"))
    e.setdefault("RUSTUP_HOME", str(real_home / ".rustup"))
    e["HOME"] = str(home)
    return e


def sh(script, cwd, env):
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=1800)
    assert r.returncode == 0, f"{script}\nfailed ({r.returncode}):\n{r.stdout}\n{r.stderr}"
    return r.stdout


def readelf(*args):
    return subprocess.run(["readelf", *args], capture_output=True, text=True, check=True).stdout


def cmake_exe():
    venv = ROOT / ".venv/bin/cmake"
    exe = str(venv) if venv.is_file() else shutil.which("cmake")
    assert exe, "cmake not found (scripts/setup.sh installs it into .venv)"
    return exe


CMAKE_PROJECT = """cmake_minimum_required(VERSION 3.16)
project(pa_consumer C)
set(PA_WANT 0.1 CACHE STRING "version asked of find_package")
find_package(PagedAttention ${PA_WANT} REQUIRED)
add_executable(app example.c)
target_link_libraries(app PRIVATE PagedAttention::paged_attention)
add_executable(app_static example.c)
target_link_libraries(app_static PRIVATE PagedAttention::paged_attention_static)
"""


def test_install_then_pkg_config_and_cmake_consumers(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    env = env_for(home)
    sh(readme_block("sh", "install"), ROOT, env)
    prefix = home / ".local"
    lib = prefix / "lib"

    # The installed files.
    so = lib / "libpaged_attention.so.0.1.0"
    assert os.readlink(lib / "libpaged_attention.so.0") == so.name
    assert os.readlink(lib / "libpaged_attention.so") == "libpaged_attention.so.0"
    d = readelf("-d", str(so))
    assert "Library soname: [libpaged_attention.so.0]" in d, d
    assert "openvino" not in d and "tbb" not in d and "RUNPATH" not in d, d
    assert ".debug_info" not in readelf("-S", str(so)), "debug info not stripped"
    assert so.stat().st_size < 6 << 20, so.stat().st_size
    assert (lib / "libpaged_attention.a").is_file()
    for h in ["paged_attention.h", "paged_attention_cache.h"]:
        assert (prefix / "include" / h).read_bytes() == (ROOT / "include" / h).read_bytes()
    ext = lib / "libpaged_attention_openvino.so"
    assert ext.is_file(), "the OpenVINO extension was not installed (it builds here: .venv has OpenVINO)"
    assert "RUNPATH" not in readelf("-d", str(ext))

    # The README's build command, as written, in a directory holding example.c.
    work = tmp_path / "work"
    work.mkdir()
    (work / "example.c").write_text(readme_c_example())
    out = sh(readme_block("sh", "builds example.c against the install"), work, env)
    assert out.startswith("output[0..4] = "), out
    assert "NEEDED" in readelf("-d", str(work / "example"))

    # Relocatable: move the prefix; pkg-config and CMake find the new place.
    moved = tmp_path / "moved"
    prefix.rename(moved)
    env["PKG_CONFIG_PATH"] = str(moved / "lib/pkgconfig")
    flags = sh("pkg-config --cflags --libs paged_attention", work, env)
    assert str(moved) in flags and str(prefix) not in flags, flags
    assert sh("pkg-config --modversion paged_attention", work, env).strip() == "0.1.0"

    proj = tmp_path / "cmake_project"
    proj.mkdir()
    (proj / "CMakeLists.txt").write_text(CMAKE_PROJECT)
    (proj / "example.c").write_text(readme_c_example())
    cmake = cmake_exe()
    build = proj / "build"
    sh(f"'{cmake}' -S . -B build -DCMAKE_PREFIX_PATH='{moved}' -DCMAKE_BUILD_TYPE=Release "
       f"&& '{cmake}' --build build", proj, env)
    for exe in ["app", "app_static"]:
        out = sh(f"./build/{exe}", proj, env)
        assert out.startswith("output[0..4] = "), (exe, out)
    needed = readelf("-d", str(build / "app"))
    assert "[libpaged_attention.so.0]" in needed and str(moved / "lib") in needed, needed
    assert "paged_attention" not in readelf("-d", str(build / "app_static"))

    # The version file refuses another major version.
    r = subprocess.run([cmake, "-S", ".", "-B", "build2", f"-DCMAKE_PREFIX_PATH={moved}", "-DPA_WANT=1.0"],
                       cwd=proj, env=env, capture_output=True, text=True)
    assert r.returncode != 0 and "0.1.0" in r.stderr, r.stderr
