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


class Server:
    def __init__(self, model, *extra, env=None, **popen):
        if not ENGINE.is_file():
            pytest.fail(f"pa-engine not found at {ENGINE}: cargo build --release --workspace")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(ENGINE), "serve", str(model), "--port", str(self.port), "--served-model-name", NAME,
             *F32, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
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
        text = httpx.get(self.url + "/metrics", timeout=5).text
        return {name: float(v) for name, v in re.findall(r"^(\w+) ([0-9.e+-]+)$", text, re.M)}

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
