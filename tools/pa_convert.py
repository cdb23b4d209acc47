"""Converts OpenVINO's paged LLM graphs to this project's op: every ``PagedAttentionExtension`` node
(what ``paged_attention_transformation`` makes, 17 to 28 inputs, 1 to 3 outputs) becomes a 16-input /
2-output ``PagedAttention`` (``ie_internal_opset``, docs/contract.md), which the extension
``libpaged_attention_openvino.so`` runs.

    python tools/pa_convert.py IN.xml OUT.xml [--block-size 32] [--cache-type f32] [--serving]

IN.xml is either a stateful SDPA LLM (as optimum-intel exports it: the converter applies
``paged_attention_transformation`` and types the caches ``[?, Hkv, block_size, D]`` first, as GenAI
does), or an IR that already holds ``PagedAttentionExtension`` layers (``ov.save_model`` of a
transformed model, caches typed). OpenVINO cannot read the latter back (``unsupported opset:
extension``), so the rewrite works on the IR's XML; the weights file is copied unchanged.

Inputs: built-in 0..11 are ours 0..11; built-in 13 (score_aggregation_window) is our 15; built-in
14..16 (rotation) are our 12..14; built-in 12 (max_context_len) is dropped (our op derives it from
past_lens and subsequence_begins; the model keeps the Parameter, so callers feed it as before).
Built-in 17.. (xattention, sinks, adaptive R-KV, token_type_ids, qq_bias) have no counterpart: each
must be a constant that is empty or a zero scalar, or the conversion is refused with a message
naming the input. Output 2 (adaptive R-KV diversity) must be unused, likewise.
"""
from __future__ import annotations

import argparse
import copy
import shutil
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np

BUILTIN_TYPE = "PagedAttentionExtension"
OUR_TYPE, OUR_VERSION = "PagedAttention", "ie_internal_opset"

# OpenVINO 2026.4.1's input order (SPEC/contract "Using OpenVINO's built-in op as an oracle").
BUILTIN_INPUTS = [
    "query", "key", "value", "key_cache", "value_cache", "past_lens", "subsequence_begins",
    "block_indices", "block_indices_begins", "scale", "sliding_window", "alibi_slopes",
    "max_context_len", "score_aggregation_window", "rotated_block_indices", "rotation_deltas",
    "rotation_trig_lut", "xattention_threshold", "xattention_block_size", "xattention_stride",
    "sinks", "adaptive_rkv_start_size", "adaptive_rkv_evictable_sizes",
    "adaptive_rkv_diversity_block_set_indices", "adaptive_rkv_diversity_block_set_indices_begins",
    "token_type_ids", "qq_bias", "qq_bias_begins",
]
# Our input i is the built-in's input OURS_FROM_BUILTIN[i].
OURS_FROM_BUILTIN = list(range(12)) + [14, 15, 16, 13]
DROPPED = 12  # max_context_len
FIRST_EXTRA = 17
BUILTIN_OUTPUTS = ["output", "scores", "adaptive_rkv_diversity"]

_DTYPE = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "i64": np.int64, "u8": np.uint8,
          "i8": np.int8, "bf16": np.uint16, "boolean": np.bool_}
CACHE_TYPES = ("f32", "f16", "bf16")


def _ov_type(name):
    import openvino as ov

    return {"f32": ov.Type.f32, "f16": ov.Type.f16, "bf16": ov.Type.bf16}[name]


class Unsupported(Exception):
    """The graph uses something the 16-input PagedAttention does not implement."""


