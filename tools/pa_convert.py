"""Converts OpenVINO's LLM graphs to this project's op through the project's one converter
(``cpp/convert.cpp``, run by ``pa-engine convert``): a stateful SDPA LLM (as optimum-intel exports
it) goes through OpenVINO's ``SDPAToPagedAttention`` pass, then every ``PagedAttentionExtension``
becomes a 9- to 17-input / 2-output ``PagedAttention`` (``ie_internal_opset``, docs/contract.md;
trailing inputs that mean what their absence means are dropped, docs/openvino.md), which
the extension ``libpaged_attention_openvino.so`` runs.

    python tools/pa_convert.py IN.xml OUT.xml [--block-size 32] [--cache-type u8|u4|f32|f16|bf16]
        [--serving]

IN.xml is a stateful SDPA LLM. An IR that already holds ``PagedAttentionExtension`` layers
(``ov.save_model`` of a transformed model) cannot be read back by OpenVINO, so it is refused: convert
the stateful model it came from. Attention sinks and a value head size other than the key's are
carried over to our op. Graphs that use what our op lacks (xattention, adaptive R-KV, token type
ids, qq_bias) are refused with the node and input named. The command line's cache type defaults
to u8, as ``pa-engine``'s (OpenVINO's own for the CPU); the functions below default to f32, the
type the oracle comparisons run in.

``to_paged`` is OpenVINO's own transformation (its Python binding): the built-in op's graph, the
oracle the tests run beside ours on the same schedule. ``pa-engine`` is found at ``$PA_ENGINE``,
else in the checkout's ``target/release``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import engine_env  # noqa: E402  (pa-engine has no RUNPATH: OpenVINO on LD_LIBRARY_PATH)

engine_env.use_in_this_process()

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
# The converter's cache types; u8 and u4 are OpenVINO's quantized layouts (key [?, Hkv, BS + 8, D] /
# [?, Hkv, BS + 16, D] by channel, value [?, Hkv, BS, D + 8] / [?, Hkv, BS, D + 16] by token).
CACHE_TYPES = ("f32", "f16", "bf16", "u8", "u4")
# OpenVINO features SDPAToPagedAttention can add, which the converter then refuses (tests).
PASS_FEATURES = ("xattention", "adaptive_rkv", "qq_bias")
ROOT = Path(__file__).resolve().parents[1]


def _ov_type(name):
    import openvino as ov

    return {"f32": ov.Type.f32, "f16": ov.Type.f16, "bf16": ov.Type.bf16}[name]


class Unsupported(Exception):
    """The graph uses something our PagedAttention does not implement."""


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


# ------------------------------------------------------------------------------ the converter
def engine_path() -> Path:
    return Path(os.environ.get("PA_ENGINE", ROOT / "target/release/pa-engine"))


def convert_file(in_xml, out_xml, block_size: int = 32, cache_type: str = "f32",
                 serving: bool = False, allow=()) -> int:
    """Converts the stateful IR ``in_xml`` to ``out_xml`` (+ .bin) with ``pa-engine convert``.
    Returns the number of PagedAttention nodes; raises ``Unsupported`` with the converter's
    message when it refuses the graph."""
    in_xml, out_xml = Path(in_xml), Path(out_xml)
    if in_xml.resolve() == out_xml.resolve():
        raise ValueError("IN and OUT must differ")
    text = in_xml.read_text(encoding="utf-8", errors="replace")
    if f'type="{BUILTIN_TYPE}"' in text:
        raise Unsupported(f"{in_xml} holds {BUILTIN_TYPE} layers, which OpenVINO cannot read back "
                          "(unsupported opset: extension): convert the stateful model it came from")
    exe = engine_path()
    if not exe.is_file():
        raise FileNotFoundError(f"{exe} not found: cargo build --release -p paged_attention_engine "
                                "(or set PA_ENGINE)")
    cmd = [str(exe), "convert", str(in_xml), str(out_xml), "--block-size", str(block_size),
           "--cache-type", cache_type] + (["--serving"] if serving else [])
    for feature in allow:
        cmd += ["--allow", feature]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise Unsupported(r.stderr.strip().removeprefix("pa-engine: "))
    return int(r.stdout.rsplit(": ", 1)[1].split()[0])


def convert_model(model, out_xml, block_size: int = 32, cache_type: str = "f32",
                  serving: bool = False, allow=()) -> int:
    """Converts an in-memory stateful model (saved to a temporary IR first) to ``out_xml``."""
    import openvino as ov

    if pa_nodes(model):
        raise Unsupported(f"the model already holds {BUILTIN_TYPE} nodes: convert the stateful model")
    with tempfile.TemporaryDirectory() as tmp:
        stateful = Path(tmp) / "stateful.xml"
        ov.save_model(model, stateful, compress_to_fp16=False)
        return convert_file(stateful, out_xml, block_size, cache_type, serving, allow)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("input", type=Path, help="stateful LLM IR (optimum-intel export)")
    ap.add_argument("output", type=Path)
    ap.add_argument("--block-size", type=int, default=32, help="cache block size (default 32)")
    ap.add_argument("--cache-type", choices=CACHE_TYPES, default="u8",
                    help="cache element type (default u8, OpenVINO's CPU default; u8 and u4: its quantized layouts)")
    ap.add_argument("--serving", action="store_true",
                    help="also give the graph the scores outputs and the cache rotation / score "
                         "window inputs that eviction needs (tools/generate.py)")
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
