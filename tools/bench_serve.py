"""Load benchmark of ``pa serve``: N concurrent streaming clients (raw HTTP, httpx) against the
same prompts run offline by ``pa-engine generate`` (one continuous batch, --timings), same model,
cache type, precision, threads and scheduler settings, greedy, EOS ignored. Reports throughput and
TTFT / TPOT p50 / p99 of each, and what the server adds to the time per output token.

    .venv/bin/python tools/bench_serve.py [--model DIR] [--streams 16] [--new-tokens 128] [--repeats 3]

Without --model the tiny gqa4 model is written to --work (default /tmp/pa_bench_serve).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(c, url, name, prompt, new):
    """One streamed completion on the shared client ``c``: (TTFT s, TPOT s, tokens). Lines are
    not parsed as JSON: on 2 cores the client's own work would count as the server's."""
    body = {"model": name, "prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "ignore_eos": True}
    t0 = time.perf_counter()
    first = end = None
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                break
            if not line.startswith("data: "):
                continue
            now = time.perf_counter()
            if '"finish_reason":null' in line:
                first = first or now
            else:
                end = now  # the chunk that ends the choice comes right after its last token
    # A token whose text is an incomplete character sends no chunk (the text waits for the next
    # token), so the time per token is over the request's `new` tokens, not over the chunks.
    return first - t0, (end - first) / max(1, new - 1), new


def served(engine, model, prompts, new, flags):
    port = free_port()
    proc = subprocess.Popen([engine, "serve", model, "--port", str(port), "--served-model-name", "m", *flags],
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        async def run():
            limits = httpx.Limits(max_connections=len(prompts) + 1)
            async with httpx.AsyncClient(timeout=600, limits=limits) as c:
                # Warm-up (first-call costs are in the offline figure's load time, not its steps),
                # which also opens the connections.
                await asyncio.gather(*[one(c, url, "m", "warm up", 2) for _ in prompts])
                t0 = time.perf_counter()
                res = await asyncio.gather(*[one(c, url, "m", p, new) for p in prompts])
                return res, time.perf_counter() - t0
        res, wall = asyncio.run(run())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"tok_s": sum(r[2] for r in res) / wall, "ttft": [r[0] * 1e3 for r in res],
            "tpot": [r[1] * 1e3 for r in res]}


def offline(engine, model, prompts, new, flags, work):
    f = Path(work) / "prompts.json"
    f.write_text(json.dumps(prompts))
    p = subprocess.run([engine, "generate", model, "--prompts", str(f), "--json", "--timings", "--stats",
                        "--max-new-tokens", str(new), "--ignore-eos", *flags],
                       capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in p.stdout.splitlines()]
    secs = float(p.stderr.split(" generated in ")[1].split(" s")[0])
    return {"tok_s": sum(len(r["token_ids"]) for r in rows) / secs, "ttft": [r["ttft_ms"] for r in rows],
            "tpot": [r["tpot_ms"] for r in rows]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--work", type=Path, default=Path("/tmp/pa_bench_serve"))
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-type", default="f32")
    ap.add_argument("--precision", default="f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", default=os.environ.get("PA_ENGINE", str(ROOT / "target/release/pa-engine")))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    model = args.model
    if model is None:
        import model_dir
        import tiny_llm

        model = args.work / "gqa4"
        if not (model / "openvino_model.xml").is_file():
            model_dir.write_model_dir(model, tiny_llm.VARIANTS["gqa4"])
    flags = ["--cache-type", args.cache_type, "--precision", args.precision, "--threads", str(args.threads),
             "--kv-cache-size", "0.2"]
    prompts = [f"request {i}: the river and the garden of the city" for i in range(args.streams)]
    runs = {"server": [], "offline": []}
    for _ in range(args.repeats):  # alternated
        runs["offline"].append(offline(args.engine, str(model), prompts, args.new_tokens, flags, args.work))
        runs["server"].append(served(args.engine, str(model), prompts, args.new_tokens, flags))
    print(f"model {model.name}, {args.streams} concurrent streams, {args.new_tokens} new tokens, "
          f"{args.cache_type} cache, {args.precision}, {args.threads} threads; median of {args.repeats}")
    print("| path | output tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms |")
    print("|---|---|---|---|")
    med = {}
    for k, rs in runs.items():
        m = {"tok_s": statistics.median(r["tok_s"] for r in rs),
             "ttft50": statistics.median(pct(r["ttft"], 50) for r in rs),
             "ttft99": statistics.median(pct(r["ttft"], 99) for r in rs),
             "tpot50": statistics.median(pct(r["tpot"], 50) for r in rs),
             "tpot99": statistics.median(pct(r["tpot"], 99) for r in rs)}
        med[k] = m
        print(f"| {k} | {m['tok_s']:.0f} | {m['ttft50']:.1f} / {m['ttft99']:.1f} | "
              f"{m['tpot50']:.3f} / {m['tpot99']:.3f} |")
    add = med["server"]["tpot50"] / med["offline"]["tpot50"] - 1
    print(f"server adds {add * 100:+.1f}% to TPOT p50 as the clients see it")


if __name__ == "__main__":
    main()