# ------------------------------------------------------------------------------ stateful -> paged
def to_paged(model, block_size: int = 32, cache_type: str = "f32", serving: bool = False):
    """Applies OpenVINO's ``paged_attention_transformation`` to ``model`` (in place) and types its
    cache Parameters ``cache_type [?, Hkv, block_size, D]`` from the PA nodes' rt_info
    (num_k_heads, k_head_size, num_v_heads, v_head_size): the transformation leaves them dynamic
    and GenAI types them the same way before compiling. ``serving``: also ask the transformation
    for what a cache manager with eviction needs (GenAI's cache-eviction options): outputs
    ``scores.N``, inputs ``score_aggregation_window`` and the rotation inputs
    (``rotated_block_indices.N``, ``rotation_deltas.N``, ``model_rotation_trig_lut``), which the
    converter maps to our inputs 15 and 12..14. Returns the model."""
    import openvino as ov
    from openvino._offline_transformations import paged_attention_transformation

    if serving:
        paged_attention_transformation(model, use_score_outputs=True, allow_score_aggregation=True,
                                       allow_cache_rotation=True)
    else:
        paged_attention_transformation(model)
    nodes = pa_nodes(model)
    if not nodes:
        raise Unsupported("paged_attention_transformation found no ScaledDotProductAttention it "
                          "could turn into PagedAttentionExtension")
    for node in nodes:
        rt = node.get_rt_info()
        for port, heads, size in ((3, "num_k_heads", "k_head_size"), (4, "num_v_heads", "v_head_size")):
            param = node.input_value(port).get_node()
            param.set_element_type(_ov_type(cache_type))
            param.set_partial_shape(ov.PartialShape(
                [-1, int(rt[heads].astype(int)), block_size, int(rt[size].astype(int))]))
    model.validate_nodes_and_infer_types()
    return model


def pa_nodes(model, type_name: str = BUILTIN_TYPE):
    return [n for n in model.get_ordered_ops() if n.get_type_name() == type_name]


# ------------------------------------------------------------------------------ IR rewrite
def _shape(attr):
    if attr is None or not attr.strip():
        return []
    return [-1 if d.strip() in ("?", "-1") else int(d) for d in attr.split(",")]


class _Ir:
    def __init__(self, xml_path: Path):
        self.xml_path = Path(xml_path)
        self.tree = ET.parse(self.xml_path)
        root = self.tree.getroot()
        self.layers_el = root.find("layers")
        self.edges_el = root.find("edges")
        self.layers = {lay.get("id"): lay for lay in self.layers_el.findall("layer")}
        self._bin = None

    def bin(self):
        if self._bin is None:
            self._bin = self.xml_path.with_suffix(".bin").read_bytes()
        return self._bin

    def source(self, layer_id, port):
        for e in self.edges_el.findall("edge"):
            if e.get("to-layer") == layer_id and e.get("to-port") == str(port):
                return self.layers[e.get("from-layer")], e.get("from-port")
        return None, None

    def const_value(self, lay):
        data = lay.find("data")
        et, shape = data.get("element_type"), _shape(data.get("shape"))
        if et not in _DTYPE:
            return None, shape
        if any(d == 0 for d in shape):  # saved with size 1, no data
            return np.zeros(shape, _DTYPE[et]), shape
        off, size = int(data.get("offset")), int(data.get("size"))
        return np.frombuffer(self.bin()[off:off + size], _DTYPE[et]).reshape(shape), shape


def _describe(lay):
    return f"{lay.get('type')} `{lay.get('name')}`" if lay is not None else "nothing"


def _check_neutral(ir, pa, i, where):
    src, _ = ir.source(pa.get("id"), i)
    name = BUILTIN_INPUTS[i] if i < len(BUILTIN_INPUTS) else f"input {i}"
    what = f"{where}: input {i} ({name})"
    if src is None or src.get("type") != "Const":
        raise Unsupported(f"{what} is fed by {_describe(src)}, not a constant: the model uses "
                          f"{name}, which the 16-input PagedAttention does not implement")
    value, shape = ir.const_value(src)
    empty = any(d == 0 for d in shape)
    zero_scalar = shape == [] and value is not None and not np.any(value)
    if not (empty or zero_scalar):
        shown = np.array2string(value.ravel()[:4]) if value is not None else "?"
        raise Unsupported(f"{what} is the constant `{src.get('name')}` of shape {shape} "
                          f"(values {shown}), not empty or zero: the model uses {name}, which the "
                          f"16-input PagedAttention does not implement")


