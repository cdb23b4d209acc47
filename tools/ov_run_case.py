"""Run golden cases (models/<case>/) through OpenVINO with our extension loaded; `pa conformance`
calls this once for all cases and compares what it writes.

    .venv/bin/python tools/ov_run_case.py --ext target/release/libpaged_attention_openvino.so \
        --out OUTDIR CASEDIR [CASEDIR...]

For each case it writes OUTDIR/<case dir name>/: out_0_output.npy and out_1_scores.npy (float32),
cache_key.npy and cache_value.npy (the caller's cache buffers after the call, in the cache type; bf16
as uint16 bits), and info.json ({"infer_ms", "compile_ms", "caches_in_place", "note"}), or
error.txt when the case could not run. Every input is an ov.Tensor over memory this script owns,
set explicitly on the request (OPENVINO.md: in-place cache writes reach the caller only through
shared buffers; set every input on every request).

f16/bf16 caches: OpenVINO's CPU plugin puts a Convert (to f32) between an f16 or bf16 cache
Parameter and the op unless it runs the model in that precision natively (INFERENCE_PRECISION_HINT=f16
on a CPU with native f16; bf16 likewise); the extension bypasses that Convert, so the op writes the
caller's cache either way. The hint is chosen per case (f16 where the CPU has native f16, bf16 for
bf16 caches, f32 otherwise), and whether the caches reach the op directly is still read from the
compiled runtime graph: when they do not, info.json says caches_in_place=false and the caches are
not compared.
"""
import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import openvino as ov


def load_input(path, element_type):
    """An ov.Tensor that owns a copy of the file's data; the request writes caches into it.
    (ov.Tensor(array, shared_memory=True) turns a 0-d array into shape [1], which a scalar
    Parameter rejects.)"""
    a = np.load(path)
    ov_type, np_type = {"f32": (ov.Type.f32, np.float32), "f16": (ov.Type.f16, np.float16),
                        "bf16": (ov.Type.bf16, np.uint16), "i32": (ov.Type.i32, np.int32),
                        "u8": (ov.Type.u8, np.uint8)}[element_type]
    a = np.array(a, dtype=np_type, order="C")  # (ascontiguousarray would make a 0-d array 1-d)
    t = ov.Tensor(ov_type, list(a.shape))
    if a.size:
        d = t.data
        (d.view(np.uint16) if element_type == "bf16" else d)[...] = a
    return t


def as_f32(t):
    """Output tensor as float32 (bf16 decoded from its bits)."""
    d = t.data
    if t.element_type == ov.Type.bf16:
        bits = np.asarray(d).view(np.uint16).astype(np.uint32) << 16
        return bits.view(np.float32).copy()
    return np.asarray(d, dtype=np.float32).copy()


def cache_npy(t, element_type):
    d = t.data
    if element_type == "bf16":
        return np.asarray(d).view(np.uint16).copy()
    return np.array(d, copy=True)


def caches_reach_op_directly(model, compiled):
    """True when, in the compiled (runtime) graph, inputs 3 and 4 of our op come straight from
    the model's inputs, so in-place writes reach the caller's buffers. The CPU plugin inserts a
    Convert in front of f16/bf16 caches when it does not run the model in that precision."""
    pa = [op.get_friendly_name() for op in model.get_ordered_ops() if op.get_type_name() == "PagedAttention"]
    for op in compiled.get_runtime_model().get_ordered_ops():
        if op.get_friendly_name() in pa:
            kinds = [op.input(i).get_source_output().get_node().get_rt_info()["layerType"].astype(str)
                     for i in (3, 4)]
            return all(k == "Input" for k in kinds)
    return False


def run_case(core, case_dir, out_dir, native_f16):
    case = json.loads((case_dir / "case.json").read_text())
    model = core.read_model(str(case_dir / "model.xml"))
    by_name = {}
    for e in case["inputs"]:
        if e.get("file"):
            by_name[e["name"]] = e
    cache_type = case.get("cache_dtype", case.get("dtype", "f32"))
    hint = {"f16": "f16" if native_f16 else "f32", "bf16": "bf16"}.get(cache_type, "f32")
    t0 = time.perf_counter()
    compiled = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": hint})
    compile_ms = (time.perf_counter() - t0) * 1e3
    in_place = caches_reach_op_directly(model, compiled)
    req = compiled.create_infer_request()
    tensors = {}
    for i, port in enumerate(compiled.inputs):
        name = port.get_node().get_friendly_name()
        entry = by_name.get(name)
        if entry is None:
            names = port.get_names()
            entry = next((by_name[n] for n in names if n in by_name), None)
        if entry is None:
            raise RuntimeError(f"no input file for Parameter `{name}`")
        t = load_input(case_dir / entry["file"], entry["element_type"])
        tensors[entry["index"]] = (t, entry["element_type"])
        req.set_input_tensor(i, t)
    t0 = time.perf_counter()
    req.infer()
    infer_ms = (time.perf_counter() - t0) * 1e3
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "out_0_output.npy", as_f32(req.get_output_tensor(0)))
    np.save(out_dir / "out_1_scores.npy", as_f32(req.get_output_tensor(1)))
    for idx, fname in [(3, "cache_key.npy"), (4, "cache_value.npy")]:
        if idx in tensors:
            t, et = tensors[idx]
            np.save(out_dir / fname, cache_npy(t, et))
    note = "" if in_place else (
        f"the CPU plugin feeds the op a converted copy of the {cache_type} caches (hint {hint}): "
        "written there, not in place")
    (out_dir / "info.json").write_text(json.dumps({
        "infer_ms": infer_ms, "compile_ms": compile_ms, "caches_in_place": in_place,
        "hint": hint, "note": note}))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ext", required=True, help="the extension module (libpaged_attention_openvino.so)")
    ap.add_argument("--out", required=True, help="directory for the results")
    ap.add_argument("cases", nargs="+", help="case directories")
    args = ap.parse_args()
    core = ov.Core()
    core.add_extension(args.ext)
    native_f16 = "FP16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES")
    out_root = Path(args.out)
    for k, c in enumerate(args.cases):
        case_dir = Path(c)
        out_dir = out_root / case_dir.name
        print(f"[openvino {k + 1}/{len(args.cases)}] {case_dir.name}", file=sys.stderr, flush=True)
        try:
            run_case(core, case_dir, out_dir, native_f16)
        except Exception as e:  # one broken case must not hide the others
            out_dir.mkdir(parents=True, exist_ok=True)
            (out_dir / "error.txt").write_text(f"{type(e).__name__}: {e}")


if __name__ == "__main__":
    main()
