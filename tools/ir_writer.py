"""Minimal, deterministic writer of OpenVINO IR v11 (model.xml + model.bin) for graphs made of
Parameter, Const, Convert, PagedAttention (ie_internal_opset) and Result layers.

The text layout follows what ``openvino.save_model`` emits (tab indentation, ``<data shape="?,128"
element_type="f16"/>`` on Parameters, ``<data element_type= shape= offset= size=/>`` on Consts,
``destination_type`` on Converts, port ids numbered inputs first then outputs).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from xml.sax.saxutils import quoteattr

import numpy as np

from pa_ref import f32_to_bf16_bits

PRECISION = {"f32": "FP32", "f16": "FP16", "bf16": "BF16", "i32": "I32", "f64": "FP64", "u8": "U8",
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
