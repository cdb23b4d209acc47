"""A real (tiny) LLM graph on our op: tools/tiny_llm.py's stateful Llama-shaped decoder, turned into
a paged graph by OpenVINO's own ``paged_attention_transformation`` (built-in
``PagedAttentionExtension``), then converted by tools/pa_convert.py to our ``PagedAttention`` and run
with the extension loaded (``$PA_EXTENSION_LIB``, default target/release/libpaged_attention_openvino.so).

Truth is OpenVINO: the stateful SDPA model checks the paged graph the transformation made, and the
built-in op runs the same schedule as ours (tools/generate.py ``serve``, driven by our scheduler and
cache manager: late arrivals, chunked prefill beside decodes, a prefix hit, a fork, eviction with
rotation, preemption). Each model decodes greedily from its own logits: the tokens must be identical
and the logits of every step within 1e-4 (f32 caches, f32 inference). Rotated keys are checked
against a float64 re-rotation.
"""
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

import pa_convert
import tiny_llm
from generate import scheduler_config, serve, workload
from pa_scheduler import Library, Scheduler
from paged_model import F32_CONFIG, PagedModel, Seq

ROOT = Path(__file__).resolve().parents[2]
EXT_LIB = Path(os.environ.get("PA_EXTENSION_LIB", ROOT / "target/release/libpaged_attention_openvino.so"))
TOL = 1e-4
BS = 32
SERVE_BLOCKS = 24  # small enough that the pool runs out: preemptions too


@pytest.fixture(scope="module")
def core():
    if not EXT_LIB.is_file():
        pytest.fail(f"{EXT_LIB} not found: build it with `cargo build --release -p paged_attention_openvino`")
    c = ov.Core()
    c.add_extension(str(EXT_LIB))
    return c


def paged(name, serving=False):
    """A fresh paged (built-in PA) model of variant ``name`` (``serving``: with scores outputs
    and rotation inputs)."""
    return pa_convert.to_paged(tiny_llm.build(tiny_llm.VARIANTS[name]), BS, serving=serving)


@pytest.fixture(scope="module", params=sorted(tiny_llm.VARIANTS))
def pair(request, core, tmp_path_factory):
    """(config, built-in PA model compiled, ours compiled, converted xml path) for one variant."""
    name = request.param
    cfg = tiny_llm.VARIANTS[name]
    model = paged(name, serving=True)
    assert len(pa_convert.pa_nodes(model)) == cfg.layers
    builtin = core.compile_model(model, "CPU", F32_CONFIG)
    out = tmp_path_factory.mktemp(name) / "model_pa.xml"
    assert pa_convert.convert_model(tiny_llm.build(cfg), out, BS, serving=True) == cfg.layers
    ours_model = core.read_model(out)
    ours_nodes = pa_convert.pa_nodes(ours_model, "PagedAttention")
    assert len(ours_nodes) == cfg.layers
    assert not pa_convert.pa_nodes(ours_model)
    for n in ours_nodes:
        assert (n.get_input_size(), n.get_output_size()) == (16 + cfg.sinks, 2)
    ours = core.compile_model(ours_model, "CPU", F32_CONFIG)
    return cfg, builtin, ours, out


# ------------------------------------------------------------------ the paged graph is right

def stateful_logits(core, cfg, tokens, prompt_len):
    """Logits of the stateful SDPA model: prefill ``tokens[:prompt_len]``, then one token a step."""
    req = core.compile_model(tiny_llm.build(cfg), "CPU", F32_CONFIG).create_infer_request()

    def run(ids, start):
        return req.infer({"input_ids": np.array([ids]), "attention_mask": np.ones((1, start + len(ids)), np.int64),
                          "position_ids": np.arange(start, start + len(ids))[None],
                          "beam_idx": np.zeros(1, np.int32)})[0][0]

    rows = [run(tokens[:prompt_len], 0)]
    for p in range(prompt_len, len(tokens)):
        rows.append(run([tokens[p]], p))
    return np.concatenate(rows)


