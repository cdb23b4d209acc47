"""Validity checks of the golden suite in models/ (no extension needed).

    .venv/bin/python -m pytest tools/test_models.py -q

* XML structure: well-formed IR v11, unique layer ids, every edge resolves to an existing output port
  and input port, one producer per input port, precisions/dims agree along edges, the PagedAttention
  layer has input ports 0..n-1 (n in 9..16) and output ports n, n+1, Const offsets/sizes inside
  model.bin and matching the shape, Convert types consistent.
* Files: an in_<i>_<name>.npy for every Parameter (i = the PagedAttention port it feeds), dtypes and
  shapes as declared, expected outputs/caches/mask of the right shapes, case.json complete.
* Semantics: the model is evaluated from the files alone (Parameter/Const/Convert in numpy, the op
  through the float64 reference) and must match the expected values within the case's tolerance.
* OpenVINO parses the surrounding IR: with the PagedAttention layer replaced by Results on its
  inputs (OpenVINO cannot load the op without the extension), read_model must accept the file.
* Coverage: the suite covers every feature the conformance issue lists.
"""
from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MODELS = os.path.join(HERE, "..", "models")

from pa_ref import bf16_bits_to_f32, paged_attention_ref, round_to  # noqa: E402

PREC = {"FP32": "f32", "FP16": "f16", "BF16": "bf16", "I32": "i32", "U8": "u8"}
ITEMSIZE = {"f32": 4, "f16": 2, "bf16": 2, "i32": 4, "u8": 1}
NPY_DTYPE = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16, "i32": np.int32,
             "u8": np.uint8}
NAMES = ["query", "key", "value", "key_cache", "value_cache", "past_lens", "subsequence_begins",
         "block_indices", "block_indices_begins", "scale", "sliding_window", "alibi_slopes",
         "rotated_block_indices", "rotation_deltas", "rotation_trig_lut", "score_aggregation_window"]


def case_dirs():
    if not os.path.isdir(MODELS):
        return []
    return sorted(d for d in os.listdir(MODELS)
                  if os.path.isfile(os.path.join(MODELS, d, "model.xml")))


CASES = case_dirs()


class Graph:
    def __init__(self, case):
        self.dir = os.path.join(MODELS, case)
        self.tree = ET.parse(os.path.join(self.dir, "model.xml"))
        self.root = self.tree.getroot()
        with open(os.path.join(self.dir, "model.bin"), "rb") as f:
            self.bin = f.read()
        with open(os.path.join(self.dir, "case.json")) as f:
            self.meta = json.load(f)
        self.layers = {}
        for lay in self.root.find("layers").findall("layer"):
            lid = int(lay.get("id"))
            assert lid not in self.layers, f"duplicate layer id {lid}"
            self.layers[lid] = lay
        self.edges = [tuple(int(e.get(k)) for k in ("from-layer", "from-port", "to-layer", "to-port"))
                      for e in self.root.find("edges").findall("edge")]

    @staticmethod
    def ports(lay, tag):
        el = lay.find(tag)
        if el is None:
            return {}
        out = {}
        for p in el.findall("port"):
            pid = int(p.get("id"))
            assert pid not in out, f"layer {lay.get('id')}: duplicate port {pid}"
            out[pid] = (PREC[p.get("precision")], [int(d.text) for d in p.findall("dim")])
        return out

    def producer(self, lid, port):
        srcs = [(a, b) for a, b, c, d in self.edges if c == lid and d == port]
        assert len(srcs) == 1, f"layer {lid} port {port}: {len(srcs)} producers"
        return srcs[0]

    def pa(self):
        pas = [lay for lay in self.layers.values() if lay.get("type") == "PagedAttention"]
        assert len(pas) == 1
        return pas[0]


@pytest.fixture(params=CASES)
def graph(request):
    return Graph(request.param)


def test_suite_not_empty():
    assert len(CASES) >= 30, CASES


