"""Oracle: run one 16-input PagedAttention call through OpenVINO 2026.4.1's BUILT-IN
``PagedAttentionExtension`` (CPU plugin, f32, block size 32) and return
``(output, scores, key_cache_after, value_cache_after)`` like ``tools/pa_ref.py``.

How the 16 inputs of our op map onto the built-in op's 28 inputs (SPEC.md, "Using OpenVINO's built-in
op as an oracle"):

  ours 0..8 -> built-in 0..8 (query, key, value, key_cache, value_cache, past_lens,
                subsequence_begins, block_indices, block_indices_begins)
  9  scale           -> 9   f32 scalar; absent -> 0.0 (the CPU plugin reads 0 as 1/sqrt(D))
  10 sliding_window  -> 10  i32 scalar; absent -> 0
  11 alibi_slopes    -> 11  f32 [H]; absent -> empty [0]
  (none)             -> 12  max_context_len, i32 scalar = max(past_lens + n_s)
  15 score_agg_window-> 13  i32 [B] (the plugin rejects a scalar: broadcast it); w < 0 is replaced by
                            n_s (same meaning; a negative value crashes the plugin for n_s > 32);
                            absent -> [1]*B (SPEC: absent means 1)
  12 rotated_block_indices -> 14 i32 [R]; absent -> empty
  13 rotation_deltas -> 15  i32 [R,BS] or [R,1]; an [R] tensor is reshaped to [R,1] (same meaning,
                            the built-in's type check wants rank 2)
  14 rotation_trig_lut -> 16 f32 [M,D]; absent -> empty [0,D]
  16 sinks           -> 20  f32 Constant [1,H,1,1]; absent -> empty [0]
  17..27 xattention / adaptive-RKV / token_type_ids / qq_bias: empty tensors or zero scalars.

The node carries rt_info num_k_heads / k_head_size / num_v_heads / v_head_size and is compiled with
{"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}. Every input is bound with
``set_input_tensor`` on a shared ``ov.Tensor`` (so the in-place cache writes land in our arrays and the
plugin's default-tensor bug is avoided), on a freshly compiled model per call.

Only f32 data and block size 32 are supported; do not combine ALiBi with a sliding window (the plugin
drops ALiBi then) -- ``run_builtin`` raises ``Unsupported`` for these.
"""
from __future__ import annotations

import numpy as np

import openvino as ov
import openvino.opset13 as ops
from openvino._pyopenvino.op import _PagedAttentionExtension

from pa_ref import normalize_inputs

__all__ = ["run_builtin", "build_model", "infer", "Unsupported", "BUILTIN_BLOCK_SIZE"]

BUILTIN_BLOCK_SIZE = 32
_CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
_core = None


class Unsupported(Exception):
    """The built-in op cannot serve as an oracle for this call."""


def _get_core():
    global _core
    if _core is None:
        _core = ov.Core()
    return _core


def _f32(x):
    return np.require(x, dtype=np.float32, requirements="C")


def _i32(x):
    return np.require(x, dtype=np.int32, requirements="C")


def run_builtin(*inputs, raw_score_window=False, native_r_deltas=False, threads=None, **named):
    """Run the call through the built-in op. ``inputs``: the 9..17 inputs in SPEC order (the fields
    of ``pa_ref.Call``), positional or by name; numpy arrays (None/empty = absent). They are checked
    and normalised by ``pa_ref.normalize_inputs`` (ValueError for a malformed call). The caches are
    copied, never modified. Returns float32 arrays (output, scores, key_cache_after,
    value_cache_after).

    raw_score_window=True passes score_aggregation_window to the plugin as given (must already be
    [B] i32; a negative value is not replaced): only for probing the plugin itself.
    native_r_deltas=True passes [R] rotation_deltas to the plugin as a rank-1 tensor instead of
    reshaping it to [R,1].
    threads: INFERENCE_NUM_THREADS for the compiled model (models/gen.py uses 1 for reproducibility)."""
    x = normalize_inputs(*inputs, **named)
    c = x.call
    for name in ("query", "key", "value", "key_cache", "value_cache"):
        if np.asarray(getattr(c, name)).dtype != np.float32:
            raise Unsupported(f"{name}: only f32 data is supported by the oracle")
    q, k, v = _f32(c.query), _f32(c.key), _f32(c.value)
    kc = np.array(c.key_cache, dtype=np.float32, order="C", copy=True)
    vc = np.array(c.value_cache, dtype=np.float32, order="C", copy=True)
    Hkv, BS, D, H, B = x.Hkv, x.BS, x.D, x.H, x.B
    if BS != BUILTIN_BLOCK_SIZE:
        raise Unsupported(f"block size {BS}: the CPU plugin only runs block size 32")
    past, sb, bi, bib = (_i32(a) for a in (x.past, x.sb, x.bi, x.bib))

    scale_a = np.array(x.scale, dtype=np.float32)  # 0 when absent: the plugin reads it as 1/sqrt(D)
    sw_a = np.array(x.sliding_window, dtype=np.int32)
    alibi_a = np.zeros([0], np.float32) if x.alibi is None else _f32(c.alibi_slopes).reshape(-1)
    if alibi_a.size and sw_a > 0:
        raise Unsupported("ALiBi together with a sliding window: the CPU plugin drops ALiBi")
    max_ctx = np.array(int((x.past + x.n).max()) if B else 0, dtype=np.int32)

    if raw_score_window:
        saw_a = _i32(c.score_aggregation_window).reshape(-1)
    else:
        # [B] (the plugin rejects a scalar); w < 0 -> n_s (same meaning; a negative value crashes
        # the plugin for n_s > 32)
        saw_a = _i32(np.where(x.score_window < 0, x.n, x.score_window))

    if x.rotated_blocks is None:
        rbi_a = np.zeros([0], np.int32)
        rd_a = np.zeros([0, 1], np.int32)
        lut_a = np.zeros([0, D], np.float32)
    else:
        rbi_a = _i32(x.rotated_blocks)
        rd_a = _i32(c.rotation_deltas if native_r_deltas else x.rotation_deltas)
        lut_a = _f32(c.rotation_trig_lut)

    feeds = [q, k, v, kc, vc, past, sb, bi, bib, scale_a, sw_a, alibi_a, max_ctx, saw_a,
             rbi_a, rd_a, lut_a]
    model = build_model(H, Hkv, D, ov.Type.f32, rd_ndim=rd_a.ndim, sinks=x.sinks, Dv=x.Dv)
    config = dict(_CONFIG)
    if threads is not None:
        config["INFERENCE_NUM_THREADS"] = int(threads)
    out, scores = infer(model, feeds, config)
    return out, scores, kc, vc


