"""A tiny Llama-shaped decoder with seeded random weights, in the stateful form optimum-intel
exports, built with OpenVINO's Python opset API; and the glue that turns it into a paged model.

The graph: inputs ``input_ids`` i64 [B,S], ``attention_mask`` i64 [B,L], ``position_ids`` i64 [B,S],
``beam_idx`` i32 [B]; per layer RMSNorm, Q/K/V projections, RoPE (rotate-half, as HF Llama), K/V
read from a variable (``ReadValue``), gathered by ``beam_idx``, concatenated with the new K/V and
written back (``Assign``), GQA by Unsqueeze-Broadcast-Reshape of K/V (HF ``repeat_kv``), an
additive float mask built from ``attention_mask`` (causal, optionally with a sliding window in the
form transformers builds for gpt-oss: ``kv_idx > q_idx - w`` in a chain of BitwiseAnds), then
``ScaledDotProductAttention``, output projection, residual, SwiGLU MLP; final RMSNorm and a
``logits`` [B,S,V] output. These are the shapes ``paged_attention_transformation``
(``openvino._offline_transformations``) matches: it replaces every SDPA with a
``PagedAttentionExtension`` node, unmodified.

``pa_convert.to_paged`` applies that transformation (and types the caches);
``pa_convert.convert_model`` then writes the model with our op. ``python tools/tiny_llm.py OUT_DIR``
writes the stateful IR of each variant.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import openvino as ov
import openvino.opset13 as ops
import openvino.opset6 as ops6


@dataclass(frozen=True)
class Config:
    name: str
    vocab: int = 512  # the size of tools/model_dir.py's trained byte-level BPE tokenizer
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 4
    head_size: int = 64
    intermediate: int = 512
    sliding_window: int = 0  # 0: none
    scale: float | None = None  # None: SDPA's default 1/sqrt(D) (no scale input)
    rope_theta: float = 10000.0
    eps: float = 1e-5
    seed: int = 0
    max_position_embeddings: int = 2048  # config.json only (tools/model_dir.py); the graph has no limit
    # gpt-oss's attention sinks: one learned logit per query head, as SDPA's 6th input
    # ([1, H, 1, 1]); paged_attention_transformation carries it to PagedAttentionExtension input 20.
    sinks: bool = False
    # With sliding_window: only the even layers use it, the odd ones see everything (gpt-oss).
    alternate_window: bool = False
    # Value head size when it differs from head_size (0: the same; DeepSeek-style attention).
    v_head_size: int = 0
    # The output projection is the embedding matrix (one Constant for both).
    tie_word_embeddings: bool = False


# gpt-oss-shaped: sinks and alternating sliding-window / full layers.
GPT_OSS = Config("gpt_oss", heads=8, kv_heads=2, head_size=32, scale=0.2, sliding_window=40,
                 sinks=True, alternate_window=True)

# The variants the tests prove: GQA groups 1 and 4, a sliding window, an explicit scale, and
# gpt-oss's sinks with alternating windows.
VARIANTS = {
    "gqa1": Config("gqa1", heads=4, kv_heads=4, head_size=64),
    "gqa4": Config("gqa4", heads=8, kv_heads=2, head_size=32, scale=0.2),
    "sliding_window": Config("sliding_window", heads=8, kv_heads=2, head_size=32, sliding_window=40),
    "gpt_oss": GPT_OSS,
    # Values narrower than keys (DeepSeek-V2-style head sizes, scaled down).
    "value_head": Config("value_head", heads=8, kv_heads=2, head_size=64, v_head_size=32),
}

_NEG = float(np.finfo(np.float32).min)  # what transformers fills masked scores with


def _c(value, dtype=np.int64):
    return ops.constant(np.array(value, dtype=dtype))


def _rms_norm(x, weight, eps):
    var = ops.reduce_mean(ops.multiply(x, x), _c([-1]), keep_dims=True)
    inv = ops.divide(_c(1.0, np.float32), ops.sqrt(ops.add(var, _c(eps, np.float32))))
    return ops.multiply(ops.multiply(x, inv), ops.constant(weight))


def _linear(x, w):
    """x @ w.T (weights stored [out, in], as PyTorch does and optimum exports)."""
    return ops.matmul(x, ops.constant(w), transpose_a=False, transpose_b=True)


def _heads(x, n, d):
    """[B,S,n*d] -> [B,n,S,d]."""
    return ops.transpose(ops.reshape(x, _c([0, 0, n, d]), special_zero=True), _c([0, 2, 1, 3]))


def _rotate_half(x, d):
    x1 = ops.slice(x, _c([0]), _c([d // 2]), _c([1]), _c([3]))
    x2 = ops.slice(x, _c([d // 2]), _c([d]), _c([1]), _c([3]))
    return ops.concat([ops.negative(x2), x1], axis=-1)


def _rope(x, cos, sin, d):
    return ops.add(ops.multiply(x, cos), ops.multiply(_rotate_half(x, d), sin))


def _mask(cfg, input_ids, attention_mask, window=None):
    """Additive [B,1,S,L] mask: key j is visible to query i (position past+i) when j <= past+i,
    attention_mask[b, j] != 0 and, with a window w, j > past+i-w."""
    total = ops.gather(ops.shape_of(attention_mask), _c(1), _c(0))
    cur = ops.gather(ops.shape_of(input_ids), _c(1), _c(0))
    past = ops.subtract(total, cur)
    q_idx = ops.unsqueeze(ops.range(past, total, _c(1), output_type="i64"), _c(1))  # [S,1]
    kv_idx = ops.unsqueeze(ops.range(_c(0), total, _c(1), output_type="i64"), _c(0))  # [1,L]
    causal = ops.less_equal(kv_idx, q_idx)
    window = cfg.sliding_window if window is None else window
    if window:
        in_window = ops.greater(kv_idx, ops.add(q_idx, _c(-window)))
    else:
        in_window = ops.greater_equal(kv_idx, _c(0))
    pad = ops.unsqueeze(ops.not_equal(attention_mask, _c(0)), _c([1, 2]))  # [B,1,1,L]
    keep = ops.bitwise_and(causal, in_window)
    keep = ops.bitwise_and(keep, ops.greater_equal(kv_idx, _c(0)))
    keep = ops.bitwise_and(pad, keep)
    keep = ops.bitwise_and(keep, ops.greater_equal(q_idx, _c(0)))
    shape = ops.concat([ops.gather(ops.shape_of(attention_mask), _c([0]), _c(0)), _c([1]),
                        ops.unsqueeze(cur, _c(0)), ops.unsqueeze(total, _c(0))], axis=0)
    keep = ops.broadcast(keep, shape)
    add = ops.select(keep, _c(0.0, np.float32), _c(_NEG, np.float32))
    return ops.slice(add, _c([0]), ops.unsqueeze(total, _c(0)), _c([1]), _c([3]))


def random_weights(cfg: Config):
    """The seeded random weights of ``cfg``: a ``weights(name, shape)`` for ``build`` that draws
    from ``np.random.default_rng(cfg.seed)`` in the order ``build`` asks (so the values depend
    on that order, not on the names): norms near 1, the embedding with std 1, attention sinks
    around 1, every other matrix with std 1/sqrt(fan-in)."""
    rng = np.random.default_rng(cfg.seed)

    def weights(name: str, shape: tuple) -> np.ndarray:
        if name.endswith("norm.weight"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        if name.endswith(".sinks"):
            # Around the logits' size, so each row gives its sink a real share of the weight.
            return (1.0 + 1.5 * rng.standard_normal(shape)).astype(np.float32)
        std = 1.0 if name == "model.embed_tokens.weight" else 1.0 / np.sqrt(shape[-1])
        return (rng.standard_normal(shape) * std).astype(np.float32)

    return weights


def build(cfg: Config, weights=None) -> ov.Model:
    """The stateful SDPA model of ``cfg``. ``weights(name, shape)`` gives each f32 array by its
    Hugging Face Llama name (``model.embed_tokens.weight``, ``model.layers.{i}.input_layernorm.
    weight``, ``...self_attn.{q,k,v,o}_proj.weight``, ``...post_attention_layernorm.weight``,
    ``...mlp.{gate,up,down}_proj.weight``, ``model.norm.weight``, ``lm_head.weight``; matrices
    [out, in]; ``model.layers.{i}.self_attn.sinks`` [1, H, 1, 1] with ``cfg.sinks``), asked in
    that order; default ``random_weights(cfg)``. With ``cfg.tie_word_embeddings`` the output
    projection is the embedding's own Constant (no ``lm_head.weight``)."""
    weights = weights or random_weights(cfg)
    H, Hkv, D, E = cfg.heads, cfg.kv_heads, cfg.head_size, cfg.hidden
    Dv = cfg.v_head_size or D
    G = H // Hkv
    assert H % Hkv == 0 and D % 2 == 0

    def w(name, *shape):
        got = np.asarray(weights(name, shape), dtype=np.float32)
        if got.shape != shape:
            raise ValueError(f"{name}: shape {got.shape}, the config needs {shape}")
        return got

    input_ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    attention_mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    position_ids = ops.parameter([-1, -1], ov.Type.i64, name="position_ids")
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    params = [input_ids, attention_mask, position_ids, beam_idx]
    for p in params:
        p.output(0).get_tensor().set_names({p.get_friendly_name()})

    embed = ops.constant(w("model.embed_tokens.weight", cfg.vocab, E))
    x = ops.gather(embed, input_ids, _c(0))  # [B,S,E]

    # RoPE tables from position_ids: [B,1,S,D], shared by all layers.
    inv_freq = (1.0 / cfg.rope_theta ** (np.arange(0, D, 2, dtype=np.float64) / D)).astype(np.float32)
    pos = ops.unsqueeze(ops.convert(position_ids, ov.Type.f32), _c(-1))  # [B,S,1]
    freqs = ops.multiply(pos, ops.constant(inv_freq))  # [B,S,D/2]
    emb = ops.unsqueeze(ops.concat([freqs, freqs], axis=-1), _c(1))  # [B,1,S,D]
    cos, sin = ops.cos(emb), ops.sin(emb)

    mask = _mask(cfg, input_ids, attention_mask)
    full_mask = _mask(cfg, input_ids, attention_mask, window=0) if cfg.alternate_window else mask
    batch = ops.gather(ops.shape_of(input_ids), _c([0]), _c(0))
    sinks = []
    for layer in range(cfg.layers):
        pre = f"model.layers.{layer}."
        h = _rms_norm(x, w(pre + "input_layernorm.weight", E), cfg.eps)
        q = _rope(_heads(_linear(h, w(pre + "self_attn.q_proj.weight", H * D, E)), H, D),
                  cos, sin, D)
        k = _rope(_heads(_linear(h, w(pre + "self_attn.k_proj.weight", Hkv * D, E)), Hkv, D),
                  cos, sin, D)
        v = _heads(_linear(h, w(pre + "self_attn.v_proj.weight", Hkv * Dv, E)), Hkv, Dv)
        kv = []
        for what, cur, width in (("key", k, D), ("value", v, Dv)):
            var_id = f"past_key_values.{layer}.{what}"
            init = ops.broadcast(_c(0.0, np.float32),
                                 ops.concat([batch, _c([Hkv, 0, width])], axis=0))
            past = ops6.read_value(init, var_id, ov.Type.f32, ov.PartialShape([-1, Hkv, -1, width]))
            past = ops.gather(past, beam_idx, _c(0))
            full = ops.concat([past, cur], axis=2)
            sinks.append(ops6.assign(full, var_id))
            if G > 1:  # transformers' repeat_kv
                full = ops.unsqueeze(full, _c(2))
                target = ops.concat([ops.gather(ops.shape_of(full), _c([0, 1]), _c(0)), _c([G]),
                                     ops.gather(ops.shape_of(full), _c([3, 4]), _c(0))], axis=0)
                full = ops.broadcast(full, target)
                full = ops.reshape(full, _c([0, H, -1, width]), special_zero=True)
            kv.append(full)
        sdpa_in = [q, kv[0], kv[1], mask if layer % 2 == 0 else full_mask]
        if cfg.scale is not None or cfg.sinks:
            sdpa_in.append(_c(cfg.scale if cfg.scale is not None else D ** -0.5, np.float32))
        attn = ops.scaled_dot_product_attention(*sdpa_in, causal=False)
        if cfg.sinks:  # the Python API has no sink argument: the 6th input is set on the node
            sink = ops.constant(w(pre + "self_attn.sinks", 1, H, 1, 1))
            attn.set_arguments([attn.input_value(i) for i in range(5)] + [sink.output(0)])
            attn.validate_and_infer_types()
        attn = ops.reshape(ops.transpose(attn, _c([0, 2, 1, 3])), _c([0, 0, H * Dv]), special_zero=True)
        x = ops.add(x, _linear(attn, w(pre + "self_attn.o_proj.weight", E, H * Dv)))
        h = _rms_norm(x, w(pre + "post_attention_layernorm.weight", E), cfg.eps)
        gate = ops.swish(_linear(h, w(pre + "mlp.gate_proj.weight", cfg.intermediate, E)))
        up = _linear(h, w(pre + "mlp.up_proj.weight", cfg.intermediate, E))
        down = w(pre + "mlp.down_proj.weight", E, cfg.intermediate)
        x = ops.add(x, _linear(ops.multiply(gate, up), down))
    h = _rms_norm(x, w("model.norm.weight", E), cfg.eps)
    head = embed if cfg.tie_word_embeddings else ops.constant(w("lm_head.weight", cfg.vocab, E))
    logits = ops.matmul(h, head, transpose_a=False, transpose_b=True)
    res = ops.result(logits)
    res.output(0).get_tensor().set_names({"logits"})
    return ov.Model([res], sinks, params, f"tiny_llm_{cfg.name}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--variant", choices=sorted(VARIANTS), action="append",
                    help="variant(s) to write (default: all)")
    args = ap.parse_args()
    for name in args.variant or sorted(VARIANTS):
        d = args.out_dir / name
        d.mkdir(parents=True, exist_ok=True)
        ov.save_model(build(VARIANTS[name]), d / "openvino_model.xml", compress_to_fp16=False)
        print(d / "openvino_model.xml")


if __name__ == "__main__":
    main()
