"""Greedy generation on a paged LLM graph, served by the project's scheduler and cache manager
(src/cache/, through its C ABI: tools/pa_scheduler.py), with OpenVINO's built-in
PagedAttentionExtension and our PagedAttention on the same schedule.

    python tools/generate.py [--variant gqa4 | --model STATEFUL.xml] [--threads N]

The loop (``serve``): requests arrive over time; each step the scheduler plans one op call
(continuous batching: decodes and prefill chunks of at most ``max_batched_tokens`` rows in one
call; prefix-cache hits; blocks from its pool); the loop performs the step's block copies on every
layer's caches, builds the rotation LUT when the step re-rotates keys, runs each model on the
step's inputs (the same block tables, past_lens and rotation inputs for both), sums our op's
``scores`` outputs over the layers into the scheduler (score-driven eviction when a sequence holds
more blocks than its budget; the kept blocks that move get the rotation inputs of the next call),
samples one greedy token per emitting sequence and completes the step. Planned forks add a parallel
sample of a decoding request (its second-best token) that shares the request's blocks. When the pool
runs out the scheduler preempts (frees a sequence and recomputes it later). Each model
decodes from its own logits; the scheduler follows ``lead`` (ours by default). Prints the event
counters, generated tokens, tokens per second of each model and the largest logit difference.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from paged_model import F32_CONFIG, PagedModel, Seq
from pa_scheduler import DEFAULT_EXTENSION, Library, Scheduler

BLOCK_SIZE = 32  # the CPU plugin's built-in op runs only this block size


@dataclass
class Arrival:
    id: int
    prompt: list
    step: int  # the request is added before this step is scheduled
    max_new_tokens: int


@dataclass
class Fork:
    """When request ``parent`` has generated ``after`` tokens, fork ``child`` from it with the
    parent's second-best token; the child generates up to ``max_new_tokens`` in all."""
    parent: int
    child: int
    after: int
    max_new_tokens: int


@dataclass
class Served:
    out: list  # per model: request id -> greedy tokens (a fork's list starts with its first token)
    first_past: dict  # request id -> past_len of its first scheduled chunk (> 0: a prefix hit)
    counters: dict
    calls: int = 0
    spent: list = field(default_factory=list)  # seconds in each model's calls

    def generated(self, i=0):
        return sum(len(t) for t in self.out[i].values())


def workload(vocab, seed=11, new_tokens=64):
    """The schedule the tests and the README run: 10 requests (prompts of 1 to 130 tokens)
    arriving over 20 steps, one repeating the first 70 tokens of request 0 (a prefix hit), and a
    fork of request 4 after its 3rd token. Each request generates ``new_tokens`` tokens."""
    rng = np.random.default_rng(seed)

    def prompt(n):
        return [int(t) for t in rng.integers(0, vocab, n)]

    p0 = prompt(80)
    plan = [(80, 0), (5, 0), (33, 1), (100, 2), (45, 3), (1, 5), (None, 6), (20, 10), (130, 14), (9, 20)]
    arrivals = []
    for rid, (n, step) in enumerate(plan):
        p = p0 if rid == 0 else (p0[:70] + prompt(20) if n is None else prompt(n))
        arrivals.append(Arrival(rid, p, step, new_tokens))
    forks = [Fork(parent=4, child=100, after=3, max_new_tokens=3 + new_tokens)]
    return arrivals, forks


def scheduler_config(num_blocks=24):
    """Scheduler settings of the tests and the README: 64-row calls (so long prompts are
    prefilled in chunks beside the decodes), eviction budget 3 blocks per sequence (first and last
    block kept), prefix caching on; 24 blocks make the pool run out (preemptions) in
    ``workload``."""
    return dict(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_batched_tokens=64, max_seqs=16,
                prefix_caching=True, eviction=(1, 1, 3))