def _check_cache(ir, pa, i, where):
    src, _ = ir.source(pa.get("id"), i)
    what = f"{where}: input {i} ({BUILTIN_INPUTS[i]})"
    if src is None or src.get("type") != "Parameter":
        raise Unsupported(f"{what} is fed by {_describe(src)}: the op writes the caches in place, "
                          "so they must be model inputs (Parameters)")
    data = src.find("data")
    et, shape = data.get("element_type"), _shape(data.get("shape"))
    if et not in CACHE_TYPES or len(shape) != 4 or any(d < 0 for d in shape[1:]):
        raise Unsupported(f"{what}: the cache Parameter `{src.get('name')}` is {et} [{data.get('shape')}]; "
                          "it must be f32, f16 or bf16 [?, Hkv, block_size, D]. Convert the stateful "
                          "model instead (the converter types the caches), or type them before saving")


def convert_ir(in_xml, out_xml) -> int:
    """Rewrites every PagedAttentionExtension layer of ``in_xml`` into our PagedAttention and writes
    ``out_xml`` (+ its .bin). Returns the number of layers converted; raises ``Unsupported``."""
    in_xml, out_xml = Path(in_xml), Path(out_xml)
    if in_xml.resolve() == out_xml.resolve():
        raise ValueError("IN and OUT must differ")
    ir = _Ir(in_xml)
    pas = [lay for lay in ir.layers.values() if lay.get("type") == BUILTIN_TYPE]
    disconnected = set()
    for pa in pas:
        pid = pa.get("id")
        where = f"{BUILTIN_TYPE} `{pa.get('name')}`"
        data = pa.find("data")
        if data is not None and data.get("write_kv_cache", "true") != "true":
            raise Unsupported(f"{where}: write_kv_cache={data.get('write_kv_cache')}; our op always "
                              "writes the new tokens into the caches")
        in_ports = pa.find("input").findall("port")
        out_el = pa.find("output")
        out_ports = out_el.findall("port") if out_el is not None else []
        n_in = len(in_ports)
        if not FIRST_EXTRA <= n_in <= len(BUILTIN_INPUTS):
            raise Unsupported(f"{where} has {n_in} inputs; this converter knows the layouts with "
                              f"{FIRST_EXTRA} to {len(BUILTIN_INPUTS)} (OpenVINO 2026.4.1 order)")
        if not 1 <= len(out_ports) <= 3:
            raise Unsupported(f"{where} has {len(out_ports)} outputs; expected 1 to 3")
        for i in range(FIRST_EXTRA, n_in):
            _check_neutral(ir, pa, i, where)
        for i in (3, 4):
            _check_cache(ir, pa, i, where)
        out_ids = [p.get("id") for p in out_ports]
        for k, port_id in enumerate(out_ids[2:], start=2):
            users = [e for e in ir.edges_el.findall("edge")
                     if e.get("from-layer") == pid and e.get("from-port") == port_id]
            if users:
                raise Unsupported(f"{where}: output {k} ({BUILTIN_OUTPUTS[k]}) is used by "
                                  f"{_describe(ir.layers[users[0].get('to-layer')])}; the 16-input "
                                  "PagedAttention has no such output")

        # Ports: ours 0..15 in, 16..17 out.
        by_id = {p.get("id"): p for p in in_ports}
        new_in = []
        for ours, builtin in enumerate(OURS_FROM_BUILTIN):
            p = copy.deepcopy(by_id[str(builtin)])
            p.set("id", str(ours))
            new_in.append(p)
        in_el = pa.find("input")
        for p in in_ports:
            in_el.remove(p)
        in_el.extend(new_in)
        scores_port = out_ports[1] if len(out_ports) > 1 else None
        if scores_port is None:
            scores_port = ET.Element("port", {"precision": out_ports[0].get("precision")})
            scores_port.text, scores_port.tail = out_ports[0].text, out_ports[0].tail
            ET.SubElement(scores_port, "dim").text = "-1"
        new_out = [copy.deepcopy(out_ports[0]), copy.deepcopy(scores_port)]
        for k, p in enumerate(new_out):
            p.set("id", str(len(OURS_FROM_BUILTIN) + k))
        for p in out_ports:
            out_el.remove(p)
        out_el.extend(new_out)

        to_ours = {str(b): str(o) for o, b in enumerate(OURS_FROM_BUILTIN)}
        out_map = {old: str(len(OURS_FROM_BUILTIN) + k) for k, old in enumerate(out_ids[:2])}
        for e in list(ir.edges_el.findall("edge")):
            if e.get("to-layer") == pid:
                port = e.get("to-port")
                if port in to_ours:
                    e.set("to-port", to_ours[port])
                else:  # max_context_len and the neutral extras
                    disconnected.add(e.get("from-layer"))
                    ir.edges_el.remove(e)
            elif e.get("from-layer") == pid:
                e.set("from-port", out_map[e.get("from-port")])

        pa.set("type", OUR_TYPE)
        pa.set("version", OUR_VERSION)
        if data is not None:
            pa.remove(data)

    # Constants that fed only the dropped inputs go; Parameters (max_context_len) stay inputs.
    still_used = {e.get("from-layer") for e in ir.edges_el.findall("edge")}
    for lid in disconnected - still_used:
        if ir.layers[lid].get("type") == "Const":
            ir.layers_el.remove(ir.layers[lid])

    ir.tree.write(out_xml, encoding="utf-8", xml_declaration=True)
    shutil.copyfile(in_xml.with_suffix(".bin"), out_xml.with_suffix(".bin"))
    return len(pas)