@pytest.mark.parametrize("name", sorted(tiny_llm.VARIANTS))
def test_transformed_graph_matches_stateful_model(core, name):
    """OpenVINO's transformation accepted the generated graph unmodified and the built-in op
    reproduces the stateful model (a prompt, then decode past the sliding window)."""
    cfg = tiny_llm.VARIANTS[name]
    rng = np.random.default_rng(7)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 60)]
    want = stateful_logits(core, cfg, tokens, 45)
    run = PagedModel(core.compile_model(paged(name), "CPU", F32_CONFIG), 4)
    blocks = [2, 0]
    got = [run.step([Seq(tokens[:45], 0, blocks)])]
    for p in range(45, 60):
        got.append(run.step([Seq([tokens[p]], p, blocks)]))
    got = np.concatenate(got)
    assert got.shape == want.shape == (60, cfg.vocab)
    assert np.abs(got - want).max() <= TOL


def test_sliding_window_is_in_effect(core):
    """The window variant's graph differs from the same weights without a window once a query
    sees more than `w` keys (so the comparisons above exercise the window)."""
    cfg = tiny_llm.VARIANTS["sliding_window"]
    assert 0 < cfg.sliding_window < 45
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, cfg.vocab, 60)]
    with_w = stateful_logits(core, cfg, tokens, 45)
    without = stateful_logits(core, tiny_llm.Config(**{**cfg.__dict__, "sliding_window": 0}), tokens, 45)
    assert np.abs(with_w[: cfg.sliding_window] - without[: cfg.sliding_window]).max() <= TOL
    assert np.abs(with_w[cfg.sliding_window + 1:] - without[cfg.sliding_window + 1:]).max() > 1e-2


# Inputs the plain (non-serving) conversion keeps: up to the last one that says something. The
# transformation feeds every model a scale, so 9 only when the model's scale is exactly the op's
# default 1/sqrt(D) in f32 (gqa1 and value_head: D = 64, 1/8).
PLAIN_INPUTS = {"gqa1": 9, "gqa4": 10, "sliding_window": 11, "gpt_oss": 17, "value_head": 9}


@pytest.mark.parametrize("name", sorted(tiny_llm.VARIANTS))
def test_plain_conversion_drops_absent_inputs_and_matches_builtin(core, tmp_path, name):
    """Without --serving the rotation and score-window inputs are empty constants and the window
    or scale may be too: the converter drops such trailing inputs (each costs the CPU plugin's
    per-call shape inference a Constant), and the graph still gives the built-in op's logits."""
    cfg = tiny_llm.VARIANTS[name]
    assert sorted(PLAIN_INPUTS) == sorted(tiny_llm.VARIANTS)
    out = tmp_path / "plain.xml"
    assert pa_convert.convert_model(tiny_llm.build(cfg), out, BS) == cfg.layers
    model = core.read_model(out)
    assert [n.get_input_size() for n in pa_convert.pa_nodes(model, "PagedAttention")] == \
        [PLAIN_INPUTS[name]] * cfg.layers
    rng = np.random.default_rng(11)
    tokens = [int(t) for t in rng.integers(0, cfg.vocab, 60)]
    runs = [PagedModel(core.compile_model(m, "CPU", F32_CONFIG), 4) for m in (paged(name), model)]
    blocks = [2, 0]
    got = [[r.step([Seq(tokens[:45], 0, blocks)])] for r in runs]
    for p in range(45, 60):
        for g, r in zip(got, runs):
            g.append(r.step([Seq([tokens[p]], p, blocks)]))
    want, ours = (np.concatenate(g) for g in got)
    assert want.shape == ours.shape == (60, cfg.vocab)
    assert np.abs(ours - want).max() <= TOL


# ------------------------------------------------------------------ ours vs built-in, served