def serve(models, sched: Scheduler, lib: Library, arrivals, forks, head_size, rope_base,
          lead=-1, pre_step=None, on_step=None, max_calls=1000) -> Served:
    """Runs the requests to completion. ``models``: PagedModels (the same graph but for the op,
    caches of ``sched``'s pool size). ``pre_step(st, models)`` runs after the copies, before the
    calls; ``on_step(st, logits, models)`` after them (each model's ``scores`` set)."""
    pending = sorted(arrivals, key=lambda a: a.step)
    plans = list(forks)
    res = Served(out=[{} for _ in models], first_past={}, counters={}, spent=[0.0] * len(models))
    last_row = {}  # request id -> the lead model's logits row it sampled from
    cache_pairs = [[(m.caches[k], m.caches["value" + k[3:]]) for k in m.caches if k.startswith("key_cache.")]
                   for m in models]
    step = 0
    while True:
        while pending and pending[0].step <= step:
            a = pending.pop(0)
            sched.add_request(a.id, a.prompt, a.max_new_tokens)
        waiting, running = sched.counts()
        if not pending and waiting + running == 0:
            break
        if res.calls >= max_calls:
            raise RuntimeError(f"not done after {max_calls} calls")
        st = sched.schedule()
        step += 1
        if not st.seq_ids:  # nothing runs until the next arrival
            sched.complete_step({})
            continue
        for pairs in cache_pairs:
            for kc, vc in pairs:
                lib.copy_blocks(kc, vc, st.copies)
        rotation = None
        if len(st.rotated_block_indices):
            rotation = (st.rotated_block_indices, st.rotation_deltas,
                        lib.rotation_lut(st.lut_rows, head_size, rope_base))
        seqs = [Seq(st.tokens_of(b), int(st.past_lens[b]), st.blocks_of(b)) for b in range(len(st.seq_ids))]
        for b, rid in enumerate(st.seq_ids):
            res.first_past.setdefault(rid, int(st.past_lens[b]))
        if pre_step is not None:
            pre_step(st, models)
        logits = []
        for i, m in enumerate(models):
            t0 = time.perf_counter()
            logits.append(m.step(seqs, rotation))
            res.spent[i] += time.perf_counter() - t0
        res.calls += 1
        sched.accumulate_scores(np.sum(models[lead].scores, axis=0))
        sampled = {}
        for b, rid in enumerate(st.seq_ids):
            if st.emits[b]:
                row = st.subsequence_begins[b + 1] - 1
                for i, lg in enumerate(logits):
                    res.out[i].setdefault(rid, []).append(int(np.argmax(lg[row])))
                sampled[rid] = res.out[lead][rid][-1]
                last_row[rid] = [lg[row] for lg in logits]
        if on_step is not None:
            on_step(st, logits, models)
        sched.complete_step(sampled)
        for f in list(plans):
            if len(res.out[lead].get(f.parent, [])) == f.after and f.parent in sampled:
                for i, row in enumerate(last_row[f.parent]):
                    res.out[i][f.child] = [int(np.argsort(row)[-2])]
                sched.fork(f.parent, f.child, res.out[lead][f.child][0], f.max_new_tokens)
                plans.remove(f)
    if plans:
        raise RuntimeError(f"forks never happened: {plans}")
    res.counters = sched.counters()
    return res


def main(argv=None):
    import openvino as ov

    import pa_convert
    import tiny_llm

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--variant", choices=sorted(tiny_llm.VARIANTS), default="gqa4")
    src.add_argument("--model", type=Path, help="a stateful SDPA LLM IR (optimum-intel export)")
    ap.add_argument("--rope-base", type=float, default=10000.0,
                    help="the model's RoPE base (rope_theta), for re-rotating moved keys")
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, help="INFERENCE_NUM_THREADS for both models")
    ap.add_argument("--extension", type=Path, default=DEFAULT_EXTENSION,
                    help="the OpenVINO extension module (its C ABI also drives the scheduler)")
    args = ap.parse_args(argv)

    core = ov.Core()
    core.add_extension(str(args.extension))

    def stateful():
        return (core.read_model(args.model) if args.model
                else tiny_llm.build(tiny_llm.VARIANTS[args.variant]))

    config = dict(F32_CONFIG)
    if args.threads:
        config["INFERENCE_NUM_THREADS"] = args.threads
    with tempfile.TemporaryDirectory() as tmp:  # ours: the project's converter
        ours_xml = Path(tmp) / "ours.xml"
        pa_convert.convert_model(stateful(), ours_xml, BLOCK_SIZE, serving=True)
        ours = core.compile_model(core.read_model(ours_xml), "CPU", config)
    model = pa_convert.to_paged(stateful(), BLOCK_SIZE, serving=True)  # the built-in op's graph
    builtin = core.compile_model(model, "CPU", config)
    vocab = builtin.outputs[0].get_partial_shape()[-1].get_length()
    head_size = int(pa_convert.pa_nodes(model)[0].get_rt_info()["k_head_size"].astype(int))

    arrivals, forks = workload(vocab, new_tokens=args.new_tokens)
    worst = [0.0]

    def check(st, logits, models):
        worst[0] = max(worst[0], float(np.abs(logits[0] - logits[1]).max()))

    lib = Library(args.extension)
    sched = Scheduler(lib, **scheduler_config(args.blocks))
    models = [PagedModel(builtin, args.blocks), PagedModel(ours, args.blocks)]
    res = serve(models, sched, lib, arrivals, forks, head_size, args.rope_base, on_step=check)
    same = res.out[0] == res.out[1]
    print(f"{res.calls} calls, {len(res.out[1])} requests ({len(forks)} forked), {res.generated(1)} generated "
          f"tokens, greedy tokens {'identical' if same else 'DIFFERENT'}")
    print("  scheduler: " + ", ".join(f"{k} {v}" for k, v in res.counters.items()))
    for name, s in zip(("OpenVINO built-in PagedAttentionExtension", "ours (PagedAttention extension)"), res.spent):
        print(f"  {name:42s} {s:7.3f} s  {res.generated(1) / s:8.1f} generated tokens/s")
    print(f"  max |logits ours - built-in| = {worst[0]:.2e}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
