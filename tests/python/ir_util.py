"""Writes OpenVINO IR (v11) XML for a model made of one PagedAttention layer: one Parameter per
input (SPEC order), the PagedAttention layer (`ie_internal_opset`), and two Results.

Dims given as None are dynamic (-1 in the IR). The model has no constants, so its .bin is empty.
"""

from xml.sax.saxutils import escape

INPUT_NAMES = [
    "query", "key", "value", "key_cache", "value_cache", "past_lens", "subsequence_begins",
    "block_indices", "block_indices_begins", "scale", "sliding_window", "alibi_slopes",
    "rotated_block_indices", "rotation_deltas", "rotation_trig_lut", "score_aggregation_window",
]

_PRECISION = {"f32": "FP32", "f16": "FP16", "bf16": "BF16", "i32": "I32"}


def _dims(shape):
    return "".join(f"<dim>{-1 if d is None else int(d)}</dim>" for d in shape)


def _port(pid, etype, shape, names=None):
    n = f' names="{escape(names)}"' if names else ""
    return f'<port id="{pid}" precision="{_PRECISION[etype]}"{n}>{_dims(shape)}</port>'


def default_inputs(n_inputs, *, heads, kv_heads, head_size, block_size, dtype="f32", cache_dtype=None,
                   window_per_seq=True, lut_dtype=None):
    """(element type, shape) of each of the first `n_inputs` inputs, with T, NB, B, ... dynamic."""
    cache_dtype = cache_dtype or dtype
    lut_dtype = lut_dtype or dtype
    full = [
        (dtype, [None, heads * head_size]),
        (dtype, [None, kv_heads * head_size]),
        (dtype, [None, kv_heads * head_size]),
        (cache_dtype, [None, kv_heads, block_size, head_size]),
        (cache_dtype, [None, kv_heads, block_size, head_size]),
        ("i32", [None]),
        ("i32", [None]),
        ("i32", [None]),
        ("i32", [None]),
        (dtype, []),
        ("i32", []),
        (dtype, [None]),
        ("i32", [None]),
        ("i32", [None, None]),
        (lut_dtype, [None, head_size]),
        ("i32", [None] if window_per_seq else []),
    ]
    return full[:n_inputs]


def paged_attention_ir(inputs, out_dtype=None, name="paged_attention"):
    """IR XML text. `inputs`: list of (element type, shape) in SPEC order (9 to 16 entries).
    Output types are the query's unless `out_dtype` is given."""
    assert 9 <= len(inputs) <= 16
    out_dtype = out_dtype or inputs[0][0]
    n = len(inputs)
    layers, edges = [], []
    for i, (et, shape) in enumerate(inputs):
        nm = INPUT_NAMES[i]
        sh = ",".join("?" if d is None else str(int(d)) for d in shape)
        layers.append(
            f'<layer id="{i}" name="{nm}" type="Parameter" version="opset1">'
            f'<data shape="{sh}" element_type="{et}"/>'
            f"<output>{_port(0, et, shape, nm)}</output></layer>"
        )
        edges.append(f'<edge from-layer="{i}" from-port="0" to-layer="{n}" to-port="{i}"/>')
    q_width = inputs[0][1][1]
    in_ports = "".join(_port(i, et, shape) for i, (et, shape) in enumerate(inputs))
    out_ports = _port(n, out_dtype, [None, q_width], "output") + _port(n + 1, out_dtype, [None], "scores")
    layers.append(
        f'<layer id="{n}" name="pa" type="PagedAttention" version="ie_internal_opset">'
        f"<input>{in_ports}</input><output>{out_ports}</output></layer>"
    )
    for k, (nm, shape) in enumerate([("output", [None, q_width]), ("scores", [None])]):
        lid = n + 1 + k
        layers.append(
            f'<layer id="{lid}" name="{nm}_result" type="Result" version="opset1">'
            f"<input>{_port(0, out_dtype, shape)}</input></layer>"
        )
        edges.append(f'<edge from-layer="{n}" from-port="{n + k}" to-layer="{lid}" to-port="0"/>')
    return (
        '<?xml version="1.0"?>\n'
        f'<net name="{escape(name)}" version="11">\n<layers>\n'
        + "\n".join(layers)
        + "\n</layers>\n<edges>\n"
        + "\n".join(edges)
        + "\n</edges>\n</net>\n"
    )


def write_ir(path_xml, xml_text):
    """Writes `path_xml` and an empty .bin beside it; returns the .xml path as a str."""
    path_xml = str(path_xml)
    with open(path_xml, "w") as f:
        f.write(xml_text)
    with open(path_xml[: -len(".xml")] + ".bin", "wb"):
        pass
    return path_xml
