"""A model's whole step with our op against the same graph with OpenVINO's built-in op: one
stateful SDPA LLM (SmolLM2-135M-Instruct's directory by default, built once under target/)
turned into two paged graphs in one process, OpenVINO's own ``PagedAttentionExtension`` graph
and ours (``pa_convert.py``), both compiled with the same configuration; a prompt of ``--past``
tokens prefilled into each, then ``--steps`` steps of ``--rows`` new tokens each (1: a decode
step; k + 1: a speculative verify step), the two graphs' steps alternated, each step timed
around infer(). With ``--profile`` OpenVINO's per-node counters (``PERF_COUNT``) give each graph's
time by node type (as shares: the plugin's counters do not add up to wall time): the attention
nodes are ``Reference`` (ours, an extension op) and ``PagedAttentionExtension`` (the built-in).

    .venv/bin/python tools/bench_step.py [MODEL_DIR] [--past 440] [--rows 1] [--steps 200]
                                         [--hint f32] [--threads 2] [--profile] [--ext LIB]

Prints the median and minimum step of each graph and the ratio ours / built-in (below 1: ours
is faster). Both graphs read the same weights in the same node order; only the attention nodes
differ, so the ratio is the attention's share of a step, OpenVINO's handling of each op
included. The extension is ``target/release/libpaged_attention_openvino.so`` unless ``--ext`` names
another build's.
"""
from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pa_convert  # noqa: E402
from paged_model import PagedModel, Seq  # noqa: E402

EXT = Path(__file__).resolve().parents[1] / "target" / "release" / "libpaged_attention_openvino.so"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model_dir", type=Path, nargs="?", help="default: SmolLM2-135M-Instruct, built once")
    ap.add_argument("--past", type=int, default=440, help="prompt tokens before the first step")
    ap.add_argument("--rows", type=int, default=1, help="new tokens a step")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--hint", default="f32", help="INFERENCE_PRECISION_HINT and KV_CACHE_PRECISION")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="per-node-type times (PERF_COUNT)")
    ap.add_argument("--ext", type=Path, default=EXT, help="our extension (another build's, say)")
    args = ap.parse_args()
    if args.model_dir is None:
        import gguf_model
        args.model_dir = gguf_model.smollm2_dir(log=lambda m: print(m, file=sys.stderr))
    import openvino as ov
    core = ov.Core()
    core.add_extension(str(args.ext))
    xml = str(args.model_dir / "openvino_model.xml")
    cfg = {"INFERENCE_PRECISION_HINT": args.hint, "KV_CACHE_PRECISION": args.hint,
           "INFERENCE_NUM_THREADS": args.threads, "PERF_COUNT": args.profile}
    ours_xml = Path(tempfile.mkdtemp(prefix="pa_bench_step_")) / "ours.xml"
    pa_convert.convert_file(xml, ours_xml, cache_type=args.hint)
    compiled = {
        "built-in": core.compile_model(pa_convert.to_paged(core.read_model(xml), cache_type=args.hint),
                                       "CPU", cfg),
        "ours": core.compile_model(core.read_model(str(ours_xml)), "CPU", cfg),
    }
    bs = 32
    blocks = list(range(-(-(args.past + args.steps * args.rows) // bs)))
    models = {k: PagedModel(c, len(blocks)) for k, c in compiled.items()}
    prompt = list(np.random.default_rng(0).integers(100, 40000, args.past))
    for m in models.values():
        m.step([Seq(prompt, 0, blocks)])
    times = collections.defaultdict(list)
    prof = {k: collections.defaultdict(float) for k in models}
    names = list(models)
    for i in range(args.steps):
        for name in (names if i % 2 else names[::-1]):
            m = models[name]
            m.step([Seq([5] * args.rows, args.past + i * args.rows, blocks)])
            if args.profile:
                for pi in m.req.profiling_info:
                    prof[name][pi.node_type] += pi.real_time.total_seconds() * 1e3
            times[name].append(m.last_infer_s)
    med = {k: float(np.median(v)) * 1e3 for k, v in times.items()}
    print(f"# {args.model_dir.name}: past {args.past}, {args.rows} row(s) a step, {args.steps} steps, "
          f"hint {args.hint}, {args.threads} threads, load {os.getloadavg()[0]:.1f}")
    for k, v in times.items():
        print(f"{k:9s} step median {med[k]:.3f} ms, min {min(v) * 1e3:.3f} ms")
    print(f"ours / built-in: {med['ours'] / med['built-in']:.3f} (medians)")
    if args.profile:
        # The CPU plugin's counters do not add up to the step's wall time (their sum is several
        # times it on 2 threads), so each node type is shown as a share of the graph's sum, and
        # that share of the measured median step.
        print("| node type | ours: share, ms a step | built-in: share, ms a step |\n|---|---|---|")
        total = {k: sum(v.values()) or 1.0 for k, v in prof.items()}
        types = sorted(set(prof["ours"]) | set(prof["built-in"]),
                       key=lambda t: -max(prof["ours"].get(t, 0), prof["built-in"].get(t, 0)))
        for t in types[:8]:
            cells = [f"{prof[k].get(t, 0) / total[k]:.1%}, {prof[k].get(t, 0) / total[k] * med[k]:.3f}"
                     for k in ("ours", "built-in")]
            print(f"| {t} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
