"""Benchmark, as users deploy: our op inside OpenVINO (the extension, default configuration:
CPU pinning on, the first call into our library made by `infer()`), OpenVINO's built-in
PagedAttentionExtension, and our bare C ABI (`pa_execute_ex`, secondary), in one process on identical
inputs (the same buffers), at each thread count asked for.

    .venv/bin/python tools/bench.py [--threads 2,all] [--hint f32] [--reps 15]
                                    [--only decode16,prefill] [--types f32,f16,bf16,u8,u4] [--json out.json]
                                    [--chart bench.svg]
    .venv/bin/python tools/bench.py --from-json out.json --chart bench.png   (chart only, no run)

Shapes: H=32, Hkv=8, D=128, block 32; query f32, cache f32/f16/bf16/u8 (u8: OpenVINO's default layout,
keys by channel, values by token, the same buffers for both ops; hint f32 unless --hint says). Both OpenVINO models are
compiled with the same INFERENCE_PRECISION_HINT (--hint) and INFERENCE_NUM_THREADS = the thread
count; every other property keeps OpenVINO's default (pinning included). The built-in op also gets
KV_CACHE_PRECISION = cache type. The default hint is the cache's type (how an f16 or bf16
deployment runs; on CPUs without native f16/bf16 the plugin falls back to f32 and the extension
bypasses the Convert it puts in front of the caches), and the built-in op refuses a bf16 cache
under an f32 hint on AVX-512 CPUs. The C ABI path uses the library's own pool, sized with
pa_set_num_threads. Each repetition runs the paths back to back (so machine noise hits them
alike); the table gives min and median ms, the ratio OpenVINO built-in / ours inside OpenVINO
(min/min), ours inside OpenVINO against the bare C ABI call, KV GB/s (cache bytes the attention
must read, at the min time) and GFLOP/s (4*D flops per visible (query head, key) pair) with our
share of the read bandwidth and FMA peak that target/release/pa_machine measures in the same run
(prefill and mixed rows whose prefill items run on bf16 products: also the share of the peak that
applies, the AMX-BF16 tile peak on the amx tier, else the bf16 dot-product (`vdpbf16ps`) peak).
Our op computes in the precision of the hint (bf16 for a bf16 hint, or for no hint on a CPU whose
default is bf16; else f32): its `inference_precision` attribute inside OpenVINO, the `precision`
argument of pa_execute_ex.
Outputs of the paths are compared (max abs difference) as a sanity check. A thread-scaling table
(parallel efficiency t1 / (n * tn)) follows when more than one thread count is measured.
--chart FILE (.svg or .png, matplotlib) draws min ms of ours inside OpenVINO and of OpenVINO's
built-in op, per workload and cache type, one panel per thread count, with the ratio above each pair.
--ab LIB times another build's C library (B, e.g. a copy of main's target/release/libpaged_attention.so)
right after this checkout's (A) in every repetition, on the same inputs, and prints a "# A/B" line per
row with min and median of each and the median of the per-repetition ratios B/A (above 1: this checkout
is faster; also in --json as ab_min, ab_med, ab_ratio): on a host whose speed drifts by tens of percent
between runs, the paired ratio is what tells two builds apart (two runs of one build: 0.99-1.03).
"""
from __future__ import annotations

import argparse
import ctypes as ct
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
LIB = ROOT / "target" / "release" / "libpaged_attention.so"  # the C library
EXT = ROOT / "target" / "release" / "libpaged_attention_openvino.so"  # the OpenVINO extension
MACHINE = ROOT / "target" / "release" / "pa_machine"
H, HKV, D, BS = 32, 8, 128, 32

WORKLOADS = {
    "decode16": ("decode 16 x 1024 past", [(1024, 1)] * 16),
    "decode4": ("decode 4 x 4096 past", [(4096, 1)] * 4),
    "prefill": ("prefill 1 x 1024", [(0, 1024)]),
    "mixed": ("mixed 256 on 768 + 15 x 1024 decode", [(768, 256)] + [(1024, 1)] * 15),
}
ELEM = {"f32": 0, "f16": 1, "bf16": 2, "i32": 3, "u8": 4, "u4": 5}
PRECISION = {"f32": 0, "bf16": 1}  # pa_precision (include/paged_attention.h)
QUANT = ("u8", "u4")


