"""A `pa serve` process for the tests: started on a free port, ready when `/health` answers,
stopped with SIGTERM. Every server test module starts its servers through `Server`."""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
ENGINE = Path(os.environ.get("PA_ENGINE", ROOT / "target/release/pa-engine"))
F32 = ["--cache-type", "f32", "--precision", "f32", "--threads", "2", "--kv-cache-size", "0.05"]
NAME = "tiny"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Metrics:
    """Samples of a Prometheus text exposition: `m[name]` sums a metric's series (every label
    set); `m.value(name, **labels)` sums the series that carry those labels."""

    SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', re.M)
    LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

    def __init__(self, text):
        self.text = text
        self.samples = []
        for name, labels, v in self.SAMPLE.findall(text):
            pairs = {k: re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], val)
                     for k, val in self.LABEL.findall(labels or "")}
            self.samples.append((name, pairs, float(v)))

    def value(self, name, **labels):
        found = [v for n, ls, v in self.samples
                 if n == name and all(ls.get(k) == str(w) for k, w in labels.items())]
        if not found:
            raise KeyError(f"no series {name}{labels or ''} in /metrics")
        return sum(found)

    def __getitem__(self, name):
        return self.value(name)

    def labels(self, name):
        return [ls for n, ls, _ in self.samples if n == name]


class Server:
    def __init__(self, model, *extra, env=None, kv_cache_size=None, **popen):
        if not ENGINE.is_file():
            pytest.fail(f"pa-engine not found at {ENGINE}: cargo build --release --workspace")
        flags = list(F32)
        if kv_cache_size is not None:  # GB, in place of F32's
            flags[flags.index("--kv-cache-size") + 1] = str(kv_cache_size)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(ENGINE), "serve", str(model), "--port", str(self.port), "--served-model-name", NAME,
             *flags, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env={**os.environ, **(env or {})}, **popen)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                pytest.fail(f"pa serve exited {self.proc.returncode}: {self.proc.stderr.read()}")
            time.sleep(0.1)
        pytest.fail("pa serve did not become ready")

    def metrics(self):
        return Metrics(httpx.get(self.url + "/metrics", timeout=5).text)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