def build_model(H, Hkv, D, cache_type, rd_ndim=2, sinks=None, Dv=None):
    """The 17 Parameters (inputs 0..16 of the built-in op, caches of element type ``cache_type``
    with fully dynamic shape, so the plugin can give them its own layout) -> built-in op -> 2 Results.
    Inputs 17..27 are empty Constants, but for ``sinks`` (H values: input 20 a [1, H, 1, 1]
    Constant). ``Dv``: the value head size (rt_info v_head_size), D when not given."""
    Dv = D if Dv is None else Dv
    f32, i32 = ov.Type.f32, ov.Type.i32
    specs = [
        ("query", f32, [-1, H * D]), ("key", f32, [-1, Hkv * D]), ("value", f32, [-1, Hkv * Dv]),
        ("key_cache", cache_type, [-1, -1, -1, -1]), ("value_cache", cache_type, [-1, -1, -1, -1]),
        ("past_lens", i32, [-1]), ("subsequence_begins", i32, [-1]), ("block_indices", i32, [-1]),
        ("block_indices_begins", i32, [-1]), ("scale", f32, []), ("sliding_window", i32, []),
        ("alibi_slopes", f32, [-1]), ("max_context_len", i32, []),
        ("score_aggregation_window", i32, [-1]), ("rotated_block_indices", i32, [-1]),
        ("rotation_deltas", i32, [-1] * rd_ndim), ("rotation_trig_lut", f32, [-1, D]),
    ]
    params = [ops.parameter(ov.PartialShape(shape), et, name=name) for name, et, shape in specs]
    extra = [
        ops.constant(np.zeros([0], np.float32)),  # 17 xattention_threshold
        ops.constant(np.array(0, np.int32)),  # 18 xattention_block_size
        ops.constant(np.array(0, np.int32)),  # 19 xattention_stride
        ops.constant(np.zeros([0], np.float32) if sinks is None  # 20 sinks
                     else np.asarray(sinks, np.float32).reshape(1, H, 1, 1)),
        ops.constant(np.array(0, np.int32)),  # 21 adaptive_rkv_start_size
        ops.constant(np.zeros([0], np.int32)),  # 22 adaptive_rkv_evictable_sizes
        ops.constant(np.zeros([0], np.int32)),  # 23 adaptive_rkv_diversity_block_set_indices
        ops.constant(np.zeros([0], np.int32)),  # 24 ... begins
        ops.constant(np.zeros([0], np.int32)),  # 25 token_type_ids
        ops.constant(np.zeros([0], np.uint8)),  # 26 qq_bias
        ops.constant(np.zeros([0], np.int32)),  # 27 qq_bias_begins
    ]
    node = _PagedAttentionExtension([p.output(0) for p in params] + [e.output(0) for e in extra])
    rt = node.get_rt_info()
    rt["num_k_heads"] = Hkv
    rt["k_head_size"] = D
    rt["num_v_heads"] = Hkv
    rt["v_head_size"] = Dv
    return ov.Model([ops.result(node.output(0)), ops.result(node.output(1))], params, "pa_oracle")


def infer(model, feeds, config):
    """Compile ``model`` with ``config`` and run it once on ``feeds`` (17 arrays, bound as shared
    tensors so the in-place cache writes land in the caller's arrays). Returns (output, scores)."""
    compiled = _get_core().compile_model(model, "CPU", config)
    req = compiled.create_infer_request()
    tensors = [ov.Tensor(a, shared_memory=True) for a in feeds]
    for i, t in enumerate(tensors):
        req.set_input_tensor(i, t)
    req.infer()
    out = np.array(req.get_output_tensor(0).data, dtype=np.float32, copy=True)
    scores = np.array(req.get_output_tensor(1).data, dtype=np.float32, copy=True)
    del req, compiled, tensors
    return out, scores
