"""The README's Python example works as written: run from the checkout's root with the extension
built (it loads target/release/libpaged_attention_openvino.so), and its results match the golden files of
models/seed_example (expected values from the float64 reference, see models/README.md)."""
import json
import os
import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def readme_blocks(lang):
    text = (ROOT / "README.md").read_text()
    return re.findall(r"<!-- readme-test: %s -->\n```[a-z]*\n(.*?)```" % lang, text, re.S)


def test_readme_python_example_runs_as_written_and_matches_the_golden_case(monkeypatch):
    blocks = readme_blocks("python")
    assert len(blocks) == 1, "expected one Python example marked in the README"
    lib = ROOT / "target/release/libpaged_attention_openvino.so"
    assert lib.exists(), f"{lib} missing: build with cargo build --release -p paged_attention_openvino"
    monkeypatch.chdir(ROOT)
    ns = {}
    exec(compile(blocks[0], "README.md", "exec"), ns)
    case = ROOT / "models/seed_example"
    tol = json.loads((case / "case.json").read_text())["tolerance"]
    out_ref = np.load(case / "out_0_output.npy")
    scores_ref = np.load(case / "out_1_scores.npy")
    assert np.max(np.abs(ns["output"] - out_ref)) <= tol["output"]
    assert np.max(np.abs(ns["scores"] - scores_ref)) <= tol["scores"]
    # the caches were written in place in the example's own arrays
    mask = np.load(case / "cache_mask.npy")
    key_ref = np.load(case / "cache_key.npy")
    assert np.array_equal(ns["inputs"][3][mask], key_ref[mask])