class PaTensor(ct.Structure):
    _fields_ = [("elem_type", ct.c_int32), ("rank", ct.c_int32), ("dims", ct.c_int64 * 8), ("data", ct.c_void_p)]


def pa_tensor(arr: np.ndarray, elem: str) -> PaTensor:
    t = PaTensor()
    t.elem_type = ELEM[elem]
    t.rank = arr.ndim
    for i, d in enumerate(elem_dims(arr, elem)):
        t.dims[i] = d
    t.data = arr.ctypes.data
    return t


def u8_caches(rng, NB):
    """u8 caches in OpenVINO's default layout (docs/contract.md, "u8 caches"): keys by channel
    [NB, Hkv, BS + 8, D] (per block and head D f32 scales, D f32 zero points, BS rows of bytes),
    values by token [NB, Hkv, BS, D + 8] (f32 scale, f32 zero point, D bytes per row)."""
    kc = rng.integers(0, 256, (NB, HKV, BS + 8, D), dtype=np.uint8)
    params = np.concatenate([rng.uniform(0.004, 0.008, (NB, HKV, D)),
                             rng.uniform(100, 150, (NB, HKV, D))], axis=-1).astype(np.float32)
    kc[:, :, :8, :] = params.view(np.uint8).reshape(NB, HKV, 8, D)
    vc = rng.integers(0, 256, (NB, HKV, BS, D + 8), dtype=np.uint8)
    vparams = np.stack([rng.uniform(0.004, 0.008, (NB, HKV, BS)),
                        rng.uniform(100, 150, (NB, HKV, BS))], axis=-1).astype(np.float32)
    vc[..., :8] = vparams.view(np.uint8).reshape(NB, HKV, BS, 8)
    return kc, vc


def elem_dims(arr: np.ndarray, elem: str):
    """The tensor's dims in elements: a u4 cache's last dim counts nibbles (two per byte)."""
    return list(arr.shape[:-1]) + [arr.shape[-1] * 2] if elem == "u4" else list(arr.shape)


