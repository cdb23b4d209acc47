"""Minimal, deterministic writer of OpenVINO IR v11 (model.xml + model.bin) for graphs made of
Parameter, Const, Convert, PagedAttention (ie_internal_opset) and Result layers.

``paged_attention_ir(ports)`` builds the plain model (one Parameter per input -> PagedAttention -> two
Results); ``add_paged_attention`` adds the op and its Results to any builder (models/gen.py);
``pa_port_dims`` gives an input port's dims with the data-dependent dimensions dynamic.

The text layout follows what ``openvino.save_model`` emits (tab indentation, ``<data shape="?,128"
element_type="f16"/>`` on Parameters, ``<data element_type= shape= offset= size=/>`` on Consts,
``destination_type`` on Converts, port ids numbered inputs first then outputs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from xml.sax.saxutils import quoteattr

import numpy as np

from ._tensors import INPUT_NAMES, f32_to_bf16_bits

PRECISION = {"f32": "FP32", "f16": "FP16", "bf16": "BF16", "i32": "I32", "f64": "FP64", "u8": "U8", "u4": "U4",
             "i64": "I64"}


def encode(arr, et):
    """numpy array of element type ``et`` in its on-disk form (bf16 -> uint16 bit patterns)."""
    a = np.asarray(arr)
    if et == "f32":
        return np.require(a, dtype=np.float32, requirements="C")
    if et == "f16":
        return np.require(a, dtype=np.float16, requirements="C")
    if et == "bf16":
        if a.dtype == np.uint16:
            return np.require(a, requirements="C")
        return f32_to_bf16_bits(a.astype(np.float32))
    if et == "i32":
        return np.require(a, dtype=np.int32, requirements="C")
    raise ValueError(et)


def shape_attr(dims):
    return ",".join("?" if d < 0 else str(d) for d in dims)


@dataclass
class Port:
    id: int
    et: str
    dims: list
    names: str | None = None


@dataclass
class Layer:
    id: int
    name: str
    type: str
    version: str = "opset1"
    data: dict = field(default_factory=dict)
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    extra_attrs: dict = field(default_factory=dict)


class IRBuilder:
    def __init__(self, name):
        self.name = name
        self.layers = []
        self.edges = []
        self.bin = bytearray()
        self._next_id = 0

    def _id(self, layer_id):
        if layer_id is None:
            layer_id = self._next_id
        self._next_id = max(self._next_id, layer_id + 1)
        return layer_id

    def parameter(self, name, et, dims, layer_id=None):
        lay = Layer(self._id(layer_id), name, "Parameter",
                    data={"shape": shape_attr(dims), "element_type": et},
                    outputs=[Port(0, et, list(dims), names=name)])
        self.layers.append(lay)
        return lay, 0

    def const(self, name, et, array, layer_id=None, align=8):
        raw = encode(array, et)
        while len(self.bin) % align:
            self.bin.append(0)
        offset = len(self.bin)
        data = raw.tobytes()
        self.bin += data
        dims = list(raw.shape)
        lay = Layer(self._id(layer_id), name, "Const",
                    data={"element_type": et, "shape": shape_attr(dims), "offset": str(offset),
                          "size": str(len(data))},
                    outputs=[Port(0, et, dims)])
        self.layers.append(lay)
        return lay, 0

    def convert(self, name, src, dst_et, layer_id=None):
        src_layer, src_port = src
        sp = next(p for p in src_layer.outputs if p.id == src_port)
        lay = Layer(self._id(layer_id), name, "Convert", data={"destination_type": dst_et},
                    inputs=[Port(0, sp.et, list(sp.dims))],
                    outputs=[Port(1, dst_et, list(sp.dims))])
        self.layers.append(lay)
        self.edge(src, (lay, 0))
        return lay, 1

    def op(self, name, type_, version, srcs, in_ports, out_ports, layer_id=None):
        """srcs: list of (layer, port) feeding in_ports (list of Port) in order."""
        lay = Layer(self._id(layer_id), name, type_, version=version, inputs=in_ports,
                    outputs=out_ports)
        self.layers.append(lay)
        for src, p in zip(srcs, in_ports):
            self.edge(src, (lay, p.id))
        return lay

    def result(self, name, src, layer_id=None):
        src_layer, src_port = src
        sp = next(p for p in src_layer.outputs if p.id == src_port)
        lay = Layer(self._id(layer_id), name, "Result", inputs=[Port(0, sp.et, list(sp.dims))],
                    extra_attrs={"output_names": name})
        self.layers.append(lay)
        self.edge(src, (lay, 0))
        return lay

    def edge(self, src, dst):
        (sl, sp), (dl, dp) = src, dst
        self.edges.append((sl.id, sp, dl.id, dp))

    # ------------------------------------------------------------------ output
    def write(self, path_xml, layer_order=None):
        """Writes ``path_xml`` and the .bin beside it (empty without Consts); returns the .xml path
        as a str."""
        path_xml = str(path_xml)
        with open(path_xml, "w", newline="\n") as f:
            f.write(self.xml(layer_order))
        with open(path_xml[: -len(".xml")] + ".bin", "wb") as f:
            f.write(bytes(self.bin))
        return path_xml

    def xml(self, layer_order=None):
        layers = self.layers if layer_order is None else [self.layers[i] for i in layer_order]
        out = ['<?xml version="1.0"?>', f'<net name={quoteattr(self.name)} version="11">', "\t<layers>"]
        for lay in layers:
            attrs = f'id="{lay.id}" name={quoteattr(lay.name)} type="{lay.type}" version="{lay.version}"'
            for k, v in lay.extra_attrs.items():
                attrs += f" {k}={quoteattr(v)}"
            out.append(f"\t\t<layer {attrs}>")
            if lay.data:
                d = " ".join(f"{k}={quoteattr(v)}" for k, v in lay.data.items())
                out.append(f"\t\t\t<data {d} />")
            for tag, ports in (("input", lay.inputs), ("output", lay.outputs)):
                if not ports:
                    continue
                out.append(f"\t\t\t<{tag}>")
                for p in ports:
                    names = f" names={quoteattr(p.names)}" if p.names else ""
                    head = f'<port id="{p.id}" precision="{PRECISION[p.et]}"{names}'
                    if not p.dims:
                        out.append(f"\t\t\t\t{head} />")
                    else:
                        out.append(f"\t\t\t\t{head}>")
                        for d in p.dims:
                            out.append(f"\t\t\t\t\t<dim>{d}</dim>")
                        out.append("\t\t\t\t</port>")
                out.append(f"\t\t\t</{tag}>")
            out.append("\t\t</layer>")
        out.append("\t</layers>")
        out.append("\t<edges>")
        for e in self.edges:
            out.append(f'\t\t<edge from-layer="{e[0]}" from-port="{e[1]}" to-layer="{e[2]}" '
                       f'to-port="{e[3]}" />')
        out.append("\t</edges>")
        out.append("\t<rt_info />")
        out.append("</net>")
        return "\n".join(out) + "\n"


# ---------------------------------------------------------------------- PagedAttention models
def pa_port_dims(i, shape, H, Hkv, D, BS):
    """Dims of the op's input port ``i`` for a value of ``shape``: -1 for the data-dependent
    dimensions (T, NB, B, R, M, ...), as in the seed example."""
    if i == 0:
        return [-1, H * D]
    if i == 1:
        return [-1, Hkv * D]
    if i == 2:  # [T, Hkv * Dv]: the value head size may differ from D (a 2-D `shape` says)
        return [-1, shape[1] if len(shape) == 2 else Hkv * D]
    if i == 3:
        return [-1, Hkv, BS, D]
    if i == 4:
        return [-1, Hkv, BS, shape[3] if len(shape) == 4 else D]
    if i in (5, 6, 7, 8, 12):
        return [-1]
    if i in (9, 10):
        return []
    if i == 11:
        return [-1]
    if i == 13:
        return [-1] if len(shape) == 1 else [-1, shape[1]]
    if i == 14:
        return [-1, shape[1]]
    if i == 15:
        return [] if len(shape) == 0 else [-1]
    if i == 16:
        return [H] if len(shape) == 1 else [1, H, 1, 1]
    raise ValueError(i)


def add_paged_attention(b, srcs, in_ports, out_et, q_width, layer_id=None):
    """Adds the PagedAttention layer (input ports ``in_ports`` fed by ``srcs``, output ports n and
    n+1 of type ``out_et``) and the Results ``output`` [-1, q_width] and ``scores`` [-1]."""
    n = len(in_ports)
    out_ports = [Port(n, out_et, [-1, q_width]), Port(n + 1, out_et, [-1])]
    pa = b.op("paged_attention", "PagedAttention", "ie_internal_opset", srcs, in_ports, out_ports,
              layer_id=layer_id)
    b.result("output", (pa, n))
    b.result("scores", (pa, n + 1))
    return pa


def paged_attention_ir(ports, name="paged_attention", out_et=None):
    """IRBuilder of the plain model: one Parameter per input (named as in SPEC.md) feeding the op
    directly, and two Results. ``ports``: (element type, dims) of the 9..17 inputs in SPEC order;
    the outputs have the query's type unless ``out_et`` is given. No Consts: the .bin is empty."""
    if not 9 <= len(ports) <= 17:
        raise ValueError(f"{len(ports)} inputs: the op takes 9 to 17")
    b = IRBuilder(name)
    srcs = [b.parameter(INPUT_NAMES[i], et, dims) for i, (et, dims) in enumerate(ports)]
    in_ports = [Port(i, et, list(dims)) for i, (et, dims) in enumerate(ports)]
    add_paged_attention(b, srcs, in_ports, out_et or ports[0][0], ports[0][1][1])
    return b
