"""Engine benchmark: our engine (``target/release/pa-engine generate``) against OpenVINO GenAI's
``ContinuousBatchingPipeline`` on the same model directory, the same prompts (token ids, so
tokenization cannot differ), the same arrival times (seconds after the start), KV cache type,
INFERENCE_PRECISION_HINT, INFERENCE_NUM_THREADS, max batched tokens per step, KV cache size (GB),
prefix caching (off for both unless --prefix-caching), greedy, EOS ignored, a fixed number of new
tokens.

    .venv/bin/python tools/bench_engine.py [--workload tiny|attn|smollm2|all] [--repeats 2]
        [--precision f32] [--threads 2] [--max-batched-tokens 256] [--kv-cache-gb 1]
        [--work /tmp/pa_bench_engine] [--json out.json] [--chart out.svg|png] [--quick]
    .venv/bin/python tools/bench_engine.py --from-json out.json [--chart out.svg]   (no run)

Workloads (model directories written by tools/model_dir.py into --work when absent):

- ``tiny``: the gqa4 tiny model (8 heads over 2 KV heads of 32, 2 layers), 16 prompts of 4 to 40
  tokens arriving evenly over 0.2 s, 64 new tokens each, f32 cache;
- ``attn``: tools/model_dir.py's ``attn`` model (32 heads over 8 KV heads of 128, 2 layers), 8
  prompts of 1024 to 4096 tokens (1024, 1024, 2048, 2048, 3072, 1024, 4096, 2048) arriving evenly
  over 2 s, 256 new tokens each; one row with a u8 cache and one with f32;
- ``smollm2``: the trained SmolLM2-135M-Instruct (tools/gguf_model.py's directory, 30 layers, 9
  heads over 3 KV heads of 64, f32 weights), batch 1: one prompt of 128 tokens, 128 new tokens;
  one row with an f32 cache and one with u8.

A full ``--workload all`` run takes about 5 minutes on 2 cores (16 engine processes); the tiny
rows last ~0.3 s each, so their figures move with any other load on the machine.
``--quick`` (smoke run, about 20 s): 8 tiny prompts, 4 attn prompts of 256 to 512 tokens and
one SmolLM2 prompt of 64 tokens (f32 cache), 16 new tokens, one repetition.

Each engine runs in its own process: ours is the CLI (a copy of target/release/pa-engine taken
at start, so a concurrent rebuild cannot swap it mid-run) with ``--json --timings --stats``;
GenAI runs in a subprocess of this tool (``--genai-worker``) that adds each request once its
arrival time has passed, calls ``step()`` until every request finished and reads each handle
after every step. Neither is warmed up (both processes are cold: the first steps include
OpenVINO's first-inference costs in both). Per (workload, cache) the two engines alternate order,
``--repeats`` times (default 2); the table gives the median over repetitions of each metric.

Metrics, computed the same way for both engines from per-request times:

- output tokens/s: every generated token / (last request's last token - first request's add);
- TTFT: from the request's scheduled arrival to its first token (so a request arriving during a
  step waits for the step in both engines; the CLI's own ttft_ms counts from when the request was
  added, kept in the JSON as ``ttft_add``);
- TPOT: (last token - first token) / (tokens - 1), per request;
- p50 / p99 over requests (numpy linear interpolation: with 8 or 16 requests p99 is nearly the max);
- ratios: tokens/s ours / GenAI, latencies GenAI / ours (so > 1 means ours is better in both);
- steps: our engine's scheduler steps (--stats) and GenAI's ``step()`` calls (with
  ``LLMPipeline``, below: its streamer's calls, one for each step that gives tokens, plus the
  prompt's earlier prefill chunks, ceil(prompt / max batched tokens) - 1, which give none);
- ours outside infer(): 100 - "% of step time in infer()" from our --stats line (the target is
  <= 5% of a step);
- KV cache: --kv-cache-gb whole GB for both (GenAI's ``SchedulerConfig.cache_size`` is an int;
  pa-engine's --kv-cache-size counts 1e9 bytes), far more than either workload needs, so neither
  engine preempts;
- ids identical: the fraction of requests whose greedy ids equal GenAI's (first repetition of
  each), and the mean fraction of tokens before the first difference (f32 should give 100%; a u8
  cache quantizes the same way in both but near-ties may flip).

Speculative decoding: ``--speculative`` runs ours with ``--speculative prompt-lookup`` (k =
``--num-speculative-tokens``, n = ``--max-ngram-size``), GenAI's pipeline with prompt lookup (its
``prompt_lookup`` property, ``num_assistant_tokens`` k and ``max_ngram_size`` n), and ours without
speculation as a third engine ``plain`` in the same rotation (paired runs: ours / plain per row);
each run line gives our acceptance rate (accepted / drafted tokens). Its workloads, on SmolLM2
with the chat template:

- ``grounded``: 8 prompts of 200 to 800 tokens asking to repeat, edit or summarise a given text or
  code (slices of this repository's sources), 256 new tokens, all at once (8 concurrent);
- ``grounded1``: the first two of them one after the other (batch 1), 256 new tokens
  (``--count 8``: all eight); a row per prompt, and a closing line per engine with the
  workload's tokens/s at batch 1 (every prompt's tokens over every prompt's wall time, per
  repetition, median over repetitions) and the median of the per-repetition ratios;
- ``norep``: 8 open questions with nothing to copy, 256 new tokens, all at once.

At batch 1 (``grounded1``) GenAI runs as ``LLMPipeline(model_dir, "CPU", prompt_lookup=True,
scheduler_config=...)`` (or ``draft_model=...``), the reference the engine's speculative decoding
is held to: one ``generate()`` on the prompt's ids with a streamer that stamps each call's tokens
(its C++ loop, no Python between steps). ``--genai-pipeline cb`` uses the
``ContinuousBatchingPipeline`` driven as above instead; elsewhere it is the only choice.

``--draft-model DIR`` (with or without ``--speculative``) runs draft-model speculation instead:
ours with ``--speculative draft --draft-model DIR`` (k drafts a step), GenAI's pipeline with
``draft_model=openvino_genai.draft_model(DIR, "CPU", ...)`` (the same precision and threads) and
``num_assistant_tokens`` k, and ours without speculation as ``plain``. tools/gguf_model.py
``--layers N`` writes an early-exit draft of SmolLM2 (its first N layers).

``--baseline PATH`` runs a second pa-engine build (another checkout's, say) as a third engine in
every repetition, in rotating order with the other two, and prints ours / baseline per row
(tokens/s, TTFT and TPOT p50, GenAI's convention: > 1 means ours is better): paired runs, so
other load on the machine falls on both.

Outputs: a markdown table on stdout, ``--json OUT`` (config, versions, every run with per-request
times and ids), ``--chart OUT.svg|png`` (matplotlib: tokens/s, TTFT p50 and TPOT p50 bars per
engine and row, the ratio over each pair).
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import engine_env  # noqa: E402  (pa-engine has no RUNPATH: OpenVINO on LD_LIBRARY_PATH)

engine_env.use_in_this_process()

ROOT = Path(__file__).resolve().parent.parent
TOOLS = ROOT / "tools"
ENGINE = ROOT / "target" / "release" / "pa-engine"
PY = sys.executable

TINY_LENGTHS = [4, 7, 12, 40, 9, 23, 31, 5, 18, 27, 36, 14, 8, 21, 33, 11]
ATTN_LENGTHS = [1024, 1024, 2048, 2048, 3072, 1024, 4096, 2048]


GROUNDED_ASKS = [
    ("Repeat the following text exactly, then stop.", "engine/src/sampling.rs", 200),
    ("Rewrite the following code with every comment removed.", "src/cache/pool.rs", 400),
    ("Copy the following code, renaming `cfg` to `config`.", "engine/src/config.rs", 600),
    ("Summarise the following text, quoting its key sentences.", "docs/cache.md", 800),
    ("Repeat the following code exactly.", "src/cache/manager.rs", 300),
    ("Rewrite the following code, adding a comment above each function.", "engine/src/metrics.rs", 500),
    ("Copy the following text and fix any typos.", "src/cache/scheduler.rs", 700),
    ("Repeat the following code exactly.", "engine/src/tokenizer.rs", 250),
]
NOREP_ASKS = [
    "Write a short story about a lighthouse keeper who finds a strange map.",
    "Explain how photosynthesis works to a ten year old.",
    "List creative names for a coffee shop and explain each.",
    "Describe the history of the bicycle.",
    "What are the pros and cons of remote work?",
    "Write a poem about autumn in the mountains.",
    "Explain the difference between weather and climate.",
    "Give advice to someone starting to learn the piano.",
]


def workloads(quick: bool) -> dict:
    """name -> model variant, prompt lengths, arrival spread (s), new tokens, cache types; the
    speculative workloads name chat prompts (``texts``) instead of lengths."""
    new = 16 if quick else 256
    spec = {
        "grounded": dict(variant="smollm2", texts="grounded", spread=0.0, new=new, caches=["f32"]),
        "grounded1": dict(variant="smollm2", texts="grounded", count=1 if quick else 2, spread=0.0,
                          new=new, caches=["f32"], serial=True),
        "norep": dict(variant="smollm2", texts="norep", spread=0.0, new=new, caches=["f32"]),
    }
    if quick:
        return spec | {
            "tiny": dict(variant="gqa4", lengths=TINY_LENGTHS[:8], spread=0.1, new=16, caches=["f32"]),
            "attn": dict(variant="attn", lengths=[256, 512, 384, 256], spread=0.3, new=16,
                         caches=["u8", "f32"]),
            "smollm2": dict(variant="smollm2", lengths=[64], spread=0.0, new=16, caches=["f32"]),
        }
    return spec | {
        "tiny": dict(variant="gqa4", lengths=TINY_LENGTHS, spread=0.2, new=64, caches=["f32"]),
        "attn": dict(variant="attn", lengths=ATTN_LENGTHS, spread=2.0, new=256, caches=["u8", "f32"]),
        "smollm2": dict(variant="smollm2", lengths=[128], spread=0.0, new=128, caches=["f32", "u8"]),
    }


# ----------------------------------------------------------------------------------------------
# Inputs: model directories and prompts


def ensure_model_dir(work: Path, variant: str) -> Path:
    if variant == "smollm2":  # built once into target/real_models/
        sys.path.insert(0, str(TOOLS))
        from gguf_model import smollm2_dir

        return smollm2_dir(log=lambda m: print(f"# {m}", file=sys.stderr, flush=True))
    d = work / "models" / variant
    if (d / "openvino_model.xml").is_file() and (d / "openvino_tokenizer.xml").is_file():
        return d
    sys.path.insert(0, str(TOOLS))
    from model_dir import ALL_VARIANTS, write_model_dir

    t0 = time.perf_counter()
    tmp = d.with_name(d.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    write_model_dir(tmp, ALL_VARIANTS[variant])
    shutil.rmtree(d, ignore_errors=True)
    tmp.rename(d)
    print(f"# wrote {d} ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
    return d


def prompt_ids(work: Path, model_dir: Path, lengths) -> list[list[int]]:
    """Token ids (BOS first, tokenizer.json) of genai_ref.make_prompts(model_dir, lengths); cached
    in --work."""
    key = hashlib.sha1(json.dumps([model_dir.name, list(lengths)]).encode()).hexdigest()[:12]
    cache = work / f"prompts_{model_dir.name}_{key}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    sys.path.insert(0, str(TOOLS))
    from genai_ref import make_prompts
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    ids = [tk.encode(t, add_special_tokens=True).ids for t in make_prompts(model_dir, lengths)]
    cache.write_text(json.dumps(ids))
    return ids


def chat_prompt_ids(model_dir: Path, which: str, count: int | None) -> list[list[int]]:
    """Token ids of the speculative workloads' prompts, as one user message each under the
    model's chat template (GenAI's tokenizer renders it; tokenizer.json encodes the text)."""
    import openvino_genai as ov_genai
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    if which == "grounded":
        texts = []
        for ask, path, n in GROUNDED_ASKS:
            body = tk.decode(tk.encode((ROOT / path).read_text(), add_special_tokens=False).ids[:n])
            texts.append(f"{ask}\n\n{body}")
    else:
        texts = list(NOREP_ASKS)
    texts = texts[:count] if count else texts
    chat = ov_genai.Tokenizer(str(model_dir))
    return [tk.encode(chat.apply_chat_template([{"role": "user", "content": t}],
                                               add_generation_prompt=True),
                      add_special_tokens=False).ids for t in texts]


# ----------------------------------------------------------------------------------------------
# Runs


def run_ours(binary: Path, spec: dict, tmp: Path) -> dict:
    pfile = tmp / "prompts_ours.json"
    pfile.write_text(json.dumps([{"token_ids": ids, "arrival": a}
                                 for ids, a in zip(spec["prompts"], spec["arrivals"])]))
    cmd = [str(binary), "generate", spec["model_dir"], "--prompts", str(pfile), "--json",
           "--timings", "--stats", "--cache-type", spec["cache_type"], "--precision",
           spec["precision"], "--threads", str(spec["threads"]), "--max-new-tokens",
           str(spec["max_new_tokens"]), "--ignore-eos", "--max-batched-tokens",
           str(spec["max_batched_tokens"]), "--kv-cache-size", str(spec["kv_cache_gb"])]
    if not spec["prefix_caching"]:
        cmd.append("--no-prefix-caching")
    if spec.get("speculative"):
        k, n = spec["speculative"]
        cmd += ["--num-speculative-tokens", str(k)]
        cmd += (["--speculative", "draft", "--draft-model", spec["draft_model"]]
                if spec.get("draft_model") else
                ["--speculative", "prompt-lookup", "--max-ngram-size", str(n)])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=spec["timeout"])
    proc_s = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"pa-engine exit {p.returncode}: {last_lines(p.stderr)}")
    reqs = []
    for line in p.stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        o = json.loads(line)
        add = o["arrival_s"]
        reqs.append({"index": o["index"], "token_ids": o["token_ids"], "add_s": add,
                     "first_s": add + o["ttft_ms"] / 1e3, "last_s": add + o["e2e_ms"] / 1e3,
                     "tokens": len(o["token_ids"]), "engine_tpot_ms": o["tpot_ms"]})
    reqs.sort(key=lambda r: r["index"])
    stats = parse_stats(p.stderr)
    return {"requests": reqs, "stats": stats, "process_s": proc_s, "cmd": " ".join(cmd),
            "stderr_tail": p.stderr.strip().splitlines()[-3:]}


def last_lines(text: str, n: int = 2) -> str:
    return " | ".join(l.strip() for l in text.strip().splitlines()[-n:])[-400:]


STATS_RES = {
    "load_s": r"load ([\d.]+) s",
    "generated": r"(\d+) generated in",
    "gen_s": r"generated in ([\d.]+) s",
    "tokens_per_s": r"\(([\d.]+) tokens/s\)",
    "steps": r"(\d+) steps",
    "infer_pct": r"([\d.]+)% of step time in infer\(\)",
    "preemptions": r"(\d+) preemptions",
    "drafted": r"(\d+) draft tokens",
    "accepted": r"(\d+) accepted \(",
}


def parse_stats(stderr: str) -> dict:
    line = next((l for l in stderr.splitlines() if "% of step time in infer()" in l), "")
    out = {"line": line}
    for k, rx in STATS_RES.items():
        m = re.search(rx, line)
        out[k] = float(m.group(1)) if m else None
    return out


def run_genai(spec: dict, tmp: Path) -> dict:
    sfile = tmp / "spec_genai.json"
    sfile.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    p = subprocess.run([PY, str(Path(__file__).resolve()), "--genai-worker", str(sfile)],
                       capture_output=True, text=True, timeout=spec["timeout"])
    proc_s = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"GenAI worker exit {p.returncode}: {last_lines(p.stderr)}")
    out = json.loads(p.stdout.strip().splitlines()[-1])
    out["process_s"] = proc_s
    return out


def genai_settings(spec: dict):
    """Both GenAI workers' settings from the run's spec: the generation options, the scheduler's
    configuration and the pipeline's properties (the speculative method's among them)."""
    import openvino_genai as ov_genai
    from genai_ref import Options, properties

    opts = Options(max_new_tokens=spec["max_new_tokens"], cache_type=spec["cache_type"],
                   precision=spec["precision"], threads=spec["threads"], ignore_eos=True,
                   max_batched_tokens=spec["max_batched_tokens"],
                   prefix_caching=spec["prefix_caching"])
    sc = ov_genai.SchedulerConfig()
    sc.max_num_batched_tokens = spec["max_batched_tokens"]
    sc.enable_prefix_caching = spec["prefix_caching"]
    sc.dynamic_split_fuse = True
    sc.max_num_seqs = 256  # as pa-engine's --max-seqs default
    sc.cache_size = int(spec["kv_cache_gb"])  # GenAI takes whole GB
    props = properties(opts)
    if spec.get("draft_model"):
        props["draft_model"] = ov_genai.draft_model(spec["draft_model"], "CPU", **props)
    elif spec.get("speculative"):
        props["prompt_lookup"] = True
    return opts, sc, props


def genai_generation_config(pipe, opts, spec: dict):
    from genai_ref import generation_config

    cfg = generation_config(pipe, opts)
    if spec.get("draft_model"):
        cfg.num_assistant_tokens = spec["speculative"][0]
    elif spec.get("speculative"):
        cfg.num_assistant_tokens, cfg.max_ngram_size = spec["speculative"]
    return cfg


def genai_llm_worker(spec: dict) -> None:
    """Runs in its own process: ``LLMPipeline`` with speculative decoding, one prompt, one
    ``generate()``; a streamer stamps when each step's tokens arrive."""
    import openvino as ov
    import openvino_genai as ov_genai

    assert len(spec["prompts"]) == 1 and spec.get("speculative"), "LLMPipeline: one prompt, speculative"
    t0 = time.perf_counter()
    opts, sc, props = genai_settings(spec)
    pipe = ov_genai.LLMPipeline(spec["model_dir"], "CPU", scheduler_config=sc, **props)
    load_s = time.perf_counter() - t0
    cfg = genai_generation_config(pipe, opts, spec)

    class Stamps(ov_genai.StreamerBase):
        def __init__(self):
            super().__init__()
            self.at, self.ids = [], []

        def write(self, tok):
            self.at.append(time.perf_counter())
            self.ids.extend([int(tok)] if isinstance(tok, int) else [int(t) for t in tok])
            return ov_genai.StreamingStatus.RUNNING

        def end(self):
            pass

    stamps = Stamps()
    start = time.perf_counter()
    res = pipe.generate(ov.Tensor(np.array([spec["prompts"][0]], dtype=np.int64)), cfg, stamps)
    wall = time.perf_counter() - start
    ids = [int(t) for t in res.tokens[0]]
    assert ids == stamps.ids, "the streamer saw other tokens than generate() returned"
    req = {"index": 0, "token_ids": ids, "add_s": 0.0, "first_s": stamps.at[0] - start,
           "last_s": stamps.at[-1] - start, "tokens": len(ids)}
    chunks = -(-len(spec["prompts"][0]) // spec["max_batched_tokens"])
    print(json.dumps({"requests": [req], "stats": {"load_s": load_s,
                                                   "steps": len(stamps.at) + chunks - 1,
                                                   "loop_s": wall, "pipeline": "LLMPipeline"}}))


def genai_worker(spec_path: str) -> None:
    """Runs in its own process: the GenAI pipeline, requests added at their arrival times."""
    spec = json.loads(Path(spec_path).read_text())
    sys.path.insert(0, str(TOOLS))
    if spec.get("genai_pipeline") == "llm":
        genai_llm_worker(spec)
        return
    import openvino as ov
    import openvino_genai as ov_genai

    t0 = time.perf_counter()
    opts, sc, props = genai_settings(spec)
    pipe = ov_genai.ContinuousBatchingPipeline(spec["model_dir"], sc, "CPU", props)
    load_s = time.perf_counter() - t0
    cfg = genai_generation_config(pipe, opts, spec)
    prompts, arrivals = spec["prompts"], spec["arrivals"]
    tensors = [ov.Tensor(np.array([ids], dtype=np.int64)) for ids in prompts]
    n = len(prompts)
    order = sorted(range(n), key=lambda i: arrivals[i])
    add_s, first_s, last_s = [None] * n, [None] * n, [None] * n
    toks = [[] for _ in range(n)]
    active = {}
    steps, step_time, nxt, step_ms = 0, 0.0, 0, []
    start = time.perf_counter()
    while nxt < n or pipe.has_non_finished_requests():
        now = time.perf_counter() - start
        while nxt < n and arrivals[order[nxt]] <= now:
            i = order[nxt]
            nxt += 1
            add_s[i] = time.perf_counter() - start
            active[i] = pipe.add_request(i, tensors[i], cfg)
        if not pipe.has_non_finished_requests():
            if nxt < n:
                time.sleep(max(0.0, arrivals[order[nxt]] - (time.perf_counter() - start)))
            continue
        ts = time.perf_counter()
        pipe.step()
        te = time.perf_counter()
        step_time += te - ts
        step_ms.append(round((te - ts) * 1e3, 3))
        steps += 1
        at = te - start
        done = []
        for i, h in active.items():
            while h.can_read():
                for o in h.read().values():
                    new = [int(t) for t in o.generated_ids]
                    if new:
                        if first_s[i] is None:
                            first_s[i] = at
                        last_s[i] = at
                        toks[i].extend(new)
            if len(toks[i]) >= spec["max_new_tokens"] and not h.can_read():
                done.append(i)
        for i in done:
            del active[i]
    wall = time.perf_counter() - start
    reqs = [{"index": i, "token_ids": toks[i], "add_s": add_s[i], "first_s": first_s[i],
             "last_s": last_s[i], "tokens": len(toks[i])} for i in range(n)]
    print(json.dumps({"requests": reqs, "stats": {"load_s": load_s, "steps": steps,
                                                  "step_s": step_time, "loop_s": wall,
                                                  "step_ms": step_ms}}))


# ----------------------------------------------------------------------------------------------
# Metrics


def pct(xs, q):
    xs = [x for x in xs if x is not None]
    return float(np.percentile(xs, q)) if xs else None


def metrics(run: dict, arrivals) -> dict:
    reqs = run["requests"]
    gen = sum(r["tokens"] for r in reqs)
    t_first = min(r["add_s"] for r in reqs)
    t_last = max(r["last_s"] for r in reqs if r["last_s"] is not None)
    ttft = [(r["first_s"] - arrivals[r["index"]]) * 1e3 for r in reqs if r["first_s"] is not None]
    ttft_add = [(r["first_s"] - r["add_s"]) * 1e3 for r in reqs if r["first_s"] is not None]
    tpot = [(r["last_s"] - r["first_s"]) * 1e3 / (r["tokens"] - 1) for r in reqs if r["tokens"] > 1]
    st = run.get("stats", {})
    return {
        "generated": gen, "wall_s": t_last - t_first, "tokens_per_s": gen / (t_last - t_first),
        "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
        "ttft_add_p50": pct(ttft_add, 50), "ttft_add_p99": pct(ttft_add, 99),
        "tpot_p50": pct(tpot, 50), "tpot_p99": pct(tpot, 99),
        "steps": st.get("steps"),
        "outside_infer_pct": (100.0 - st["infer_pct"]) if st.get("infer_pct") is not None else None,
        "load_s": st.get("load_s"), "process_s": run.get("process_s"),
        "acceptance": (st["accepted"] / st["drafted"]) if st.get("drafted") else None,
    }


METRIC_KEYS = ["tokens_per_s", "ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99", "ttft_add_p50",
               "ttft_add_p99", "wall_s", "steps", "outside_infer_pct", "load_s", "process_s",
               "acceptance"]


def median_metrics(runs) -> dict | None:
    ok = [r["metrics"] for r in runs if "metrics" in r]
    if not ok:
        return None
    out = {}
    for k in METRIC_KEYS:
        vals = [m[k] for m in ok if m.get(k) is not None]
        out[k] = statistics.median(vals) if vals else None
    out["runs"] = len(ok)
    return out


def agreement(ours_reqs, genai_reqs) -> dict:
    same, frac = 0, []
    for a, b in zip(ours_reqs, genai_reqs):
        x, y = a["token_ids"], b["token_ids"]
        same += x == y
        k = next((k for k, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))
        frac.append(k / max(len(x), len(y), 1))
    n = len(ours_reqs)
    return {"requests": n, "identical": same, "identical_frac": same / n if n else None,
            "prefix_token_frac": float(np.mean(frac)) if frac else None}


# ----------------------------------------------------------------------------------------------
# Output


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def cell(o, g, key, higher_better, nd=1):
    a = o.get(key) if o else None
    b = g.get(key) if g else None
    if a is None and b is None:
        return "-"
    r = ""
    if a and b:
        r = f" ({(a / b) if higher_better else (b / a):.2f}x)"
    return f"{fmt(a, nd)} / {fmt(b, nd)}{r}"


def table(rows) -> str:
    hdr = ("| workload | cache | out tok/s ours / GenAI (x) | TTFT p50 ms (x) | TTFT p99 ms (x) "
           "| TPOT p50 ms (x) | TPOT p99 ms (x) | steps ours / GenAI | ours outside infer() "
           "| ids identical (token prefix) |")
    lines = [hdr, "|---" * (hdr.count("|") - 1) + "|"]
    for row in rows:
        o, g = row["median"].get("ours"), row["median"].get("genai")
        ag = row.get("agreement")
        ag_txt = (f"{ag['identical']}/{ag['requests']} ({100 * ag['prefix_token_frac']:.0f}%)"
                  if ag else "-")
        oi = o.get("outside_infer_pct") if o else None
        errs = "; ".join(f"{r['engine']}: {r['error'][:80]}" for r in row["runs"] if "error" in r)
        lines.append(
            f"| {row['workload']} | {row['cache']} | {cell(o, g, 'tokens_per_s', True)} "
            f"| {cell(o, g, 'ttft_p50', False)} | {cell(o, g, 'ttft_p99', False)} "
            f"| {cell(o, g, 'tpot_p50', False, 2)} | {cell(o, g, 'tpot_p99', False, 2)} "
            f"| {cell(o, g, 'steps', None, 0).split(' (')[0]} | {fmt(oi)}% | {ag_txt} |"
            + (f" errors: {errs}" if errs else ""))
    return "\n".join(lines)


def pooled_lines(rows, engines, repeats, serial) -> list[str]:
    """Per batch-1 workload (``serial``: their names) of several prompts, per cache type: each
    engine's tokens/s over the whole workload (all its prompts' tokens over all their wall
    times) per repetition, the median over repetitions, and the median of the per-repetition
    ratios to GenAI (same repetition: the same machine state)."""
    out = []
    for name, cache in dict.fromkeys((r["workload"], r["cache"]) for r in rows):
        wrows = [r for r in rows if r["workload"] == name and r["cache"] == cache]
        if name not in serial or len(wrows) < 2:
            continue
        rate = {}
        for e in engines:
            per = []
            for rep in range(repeats):
                runs = [next((x for x in r["runs"] if x["engine"] == e and x["rep"] == rep
                              and "metrics" in x), None) for r in wrows]
                if all(runs):
                    per.append(sum(x["metrics"]["generated"] for x in runs)
                               / sum(x["metrics"]["wall_s"] for x in runs))
                else:
                    per.append(None)
            rate[e] = per
        for e in engines:
            got = [x for x in rate[e] if x is not None]
            if not got:
                continue
            line = (f"{name} {cache}, {len(wrows)} prompts at batch 1, {e}: {np.median(got):.1f} tok/s "
                    f"(repetitions {', '.join(f'{x:.1f}' for x in got)})")
            if e != "genai" and "genai" in rate:
                ratios = [a / b for a, b in zip(rate[e], rate["genai"]) if a and b]
                if ratios:
                    line += (f"; / GenAI per repetition {', '.join(f'{x:.3f}' for x in ratios)}, "
                             f"median {np.median(ratios):.3f}")
            out.append(line)
    return out


def write_chart(rows, path):
    """Tokens/s, TTFT p50 and TPOT p50 (columns) of both engines per workload (rows of panels,
    each with its own scale) and cache type; the ratio above each pair (> 1: ours is better)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.fonttype"] = "none"
    panels = [("tokens_per_s", "output tokens/s (higher is better)", True),
              ("ttft_p50", "TTFT p50 ms (lower is better)", False),
              ("tpot_p50", "TPOT p50 ms (lower is better)", False)]
    names = list(dict.fromkeys(r["workload"] for r in rows))
    if not names:
        raise ValueError("no rows to draw")
    fig, axes = plt.subplots(len(names), 3, figsize=(12, 3.3 * len(names) + 0.6), squeeze=False)
    for wi, name in enumerate(names):
        rs = [r for r in rows if r["workload"] == name]
        x = np.arange(len(rs))
        for ax, (key, title, hb) in zip(axes[wi], panels):
            ours = [(r["median"].get("ours") or {}).get(key) or 0.0 for r in rs]
            gen = [(r["median"].get("genai") or {}).get(key) or 0.0 for r in rs]
            ax.bar(x - 0.2, ours, 0.4, label="ours (pa-engine)", color="#1f77b4")
            ax.bar(x + 0.2, gen, 0.4, label="OpenVINO GenAI CB", color="#d62728")
            for k in range(len(rs)):
                if ours[k] and gen[k]:
                    ratio = ours[k] / gen[k] if hb else gen[k] / ours[k]
                    ax.annotate(f"{ratio:.2f}x", (x[k], max(ours[k], gen[k])), ha="center",
                                va="bottom", fontsize=8)
            ax.set_xticks(x, [f"{name}, {r['cache']} cache" for r in rs], fontsize=8)
            ax.set_title(title, fontsize=9)
            ax.set_xlim(-0.8, max(len(rs), 2) - 0.2)
            ax.margins(y=0.15)
        axes[wi][0].set_ylabel(f"{name}: {rs[0]['variant']}, {len(rs[0]['prompt_lens'])} prompts, "
                               f"{rs[0]['max_new_tokens']} new", fontsize=8)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper right", fontsize=8)
    fig.suptitle("pa-engine vs OpenVINO GenAI ContinuousBatchingPipeline (median of repetitions; "
                 "ratio > 1: ours better)", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path)
    plt.close(fig)


def versions() -> dict:
    v = {"python": platform.python_version(), "nproc": os.cpu_count(),
         "affinity": len(os.sched_getaffinity(0))}
    try:
        v["cpu"] = next(l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo")
                        if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    for mod in ("openvino", "openvino_genai"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001
            v[mod] = f"n/a ({e})"
    try:
        v["git_head"] = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                                       capture_output=True, text=True).stdout.strip()
        v["git_dirty"] = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                              "--untracked-files=no"],
                                             capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    return v


# ----------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="all",
                    help="tiny, attn, smollm2, grounded, grounded1, norep, comma-separated, or all "
                         "(the first three)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions per engine (default 2, --quick 1)")
    ap.add_argument("--precision", default="f32", help="INFERENCE_PRECISION_HINT for both (default f32)")
    ap.add_argument("--threads", type=int, default=2, help="INFERENCE_NUM_THREADS for both (default 2)")
    ap.add_argument("--max-batched-tokens", type=int, default=256,
                    help="token rows per step for both (default 256, GenAI's SchedulerConfig default)")
    ap.add_argument("--kv-cache-gb", type=int, default=1,
                    help="KV cache size for both, whole GB (GenAI's SchedulerConfig.cache_size is an int)")
    ap.add_argument("--prefix-caching", action="store_true", help="prefix caching on in both (default off)")
    ap.add_argument("--caches", default="", help="override the cache types of every workload, e.g. u8")
    ap.add_argument("--quick", action="store_true", help="smoke run: small workloads, 1 repetition")
    ap.add_argument("--work", type=Path, default=Path("/tmp/pa_bench_engine"),
                    help="model directories, prompts and the engine copy (default /tmp/pa_bench_engine)")
    ap.add_argument("--engine", type=Path, default=ENGINE, help="pa-engine binary (copied before use)")
    ap.add_argument("--baseline", type=Path, help="another pa-engine binary run beside ours (copied)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per engine process")
    ap.add_argument("--json", type=Path, help="write every figure to this file")
    ap.add_argument("--chart", type=Path, help="draw tokens/s, TTFT and TPOT p50 to this .svg/.png")
    ap.add_argument("--from-json", type=Path, help="no run: table (and --chart) from a --json file")
    ap.add_argument("--speculative", action="store_true",
                    help="prompt lookup in ours and GenAI, and ours without it as engine `plain`")
    ap.add_argument("--num-speculative-tokens", type=int, default=4, help="k (default 4)")
    ap.add_argument("--max-ngram-size", type=int, default=3, help="n (default 3)")
    ap.add_argument("--draft-model", type=Path,
                    help="draft-model speculation (this draft directory) in ours and GenAI, "
                         "and ours without it as engine `plain`")
    ap.add_argument("--count", type=int, help="prompts of a chat workload (grounded1: default 2)")
    ap.add_argument("--genai-pipeline", choices=["llm", "cb"], default="llm",
                    help="GenAI at batch 1 with speculation: LLMPipeline (default) or "
                         "ContinuousBatchingPipeline")
    ap.add_argument("--genai-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.genai_worker:
        genai_worker(args.genai_worker)
        return 0
    if args.from_json:
        saved = json.loads(args.from_json.read_text())
        print(table(saved["rows"]))
        if args.chart:
            write_chart(saved["rows"], args.chart)
            print(f"\nwrote {args.chart}")
        return 0

    repeats = args.repeats or (1 if args.quick else 2)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / f"run_{os.getpid()}"
    tmp.mkdir(exist_ok=True)
    if not args.engine.is_file():
        ap.error(f"{args.engine} not found (cargo build --release -p paged_attention_engine)")
    binary = tmp / "pa-engine"
    shutil.copy2(args.engine, binary)
    base_binary = None
    if args.baseline:
        base_binary = tmp / "pa-engine-baseline"
        shutil.copy2(args.baseline, base_binary)
    args.speculative |= args.draft_model is not None
    engines = (["ours", "genai"] + (["base"] if base_binary else [])
               + (["plain"] if args.speculative else []))
    speculative = (args.num_speculative_tokens, args.max_ngram_size) if args.speculative else None
    draft = str(args.draft_model.resolve()) if args.draft_model else None
    eng_mtime = datetime.datetime.fromtimestamp(args.engine.stat().st_mtime).isoformat(timespec="seconds")
    wls = workloads(args.quick)
    names = ([n for n in wls if "texts" not in wls[n]] if args.workload == "all"
             else args.workload.split(","))
    ver = versions()
    config = {"precision": args.precision, "threads": args.threads,
              "max_batched_tokens": args.max_batched_tokens, "kv_cache_gb": args.kv_cache_gb,
              "prefix_caching": args.prefix_caching, "repeats": repeats, "quick": args.quick,
              "engine": str(args.engine), "engine_mtime": eng_mtime, "load_avg_start": os.getloadavg(),
              "speculative": speculative, "draft_model": draft,
              "genai_pipeline": args.genai_pipeline}
    print(f"# pa-engine ({eng_mtime}, git {ver.get('git_head')}{'+dirty' if ver.get('git_dirty') else ''}) "
          f"vs OpenVINO GenAI {ver.get('openvino_genai')}; precision {args.precision}, "
          f"{args.threads} threads, max batched tokens {args.max_batched_tokens}, KV cache "
          f"{args.kv_cache_gb} GB, prefix caching {'on' if args.prefix_caching else 'off'}, "
          f"{repeats} repetition(s); {ver.get('cpu')}, {ver.get('affinity')} CPUs, "
          f"load avg {os.getloadavg()[0]:.2f}"
          + ("; GenAI at batch 1: LLMPipeline" if speculative and args.genai_pipeline == "llm"
             else ""), flush=True)

    rows = []
    t_all = time.perf_counter()
    for name in names:
        w = wls[name]
        model_dir = ensure_model_dir(work, w["variant"])
        ids = (chat_prompt_ids(model_dir, w["texts"], args.count or w.get("count")) if "texts" in w
               else prompt_ids(work, model_dir, w["lengths"]))
        # Batch 1 (serial): a row per prompt, each run alone.
        groups = [[x] for x in ids] if w.get("serial") else [ids]
        caches = args.caches.split(",") if args.caches else w["caches"]
        for ids, cache in ((g, c) for g in groups for c in caches):
            n = len(ids)
            arrivals = [w["spread"] * i / (n - 1) if n > 1 else 0.0 for i in range(n)]
            spec = {"model_dir": str(model_dir), "prompts": ids, "arrivals": arrivals,
                    "max_new_tokens": w["new"], "cache_type": cache, "precision": args.precision,
                    "threads": args.threads, "max_batched_tokens": args.max_batched_tokens,
                    "kv_cache_gb": args.kv_cache_gb, "prefix_caching": args.prefix_caching,
                    "timeout": args.timeout, "speculative": speculative, "draft_model": draft,
                    "genai_pipeline": ("llm" if w.get("serial") and speculative
                                       and args.genai_pipeline == "llm" else "cb")}
            row = {"workload": name, "cache": cache, "variant": w["variant"],
                   "prompt_lens": [len(x) for x in ids], "arrivals": arrivals,
                   "max_new_tokens": w["new"], "runs": []}
            for rep in range(repeats):
                k = rep % len(engines)
                order = engines[k:] + engines[:k]
                for eng in order:
                    t0 = time.perf_counter()
                    rec = {"engine": eng, "rep": rep, "first": eng == order[0],
                           "load_avg": os.getloadavg()[0]}
                    try:
                        res = (run_genai(spec, tmp) if eng == "genai"
                               else run_ours(base_binary, spec, tmp) if eng == "base"
                               else run_ours(binary, spec if eng == "ours" else
                                             spec | {"speculative": None}, tmp))
                        rec.update(res)
                        rec["metrics"] = metrics(res, arrivals)
                        m = rec["metrics"]
                        print(f"#   {name} {cache} rep {rep} {eng:5s}: {m['tokens_per_s']:.1f} tok/s, "
                              f"TTFT p50 {m['ttft_p50']:.1f} ms, TPOT p50 {m['tpot_p50']:.2f} ms, "
                              f"{m['steps']} steps"
                              + (f", {m['outside_infer_pct']:.1f}% outside infer()"
                                 if m.get("outside_infer_pct") is not None else "")
                              + (f", acceptance {100 * m['acceptance']:.1f}%"
                                 if m.get("acceptance") is not None else "")
                              + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
                    except Exception as e:  # noqa: BLE001  (reported in the table; other runs go on)
                        rec["error"] = str(e)
                        print(f"#   {name} {cache} rep {rep} {eng}: ERROR {str(e)[:300]}", flush=True)
                    row["runs"].append(rec)
            row["median"] = {e: median_metrics([r for r in row["runs"] if r["engine"] == e])
                             for e in engines}
            first = {e: next((r for r in row["runs"] if r["engine"] == e and "requests" in r), None)
                     for e in ("ours", "genai")}
            if first["ours"] and first["genai"]:
                row["agreement"] = agreement(first["ours"]["requests"], first["genai"]["requests"])
            # each engine against itself across repetitions (greedy: should be deterministic)
            for e in engines:
                rs = [r for r in row["runs"] if r["engine"] == e and "requests" in r]
                row[f"{e}_self_consistent"] = all(
                    [q["token_ids"] for q in r["requests"]] == [q["token_ids"] for q in rs[0]["requests"]]
                    for r in rs)
            rows.append(row)
    config["load_avg_end"] = os.getloadavg()
    total = time.perf_counter() - t_all
    print()
    print(table(rows))
    print(f"\nMedians of {repeats} run(s) per engine, alternating order. (x): tokens/s ours/GenAI, "
          f"latencies GenAI/ours: > 1 means ours is better. TTFT from the scheduled arrival. "
          f"Total {total:.0f} s; load average at start/end {config['load_avg_start'][0]:.2f} / "
          f"{config['load_avg_end'][0]:.2f}.")
    for row in rows:
        o, p = row["median"].get("ours"), row["median"].get("plain")
        if o and p:
            print(f"speculation, {row['workload']} {row['cache']}: tokens/s ours / plain "
                  f"{o['tokens_per_s'] / p['tokens_per_s']:.3f}, TPOT p50 plain / ours "
                  f"{p['tpot_p50'] / o['tpot_p50']:.3f}, acceptance "
                  f"{100 * (o.get('acceptance') or 0):.1f}%")
        o, b = row["median"].get("ours"), row["median"].get("base")
        if o and b:
            ratio = lambda k, up: (o[k] / b[k]) if up else (b[k] / o[k])  # noqa: E731
            print(f"ours / baseline, {row['workload']} {row['cache']}: tokens/s "
                  f"{ratio('tokens_per_s', True):.3f}, TTFT p50 {ratio('ttft_p50', False):.3f}, "
                  f"TPOT p50 {ratio('tpot_p50', False):.3f} (> 1: ours better)")
        for e in engines:
            if not row[f"{e}_self_consistent"]:
                print(f"note: {e} gave different ids across repetitions on {row['workload']} {row['cache']}")
    for line in pooled_lines(rows, engines, repeats, {n for n in names if wls[n].get("serial")}):
        print(line)
    if args.json:
        args.json.write_text(json.dumps({"config": config, "versions": ver, "rows": rows,
                                         "total_s": total}, indent=1))
        print(f"wrote {args.json}")
    if args.chart:
        write_chart(rows, args.chart)
        print(f"wrote {args.chart}")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