def u4_caches(rng, NB):
    """u4 caches in OpenVINO's default u4 layout (docs/contract.md, "u4 caches"), as bytes: keys by
    channel [NB, Hkv, BS + 16, D] nibbles = bytes [NB, Hkv, BS + 16, D / 2] (per block and head D
    f32 scales, D f32 zero points, BS rows of D / 2 bytes), values by token [NB, Hkv, BS, D + 16]
    nibbles = bytes [..., D / 2 + 8] (f32 scale, f32 zero point, D / 2 bytes per row)."""
    kc = rng.integers(0, 256, (NB, HKV, BS + 16, D // 2), dtype=np.uint8)
    params = np.concatenate([rng.uniform(0.06, 0.13, (NB, HKV, D)),
                             rng.uniform(6, 9, (NB, HKV, D))], axis=-1).astype(np.float32)
    kc[:, :, :16, :] = params.view(np.uint8).reshape(NB, HKV, 16, D // 2)
    vc = rng.integers(0, 256, (NB, HKV, BS, D // 2 + 8), dtype=np.uint8)
    vparams = np.stack([rng.uniform(0.06, 0.13, (NB, HKV, BS)),
                        rng.uniform(6, 9, (NB, HKV, BS))], axis=-1).astype(np.float32)
    vc[..., :8] = vparams.view(np.uint8).reshape(NB, HKV, BS, 8)
    return kc, vc


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    b = a.astype(np.float32).view(np.uint32)
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)


class Call:
    """One workload's inputs, in buffers both implementations use."""

    def __init__(self, seqs, cache: str, rng, qtype: str = "f32", precision: str = "f32"):
        self.seqs, self.cache, self.qtype = seqs, cache, qtype
        # Our op's inference precision (the hint both models are compiled with): the extension's
        # attribute and pa_execute_ex's argument.
        self.precision_name = precision
        self.precision = PRECISION[precision]
        n = [s[1] for s in seqs]
        self.T = sum(n)
        self.B = len(seqs)
        nblocks = [-(-(p + k) // BS) for p, k in seqs]
        NB = sum(nblocks)
        perm = rng.permutation(NB).astype(np.int32)
        self.q = rng.uniform(-1, 1, (self.T, H * D)).astype(np.float32)
        self.k = rng.uniform(-1, 1, (self.T, HKV * D)).astype(np.float32)
        self.v = rng.uniform(-1, 1, (self.T, HKV * D)).astype(np.float32)
        # A bf16 query (and key/value) for our paths; the built-in op gets the same values as f32.
        self.qkv = [self.q, self.k, self.v]
        if qtype == "bf16":
            self.qkv = [f32_to_bf16_bits(a) for a in self.qkv]
            self.q, self.k, self.v = [(b.astype(np.uint32) << 16).view(np.float32) for b in self.qkv]
        kc = rng.uniform(-1, 1, (NB, HKV, BS, D)).astype(np.float32)
        vc = rng.uniform(-1, 1, (NB, HKV, BS, D)).astype(np.float32)
        if cache == "u8":
            kc, vc = u8_caches(rng, NB)
        elif cache == "u4":
            kc, vc = u4_caches(rng, NB)
        elif cache == "f16":
            kc, vc = kc.astype(np.float16), vc.astype(np.float16)
        elif cache == "bf16":
            kc, vc = f32_to_bf16_bits(kc), f32_to_bf16_bits(vc)
        self.kc, self.vc = kc, vc
        self.past = np.array([p for p, _ in seqs], np.int32)
        self.sb = np.concatenate([[0], np.cumsum(n)]).astype(np.int32)
        self.bi = perm
        self.bib = np.concatenate([[0], np.cumsum(nblocks)]).astype(np.int32)
        odt = np.uint16 if qtype == "bf16" else np.float32
        self.out = np.zeros((self.T, H * D), odt)
        self.scores = np.zeros(int(self.past.sum()) + self.T, odt)
        esize = 4 if cache == "f32" else 2
        self.kv_bytes = sum((p + k) for p, k in seqs) * HKV * D * 2 * esize
        if cache == "u8":  # key and value bytes, 8 per value row, 8*D per key block
            self.kv_bytes = (sum((p + k) for p, k in seqs) * HKV * (2 * D + 8)
                             + sum(nblocks) * HKV * 8 * D)
        if cache == "u4":  # half a byte per value, 8 bytes per value row, 8*D per key block
            self.kv_bytes = (sum((p + k) for p, k in seqs) * HKV * (D + 8)
                             + sum(nblocks) * HKV * 8 * D)
        self.flops = sum(sum(p + i + 1 for i in range(k)) for p, k in seqs) * H * D * 4

    # --- ours, C ABI
    def bind_ours(self, lib):
        qt = self.qtype
        ins = [pa_tensor(self.qkv[0], qt), pa_tensor(self.qkv[1], qt), pa_tensor(self.qkv[2], qt),
               pa_tensor(self.kc, self.cache), pa_tensor(self.vc, self.cache),
               pa_tensor(self.past, "i32"), pa_tensor(self.sb, "i32"), pa_tensor(self.bi, "i32"),
               pa_tensor(self.bib, "i32")]
        self._ins = (PaTensor * len(ins))(*ins)
        self._outs = (PaTensor * 2)(pa_tensor(self.out, qt), pa_tensor(self.scores, qt))
        self._lib = lib

    def run_ours(self):
        rc = self._lib.pa_execute_ex(self._ins, len(self._ins), self._outs, 2, None, self.precision)
        if rc != 0:
            buf = ct.create_string_buffer(1024)
            self._lib.pa_last_error_message(buf, 1024)
            raise RuntimeError(f"pa_execute_ex: {rc}: {buf.value.decode()}")

    # --- OpenVINO built-in
    def bind_ov(self, core, threads, hint):
        import openvino as ov
        import openvino.opset13 as ops
        from openvino._pyopenvino.op import _PagedAttentionExtension
        ctype = {"f32": ov.Type.f32, "f16": ov.Type.f16, "bf16": ov.Type.bf16, "u8": ov.Type.u8,
                 "u4": ov.Type.dynamic}[self.cache]
        # u8, u4: the plugin gives the cache ports its own layout (the one our buffers have)
        cdims = [-1] * 4 if self.cache in QUANT else [-1, HKV, BS, D]
        f32, i32 = ov.Type.f32, ov.Type.i32
        max_ctx = np.array(max(p + k for p, k in self.seqs), np.int32)
        feeds = [
            ("query", f32, [-1, H * D], self.q), ("key", f32, [-1, HKV * D], self.k),
            ("value", f32, [-1, HKV * D], self.v),
            ("key_cache", ctype, cdims, self.kc), ("value_cache", ctype, cdims, self.vc),
            ("past_lens", i32, [-1], self.past), ("subsequence_begins", i32, [-1], self.sb),
            ("block_indices", i32, [-1], self.bi), ("block_indices_begins", i32, [-1], self.bib),
            ("scale", f32, [], np.array(0.0, np.float32)), ("sliding_window", i32, [], np.array(0, np.int32)),
            ("alibi_slopes", f32, [-1], np.zeros([0], np.float32)), ("max_context_len", i32, [], max_ctx),
            ("score_aggregation_window", i32, [-1], np.ones(self.B, np.int32)),
            ("rotated_block_indices", i32, [-1], np.zeros([0], np.int32)),
            ("rotation_deltas", i32, [-1, -1], np.zeros([0, 1], np.int32)),
            ("rotation_trig_lut", f32, [-1, D], np.zeros([0, D], np.float32)),
        ]
        params = [ops.parameter(ov.PartialShape(s), et, name=nm) for nm, et, s, _ in feeds]
        extra = [ops.constant(np.zeros([0], np.float32)), ops.constant(np.array(0, np.int32)),
                 ops.constant(np.array(0, np.int32)), ops.constant(np.zeros([0], np.float32)),
                 ops.constant(np.array(0, np.int32)), ops.constant(np.zeros([0], np.int32)),
                 ops.constant(np.zeros([0], np.int32)), ops.constant(np.zeros([0], np.int32)),
                 ops.constant(np.zeros([0], np.int32)), ops.constant(np.zeros([0], np.uint8)),
                 ops.constant(np.zeros([0], np.int32))]
        node = _PagedAttentionExtension([p.output(0) for p in params] + [e.output(0) for e in extra])
        rt = node.get_rt_info()
        rt["num_k_heads"], rt["k_head_size"], rt["num_v_heads"], rt["v_head_size"] = HKV, D, HKV, D
        model = ov.Model([ops.result(node.output(0)), ops.result(node.output(1))], params, "pa_bench")
        cfg = {"KV_CACHE_PRECISION": self.cache, "INFERENCE_NUM_THREADS": threads}
        if hint is not None:
            cfg["INFERENCE_PRECISION_HINT"] = hint
        self._ov_compiled = core.compile_model(model, "CPU", cfg)
        self._ov_req = self._ov_compiled.create_infer_request()
        self._ov_tensors = []
        for i, (nm, et, _, a) in enumerate(feeds):
            if i in (3, 4) and self.cache == "u4":
                t = ov.Tensor(a, elem_dims(a, "u4"), ov.Type.u4)
            elif et == ov.Type.bf16:
                t = ov.Tensor(a, list(a.shape), et)
            else:
                t = ov.Tensor(a, shared_memory=True)
            self._ov_tensors.append(t)
            self._ov_req.set_input_tensor(i, t)

    # --- ours through OpenVINO (the extension in the same library), when it is built in
    def bind_ext(self, core, tmpdir, threads, hint):
        import openvino as ov
        sys.path.insert(0, str(ROOT / "tools"))
        from ir_writer import IRBuilder, Port
        b = IRBuilder("pa_ext_bench")
        qt = self.qtype
        ins = [("query", qt, [-1, H * D], self.qkv[0]), ("key", qt, [-1, HKV * D], self.qkv[1]),
               ("value", qt, [-1, HKV * D], self.qkv[2]),
               ("key_cache", self.cache, [-1] + elem_dims(self.kc, self.cache)[1:], self.kc),
               ("value_cache", self.cache, [-1] + elem_dims(self.vc, self.cache)[1:], self.vc),
               ("past_lens", "i32", [-1], self.past), ("subsequence_begins", "i32", [-1], self.sb),
               ("block_indices", "i32", [-1], self.bi), ("block_indices_begins", "i32", [-1], self.bib)]
        srcs = [b.parameter(nm, et, dims) for nm, et, dims, _ in ins]
        node = b.op("pa", "PagedAttention", "ie_internal_opset", srcs,
                    [Port(i, et, dims) for i, (_, et, dims, _) in enumerate(ins)],
                    [Port(len(ins), qt, [-1, H * D]), Port(len(ins) + 1, qt, [-1])])
        node.data = {"inference_precision": self.precision_name}
        b.result("output", (node, len(ins)))
        b.result("scores", (node, len(ins) + 1))
        xml = Path(tmpdir) / f"pa_{id(self)}.xml"
        xml.write_text(b.xml())
        xml.with_suffix(".bin").write_bytes(bytes(b.bin))
        model = core.read_model(str(xml))
        cfg = {"INFERENCE_NUM_THREADS": threads}
        if hint is not None:
            cfg["INFERENCE_PRECISION_HINT"] = hint
        self._ext_compiled = core.compile_model(model, "CPU", cfg)
        self._ext_req = self._ext_compiled.create_infer_request()
        self._ext_tensors = []
        for i, (_, et, _, a) in enumerate(ins):
            if et == "u4":
                t = ov.Tensor(a, elem_dims(a, "u4"), ov.Type.u4)
            elif et == "bf16":
                t = ov.Tensor(a, list(a.shape), ov.Type.bf16)
            else:
                t = ov.Tensor(a, shared_memory=True)
            self._ext_tensors.append(t)
            self._ext_req.set_input_tensor(i, t)

    def run_ext(self):
        self._ext_req.infer(share_outputs=True)

    def run_ov(self):
        self._ov_req.infer(share_outputs=True)

    def our_outputs(self):
        if self.qtype == "bf16":
            return [(a.astype(np.uint32) << 16).view(np.float32) for a in (self.out, self.scores)]
        return [self.out, self.scores]

    def ov_outputs(self):
        return (np.array(self._ov_req.get_output_tensor(0).data, np.float32),
                np.array(self._ov_req.get_output_tensor(1).data, np.float32))


def timed(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--only", default=",".join(WORKLOADS))
    ap.add_argument("--types", default="f32,f16,bf16,bf16q",
                    help="cache types; bf16q = a bf16 cache with the query, key and value declared bf16 "
                         "for our op (the built-in op gets the same values as f32 under the bf16 hint)")
    ap.add_argument("--threads", default="2,all", help="thread counts, 'all' = the CPUs of this process")
    ap.add_argument("--hint", default="cache",
                    help="INFERENCE_PRECISION_HINT for both OpenVINO models: f32, f16, bf16, 'default' = "
                         "none set (OpenVINO's default config: bf16 on CPUs with AVX512-BF16 or AMX), or "
                         "'cache' = the cache's type (how an f16 or bf16 deployment runs). Our op computes "
                         "in the hint's precision (bf16, else f32), given as its inference_precision "
                         "attribute and pa_execute_ex's argument")
    ap.add_argument("--ab", metavar="LIB",
                    help="also time another build's C library (B) after this checkout's (A) in every "
                         "repetition and print the median paired ratio B/A (see above)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--chart", help="also draw the results to this .svg or .png file")
    ap.add_argument("--from-json", help="no benchmark: read the rows --json wrote (use with --chart)")
    args = ap.parse_args()
    if args.from_json:
        if not args.chart:
            ap.error("--from-json needs --chart")
        saved = json.loads(Path(args.from_json).read_text())
        write_chart(saved["rows"], args.chart)
        print(f"wrote {args.chart}")
        return 0
    ncpu = len(os.sched_getaffinity(0))
    threads = sorted({ncpu if t == "all" else int(t) for t in args.threads.split(",")})

    import openvino as ov
    lib = ct.CDLL(str(LIB))
    lib.pa_execute_ex.restype = ct.c_int32
    lib.pa_set_num_threads.argtypes = [ct.c_size_t]
    lib_b = None
    if args.ab:
        lib_b = ct.CDLL(str(Path(args.ab).resolve()))
        lib_b.pa_set_num_threads.argtypes = [ct.c_size_t]
        if not hasattr(lib_b, "pa_execute_ex"):
            raise SystemExit(f"--ab {args.ab}: no pa_execute_ex")
        lib_b.pa_execute_ex.restype = ct.c_int32
    core = ov.Core()
    default_hint = str(core.get_property("CPU", "INFERENCE_PRECISION_HINT"))
    default_hint = {"<Type: 'bfloat16'>": "bf16", "<Type: 'float32'>": "f32",
                    "<Type: 'float16'>": "f16"}.get(default_hint, default_hint)
    has_ext = EXT.is_file()
    import tempfile
    tmpdir = tempfile.mkdtemp(prefix="pa_bench_")
    if has_ext:
        core.add_extension(str(EXT))
    print(f"# OpenVINO {ov.__version__.split('-')[0]}, INFERENCE_PRECISION_HINT={args.hint} for both ops "
          f"(this CPU's default: {default_hint}), "
          f"{ncpu} CPUs; our extension: {'yes' if has_ext else 'n/a (no ' + str(EXT) + ': cargo build --release -p paged_attention_openvino)'}")
    hdr = ("| workload | cache | threads | ours in OV ms min / med | OV built-in ms min / med | ratio OV/ours "
           "| ours C ABI ms min (in OV vs C ABI) | GB/s in OV (% read BW) "
           "| GFLOP/s in OV (% FMA peak[, % bf16 dot or AMX peak]) "
           "| OV GB/s | max abs diff |")
    rows = []
    first = True
    for nthr in threads:
        machine = json.loads(subprocess.run([str(MACHINE)], capture_output=True, text=True, check=True,
                                            env=dict(os.environ, RAYON_NUM_THREADS=str(nthr))).stdout)
        # The AMX share only where our calls run on the tiles: the CPU has AMX and PA_SIMD (which
        # pa_machine reads as the library does) does not lower the level below it.
        runs = machine.get("runs", machine["simd"])
        amx_peak = machine.get("amx_bf16_gflops") if runs == "Amx" else None
        dot_peak = machine.get("dot_bf16_gflops") if runs in ("Avx512Bf16", "Amx") else None
        amx_txt = f", AMX-BF16 tile peak {amx_peak:.0f} GFLOP/s" if amx_peak else ""
        amx_txt += f", bf16 dot-product peak {dot_peak:.0f} GFLOP/s" if dot_peak else ""
        print(f"\n## {nthr} threads; machine: read {machine['read_gbs']:.1f} GB/s, "
              f"FMA peak {machine['fma_gflops']:.0f} GFLOP/s ({machine['simd']}"
              f"{'' if runs == machine['simd'] else f', our calls at {runs}'}){amx_txt}")
        print(hdr)
        print("|---" * (hdr.count("|") - 1) + "|")
        rng = np.random.default_rng(0)
        for key in args.only.split(","):
            label, seqs = WORKLOADS[key]
            for ctype in args.types.split(","):
                cache, qtype = ("bf16", "bf16") if ctype == "bf16q" else (ctype, "f32")
                hint = (cache if cache not in QUANT else "f32") if args.hint == "cache" else args.hint
                hint = None if hint == "default" else hint
                precision = "bf16" if (hint or default_hint) == "bf16" else "f32"
                call = Call(seqs, cache, rng, qtype, precision)
                call.bind_ours(lib)
                try:
                    call.bind_ov(core, nthr, hint)
                    ov_err = None
                except Exception as e:  # the built-in op refuses some hint/cache pairs on some CPUs
                    ov_err = f"refused: {str(e).splitlines()[0][:50]}"
                ext_err = None if has_ext else "n/a"
                if has_ext:
                    try:
                        call.bind_ext(core, tmpdir, nthr, hint)
                    except Exception as e:  # reported in the table, the other columns still run
                        ext_err = f"error: {str(e).splitlines()[0][:60]}"
                if first and ext_err is None:
                    call.run_ext()  # the process's first call into our library, from infer()
                    first = False
                lib.pa_set_num_threads(nthr)
                if lib_b is not None:
                    lib_b.pa_set_num_threads(nthr)

                def run_b():
                    call._lib = lib_b
                    try:
                        call.run_ours()
                    finally:
                        call._lib = lib
                for _ in range(2):  # warm-up (thread pools, page faults, plugin caches)
                    if ext_err is None:
                        call.run_ext()
                    if ov_err is None:
                        call.run_ov()
                    call.run_ours()
                    if lib_b is not None:
                        run_b()
                ours, ovt, ext, ab = [], [], [], []
                for _ in range(args.reps):
                    if ext_err is None:
                        ext.append(timed(call.run_ext))
                    if ov_err is None:
                        ovt.append(timed(call.run_ov))
                    ours.append(timed(call.run_ours))
                    if lib_b is not None:
                        ab.append(timed(run_b))
                if ab:
                    ratios = statistics.median(b / a for a, b in zip(ours, ab))
                    print(f"#   A/B {label} {ctype} {nthr} thr: A (this checkout) {min(ours):.2f} / "
                          f"{statistics.median(ours):.2f} ms, B ({args.ab}) {min(ab):.2f} / "
                          f"{statistics.median(ab):.2f} ms (min / median); median B/A {ratios:.3f}",
                          flush=True)
                omin = min(ours)
                diff = float("nan")
                if ov_err is None:
                    v_out, v_sc = call.ov_outputs()
                    o_out, o_sc = call.our_outputs()
                    diff = max(float(np.abs(o_out - v_out).max()), float(np.abs(o_sc - v_sc).max()))
                emin = min(ext) if ext else None
                vmin = min(ovt) if ovt else None
                t = emin if emin is not None else omin
                gbs, gfl = call.kv_bytes / t / 1e6, call.flops / t / 1e6
                row = dict(workload=label, key=key, cache=ctype, threads=nthr, hint=hint or f"default ({default_hint})",
                           precision=precision, ours_min=omin,
                           ours_med=statistics.median(ours), ov_min=vmin,
                           ov_med=statistics.median(ovt) if ovt else None, ext_min=emin,
                           ext_med=statistics.median(ext) if ext else None,
                           ratio=(vmin / emin) if (vmin and emin) else None, gbs=gbs,
                           bw_pct=100 * gbs / machine["read_gbs"], gflops=gfl,
                           fma_pct=100 * gfl / machine["fma_gflops"], diff=diff, machine=machine)
                # Prefill items under bf16 math (the bf16 precision or a bf16 query) run on bf16
                # products (mixed: its 256 prefill tokens hold 94% of the visible pairs): their limit
                # is the AMX tiles' peak on the amx tier, else the bf16 dot-product peak. On the amx
                # tier a bf16 cache also runs its f32 math on tiles.
                bf16_math = precision == "bf16" or qtype == "bf16"
                on_bf16 = key in ("prefill", "mixed") and (bf16_math or (amx_peak and cache == "bf16"))
                row["amx_pct"] = 100 * gfl / amx_peak if (on_bf16 and amx_peak) else None
                row["dot_pct"] = 100 * gfl / dot_peak if (on_bf16 and dot_peak and not amx_peak) else None
                if ab:
                    row.update(ab_min=min(ab), ab_med=statistics.median(ab), ab_ratio=ratios)
                rows.append(row)
                ext_txt = ext_err or f"{emin:.2f} / {row['ext_med']:.2f}"
                ov_txt = ov_err or f"{vmin:.2f} / {row['ov_med']:.2f}"
                ratio_txt = f"{row['ratio']:.2f}x" if row["ratio"] else "-"
                vs = f" ({100 * (emin / omin - 1):+.0f}%)" if emin else ""
                ov_gbs = f"{call.kv_bytes / vmin / 1e6:.1f}" if vmin else "-"
                print(f"| {label} | {ctype} | {nthr} | {ext_txt} | {ov_txt} | {ratio_txt} | {omin:.2f}{vs} "
                      f"| {gbs:.1f} ({row['bw_pct']:.0f}%) | {gfl:.0f} ({row['fma_pct']:.0f}%{amx_share(row)}) "
                      f"| {ov_gbs} "
                      f"| {diff:.1e} |", flush=True)
                del call
    if len(threads) > 1:
        print("\n## Thread scaling (min ms; efficiency = t1 / (n * tn) against the smallest count n0, "
              "scaled to n0 = 1)")
        print("| workload | cache | " + " | ".join(f"{n} thr ours in OV / OV (eff ours / OV)" for n in threads) + " |")
        print("|---|---|" + "---|" * len(threads))
        for key in args.only.split(","):
            for cache in args.types.split(","):
                rs = {r["threads"]: r for r in rows if r["key"] == key and r["cache"] == cache}
                n0 = threads[0]
                cells = []
                for n in threads:
                    r = rs.get(n)
                    if not r or not r["ext_min"]:
                        cells.append("-")
                        continue
                    eff = rs[n0]["ext_min"] * n0 / (n * r["ext_min"]) if rs[n0]["ext_min"] else float("nan")
                    if r["ov_min"] and rs[n0]["ov_min"]:
                        oeff = rs[n0]["ov_min"] * n0 / (n * r["ov_min"])
                        cells.append(f"{r['ext_min']:.2f} / {r['ov_min']:.2f} ({100 * eff:.0f}% / {100 * oeff:.0f}%)")
                    else:
                        cells.append(f"{r['ext_min']:.2f} / - ({100 * eff:.0f}%)")
                print(f"| {WORKLOADS[key][0]} | {cache} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(threads=threads, hint=args.hint, rows=rows), indent=1))
    if args.chart:
        write_chart(rows, args.chart)
        print(f"\nwrote {args.chart}")


def amx_share(row):
    """", x.x% AMX" for a row whose prefill items ran on AMX tiles, ", x.x% bf16 dot" for one
    whose items ran on `vdpbf16ps`, else ""."""
    if row.get("amx_pct") is not None:
        return f", {row['amx_pct']:.1f}% AMX"
    return f", {row['dot_pct']:.1f}% bf16 dot" if row.get("dot_pct") is not None else ""


def write_chart(rows, path):
    """Bars of min ms, ours inside OpenVINO vs OpenVINO's built-in op, per (workload, cache type),
    one panel per thread count; the built-in / ours ratio above each pair (> 1: ours is faster).
    The format follows the file's suffix (.svg keeps text as text, so it can be searched)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    plt.rcParams["svg.fonttype"] = "none"
    threads = sorted({r["threads"] for r in rows})
    if not threads:
        raise ValueError("no benchmark rows to draw")
    per_panel = max(sum(r["threads"] == n for r in rows) for n in threads)
    fig, axes = plt.subplots(len(threads), 1, figsize=(max(8, 0.75 * per_panel), 4.4 * len(threads)),
                             squeeze=False)
    for ax, n in zip(axes[:, 0], threads):
        rs = [r for r in rows if r["threads"] == n]
        labels = [f"{r['workload']}, {r['cache']}" for r in rs]
        x = np.arange(len(rs))
        ours = [r["ext_min"] if r["ext_min"] is not None else r["ours_min"] for r in rs]
        ovb = [r["ov_min"] if r["ov_min"] is not None else 0.0 for r in rs]
        ax.bar(x - 0.2, ours, 0.4, label="ours in OpenVINO", color="#1f77b4")
        ax.bar(x + 0.2, ovb, 0.4, label="OpenVINO built-in", color="#d62728")
        for k, r in enumerate(rs):
            if r.get("ratio"):
                ax.annotate(f"{r['ratio']:.2f}x", (x[k], max(ours[k], ovb[k])), ha="center",
                            va="bottom", fontsize=8)
        ax.set_xticks(x, labels, fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("min ms (lower is better)")
        ax.set_title(f"{n} thread{'s' if n != 1 else ''}")
        ax.legend(fontsize=8)
    fig.suptitle("PagedAttention: ours inside OpenVINO vs OpenVINO's built-in op")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
