"""The library as an OpenVINO extension, in the real runtime (openvino 2026.4.1, CPU plugin).

Needs the release extension module:
    cargo build --release -p paged_attention_openvino
(path from $PA_EXTENSION_LIB, default target/release/libpaged_attention_openvino.so). A missing library or
a missing OpenVINO fails these tests. One test reads the item counters that only an extension built
with the feature test-hooks exports (`cargo build --release -p paged_attention_openvino
--no-default-features --features paged_attention/test-hooks`): it is skipped on any other build, and
fails instead when PA_TEST_HOOKS=1 (scripts/test.sh runs it so, on such a build in target/test-hooks);
test_extension_exports_no_test_hooks checks that the extension under test has no hooks otherwise.

Every model is tools/ir_writer.py's `paged_attention_ir` (Parameters -> PagedAttention -> 2
Results). Each call is compared with the float64 reference (tools/pa_ref.py) and, for f32 and block
32, with OpenVINO's built-in PagedAttentionExtension (tools/ov_builtin.py) on the same inputs
(conftest.py puts tools/ on sys.path). Caches are compared on slots
that hold tokens and on blocks no sequence references (SPEC.md, "Slots that hold no token").
Every input tensor is set explicitly on every request (OPENVINO.md: plugin bug with default
tensors), from buffers kept alive as long as the request.
"""

import ctypes
import os
import zlib
from pathlib import Path

import numpy as np
import openvino as ov  # (a missing openvino fails here, it is not skipped)
import pytest

from ir_writer import paged_attention_ir, pa_port_dims
from ov_builtin import run_builtin
from pa_ref import paged_attention_ref


def reference(inputs):
    """float64 reference of one call (inputs in SPEC order). Values written into an f16 cache are
    not rounded (cache_dtype=None): the CPU plugin runs the op on an f32 copy of an f16 cache unless
    it runs f16 natively, and test_f16_cache_... asks for the rounding itself."""
    return paged_attention_ref(*inputs)


def builtin(inputs):
    """OpenVINO's built-in op on the same call (f32, block 32), in its own Core."""
    return run_builtin(*inputs)

ROOT = Path(__file__).resolve().parents[2]
EXT_LIB = Path(os.environ.get("PA_EXTENSION_LIB", ROOT / "target/release/libpaged_attention_openvino.so"))
TOL = 2e-6  # f32: |ours - other| <= TOL * max(1, |other|)


@pytest.fixture(scope="module")
def core():
    if not EXT_LIB.is_file():
        pytest.fail(f"{EXT_LIB} not found: build it with `cargo build --release -p paged_attention_openvino` "
                    "(or set PA_EXTENSION_LIB)")
    c = ov.Core()
    c.add_extension(str(EXT_LIB))
    return c


# ---------------------------------------------------------------------------- cases

