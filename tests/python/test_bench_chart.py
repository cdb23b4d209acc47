"""tools/bench.py --chart: the chart of benchmark rows (matplotlib), as SVG and PNG, from rows in
the shape `--json` writes. Runs no benchmark."""
import json
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import bench

ROOT = Path(__file__).resolve().parents[2]


def rows():
    out = []
    for n in (1, 2):
        for key, label in (("decode16", "decode 16 x 1024 past"), ("prefill", "prefill 1 x 1024")):
            for cache in ("f16", "u8"):
                ext = 1.0 + n + len(cache)
                out.append(dict(workload=label, key=key, cache=cache, threads=n, ext_min=ext,
                                ours_min=ext * 0.9, ov_min=ext * 2.5, ratio=2.5))
    return out


def test_svg_chart_has_a_panel_per_thread_count_and_a_bar_per_path(tmp_path):
    path = tmp_path / "bench.svg"
    bench.write_chart(rows(), str(path))
    root = ET.parse(path).getroot()
    assert root.tag.endswith("svg")
    text = " ".join(t.text or "" for t in root.iter() if t.tag.endswith("text"))
    for want in ("1 thread", "2 threads", "ours in OpenVINO", "OpenVINO built-in", "2.50x", "prefill 1 x 1024"):
        assert want in text, (want, text[:500])
    # 2 panels x 4 (workload, cache) pairs x 2 paths = 16 bars, each a patch with a path.
    bars = [g for g in root.iter() if g.tag.endswith("g") and (g.get("id") or "").startswith("patch")]
    # Each axes also has a background patch, and each legend a frame and two handles.
    assert len(bars) >= 16, len(bars)


def test_png_chart_from_saved_json(tmp_path):
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps(dict(threads=[1, 2], hint="cache", rows=rows())))
    png = tmp_path / "bench.png"
    subprocess.run([sys.executable, str(ROOT / "tools" / "bench.py"), "--from-json", str(saved),
                    "--chart", str(png)], check=True)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000