def convert_model(model, out_xml, block_size: int = 32, cache_type: str = "f32",
                  serving: bool = False) -> int:
    """Converts an in-memory model: a stateful SDPA LLM (transformed here first, ``serving`` as
    in ``to_paged``) or one that already holds PagedAttentionExtension nodes with typed caches.
    Writes ``out_xml`` (+ .bin)."""
    import openvino as ov

    if not pa_nodes(model):
        to_paged(model, block_size, cache_type, serving)
    with tempfile.TemporaryDirectory() as tmp:
        paged = Path(tmp) / "paged.xml"
        ov.save_model(model, paged, compress_to_fp16=False)
        return convert_ir(paged, out_xml)


def convert_file(in_xml, out_xml, block_size: int = 32, cache_type: str = "f32", serving: bool = False) -> int:
    in_xml = Path(in_xml)
    text = in_xml.read_text(encoding="utf-8")
    if f'type="{BUILTIN_TYPE}"' in text:
        return convert_ir(in_xml, out_xml)
    if f'type="{OUR_TYPE}" version="{OUR_VERSION}"' in text:
        raise Unsupported(f"{in_xml} already uses {OUR_TYPE} ({OUR_VERSION}): nothing to convert")
    import openvino as ov

    return convert_model(ov.Core().read_model(in_xml), out_xml, block_size, cache_type, serving)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path, help="stateful LLM IR, or IR with PagedAttentionExtension")
    ap.add_argument("output", type=Path)
    ap.add_argument("--block-size", type=int, default=32,
                    help="cache block size when the converter types the caches (default 32)")
    ap.add_argument("--cache-type", choices=CACHE_TYPES, default="f32",
                    help="cache element type when the converter types the caches (default f32)")
    ap.add_argument("--serving", action="store_true",
                    help="with a stateful IN: also give the graph the scores outputs and the cache "
                         "rotation / score window inputs that eviction needs (tools/generate.py)")
    args = ap.parse_args(argv)
    try:
        n = convert_file(args.input, args.output, args.block_size, args.cache_type, args.serving)
    except Unsupported as e:
        print(f"pa_convert: refused: {e}", file=sys.stderr)
        return 2
    print(f"{args.output}: {n} PagedAttention node(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
