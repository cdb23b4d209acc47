"""OpenVINO's built-in PagedAttentionExtension (CPU, f32, block 32) run on our 16 inputs, as an
oracle (SPEC.md, "Using OpenVINO's built-in op as an oracle"; OPENVINO.md lists the bugs steered
around here). (tools/ov_builtin.py on branch `golden` is the project's full version.)

`builtin(inputs)` returns float32 arrays (output, scores, key_cache after, value_cache after); the
caller's arrays are not modified.
"""

import numpy as np
import openvino as ov
import openvino.opset13 as ops
from openvino._pyopenvino.op import _PagedAttentionExtension

from ref64 import given

CONFIG = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}


def builtin(inputs, core=None):
    core = core or ov.Core()
    q, k, v = (np.ascontiguousarray(inputs[i], np.float32) for i in range(3))
    kc, vc = (np.array(inputs[i], np.float32, copy=True) for i in (3, 4))
    past, sb, bi, bib = (np.ascontiguousarray(inputs[i], np.int32).reshape(-1) for i in range(5, 9))
    NB, Hkv, BS, D = kc.shape
    assert BS == 32, "the CPU plugin runs block size 32 only"
    B = past.shape[0]
    n = sb[1:] - sb[:-1]
    g = lambda i: given(inputs, i)  # noqa: E731
    scale = np.array(0.0 if g(9) is None else g(9).reshape(-1)[0], np.float32)
    sw = np.array(0 if g(10) is None else g(10).reshape(-1)[0], np.int32)
    alibi = np.zeros(0, np.float32) if g(11) is None else g(11).astype(np.float32).reshape(-1)
    assert not (alibi.size and sw > 0), "the plugin drops ALiBi with a sliding window"
    max_ctx = np.array((past + n).max(), np.int32)
    # The plugin wants [B] (no scalar), and a negative value crashes it for n_s > 32: pass n_s.
    w = np.ones(B, np.int64) if g(15) is None else np.broadcast_to(g(15).reshape(-1).astype(np.int64), (B,))
    w = np.where(w < 0, n, w).astype(np.int32)
    if g(12) is None:
        rbi, rd, lut = np.zeros(0, np.int32), np.zeros((0, 1), np.int32), np.zeros((0, D), np.float32)
    else:
        rbi = g(12).astype(np.int32).reshape(-1)
        rd = np.asarray(inputs[13], np.int32)
        rd = np.ascontiguousarray(rd.reshape(-1, 1) if rd.ndim == 1 else rd)
        lut = np.ascontiguousarray(inputs[14], np.float32)
    feeds = [q, k, v, kc, vc, past, sb, bi, bib, scale, sw, alibi, max_ctx, w, rbi, rd, lut]
    params = [ops.parameter(ov.PartialShape([-1] * a.ndim), ov.Type(a.dtype), name=f"in{i}")
              for i, a in enumerate(feeds)]
    params[1] = ops.parameter(ov.PartialShape([-1, Hkv * D]), ov.Type.f32, name="in1")
    params[2] = ops.parameter(ov.PartialShape([-1, Hkv * D]), ov.Type.f32, name="in2")
    params[3] = ops.parameter(ov.PartialShape([-1, Hkv, BS, D]), ov.Type.f32, name="in3")
    params[4] = ops.parameter(ov.PartialShape([-1, Hkv, BS, D]), ov.Type.f32, name="in4")
    params[0] = ops.parameter(ov.PartialShape([-1, q.shape[1]]), ov.Type.f32, name="in0")
    params[16] = ops.parameter(ov.PartialShape([-1, D]), ov.Type.f32, name="in16")
    extra = [np.zeros(0, np.float32), np.array(0, np.int32), np.array(0, np.int32), np.zeros(0, np.float32),
             np.array(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32),
             np.zeros(0, np.int32), np.zeros(0, np.uint8), np.zeros(0, np.int32)]
    node = _PagedAttentionExtension([p.output(0) for p in params] + [ops.constant(e).output(0) for e in extra])
    rt = node.get_rt_info()
    rt["num_k_heads"], rt["k_head_size"], rt["num_v_heads"], rt["v_head_size"] = Hkv, D, Hkv, D
    model = ov.Model([ops.result(node.output(0)), ops.result(node.output(1))], params, "oracle")
    req = core.compile_model(model, "CPU", CONFIG).create_infer_request()
    tensors = [ov.Tensor(a, shared_memory=True) for a in feeds]
    for i, t in enumerate(tensors):
        req.set_input_tensor(i, t)
    req.infer()
    out = np.array(req.get_output_tensor(0).data, np.float32, copy=True)
    scores = np.array(req.get_output_tensor(1).data, np.float32, copy=True)
    return out, scores, kc, vc
