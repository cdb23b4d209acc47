"""Deployment: the engine off the clone (scripts/install.sh, OpenVINO found at run time, no RUNPATH),
response ids unique across replicas, --threads above the cores, and --kv-cache-size auto.

- The install test copies the checkout (sources with their times, target/ hard-linked, so nothing
  is rebuilt), installs from the copy into a prefix, deletes the copy and runs the installed
  `pa generate` with OpenVINO found through the active Python environment.
- auto: on SmolLM2 and the attention-heavy tiny model, without the option, the engine reports its
  cache size; the process's peak resident memory stays under the bound it reports; greedy ids
  equal those of an explicit size; a bound of context x --max-seqs gives the block count the
  model's shapes give (computed here from config.json); an impossible size is a start-up error."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import model_dir
import tiny_llm
from serve_proc import ENGINE, Server
from smollm2_model import smollm2  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
F32 = ["--cache-type", "f32", "--precision", "f32", "--threads", "2"]
VENV = Path(sys.prefix)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("deploy_models")
    return model_dir.write_model_dir(base / "gqa4", tiny_llm.VARIANTS["gqa4"])


@pytest.fixture(scope="module")
def attn(tmp_path_factory):
    base = tmp_path_factory.mktemp("deploy_attn")
    return model_dir.write_model_dir(base / "attn", model_dir.BENCH_VARIANTS["attn"])


def runpath(binary):
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library r(?:un)?path: \[(.*)\]", out)


def run_engine(args, timeout=300):
    """Runs pa-engine; returns (exit code, stdout, stderr)."""
    p = subprocess.run([str(ENGINE), *args], capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


# ----------------------------------------------------------------------------- off the clone

def test_engine_binary_has_no_runpath():
    assert ENGINE.is_file(), f"{ENGINE} missing: cargo build --release -p paged_attention_engine"
    assert runpath(ENGINE) == [], f"{ENGINE} has a RUNPATH: {runpath(ENGINE)}"


def test_install_runs_off_a_deleted_clone(tiny, tmp_path):
    copy, prefix = tmp_path / "clone", tmp_path / "prefix"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    copy.mkdir()
    for f in filter(None, files.decode().split("\0")):
        src = ROOT / f
        if src.is_file():
            (copy / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, copy / f)  # keeps the times, so cargo finds its outputs fresh
    # target/ hard-linked (cargo replaces the files it writes, never writing through a link).
    subprocess.run(["cp", "-al", str(ROOT / "target"), str(copy / "target")], check=True)
    os.symlink(VENV, copy / ".venv")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PA_ENGINE")}
    r = subprocess.run(["bash", "scripts/install.sh", "--prefix", str(prefix)], cwd=copy, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "with pa-engine" in r.stdout, r.stdout
    shutil.rmtree(copy)
    pa, engine = prefix / "bin/pa", prefix / "bin/pa-engine"
    assert runpath(engine) == [], runpath(engine)
    # OpenVINO through the active Python environment: VIRTUAL_ENV, no LD_LIBRARY_PATH.
    env = {**env, "VIRTUAL_ENV": str(VENV), "PATH": "/usr/bin:/bin"}
    v = subprocess.run([str(pa), "--version"], env=env, capture_output=True, text=True, timeout=60)
    import openvino
    want = openvino.get_version().split("-")[0]
    libs = Path(openvino.__file__).parent / "libs"
    assert f"OpenVINO {want} (libopenvino.so." in v.stdout, v.stdout
    assert "found through the Python package of" in v.stdout and str(VENV) in v.stdout, v.stdout
    assert f"engine: {engine}" in v.stdout, v.stdout
    g = subprocess.run([str(pa), "generate", str(tiny), "--prompt", "the quick brown fox", "--max-new-tokens",
                        "6", "--ignore-eos", "--json", *F32, "--kv-cache-size", "0.05"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert g.returncode == 0, g.stderr
    installed = json.loads(g.stdout)["token_ids"]
    assert len(installed) == 6
    # The same ids as the build tree's engine.
    b = subprocess.run([str(ENGINE), "generate", str(tiny), "--prompt", "the quick brown fox",
                        "--max-new-tokens", "6", "--ignore-eos", "--json", *F32, "--kv-cache-size", "0.05"],
                       capture_output=True, text=True, timeout=120)
    assert b.returncode == 0, b.stderr
    assert json.loads(b.stdout)["token_ids"] == installed
    # With no OpenVINO to find, `pa` says where it looked (it does not exit 127 from the loader).
    bare = {**env, "PYTHON": "/nonexistent/python", "VIRTUAL_ENV": "/nonexistent", "PATH": "/nonexistent"}
    n = subprocess.run([str(pa), "generate", str(tiny), "--prompt", "x"], env=bare, capture_output=True,
                       text=True, timeout=60)
    assert n.returncode == 1 and "OpenVINO not found" in n.stderr, (n.returncode, n.stderr)
    # OpenVINO_DIR, the wheel's cmake directory, wins over the Python environment.
    d = subprocess.run([str(pa), "--version"], env={**bare, "OpenVINO_DIR": str(libs.parent / "cmake")},
                       capture_output=True, text=True, timeout=60)
    assert "found through $OpenVINO_DIR" in d.stdout, d.stdout


# ----------------------------------------------------------------------------- ids, threads

def test_ids_never_collide_across_two_replicas(tiny):
    a, b = Server(tiny), Server(tiny)
    try:
        def ask(i):
            url = (a if i % 2 else b).url
            kind, path = (("prompt", "/v1/completions") if i % 4 < 2 else ("messages", "/v1/chat/completions"))
            body = {"model": "tiny", "max_tokens": 1,
                    kind: "hi" if kind == "prompt" else [{"role": "user", "content": "hi"}]}
            r = httpx.post(url + path, json=body, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["id"]

        with ThreadPoolExecutor(16) as pool:
            ids = list(pool.map(ask, range(1000)))
    finally:
        a.stop()
        b.stop()
    assert all(re.fullmatch(r"(cmpl|chatcmpl)-[0-9a-f]{32}", i) for i in ids), ids[:4]
    assert len(set(ids)) == 1000, f"{1000 - len(set(ids))} duplicate ids"


def test_threads_above_the_cores_are_warned_about(tiny):
    cores = len(os.sched_getaffinity(0))
    base = ["generate", str(tiny), "--prompt", "hi", "--max-new-tokens", "1", "--cache-type", "f32",
            "--kv-cache-size", "0.05"]
    code, _, err = run_engine([*base, "--threads", str(cores + 1)])
    assert code == 0, err
    assert f"--threads {cores + 1} is more than the {cores} cores" in err, err
    # Pinned to one core, two threads are too many.
    p = subprocess.run(["taskset", "-c", "0", str(ENGINE), *base, "--threads", "2"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "--threads 2 is more than the 1 cores" in p.stderr, p.stderr
    code, _, err = run_engine([*base, "--threads", "1"])
    assert code == 0 and "warning" not in err, err


# ----------------------------------------------------------------------------- --kv-cache-size auto

REPORT = re.compile(r"KV cache: ([0-9.]+) GB, (\d+) blocks of (\d+) tokens \((\d+) bytes a block\); auto: "
                    r"50% of the ([0-9.]+) GB available after compiling .*resident memory at most ([0-9.]+) GB")


def peak_run(args):
    """Runs pa-engine and samples its resident memory (VmRSS) every 20 ms; returns (stdout,
    stderr, peak bytes)."""
    import threading
    import time
    p = subprocess.Popen([str(ENGINE), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak = [0]

    def sample():
        while p.poll() is None:
            try:
                status = Path(f"/proc/{p.pid}/status").read_text()
                hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024
                peak[0] = max(peak[0], hwm)
            except (OSError, AttributeError):
                pass
            time.sleep(0.02)

    t = threading.Thread(target=sample)
    t.start()
    out, err = p.communicate(timeout=600)
    t.join()
    assert p.returncode == 0, err
    return out, err, peak[0]


@pytest.mark.parametrize("which", ["smollm2", "attn"])
def test_kv_cache_auto_fits_and_keeps_greedy_ids(which, request, tmp_path):
    model = request.getfixturevalue(which)
    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["The capital of France is", "Once upon a time " * 20, "1, 2, 3, 4,"]))
    base = ["generate", str(model), "--prompts", str(prompts), "--max-new-tokens", "12", "--json",
            "--ignore-eos", *F32]
    out, err, peak = peak_run(base)
    m = REPORT.search(err)
    assert m, err
    gb, blocks, bs, block_bytes, avail_gb, bound_gb = m.groups()
    assert int(blocks) > 0 and abs(float(gb) - int(blocks) * int(block_bytes) / 1e9) < 2e-3
    assert float(gb) <= 0.5 * float(avail_gb) + 1e-3
    assert peak <= float(bound_gb) * 1e9, f"peak resident {peak / 1e9:.3f} GB over the bound {bound_gb} GB"
    explicit, err2, _ = peak_run([*base, "--kv-cache-size", "0.2"])
    ids = lambda text: [json.loads(l)["token_ids"] for l in text.splitlines()]  # noqa: E731
    assert ids(out) == ids(explicit), "greedy ids changed with the cache size"


def test_kv_cache_auto_is_bounded_by_context_times_sequences(attn):
    cfg = json.loads((attn / "config.json").read_text())
    layers, kv_heads = cfg["num_hidden_layers"], cfg["num_key_value_heads"]
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = layers * 2 * kv_heads * 32 * head * 4  # f32 keys and values, 32-token blocks
    blocks = -(-cfg["max_position_embeddings"] // 32) * 2  # --max-seqs 2
    code, _, err = run_engine(["generate", str(attn), "--prompt", "hi", "--max-new-tokens", "1", *F32,
                               "--max-seqs", "2"])
    assert code == 0, err
    assert f", {blocks} blocks of 32 tokens ({block_bytes} bytes a block)" in err, err


def test_kv_cache_too_large_is_a_start_up_error(tiny):
    code, _, err = run_engine(["generate", str(tiny), "--prompt", "hi", *F32, "--kv-cache-size", "1e6"])
    assert code == 1 and "out of memory for the KV cache" in err, (code, err)
    assert "panicked" not in err
