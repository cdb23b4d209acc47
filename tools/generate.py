"""Greedy generation on a paged LLM graph with a small continuous-batching schedule, OpenVINO's
built-in PagedAttentionExtension and our PagedAttention side by side on the same schedule.

    python tools/generate.py [--variant gqa4 | --model STATEFUL.xml] [--steps 80] [--threads N]

The schedule (``serve``): requests arrive over time; a prompt is prefilled in chunks of at most
``chunk`` tokens, in the same call as other requests' decode steps; blocks come from a shuffled free
list as sequences grow. Each model decodes from its own logits. Blocks are handed out here in
Python (this is not the project's cache manager / scheduler, src/cache/). Prints calls, generated
tokens, tokens per second of each model and the largest logit difference.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from paged_model import F32_CONFIG, PagedModel, Seq


class Request:
    def __init__(self, prompt, arrive, chunk):
        self.prompt, self.arrive, self.chunk = list(prompt), arrive, chunk
        self.done = 0  # tokens in the cache
        self.out = {}  # model index -> generated tokens
        self.blocks = []


def serve(models, requests, steps, num_blocks, rng, on_step=None):
    """Runs ``steps`` calls of every model in ``models`` (PagedModel, same block size) on one
    schedule. ``on_step(step, logits_per_model)`` may check each call. Returns the seconds each
    model spent in its calls."""
    bs = models[0].block_size
    free = list(rng.permutation(num_blocks))
    spent = [0.0] * len(models)
    for step in range(steps):
        live = [r for r in requests if r.arrive <= step]
        if not live:
            continue
        seqs = []
        for r in live:
            if r.done < len(r.prompt):
                new = r.prompt[r.done:r.done + r.chunk]
            else:  # all models agree on the tokens so far (on_step checks), follow model 0
                new = [r.out[0][-1]]
            while len(r.blocks) < -(-(r.done + len(new)) // bs):
                if not free:
                    raise RuntimeError(f"out of blocks at step {step}")
                r.blocks.append(int(free.pop()))
            seqs.append((r, Seq(new, r.done, list(r.blocks))))
        logits = []
        for i, m in enumerate(models):
            t0 = time.perf_counter()
            logits.append(m.step([s for _, s in seqs]))
            spent[i] += time.perf_counter() - t0
        end = 0
        for r, s in seqs:
            end += len(s.tokens)
            r.done += len(s.tokens)
            if r.done >= len(r.prompt):  # the last row of a finished prefill, or a decode
                for i, lg in enumerate(logits):
                    r.out.setdefault(i, []).append(int(np.argmax(lg[end - 1])))
        if on_step is not None:
            on_step(step, logits, requests)
    return spent


def main(argv=None):
    import openvino as ov

    import pa_convert
    import tiny_llm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--variant", choices=sorted(tiny_llm.VARIANTS), default="gqa4")
    src.add_argument("--model", type=Path, help="a stateful SDPA LLM IR (optimum-intel export)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--threads", type=int, help="INFERENCE_NUM_THREADS for both models")
    ap.add_argument("--extension", type=Path,
                    default=Path(__file__).resolve().parents[1] / "target/release/libpaged_attention.so")
    args = ap.parse_args(argv)

    core = ov.Core()
    core.add_extension(str(args.extension))
    stateful = (core.read_model(args.model) if args.model
                else tiny_llm.build(tiny_llm.VARIANTS[args.variant]))
    model = pa_convert.to_paged(stateful)
    config = dict(F32_CONFIG)
    if args.threads:
        config["INFERENCE_NUM_THREADS"] = args.threads
    with tempfile.TemporaryDirectory() as tmp:
        ours_xml = Path(tmp) / "ours.xml"
        pa_convert.convert_model(model, ours_xml)
        ours = core.compile_model(core.read_model(ours_xml), "CPU", config)
    builtin = core.compile_model(model, "CPU", config)
    vocab = builtin.outputs[0].get_partial_shape()[-1].get_length()

    rng = np.random.default_rng(0)
    requests = [Request(rng.integers(0, vocab, n), arrive, 48)
                for n, arrive in ((5, 0), (33, 0), (100, 2), (64, 5), (1, 9), (20, 12), (70, 15), (9, 20))]
    worst = [0.0]

    def check(step, logits, reqs):
        worst[0] = max(worst[0], float(np.abs(logits[0] - logits[1]).max()))
        for r in reqs:
            if r.out and r.out[0] != r.out[1]:
                raise SystemExit(f"step {step}: greedy tokens differ")

    models = [PagedModel(builtin, args.blocks), PagedModel(ours, args.blocks)]
    spent = serve(models, requests, args.steps, args.blocks, rng, check)
    generated = sum(len(r.out.get(0, [])) for r in requests)
    print(f"{args.steps} calls, {len(requests)} requests, {generated} generated tokens, identical greedy tokens")
    for name, s in zip(("OpenVINO built-in PagedAttentionExtension", "ours (PagedAttention extension)"), spent):
        print(f"  {name:42s} {s:7.3f} s  {generated / s:8.1f} generated tokens/s")
    print(f"  max |logits ours - built-in| = {worst[0]:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
