"""The Python package as a user gets it: the wheel built from this repository (pyproject.toml,
setup.py: setuptools-rust compiles both libraries) installed with pip into a fresh venv, then the
README's package example run with that venv's Python, with nothing of the checkout on its
import or library path. Expected values: the golden files of models/seed_example (float64
reference, see models/README.md)."""
import json
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def readme_block(tag):
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"<!-- readme-test: %s -->\n```[a-z]*\n(.*?)```" % tag, text, re.S)
    assert len(blocks) == 1, f"expected one block marked readme-test: {tag} in the README"
    return blocks[0]


def clean_env():
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PA_EXTENSION_LIB", "PA_LIBRARY", "LD_LIBRARY_PATH", "VIRTUAL_ENV")}
    return env


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    dist = tmp / "dist"
    # The README's build command (pip of the project's venv, which scripts/setup.sh gives
    # setuptools-rust).
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--disable-pip-version-check", "-q", "-w", str(dist), "."],
                   check=True, cwd=ROOT, env=clean_env())
    wheels = list(dist.glob("paged_attention-0.1.0-*.whl"))
    assert len(wheels) == 1, wheels
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    str(wheels[0])], check=True, env=clean_env())
    return py, wheels[0]


def test_wheel_holds_both_libraries_and_pins_openvino(installed):
    _, whl = installed
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        meta = next(z.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    libs = [n for n in names if n.startswith("paged_attention/") and n.endswith(".so")]
    assert any("libpaged_attention_openvino" in n for n in libs), libs
    assert any("libpaged_attention" in n and "openvino" not in n for n in libs), libs
    assert "paged_attention/ir.py" in names
    assert "Requires-Dist: openvino==2026.4.1" in meta


def test_readme_package_example_runs_from_the_installed_wheel(installed, tmp_path):
    py, _ = installed
    case = ROOT / "models/seed_example"
    tol = json.loads((case / "case.json").read_text())["tolerance"]
    check = f"""
import numpy as np, paged_attention as pa
from pathlib import Path
site = Path(pa.__file__).resolve().parent
assert Path(pa.extension_path()).resolve().parent == site, pa.extension_path()
assert Path(pa.library_path()).resolve().parent == site, pa.library_path()
case = Path({str(case)!r})
assert np.max(np.abs(output - np.load(case / "out_0_output.npy"))) <= {tol["output"]!r}
assert np.max(np.abs(scores - np.load(case / "out_1_scores.npy"))) <= {tol["scores"]!r}
# the same call through the numpy binding of the C library (fresh caches from the files)
fresh = [np.load(case / f"in_{{i}}_{{n}}.npy") for i, n in enumerate(pa.INPUT_NAMES[:16])]
o, s = pa.execute(fresh)
assert np.max(np.abs(o - np.load(case / "out_0_output.npy"))) <= {tol["output"]!r}
mask = np.load(case / "cache_mask.npy")
assert np.array_equal(fresh[3][mask], np.load(case / "cache_key.npy")[mask])
bad = list(fresh); bad[7] = np.array([99], dtype=np.int32)
try:
    pa.execute(bad)
    raise SystemExit("a bad call was accepted")
except pa.PaError as e:
    assert e.status.startswith("PA_STATUS_"), e
print("package ok")
"""
    # Run from the repository root, as the README says, with the venv's Python: `import
    # paged_attention` must resolve to the installed wheel (python/ is not on the path).
    r = subprocess.run([str(py), "-c", readme_block("python-package") + check], cwd=ROOT,
                       env=clean_env(), capture_output=True, text=True)
    assert r.returncode == 0 and "package ok" in r.stdout, r.stdout + r.stderr