def test_structure(graph):
    g = graph
    assert g.root.tag == "net" and g.root.get("version") == "11"
    # edges resolve, one producer per input port, dims and precision agree
    consumed = {}
    for a, ap, b, bp in g.edges:
        assert a in g.layers, f"edge from missing layer {a}"
        assert b in g.layers, f"edge to missing layer {b}"
        outs = Graph.ports(g.layers[a], "output")
        ins = Graph.ports(g.layers[b], "input")
        assert ap in outs, f"layer {a} has no output port {ap}"
        assert bp in ins, f"layer {b} has no input port {bp}"
        assert outs[ap] == ins[bp], (a, ap, b, bp, outs[ap], ins[bp])
        assert (b, bp) not in consumed, f"two producers for layer {b} port {bp}"
        consumed[(b, bp)] = (a, ap)
    for lid, lay in g.layers.items():
        t = lay.get("type")
        ins, outs = Graph.ports(lay, "input"), Graph.ports(lay, "output")
        for pid in ins:
            assert (lid, pid) in consumed, f"layer {lid} input port {pid} unconnected"
        assert not (set(ins) & set(outs)), f"layer {lid}: port ids reused"
        if t == "Parameter":
            d = lay.find("data")
            assert not ins and list(outs) == [0]
            et, dims = outs[0]
            assert d.get("element_type") == et
            want = ",".join("?" if x < 0 else str(x) for x in dims)
            assert d.get("shape") == want, (d.get("shape"), want)
        elif t == "Const":
            d = lay.find("data")
            et, dims = outs[0]
            assert d.get("element_type") == et
            shape = [int(x) for x in d.get("shape").split(",")] if d.get("shape") else []
            assert shape == dims and all(x >= 0 for x in dims)
            off, size = int(d.get("offset")), int(d.get("size"))
            assert 0 <= off and off + size <= len(g.bin), f"Const {lid} outside model.bin"
            assert size == int(np.prod(shape, dtype=np.int64)) * ITEMSIZE[et]
        elif t == "Convert":
            d = lay.find("data")
            assert list(ins) == [0] and list(outs) == [1]
            assert outs[1][0] == d.get("destination_type")
            assert outs[1][1] == ins[0][1]
            assert lay.get("version") == "opset1"
        elif t == "Result":
            assert list(ins) == [0] and not outs
        elif t == "PagedAttention":
            assert lay.get("version") == "ie_internal_opset"
            n = len(ins)
            assert 9 <= n <= 16 and sorted(ins) == list(range(n))
            assert sorted(outs) == [n, n + 1]
            assert n == g.meta["n_inputs"]
        else:
            pytest.fail(f"unexpected layer type {t}")
    # every layer reaches a Result through the PA op (no dangling producers)
    used = {a for a, _, _, _ in g.edges}
    for lid, lay in g.layers.items():
        if lay.get("type") != "Result":
            assert lid in used, f"layer {lid} output unused"


def _np_from_bin(g, lay):
    d = lay.find("data")
    et = d.get("element_type")
    shape = [int(x) for x in d.get("shape").split(",")] if d.get("shape") else []
    off, size = int(d.get("offset")), int(d.get("size"))
    return np.frombuffer(g.bin[off:off + size], dtype=NPY_DTYPE[et]).reshape(shape), et


def _to_f64(arr, et):
    if et == "bf16":
        return bf16_bits_to_f32(arr).astype(np.float64)
    if et == "i32":
        return np.asarray(arr, np.int32)
    if et == "u8":
        return np.asarray(arr, np.uint8)  # u8 cache bytes, kept as bytes
    return np.asarray(arr, np.float64)


def evaluate_inputs(g):
    """Values at the PagedAttention input ports, computed from the files (float64 / int32)."""
    pa = g.pa()
    pid = int(pa.get("id"))
    n = len(Graph.ports(pa, "input"))
    vals = []
    for port in range(n):
        lid, _ = g.producer(pid, port)
        chain = []
        lay = g.layers[lid]
        while lay.get("type") == "Convert":
            chain.append(lay.find("data").get("destination_type"))
            lid, _ = g.producer(lid, 0)
            lay = g.layers[lid]
        if lay.get("type") == "Parameter":
            et = lay.find("data").get("element_type")
            fname = f"in_{port}_{NAMES[port]}.npy"
            path = os.path.join(g.dir, fname)
            assert os.path.isfile(path), f"missing {fname}"
            arr = np.load(path)
            assert arr.dtype == NPY_DTYPE[et], (fname, arr.dtype, et)
            dims = Graph.ports(lay, "output")[0][1]
            assert arr.ndim == len(dims) and all(d < 0 or d == s for d, s in zip(dims, arr.shape)), \
                (fname, arr.shape, dims)
            v = _to_f64(arr, et)
        elif lay.get("type") == "Const":
            arr, et = _np_from_bin(g, lay)
            v = _to_f64(arr, et)
        else:
            pytest.fail(f"port {port} fed by {lay.get('type')}")
        for dst in reversed(chain):
            v = round_to(v, dst) if dst != "i32" else np.asarray(v, np.int32)
        vals.append(v)
    return vals


