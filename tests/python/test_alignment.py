"""Inputs read by value are accepted at any address inside OpenVINO: a Constant's data comes
straight from the mapped weights file, at whatever byte offset the serializer put it. The golden
cases whose inputs are Constants are rewritten with every Constant one, two and three bytes off
its place in the .bin, and must pass through OpenVINO with the extension (and our executor)
against their expected files, as the original cases do."""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CASES = ["const_inputs", "const_rotation_f16_convert"]


def shifted(case: Path, out: Path, by: int) -> Path:
    shutil.copytree(case, out)
    xml = (out / "model.xml").read_text()
    xml, n = re.subn(r'offset="(\d+)"', lambda m: f'offset="{int(m.group(1)) + by}"', xml)
    assert n > 0, "the case has Constants with data"
    (out / "model.xml").write_text(xml)
    (out / "model.bin").write_bytes(b"\0" * by + (case / "model.bin").read_bytes())
    return out


@pytest.mark.parametrize("by", [1, 2, 3])
def test_constants_at_odd_offsets_run_and_match(tmp_path, by):
    for c in CASES:
        shifted(ROOT / "models" / c, tmp_path / "cases" / c, by)
    r = subprocess.run([str(ROOT / "target/release/pa"), "conformance", "--require-openvino",
                        str(tmp_path / "cases")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(CASES)} passed, 0 failed" in r.stdout
