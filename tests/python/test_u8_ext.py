"""u8 caches in OpenVINO's layout through our extension, in the real runtime, against OpenVINO's
built-in op compiled with KV_CACHE_PRECISION=u8 (tools/ov_u8_cache.py) on the same schedule of
calls: a batched prefill, decodes, a chunked prefill that grows a by-channel key block. Each op
keeps its own caches (starting from the same zero bytes); after every call the cache bytes must be
equal and the outputs within 1e-2. Needs the release extension module (`cargo build --release -p paged_attention_openvino`).
"""

import numpy as np
import openvino as ov
import pytest

from ir_writer import paged_attention_ir, pa_port_dims
from ov_u8_cache import cache_shapes, run_u8, u8_config
from test_openvino_ext import Runner, core, max_err  # noqa: F401 (core is a fixture)

H, HKV, D, BS, NB = 4, 2, 64, 32, 6
# (past, new) of sequences A and B per call; A's blocks [3, 0], B's [5]
SCHEDULE = [((0, 0), (45, 10)), ((45, 10), (1, 1)), ((46, 11), (5, 1)), ((51, 12), (1, 1))]
BLOCKS = ([3, 0], [5])
LAYOUTS = {
    "by_channel": dict(),
    "by_channel_value_groups_16": dict(value_group=16),
    "by_token_keys": dict(key_by_token=True),
    "by_token_key_groups_8_value_groups_32": dict(key_by_token=True, key_group=8, value_group=32),
}


def compile_ours(core, tmp_path, kc, vc):
    types = {np.dtype(np.float32): "f32", np.dtype(np.int32): "i32", np.dtype(np.uint8): "u8"}
    ports = []
    for i in range(9):
        if i in (3, 4):
            ports.append(("u8", [-1] + list((kc, vc)[i - 3].shape[1:])))
        else:
            et = "f32" if i < 3 else "i32"
            ports.append((et, pa_port_dims(i, (), H, HKV, D, BS)))
    assert all(t in types.values() for t, _ in ports)
    xml = paged_attention_ir(ports).write(tmp_path / "pa_u8.xml")
    return core.compile_model(core.read_model(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_u8_caches_match_the_builtin_op_bytes_and_outputs(core, tmp_path, name):
    layout = LAYOUTS[name]
    cfg = u8_config(**layout)
    ks, vs = cache_shapes(NB, HKV, D, **layout)
    kc_ov, vc_ov = np.zeros(ks, np.uint8), np.zeros(vs, np.uint8)
    kc, vc = kc_ov.copy(), vc_ov.copy()
    run = Runner(compile_ours(core, tmp_path, kc, vc))
    rng = np.random.default_rng(len(name))
    bi = np.array(BLOCKS[0] + BLOCKS[1], np.int32)
    bib = np.array([0, len(BLOCKS[0]), len(bi)], np.int32)
    worst = 0.0
    for step, (past, new) in enumerate(SCHEDULE):
        T = sum(new)
        q = rng.standard_normal((T, H * D)).astype(np.float32)
        k = rng.standard_normal((T, HKV * D)).astype(np.float32)
        v = rng.standard_normal((T, HKV * D)).astype(np.float32)
        past_a = np.array(past, np.int32)
        sb = np.array([0, new[0], T], np.int32)
        out_ov, kc_ov, vc_ov = run_u8(D, k, v, kc_ov, vc_ov, past_a, sb, bi, bib, cfg, query=q, H=H)
        out, _ = run([q, k, v, kc, vc, past_a, sb, bi, bib])
        assert np.array_equal(kc, kc_ov), f"{name} step {step}: key cache bytes differ " \
            f"({int(np.count_nonzero(kc != kc_ov))} of {kc.size})"
        assert np.array_equal(vc, vc_ov), f"{name} step {step}: value cache bytes differ " \
            f"({int(np.count_nonzero(vc != vc_ov))} of {vc.size})"
        e = max_err(out, out_ov)
        assert e <= 1e-2, f"{name} step {step}: output max error {e:.3g} vs the built-in op"
        worst = max(worst, e)
    assert np.count_nonzero(kc) > 0 and np.count_nonzero(vc) > 0
    print(f"{name}: worst output distance to the built-in op {worst:.2e}")