def test_files(graph):
    g = graph
    m = g.meta
    for k in ("name", "features", "truth", "tolerance", "dtype", "npy_bf16", "n_inputs", "inputs"):
        assert k in m, k
    assert m["truth"] in ("openvino-builtin", "float64-reference")
    assert set(m["tolerance"]) == {"output", "scores", "cache_key", "cache_value"}
    vals = evaluate_inputs(g)
    params = [lay for lay in g.layers.values() if lay.get("type") == "Parameter"]
    npys = {f for f in os.listdir(g.dir) if f.startswith("in_")}
    assert len(npys) == len(params), (sorted(npys), len(params))
    T, HD = vals[0].shape
    NB, Hkv = vals[3].shape[:2]
    BS = m["shapes"]["BS"]
    past = vals[5]
    out = np.load(os.path.join(g.dir, "out_0_output.npy"))
    sc = np.load(os.path.join(g.dir, "out_1_scores.npy"))
    assert out.dtype == np.float32 and out.shape == (T, HD)
    assert sc.dtype == np.float32 and sc.shape == (int(past.sum()) + T,)
    for c, given in (("cache_key.npy", vals[3]), ("cache_value.npy", vals[4])):
        a = np.load(os.path.join(g.dir, c))
        if m["cache_dtype"] != "u8":
            assert given.shape == (NB, Hkv, BS, m["shapes"]["D"])
        assert a.shape == given.shape  # u8: the layout's own rows and bytes
        assert a.dtype == NPY_DTYPE[m["cache_dtype"]]
    mask = np.load(os.path.join(g.dir, "cache_mask.npy"))
    assert mask.dtype == np.bool_ and mask.shape == (NB, Hkv, BS)


def test_expected_matches_reference(graph):
    """Evaluate the model from its files with the float64 reference; compare with expectations."""
    g = graph
    m = g.meta
    vals = evaluate_inputs(g)
    if m["cache_dtype"] == "u8":
        return check_u8_case(g, vals)
    args = vals + [None] * (16 - len(vals))
    out, sc, kc, vc = paged_attention_ref(*args, cache_dtype=m["cache_dtype"])
    tol = m["tolerance"]
    e_out = np.load(os.path.join(g.dir, "out_0_output.npy")).astype(np.float64)
    e_sc = np.load(os.path.join(g.dir, "out_1_scores.npy")).astype(np.float64)
    mask = np.load(os.path.join(g.dir, "cache_mask.npy"))
    ce = m["cache_dtype"]
    e_kc = _to_f64(np.load(os.path.join(g.dir, "cache_key.npy")), ce)
    e_vc = _to_f64(np.load(os.path.join(g.dir, "cache_value.npy")), ce)
    # the reference is the truth (f64 cases) or within 2e-6 of it (OpenVINO cases, checked at
    # generation), so it must always land inside the tolerance
    assert np.abs(out - e_out).max(initial=0) <= tol["output"]
    assert np.abs(sc - e_sc).max(initial=0) <= tol["scores"]
    assert np.abs(kc - e_kc)[mask].max(initial=0) <= max(tol["cache_key"], 1e-6)
    assert np.abs(vc - e_vc)[mask].max(initial=0) <= tol["cache_value"]
    # the expected caches differ from the inputs where tokens were inserted (the test can fail)
    assert not np.array_equal(e_kc, vals[3]) or vals[0].shape[0] == 0