def written_slots(st):
    """(block, slot) of every token row the step writes into the caches."""
    out = []
    for b in range(len(st.seq_ids)):
        blocks, past = st.blocks_of(b), int(st.past_lens[b])
        out += [(blocks[p // BS], p % BS) for p in range(past, past + len(st.tokens_of(b)))]
    return out


def rotated_f64(keys, deltas, head_size, base):
    """Float64 RoPE re-rotation of cached keys ``[R, Hkv, BS, D]`` back by ``deltas [R, BS]``
    positions (the rotate-half layout of tools/tiny_llm.py), with angles computed here, not taken
    from any LUT."""
    half = head_size // 2
    f = base ** (-2.0 * np.arange(half) / head_size)
    a = -deltas.astype(np.float64)[:, None, :, None] * f  # [R, 1, BS, D/2]
    x, y = keys[..., :half].astype(np.float64), keys[..., half:].astype(np.float64)
    return np.concatenate([x * np.cos(a) - y * np.sin(a), x * np.sin(a) + y * np.cos(a)], axis=-1)


def test_served_by_our_scheduler_matches_builtin(pair):
    """tools/generate.py's serving loop, driven by our scheduler and cache manager through the C
    ABI, runs the built-in op and ours on one schedule: 10 requests arriving over time, chunked
    prefill beside decodes, a prefix-cache hit, a fork (copy-on-write of the shared partial block),
    score-driven eviction (our op's scores) with rotation of the moved blocks. Every call: logits
    and scores within 1e-4, the new tokens' cache rows equal; every rotated key (both ops) equals a
    float64 RoPE re-rotation of the key before the call. Greedy tokens identical, >= 64 a request;
    the scheduler's counters prove each event happened."""
    cfg, builtin, ours, _ = pair
    lib = Library(EXT_LIB)
    sched = Scheduler(lib, **scheduler_config(SERVE_BLOCKS))
    arrivals, forks = workload(cfg.vocab)
    a, b = PagedModel(builtin, SERVE_BLOCKS), PagedModel(ours, SERVE_BLOCKS)
    seen = {"worst": 0.0, "worst_scores": 0.0, "chunked": 0, "mixed": 0, "rotation_calls": 0,
            "rotated_keys": 0}
    before = {}

    def pre_step(st, models):
        before.clear()
        if len(st.rotated_block_indices):
            for i, m in enumerate(models):
                for name, cache in m.caches.items():
                    if name.startswith("key_cache."):
                        before[i, name] = cache[st.rotated_block_indices].copy()

    def on_step(st, logits, models):
        diff = float(np.abs(logits[0] - logits[1]).max())
        assert diff <= TOL, f"logits differ by {diff}; past {list(st.past_lens)} rot {len(st.rotated_block_indices)} tokens {[len(st.tokens_of(b)) for b in range(len(st.seq_ids))]} step {seen}"
        seen["worst"] = max(seen["worst"], diff)
        assert len(models[0].scores) == len(models[1].scores) == cfg.layers
        for sa, sb in zip(models[0].scores, models[1].scores):
            assert sa.shape == sb.shape == (st.scores_len,)
            d = float(np.abs(sa - sb).max())
            assert d <= TOL, f"scores differ by {d}"
            seen["worst_scores"] = max(seen["worst_scores"], d)
        for k, rid in enumerate(st.seq_ids):
            if st.emits[k]:
                row = st.subsequence_begins[k + 1] - 1
                assert np.argmax(logits[0][row]) == np.argmax(logits[1][row]), f"request {rid}: tokens differ"
        prefill = [len(st.tokens_of(k)) > 1 for k in range(len(st.seq_ids))]
        seen["chunked"] += any(not e for e in st.emits)
        seen["mixed"] += any(prefill) and not all(prefill)
        slots = written_slots(st)
        for name in models[0].caches:
            ca, cb = models[0].caches[name], models[1].caches[name]
            for blk, slot in slots:
                np.testing.assert_allclose(cb[blk, :, slot], ca[blk, :, slot], atol=TOL, rtol=0)
        if before:
            seen["rotation_calls"] += 1
            untouched = np.ones(st.rotation_deltas.shape, bool)
            for r, blk in enumerate(st.rotated_block_indices):
                for wb, slot in slots:
                    if wb == blk:
                        untouched[r, slot] = False
            for (i, name), keys in before.items():
                want = rotated_f64(keys, st.rotation_deltas, cfg.head_size, cfg.rope_theta)
                got = models[i].caches[name][st.rotated_block_indices]
                err = np.abs(got - want).transpose(0, 2, 1, 3)[untouched]
                assert err.size and err.max() <= 1e-5, f"model {i} {name}: rotation off by {err.max()}"
                seen["rotated_keys"] += int(untouched.sum())

    res = serve([a, b], sched, lib, arrivals, forks, cfg.head_size, cfg.rope_theta,
                pre_step=pre_step, on_step=on_step)
    c = res.counters
    assert res.out[0] == res.out[1]
    assert len(res.out[0]) == len(arrivals) + len(forks) >= 9
    assert min(len(t) for t in res.out[0].values()) >= 64
    assert len({len(r.prompt) for r in arrivals}) >= 8, "prompts of different lengths"
    assert c["forks"] == 1 and c["block_copies"] >= 1 and c["preemptions"] >= 1
    assert c["prefix_hits"] >= 1 and res.first_past[6] >= BS, "request 6 reuses request 0's blocks"
    assert c["evictions"] >= 1 and c["evicted_blocks"] >= 1 and c["rotated_blocks"] >= 1
    assert seen["rotation_calls"] >= 1 and seen["rotated_keys"] > 0
    assert seen["chunked"] >= 2 and seen["mixed"] >= 3
    assert res.out[0][100][0] != res.out[0][4][2], "the fork continues with another token"
    print(f"{cfg.name}: {res.calls} calls, {c}, max |logits ours - built-in| = {seen['worst']:.2e}, "
          f"scores {seen['worst_scores']:.2e}")


def test_converted_file_roundtrip(pair, core, tmp_path):
    """The CLI takes the stateful IR (as optimum-intel writes it) and gives the model the
    in-memory path gives; a saved PagedAttentionExtension IR and our own output are refused."""
    cfg, _, ours, converted = pair
    stateful = tmp_path / "openvino_model.xml"
    ov.save_model(tiny_llm.build(cfg), stateful, compress_to_fp16=False)
    out = tmp_path / "cli.xml"
    # f32 caches, as the in-memory path's model (the CLI's default is u8, OpenVINO's)
    r = subprocess.run([sys.executable, str(ROOT / "tools/pa_convert.py"), "--serving", "--cache-type", "f32",
                        str(stateful), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, cfg.vocab, 40)]
    want = PagedModel(ours, 4).step([Seq(tokens, 0, [1, 3])])
    got = PagedModel(core.compile_model(core.read_model(out), "CPU", F32_CONFIG), 4).step(
        [Seq(tokens, 0, [1, 3])])
    assert np.abs(got - want).max() <= 1e-6
    saved_builtin = tmp_path / "builtin_pa.xml"
    ov.save_model(paged(cfg.name), saved_builtin, compress_to_fp16=False)
    with pytest.raises(pa_convert.Unsupported, match="convert the stateful model"):
        pa_convert.convert_file(saved_builtin, tmp_path / "x.xml")
    # Converting our own output again is refused, not silently passed through.
    r = subprocess.run([sys.executable, str(ROOT / "tools/pa_convert.py"), str(out), str(tmp_path / "x.xml")],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "already uses PagedAttention" in r.stderr, r.stderr


def test_cli_serving_graph_has_scores_and_rotation_inputs(core, tmp_path):
    """``pa_convert.py --serving`` gives the converted graph what the serving loop feeds and reads:
    our inputs 12..15 fed by the rotation / score window Parameters, outputs scores.N."""
    stateful = tmp_path / "openvino_model.xml"
    ov.save_model(tiny_llm.build(tiny_llm.VARIANTS["gqa4"]), stateful, compress_to_fp16=False)
    out = tmp_path / "serving.xml"
    # f32 caches, as the in-memory path's model (the CLI's default is u8, OpenVINO's)
    r = subprocess.run([sys.executable, str(ROOT / "tools/pa_convert.py"), "--serving", "--cache-type", "f32",
                        str(stateful), str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    model = core.read_model(out)
    names = {i.get_any_name() for i in model.inputs}
    assert {"rotated_block_indices.0", "rotation_deltas.1", "model_rotation_trig_lut",
            "score_aggregation_window"} <= names
    assert {o.get_any_name() for o in model.outputs} >= {"scores.0", "scores.1"}
    for n in pa_convert.pa_nodes(model, "PagedAttention"):
        feeds = [n.input_value(i).get_node() for i in range(12, 16)]
        assert [f.get_type_name() for f in feeds] == ["Parameter"] * 4
        assert feeds[2].get_friendly_name() == "model_rotation_trig_lut"
        assert feeds[3].get_friendly_name() == "score_aggregation_window"


# ------------------------------------------------------------------ refusals

# What OpenVINO's pass gives a graph when asked (pa-engine convert --allow FEATURE), and the
# first input the converter names: the op has none of these.
REFUSED = [
    ("xattention", 17, "xattention_threshold"),
    ("adaptive_rkv", 21, "adaptive_rkv_start_size"),
    ("qq_bias", 26, "qq_bias"),
]


@pytest.mark.parametrize("feature,port,name", REFUSED, ids=[r[0] for r in REFUSED])
def test_converter_refuses_unsupported_input(tmp_path, feature, port, name):
    with pytest.raises(pa_convert.Unsupported, match=rf"input {port} \({name}\) is fed by Parameter"):
        pa_convert.convert_model(tiny_llm.build(tiny_llm.VARIANTS["gqa4"]), tmp_path / "out.xml",
                                 allow=[feature])
    assert not (tmp_path / "out.xml").exists()


def test_cli_converts_a_model_with_sinks(core, tmp_path):
    """gpt-oss's sinks (SDPA's 6th input) reach PagedAttentionExtension input 20 as a constant;
    the CLI's converter passes them on as our input 16 (they were refused before the op had
    sinks)."""
    stateful = tmp_path / "sinks.xml"
    ov.save_model(tiny_llm.build(tiny_llm.GPT_OSS), stateful, compress_to_fp16=False)
    out = tmp_path / "o.xml"
    r = subprocess.run([sys.executable, str(ROOT / "tools/pa_convert.py"), str(stateful), str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    nodes = pa_convert.pa_nodes(core.read_model(out), "PagedAttention")
    assert len(nodes) == tiny_llm.GPT_OSS.layers
    for n in nodes:
        assert n.get_input_size() == 17
        assert list(n.get_input_partial_shape(16).to_shape()) == [1, tiny_llm.GPT_OSS.heads, 1, 1]


def test_converted_ir_structure(pair):
    """Every converted node: 16 input ports fed in our order (17 with sinks: the built-in's input
    20 as our 16, a [1, H, 1, 1] constant), 2 output ports, nothing of the built-in op left."""
    cfg, _, _, path = pair
    root = ET.parse(path).getroot()
    layers = {lay.get("id"): lay for lay in root.iter("layer")}
    pas = [lay for lay in layers.values() if lay.get("type") == "PagedAttention"]
    assert len(pas) == cfg.layers and all(lay.get("version") == "ie_internal_opset" for lay in pas)
    assert not [lay for lay in layers.values() if lay.get("type") == "PagedAttentionExtension"]
    for lay in pas:
        n_in = 16 + cfg.sinks
        assert [p.get("id") for p in lay.find("input")] == [str(i) for i in range(n_in)]
        assert [p.get("id") for p in lay.find("output")] == [str(n_in), str(n_in + 1)]
        feeds = {e.get("to-port"): layers[e.get("from-layer")] for e in root.iter("edge")
                 if e.get("to-layer") == lay.get("id")}
        assert sorted(feeds, key=int) == [str(i) for i in range(n_in)]
        if cfg.sinks:
            sink = feeds["16"]
            assert sink.get("type") == "Const" and sink.find("data").get("shape").replace(" ", "") == f"1,{cfg.heads},1,1"
        assert feeds["3"].get("name").startswith("key_cache.")
        assert feeds["4"].get("name").startswith("value_cache.")
        for port, name in ((5, "past_lens"), (6, "subsequence_begins"), (7, "block_indices"),
                           (8, "block_indices_begins")):
            assert feeds[str(port)].get("name") == name