def make_case(rng, *, H=4, Hkv=2, D=16, BS=32, past=(0,), new=(1,), spare_blocks=2, scale=None,
              sliding_window=None, alibi=False, rotation=None, window=None, n_inputs=None,
              cache_dtype=np.float32, extra_tokens=0, sinks=False, Dv=None):
    """The 16 inputs (17 with `sinks`: a [1, H, 1, 1] logit per head; trimmed to the last given
    one, or `n_inputs`; values `Dv` wide when given) for sequences with `past[s]`
    cached and `new[s]` new tokens. Blocks are a random permutation with `spare_blocks`
    unreferenced ones and a -1 pad after each sequence's list; each sequence gets blocks for
    `extra_tokens` more tokens (for later steps). rotation: None, or the form of
    rotation_deltas ("per_token" [R,BS], "per_block" [R,1], "flat" [R])."""
    B = len(past)
    need = [-(-(p + n + extra_tokens) // BS) for p, n in zip(past, new)]
    NB = sum(need) + spare_blocks
    perm = rng.permutation(NB).astype(np.int32)
    bi, bib, used = [], [0], 0
    for c in need:
        bi += list(perm[used:used + c]) + [-1]
        used += c
        bib.append(len(bi))
    T = sum(new)
    Dv = D if Dv is None else Dv
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    inputs = [
        f(T, H * D), f(T, Hkv * D), f(T, Hkv * Dv),
        f(NB, Hkv, BS, D).astype(cache_dtype), f(NB, Hkv, BS, Dv).astype(cache_dtype),
        np.array(past, np.int32), np.concatenate([[0], np.cumsum(new)]).astype(np.int32),
        np.array(bi, np.int32), np.array(bib, np.int32),
        np.array(0.0 if scale is None else scale, np.float32),
        np.array(0 if sliding_window is None else sliding_window, np.int32),
        (rng.uniform(-0.5, 0.0, H).astype(np.float32) if alibi else np.zeros(0, np.float32)),
        np.zeros(0, np.int32), np.zeros((0, 0), np.int32), np.zeros((0, D), np.float32),
        np.array(window if window is not None else [1] * B, np.int32),
    ]
    if rotation:
        R, M = 3, 8
        inputs[12] = rng.choice(NB, R, replace=False).astype(np.int32)
        shape = {"per_token": (R, BS), "per_block": (R, 1), "flat": (R,)}[rotation]
        inputs[13] = rng.integers(0, M, shape).astype(np.int32)
        ang = rng.uniform(-np.pi, np.pi, (M, D // 2))
        inputs[14] = np.concatenate([np.cos(ang), np.sin(ang)], axis=1).astype(np.float32)
    if window is None:
        inputs[15] = np.zeros(0, np.int32)
    if sinks:
        inputs.append((1.0 + 1.5 * rng.standard_normal((1, H, 1, 1))).astype(np.float32))
    last = n_inputs or max(i + 1 for i, a in enumerate(inputs) if i < 9 or a.size)
    return inputs[:last]


def checked_slots(inputs):
    """[NB, BS] mask of cache slots a test may compare: slots holding a token after the call, and
    every slot of blocks no sequence references."""
    NB, _, BS, _ = inputs[3].shape
    past, sb, bi, bib = (np.asarray(inputs[i]).reshape(-1) for i in range(5, 9))
    mask = np.ones((NB, BS), bool)
    for s in range(len(past)):
        L = past[s] + sb[s + 1] - sb[s]
        for slot_block in bi[bib[s]:bib[s + 1]]:
            if slot_block >= 0:
                mask[slot_block] = False
        for p in range(L):
            mask[bi[bib[s] + p // BS], p % BS] = True
    return mask


def read_ext_model(core, tmp_path, inputs):
    """A model whose Parameters have the element types of `inputs` and dynamic T, NB, B, ...
    (rotation_deltas dynamic in every dimension)."""
    types = {np.dtype(np.float32): "f32", np.dtype(np.float16): "f16", np.dtype(np.int32): "i32"}
    NB, Hkv, BS, D = inputs[3].shape
    H = inputs[0].shape[1] // D
    ports = [(types[np.asarray(a).dtype], pa_port_dims(i, np.shape(a), H, Hkv, D, BS))
             for i, a in enumerate(inputs)]
    if len(inputs) > 13:
        ports[13] = ("i32", [-1] * np.asarray(inputs[13]).ndim)
    return core.read_model(paged_attention_ir(ports).write(tmp_path / "pa.xml"))


def compile_ext(core, tmp_path, inputs, config=None):
    """`read_ext_model`, compiled for the CPU with `config`."""
    return core.compile_model(read_ext_model(core, tmp_path, inputs), "CPU", config or {})


class Runner:
    """One infer request of a compiled model; sets every input on every call, sharing the
    caller's arrays (so cache writes land in them), and keeps them alive with the request."""

    def __init__(self, compiled):
        self.req = compiled.create_infer_request()
        self.alive = []

    def __call__(self, inputs):
        tensors = [ov.Tensor(a, shared_memory=True) for a in inputs]
        self.alive.append((inputs, tensors))
        for i, t in enumerate(tensors):
            self.req.set_input_tensor(i, t)
        self.req.infer()
        return (np.array(self.req.get_output_tensor(0).data, copy=True),
                np.array(self.req.get_output_tensor(1).data, copy=True))


def max_err(ours, other):
    ours, other = np.asarray(ours, np.float64), np.asarray(other, np.float64)
    assert ours.shape == other.shape, f"shape {ours.shape}, expected {other.shape}"
    return float(np.max(np.abs(ours - other) / np.maximum(1.0, np.abs(other)), initial=0.0))


def assert_close(what, ours, other):
    e = max_err(ours, other)
    assert e <= TOL, f"{what}: max error {e:.3g} > {TOL} (scaled by max(1, |expected|))"
    return e


def assert_call_matches(what, before, after, out, scores, expected):
    """`after` are the inputs after our call (caches written in place), `before` a copy taken
    before; `expected` = (output, scores, key_cache, value_cache)."""
    m = checked_slots(before)
    errs = [assert_close(f"{what} output", out, expected[0]),
            assert_close(f"{what} scores", scores, expected[1])]
    for name, i, exp in (("key_cache", 3, expected[2]), ("value_cache", 4, expected[3])):
        errs.append(assert_close(f"{what} {name}", after[i].transpose(0, 2, 1, 3)[m],
                                 np.asarray(exp).transpose(0, 2, 1, 3)[m]))
    return max(errs)


CASES = {
    "decode": dict(past=(37, 5, 64), new=(1, 1, 1)),
    "prefill": dict(past=(0,), new=(45,)),
    "mixed": dict(past=(0, 40, 7), new=(33, 1, 9)),
    "gqa_4_to_1": dict(H=8, Hkv=2, past=(20, 3), new=(2, 30)),
    "mha_seed_shapes": dict(H=8, Hkv=8, D=16, past=(10,), new=(3,)),
    "sliding_window": dict(past=(50, 0), new=(3, 40), sliding_window=7),
    "alibi": dict(past=(33, 0), new=(2, 20), alibi=True),
    "explicit_scale": dict(past=(12,), new=(4,), scale=0.3),
    "rotation_per_token": dict(past=(40, 20), new=(2, 1), rotation="per_token"),
    "rotation_per_block": dict(past=(40, 20), new=(2, 1), rotation="per_block"),
    "rotation_flat": dict(past=(40, 20), new=(2, 1), rotation="flat"),
    "window_absent_9_inputs": dict(past=(5, 8), new=(6, 2), n_inputs=9),
    "window_absent_empty": dict(past=(5, 8), new=(6, 2)),
    "window_scalar": dict(past=(5, 8), new=(6, 2), window=3),
    "window_per_seq_all_forms": dict(past=(5, 8, 2, 0), new=(6, 2, 3, 40), window=[3, 0, -1, 35]),
    "window_larger_than_new": dict(past=(5,), new=(4,), window=[10]),
    "sinks_decode": dict(past=(37, 5, 64), new=(1, 1, 1), sinks=True),
    "sinks_mixed_scores": dict(H=8, Hkv=2, past=(0, 40, 7), new=(33, 1, 9), window=[-1, 1, 4],
                               sinks=True),
    "sinks_window_rotation": dict(past=(50, 20), new=(3, 40), sliding_window=7, rotation="per_token",
                                  sinks=True),
    "value_head_wider": dict(past=(37, 0, 5), new=(1, 30, 2), Dv=32),
    "value_head_narrower": dict(H=8, Hkv=2, D=32, past=(20, 3), new=(2, 30), Dv=16, window=[-1, 2],
                                rotation="per_block"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_float64_reference_and_builtin_op(core, tmp_path, name):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    inputs = make_case(rng, **CASES[name])
    before = [a.copy() for a in inputs]
    out, scores = Runner(compile_ext(core, tmp_path, inputs))(inputs)
    e64 = assert_call_matches(f"{name} vs float64", before, inputs, out, scores, reference(before))
    eov = assert_call_matches(f"{name} vs built-in", before, inputs, out, scores, builtin(before))
    print(f"{name}: max scaled error vs float64 {e64:.3g}, vs built-in op {eov:.3g}")


def test_bad_block_id_raises_our_message_and_next_call_works(core, tmp_path):
    rng = np.random.default_rng(1)
    good = make_case(rng, past=(3,), new=(2,))
    run = Runner(compile_ext(core, tmp_path, good))
    bad = [a.copy() for a in good]
    bad[7][0] = bad[3].shape[0] + 5
    bad_before = [a.copy() for a in bad]
    with pytest.raises(RuntimeError, match=r"PA_STATUS_VALUE: block_indices\[0\] = \d+ is outside"):
        run(bad)
    assert all(np.array_equal(a, b) for a, b in zip(bad, bad_before)), "a rejected call wrote into a buffer"
    before = [a.copy() for a in good]
    out, scores = run(good)
    assert_call_matches("good call after a bad one", before, good, out, scores, reference(before))


def test_five_decode_steps_feed_caches_back(core, tmp_path):
    rng = np.random.default_rng(2)
    inputs = make_case(rng, past=(30, 31), new=(1, 1), spare_blocks=1, extra_tokens=4)
    run = Runner(compile_ext(core, tmp_path, inputs))
    ref_caches = [inputs[3].copy(), inputs[4].copy()]
    for step in range(5):
        past = inputs[5] + step
        step_in = list(inputs)
        step_in[0], step_in[1], step_in[2] = (rng.standard_normal(a.shape).astype(np.float32) for a in inputs[:3])
        step_in[5] = past.astype(np.int32)
        ref_in = [a.copy() for a in step_in]
        ref_in[3], ref_in[4] = ref_caches
        exp = reference(ref_in)
        out, scores = run(step_in)  # writes into inputs[3], inputs[4]: the same arrays every step
        assert_close(f"step {step} output", out, exp[0])
        assert_close(f"step {step} scores", scores, exp[1])
        ref_caches = [exp[2], exp[3]]
        m = checked_slots(ref_in)
        for i in (3, 4):
            assert_close(f"step {step} cache {i}", inputs[i].transpose(0, 2, 1, 3)[m],
                         ref_caches[i - 3].transpose(0, 2, 1, 3)[m])


def test_repeated_calls_with_different_token_counts(core, tmp_path):
    rng = np.random.default_rng(3)
    first = make_case(rng, past=(0,), new=(1,))
    compiled = compile_ext(core, tmp_path, first)
    run = Runner(compiled)
    for past, new in [((0,), (1,)), ((10, 4), (7, 1)), ((0,), (50,)), ((63, 1, 2), (1, 1, 1)), ((5,), (3,))]:
        inputs = make_case(rng, past=past, new=new)
        before = [a.copy() for a in inputs]
        out, scores = run(inputs)
        assert_call_matches(f"past {past} new {new}", before, inputs, out, scores, reference(before))


@pytest.mark.parametrize("hint", [None, "f32", "bf16", "f16"])
def test_f32_model_caches_in_place_under_precision_hints(core, tmp_path, hint):
    rng = np.random.default_rng(4)
    inputs = make_case(rng, past=(20, 3), new=(3, 5))
    config = {} if hint is None else {"INFERENCE_PRECISION_HINT": hint}
    before = [a.copy() for a in inputs]
    out, scores = Runner(compile_ext(core, tmp_path, inputs, config))(inputs)
    assert out.dtype == np.float32
    exp = list(reference(before))
    if hint == "f16" and "FP16" in core.get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        # A CPU with native f16 runs the model in f16: our node stays f32 (precise_0), but the
        # plugin converts its outputs to f16 and back before the Results, as it does for every
        # op of an f16 model. The outputs are then f16 values (checked exactly), one f16 rounding
        # from f32 ones; the caches are written in place in f32 all the same.
        for got in (out, scores):
            assert np.array_equal(got.astype(np.float16).astype(np.float32), got), "outputs not f16-rounded"
        for i, got in ((0, out), (1, scores)):
            e = max_err(got, exp[i])
            assert e <= 2 ** -11 + TOL, f"hint f16: output {i} is {e:.3g} from float64, more than one f16 rounding"
            exp[i] = got
    assert_call_matches(f"hint {hint}", before, inputs, out, scores, exp)


@pytest.mark.parametrize("hint", [None, "f32", "bf16", "f16"])
def test_f16_cache_in_place_under_every_hint(core, tmp_path, hint):
    """An f16 cache is written in place whatever the hint. Where the CPU plugin runs f16 natively
    ('FP16' in OPTIMIZATION_CAPABILITIES) and the hint is f16, the node gets the f16 Parameters;
    elsewhere the plugin puts a Convert (f16 -> f32) between them and the node, which the shim
    bypasses (in-place writes would otherwise land in that copy). Inserted rows must be exact
    f16 roundings of the new f32 tokens, in the caller's buffers; outputs within one f16
    rounding of float64 over the same f16 cache."""
    rng = np.random.default_rng(5)
    inputs = make_case(rng, past=(20, 3), new=(3, 5), cache_dtype=np.float16)
    before = [a.copy() for a in inputs]
    config = {} if hint is None else {"INFERENCE_PRECISION_HINT": hint}
    out, scores = Runner(compile_ext(core, tmp_path, inputs, config))(inputs)
    exp = paged_attention_ref(*before, cache_dtype="f16")
    m = checked_slots(before)
    for i in (3, 4):
        np.testing.assert_array_equal(inputs[i].transpose(0, 2, 1, 3)[m],
                                      exp[i - 1].astype(np.float16).transpose(0, 2, 1, 3)[m],
                                      err_msg=f"hint {hint}: cache {i} not written in place")
    for i, got in ((0, out), (1, scores)):
        e = max_err(got, exp[i])
        assert e <= 2 ** -11 + TOL, f"hint {hint}: output {i} is {e:.3g} from float64"


def test_cache_converted_inside_the_model_is_refused(core, tmp_path):
    """A Convert the shim cannot bypass (here the model's own f32 -> f16, in front of both
    caches) would make the op write a temporary copy: compile_model fails naming it."""
    rng = np.random.default_rng(8)
    inputs = make_case(rng, past=(4,), new=(2,))
    model = read_ext_model(core, tmp_path, inputs)
    for name in ("key_cache", "value_cache"):
        param = next(p for p in model.get_parameters() if p.get_friendly_name() == name)
        targets = list(param.output(0).get_target_inputs())
        cvt = ov.opset13.convert(param, "f16")
        for t in targets:
            t.replace_source_output(cvt.output(0))
    with pytest.raises(RuntimeError, match=r"key_cache \(input 3\).*comes through the Convert"):
        model.validate_nodes_and_infer_types()
        core.compile_model(model, "CPU")


def test_const_cache_is_refused_before_it_can_be_written(core, tmp_path):
    """Issue 11 item 2: a Const key_cache reached the op as a pointer into the read-only weights
    mapping (SIGSEGV on insertion), or was silently changed with ENABLE_MMAP=False."""
    rng = np.random.default_rng(7)
    inputs = make_case(rng, past=(4,), new=(2,))
    model = read_ext_model(core, tmp_path, inputs)
    param = next(p for p in model.get_parameters() if p.get_friendly_name() == "key_cache")
    const = ov.opset13.constant(inputs[3])
    with pytest.raises(RuntimeError, match=r"key_cache \(input 3\).*is the Constant"):
        param.output(0).replace(const.output(0))
        model.remove_parameter(param)
        model.validate_nodes_and_infer_types()
        core.compile_model(model, "CPU")


# ---------------------------------------------------------------------------- threads

class ItemCounts(ctypes.Structure):
    _fields_ = [("pool", ctypes.c_uint64), ("host", ctypes.c_uint64), ("other", ctypes.c_uint64)]


def item_counts():
    """Items run so far by kind of thread, read from the library OpenVINO loaded (dlopen of the
    same path returns the same instance)."""
    lib = ctypes.CDLL(str(EXT_LIB))
    c = ItemCounts()
    assert lib.pa_item_counts_get(ctypes.byref(c)) == 0
    return c


def has_test_hooks():
    """Whether the extension under test was built with the feature test-hooks."""
    return hasattr(ctypes.CDLL(str(EXT_LIB)), "pa_item_counts_get")


HOOKS_REQUIRED = os.environ.get("PA_TEST_HOOKS") == "1"


def test_extension_exports_no_test_hooks():
    """The extension users get has no per-item counters (they are the feature test-hooks)."""
    if HOOKS_REQUIRED:
        pytest.skip("PA_TEST_HOOKS=1: this run is on a build with the test hooks")
    assert not has_test_hooks(), f"{EXT_LIB} exports pa_item_counts_get (built with test-hooks)"


@pytest.mark.parametrize("threads", [1, 2])
def test_work_runs_on_openvino_threads_with_identical_results(core, tmp_path, threads):
    """Inside OpenVINO (default config: CPU pinning on) the op's work items run in OpenVINO's
    own parallel regions (its TBB arena), none on the library's pool or the calling thread, and
    the results are bit-identical to a single-threaded run."""
    if not has_test_hooks():
        msg = (f"{EXT_LIB} has no item counters: build it with --no-default-features "
               "--features paged_attention/test-hooks (scripts/test.sh does, in target/test-hooks)")
        if HOOKS_REQUIRED:
            pytest.fail(msg)
        pytest.skip(msg)
    rng = np.random.default_rng(99)
    inputs = make_case(rng, H=8, Hkv=2, D=32, past=(300, 0, 40), new=(1, 90, 20), alibi=True)
    runs = {}
    for n in sorted({1, threads}):
        cur = [a.copy() for a in inputs]
        req = Runner(compile_ext(core, tmp_path, cur, {"INFERENCE_NUM_THREADS": n}))
        before = item_counts()
        out, scores = req(cur)
        after = item_counts()
        assert after.host > before.host, f"{n} threads: no item ran on OpenVINO's threads"
        assert after.pool == before.pool, f"{n} threads: items ran on the library's own pool"
        assert after.other == before.other, f"{n} threads: items ran outside OpenVINO's parallel regions"
        runs[n] = [out, scores, cur[3], cur[4]]
    for a, b in zip(runs[1], runs[threads]):
        assert a.tobytes() == b.tobytes(), f"{threads} threads differ from 1 thread"


def bf16_round(a):
    """f32 values rounded to bf16 (nearest even), as f32."""
    b = np.asarray(a, np.float32).view(np.uint32).astype(np.uint64)
    b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    return b.view(np.float32)


def cpu_has_bf16_products():
    flags = Path("/proc/cpuinfo").read_text()
    return " avx512_bf16" in flags or " amx_bf16" in flags


@pytest.mark.parametrize("precision", [None, "f32", "bf16"])
def test_inference_precision_attribute_chooses_the_math(core, tmp_path, precision):
    """The op's `inference_precision` attribute (docs/contract.md, "Precision") reaches the
    kernel under OpenVINO's default config: absent or f32, a prefill is f32 math (2e-6 of
    float64); bf16, on a CPU with bf16 products, it is within 1e-2 of float64 attention of the
    query rounded to bf16, and not the f32 result (the choice took effect)."""
    rng = np.random.default_rng(38)
    inputs = make_case(rng, H=8, Hkv=2, D=64, past=(0, 20), new=(130, 70), scale=0.05)
    model = read_ext_model(core, tmp_path, inputs)
    ops = [op for op in model.get_ops() if op.get_type_name() == "PagedAttention"]
    assert len(ops) == 1 and ops[0].get_attributes() == {"inference_precision": ""}
    if precision is not None:
        ops[0].set_attribute("inference_precision", precision)
    run = Runner(core.compile_model(model, "CPU", {}))
    before = [np.array(a, copy=True) for a in inputs]
    out, scores = run(inputs)
    exact = reference(before)
    if precision != "bf16":
        assert_close("output", out, exact[0])
        assert_close("scores", scores, exact[1])
        return
    rounded = [np.array(a, copy=True) for a in before]
    rounded[0] = bf16_round(rounded[0])
    exp = reference(rounded)
    err = float(np.max(np.abs(out - exp[0])))
    serr = max_err(scores, exp[1])
    assert err <= 1e-2 and serr <= 1e-2, f"bf16: output error {err:.3g}, scores {serr:.3g}"
    moved = max_err(out, exact[0])
    if cpu_has_bf16_products():
        assert moved > TOL, "bf16 precision gave the f32 result: the attribute did not reach the kernel"
    else:
        assert moved <= TOL, "no bf16 products here: the call must fall back to f32"