def check_u8_case(g, vals):
    """u8 caches: the expected caches hold, in every compared slot, the bytes the numpy model of
    OpenVINO's quantization (tools/ov_u8_cache.py) writes into the input caches, and the expected
    outputs are float64 attention over the expected caches dequantized."""
    import ov_u8_cache as u8
    tol = g.meta["tolerance"]
    q, k, v, kc0, vc0, past, sb, bi, bib = vals[:9]
    e_kc = np.load(os.path.join(g.dir, "cache_key.npy"))
    e_vc = np.load(os.path.join(g.dir, "cache_value.npy"))
    mask = np.load(os.path.join(g.dir, "cache_mask.npy"))
    km, vm = u8.insert_model(k.astype(np.float32), v.astype(np.float32), kc0, vc0, past, sb, bi, bib)
    assert np.array_equal(km[u8.key_row_mask(mask)], e_kc[u8.key_row_mask(mask)])
    assert np.array_equal(vm[mask], e_vc[mask])
    out, sc = u8.attention_over_dequantized(q, k.shape, e_kc, e_vc, past, sb, bi, bib,
                                            vals[15] if len(vals) > 15 else None)
    e_out = np.load(os.path.join(g.dir, "out_0_output.npy")).astype(np.float64)
    e_sc = np.load(os.path.join(g.dir, "out_1_scores.npy")).astype(np.float64)
    assert np.abs(out - e_out).max(initial=0) <= tol["output"]
    assert np.abs(sc - e_sc).max(initial=0) <= tol["scores"]
    # the call wrote its new tokens (the test can fail)
    assert not np.array_equal(e_kc, kc0) and not np.array_equal(e_vc, vc0)


def test_openvino_parses_surrounding_ir(graph, tmp_path):
    """OpenVINO's own IR reader accepts everything but the PagedAttention layer."""
    ov = pytest.importorskip("openvino")
    g = graph
    pa = g.pa()
    pid = pa.get("id")
    root = ET.fromstring(ET.tostring(g.root))
    layers = root.find("layers")
    edges = root.find("edges")
    for lay in list(layers):
        if lay.get("id") == pid or lay.get("type") == "Result":
            layers.remove(lay)
    for e in list(edges):
        if e.get("to-layer") == pid or e.get("from-layer") == pid:
            edges.remove(e)
    next_id = max(int(lay.get("id")) for lay in g.layers.values()) + 1
    for a, ap, b, bp in g.edges:
        if str(b) != pid:
            continue
        prec, dims = Graph.ports(pa, "input")[bp]
        r = ET.SubElement(layers, "layer", {"id": str(next_id), "name": f"r{bp}", "type": "Result",
                                            "version": "opset1"})
        inp = ET.SubElement(r, "input")
        port = ET.SubElement(inp, "port", {"id": "0", "precision": {v: k for k, v in PREC.items()}[prec]})
        for d in dims:
            ET.SubElement(port, "dim").text = str(d)
        ET.SubElement(edges, "edge", {"from-layer": str(a), "from-port": str(ap),
                                      "to-layer": str(next_id), "to-port": "0"})
        next_id += 1
    xml_path = tmp_path / "m.xml"
    xml_path.write_bytes(ET.tostring(root))
    bin_path = os.path.join(g.dir, "model.bin")
    model = ov.Core().read_model(str(xml_path), bin_path)
    assert len(model.outputs) == g.meta["n_inputs"]
    # Const values as OpenVINO reads them equal ours
    ours = evaluate_inputs(g)
    for i, o in enumerate(model.outputs):
        node = o.get_node().input_value(0).get_node()
        if node.get_type_name() == "Constant":
            got = node.get_data()
            if got.dtype.kind == "f":
                np.testing.assert_array_equal(got.astype(np.float64), ours[i])


def test_openvino_rejects_without_extension():
    """Documented behaviour: the op is unknown to OpenVINO without the extension."""
    ov = pytest.importorskip("openvino")
    path = os.path.join(MODELS, "seed_example", "model.xml")
    if not os.path.isfile(path):
        pytest.skip("no seed_example")
    with pytest.raises(RuntimeError, match=re.compile("opset|PagedAttention", re.I)):
        ov.Core().read_model(path)


REQUIRED = [
    "seed", "decode", "prefill", "chunked_prefill", "mixed", "gqa", "mqa", "sliding_window", "alibi",
    "rotation_deltas_R1", "rotation_deltas_RBS", "rotation_deltas_R", "score_window_scalar",
    "score_window_zero", "score_window_negative", "score_window_per_seq", "score_window_absent",
    "f16", "bf16", "block1", "block16", "block64", "head64", "head128", "head256", "empty_sequence",
    "const_inputs", "inputs_9", "convert",
]


def test_coverage():
    feats = set()
    for c in CASES:
        with open(os.path.join(MODELS, c, "case.json")) as f:
            meta = json.load(f)
        feats |= set(meta["features"])
        if meta["shapes"]["BS"] == 32:
            feats.add("block32")
    missing = [f for f in REQUIRED + ["block32"] if f not in feats]
    assert not missing, missing
