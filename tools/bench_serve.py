"""Load benchmark of ``pa serve``: N concurrent streaming clients (raw HTTP/1.1 on asyncio) against
the same prompts run offline by ``pa-engine generate`` (one continuous batch, --timings), same
model, cache type, precision, threads and scheduler settings, greedy, EOS ignored. Reports
throughput and TTFT / TPOT p50 / p99 of each, and what the server adds to the time per output
token: the median over alternated (offline, server) pairs.

    .venv/bin/python tools/bench_serve.py [--model DIR] [--streams 16] [--new-tokens 128] [--repeats 11]
    # the client on a core of its own, as when clients are other machines:
    .venv/bin/python tools/bench_serve.py --threads 1 --server-cpus 0 --client-cpus 1

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

import engine_env  # noqa: E402  (pa-engine has no RUNPATH: OpenVINO on LD_LIBRARY_PATH)

engine_env.use_in_this_process()

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one(url, name, prompt, new):
    """One streamed completion over its own connection: (TTFT s, TPOT s, tokens).

    Raw HTTP/1.1 on asyncio streams, chunks not parsed as JSON: on 2 cores the client shares the
    server's cores, so its own CPU time is charged to the server (an httpx client spent 0.27 s of
    CPU per 2,048 tokens, 14% of one core during the attn run: all of the server's apparent
    overhead). This one spends a small fraction of that."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": name, "prompt": prompt, "max_tokens": new, "temperature": 0,
                       "stream": True, "ignore_eos": True}).encode()
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    head = await reader.readuntil(b"\r\n\r\n")
    status = head.split(b" ", 2)[1]
    if status != b"200":
        raise RuntimeError(f"HTTP {status.decode()}: {(await reader.read()).decode(errors='replace')}")
    chunked = b"transfer-encoding: chunked" in head.lower()
    first = end = None
    buf = b""
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            data = (await reader.readexactly(size + 2))[:-2]  # the chunk, without its CRLF
        else:
            data = await reader.read(65536)
            if not data:
                break
        now = time.perf_counter()
        buf += data
        # One SSE event per chunk as a rule; split defensively on the blank line that ends one.
        *events, buf = buf.split(b"\n\n")
        done = False
        for ev in events:
            if not ev.startswith(b"data: "):
                continue
            if ev == b"data: [DONE]":
                done = True
            elif b'"finish_reason":null' in ev:
                first = first or now
            else:
                end = now  # the chunk that ends the choice comes right after its last token
        if done:
            break
    writer.close()
    # A token whose text is an incomplete character sends no chunk (the text waits for the next
    # token), so the time per token is over the request's `new` tokens, not over the chunks.
    return first - t0, (end - first) / max(1, new - 1), new


def served(engine, model, prompts, new, flags, pin):
    port = free_port()
    proc = subprocess.Popen([*pin, engine, "serve", model, "--port", str(port), "--served-model-name", "m", *flags],
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
            # Warm-up (first-call costs are in the offline figure's load time, not its steps).
            await asyncio.gather(*[one(url, "m", "warm up", 2) for _ in prompts])
            t0 = time.perf_counter()
            res = await asyncio.gather(*[one(url, "m", p, new) for p in prompts])
            return res, time.perf_counter() - t0
        res, wall = asyncio.run(run())
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    return {"tok_s": sum(r[2] for r in res) / wall, "ttft": [r[0] * 1e3 for r in res],
            "tpot": [r[1] * 1e3 for r in res]}


def offline(engine, model, prompts, new, flags, work, pin):
    f = Path(work) / "prompts.json"
    f.write_text(json.dumps(prompts))
    p = subprocess.run([*pin, engine, "generate", model, "--prompts", str(f), "--json", "--timings", "--stats",
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
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--cache-type", default="f32")
    ap.add_argument("--precision", default="f32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-cpus", help="taskset CPU list for the server and the offline run (e.g. 0)")
    ap.add_argument("--client-cpus", help="CPU list the client runs on (e.g. 1): with --server-cpus, keeps "
                    "the client's own work off the server's cores, as when clients are other machines")
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
    pin = ["taskset", "-c", args.server_cpus] if args.server_cpus else []
    if args.client_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.client_cpus.split(",")})
    runs = {"server": [], "offline": []}
    for _ in range(args.repeats):  # alternated
        runs["offline"].append(offline(args.engine, str(model), prompts, args.new_tokens, flags, args.work, pin))
        runs["server"].append(served(args.engine, str(model), prompts, args.new_tokens, flags, pin))
    print(f"model {model.name}, {args.streams} concurrent streams, {args.new_tokens} new tokens, "
          f"{args.cache_type} cache, {args.precision}, {args.threads} threads; median of {args.repeats}"
          + (f"; server on CPUs {args.server_cpus}" if args.server_cpus else "")
          + (f", client on CPUs {args.client_cpus}" if args.client_cpus else ""))
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
    # Paired: each server run against the offline run just before it (the host's speed drifts
    # between minutes on shared machines; a pair shares it).
    adds = sorted(pct(s["tpot"], 50) / pct(o["tpot"], 50) - 1 for s, o in zip(runs["server"], runs["offline"]))
    print(f"server adds {statistics.median(adds) * 100:+.1f}% to TPOT p50 as the clients see it "
          f"(median of {len(adds)} alternated pairs; range {adds[0] * 100:+.1f}% to {adds[-1] * 100:+.1f}%)")

if __name__ == "__main__":
    main()
