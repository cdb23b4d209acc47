"""The OpenVINO extension module as a shipped artifact (libpaged_attention_openvino.so, $PA_EXTENSION_LIB):
linked to OpenVINO by SONAME with no RUNPATH, so it loads only where OpenVINO already is (and says
so elsewhere), and `create_extensions` refuses an OpenVINO release other than the one it was built
against, naming both. Each case runs in a fresh Python process, since a process keeps what it has
loaded. The C library (libpaged_attention.so) must not need OpenVINO at all."""
import os
import subprocess
import sys
from pathlib import Path

import openvino as ov

ROOT = Path(__file__).resolve().parents[2]
EXT_LIB = Path(os.environ.get("PA_EXTENSION_LIB", ROOT / "target/release/libpaged_attention_openvino.so"))
C_LIB = ROOT / "target/release/libpaged_attention.so"
RUNNING = ov.get_version().split("-")[0]


def python(code, **env):
    """Runs `code` in a fresh interpreter (this venv's), without LD_LIBRARY_PATH."""
    e = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    e.update(env)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=e, timeout=120)


def dynamic_section(lib):
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return out


def test_module_links_openvino_by_soname_without_runpath():
    assert EXT_LIB.is_file(), f"{EXT_LIB} missing: cargo build --release -p paged_attention_openvino"
    d = dynamic_section(EXT_LIB)
    assert "RUNPATH" not in d and "RPATH" not in d, d
    assert "[libopenvino.so." in d, d
    assert "Library soname: [libpaged_attention_openvino.so]" in d, d


def test_c_library_needs_no_openvino():
    d = dynamic_section(C_LIB)
    assert "openvino" not in d and "tbb" not in d, d
    assert "Library soname: [libpaged_attention.so.0]" in d, d


def test_module_loads_into_openvino_from_a_copy_elsewhere(tmp_path):
    # Relocatable: a copy in another directory resolves libopenvino against the loaded one.
    copy = tmp_path / "libpaged_attention_openvino.so"
    copy.write_bytes(EXT_LIB.read_bytes())
    r = python(f"import openvino as ov; c = ov.Core(); c.add_extension({str(copy)!r}); "
               f"m = c.read_model({str(ROOT / 'models/seed_example/model.xml')!r}); "
               "print(len(c.compile_model(m, 'CPU').inputs))")
    assert r.returncode == 0 and r.stdout.strip() == "16", r.stderr


def test_dlopen_without_openvino_fails_naming_the_missing_library():
    r = python(f"import ctypes; ctypes.CDLL({str(EXT_LIB)!r})")
    assert r.returncode != 0
    assert "libopenvino.so." in r.stderr and "cannot open shared object file" in r.stderr, r.stderr


def test_other_openvino_release_is_refused_naming_both_versions():
    for other in ["2025.4.1-20000-abc", "2026.4.0"]:
        r = python(f"import openvino as ov; ov.Core().add_extension({str(EXT_LIB)!r})",
                   PA_TEST_OPENVINO_RUNNING_VERSION=other)
        assert r.returncode != 0, f"{other}: loaded without error"
        assert f"built for OpenVINO {RUNNING}" in r.stderr, r.stderr
        assert f"runs OpenVINO {other}" in r.stderr, r.stderr


def test_same_release_with_another_build_suffix_loads():
    r = python(f"import openvino as ov; ov.Core().add_extension({str(EXT_LIB)!r}); print('ok')",
               PA_TEST_OPENVINO_RUNNING_VERSION=f"{RUNNING}-1-other-build")
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
