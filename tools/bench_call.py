"""Per-call cost of small attention calls inside OpenVINO, as a batch-1 decode or a speculative
verify step of a small model makes them: our op (the extension) against OpenVINO's built-in
PagedAttentionExtension, one one-node model per layer (`--layers`, each with its own caches), infer()
timed call by call, both ops in turns on the same inputs. Before each call the benchmark reads
`--evict-mb` of other memory, as a model's weights stream between two of its attention calls, so
each call meets its caches as inside a model: not warm from the other op's call on them.

    .venv/bin/python tools/bench_call.py [--shape 9,3,64] [--ctx 200,500,1000] [--rows 1,5]
                                         [--types f32,u8] [--hint f32] [--threads 2]
                                         [--layers 30] [--reps 20] [--evict-mb 18]

Shapes default to SmolLM2-135M's attention (9 query heads, 3 KV heads, head size 64; block 32).
Prints min and median ms a call for each op and the ratio built-in / ours (min / min and median /
median). Our op reads `PA_SERIAL_BELOW` (0: never run a call on the calling thread alone) as the
C ABI does: run once with `PA_SERIAL_BELOW=0` and once without to see what the serial rule saves.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the workloads' buffers and both ops' models)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9,3,64", help="query heads, KV heads, head size")
    ap.add_argument("--ctx", default="200,500,1000", help="context lengths (cached + new tokens)")
    ap.add_argument("--rows", default="1,5", help="new tokens per call (1: decode; k+1: a verify step)")
    ap.add_argument("--types", default="f32,u8", help="cache types")
    ap.add_argument("--hint", default="f32", help="INFERENCE_PRECISION_HINT of both models ('default': none)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--evict-mb", type=float, default=18.0,
                    help="MB read between two calls, as a layer's weights stream between two "
                         "attention calls of a model (SmolLM2-135M f32: 18); 0: none")
    args = ap.parse_args()
    bench.H, bench.HKV, bench.D = (int(x) for x in args.shape.split(","))
    import openvino as ov
    core = ov.Core()
    core.add_extension(str(bench.EXT))
    hint = None if args.hint == "default" else args.hint
    default = str(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
    precision = "bf16" if (hint == "bf16" or (hint is None and "bfloat16" in default)) else "f32"
    tmp = tempfile.mkdtemp(prefix="pa_bench_call_")
    print(f"# OpenVINO {ov.__version__.split('-')[0]}, H={bench.H} Hkv={bench.HKV} D={bench.D} block {bench.BS}, "
          f"{args.threads} threads, hint {args.hint}, {args.layers} layers, "
          f"PA_SERIAL_BELOW={os.environ.get('PA_SERIAL_BELOW', '(default)')}")
    print("| cache | rows x ctx | ours ms min / med | built-in ms min / med | ratio min / med | load |")
    print("|---|---|---|---|---|---|")
    rng = np.random.default_rng(0)
    stream = np.ones(int(args.evict_mb * (1 << 20)) // 4, np.float32)

    def evict():
        if stream.size:
            float(stream.sum())

    for cache in args.types.split(","):
        for rows in (int(r) for r in args.rows.split(",")):
            for ctx in (int(c) for c in args.ctx.split(",")):
                layers = []
                for _ in range(args.layers):
                    call = bench.Call([(ctx - rows, rows)], cache, rng, "f32", precision)
                    call.bind_ext(core, tmp, args.threads, hint)
                    call.bind_ov(core, args.threads, hint)
                    layers.append(call)
                for call in layers:  # warm-up: thread pools, page faults, plugin caches
                    call.run_ext()
                    call.run_ov()
                ours, builtin = [], []
                for _ in range(args.reps):
                    for call in layers:
                        # Both ops read the same cache buffers: each call meets them as the
                        # other op's call left them, unless a layer's weights went between.
                        evict()
                        t = time.perf_counter()
                        call.run_ext()
                        ours.append(time.perf_counter() - t)
                        evict()
                        t = time.perf_counter()
                        call.run_ov()
                        builtin.append(time.perf_counter() - t)
                o, b = np.array(ours) * 1e3, np.array(builtin) * 1e3
                print(f"| {cache} | {rows} x {ctx} | {o.min():.3f} / {np.median(o):.3f} | "
                      f"{b.min():.3f} / {np.median(b):.3f} | {b.min() / o.min():.2f}x / "
                      f"{np.median(b) / np.median(o):.2f}x | {os.getloadavg()[0]:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
