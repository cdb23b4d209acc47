"""Complete model directories for tools/tiny_llm.py's models, laid out as
``optimum-cli export openvino --task text-generation-with-past`` writes them, made offline: the
stateful IR, a byte-level BPE tokenizer trained here on a generated corpus, its OpenVINO
tokenizer/detokenizer IRs, and the HF config files.

``write_model_dir(out_dir, cfg)`` writes one directory; ``python tools/model_dir.py OUT_DIR
[--variant NAME ...]`` writes ``OUT_DIR/NAME`` for each variant (default: every tiny variant;
``attn``, the attention-heavy benchmark model, only when named). Files written:

- ``openvino_model.xml/.bin``: ``tiny_llm.build(cfg)`` saved with ``compress_to_fp16=False``;
- ``tokenizer.json``: a byte-level BPE (GPT-2 pre-tokenizer regex, every byte in the alphabet, so
  any UTF-8 text encodes) trained with the ``tokenizers`` library on ``corpus()`` (seeded, about
  200 KB of English-like text, trains in well under a second) to exactly ``cfg.vocab`` entries;
  special tokens ``<pad>`` 0, ``<s>`` 1 (BOS), ``</s>`` 2 (EOS), ``<|im_start|>`` 3, ``<|im_end|>``
  4; a ``TemplateProcessing`` post-processor that prepends BOS (``encode(text)`` with special
  tokens = ``[1] + tokens``); a ByteLevel decoder (``decode(encode(t), skip_special_tokens=True)
  == t``);
- ``tokenizer_config.json`` (bos/eos/pad tokens, ``add_bos_token``, a ChatML ``chat_template``
  that starts with ``bos_token``), ``special_tokens_map.json``;
- ``config.json`` (``LlamaForCausalLM``, the sizes of ``cfg``, ``head_dim``, ``sliding_window`` or
  null, ``max_position_embeddings``), ``generation_config.json``;
- ``openvino_tokenizer.xml/.bin``, ``openvino_detokenizer.xml/.bin``: ``openvino_tokenizers.
  convert_tokenizer(PreTrainedTokenizerFast.from_pretrained(out_dir), with_detokenizer=True)``,
  as optimum-cli converts them (the chat template, BOS/EOS/PAD ids go into the IRs' rt_info).

``check_tokenizer(out_dir)`` encodes ``CHECK_TEXTS`` (ASCII, whitespace runs, digits, accents, CJK,
emoji, special-token strings) with ``openvino_tokenizer.xml`` and with ``tokenizer.json`` and
decodes with both; it returns the list of mismatches (empty when they agree).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import tiny_llm  # noqa: E402
from tiny_llm import Config, VARIANTS  # noqa: E402

PAD, BOS, EOS, IM_START, IM_END = "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, IM_END]  # ids 0..4
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

# HF-style ChatML template (as Qwen's, with BOS first as Llama's): uses messages,
# add_generation_prompt and bos_token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The attention-heavy benchmark model (1k-4k token prompts): 32 query heads of 128 over 8 KV heads,
# a small MLP, so attention dominates a long prefill. Not in tiny_llm.VARIANTS, whose every entry
# the tests run.
BENCH_VARIANTS = {
    "attn": Config("attn", heads=32, kv_heads=8, head_size=128, hidden=1024, layers=2,
                   intermediate=1024, max_position_embeddings=8192),
}
ALL_VARIANTS = {**VARIANTS, **BENCH_VARIANTS}

# Texts check_tokenizer compares the two tokenizers on.
CHECK_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "a",
    " leading space",
    "trailing space ",
    "  two  spaces   and\ttabs\t\tand\nnewlines\n\n",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1,000,000",
    "Punctuation!? (brackets) [more] {braces} \"quotes\" 'single' -- dashes... end.",
    "It's, I'm, you're, they'll, we've, he'd, don't",
    "Café naïve résumé façade Über straße",
    "Привет, мир! Γειά σου Κόσμε",
    "日本語のテキスト、東京。中文字符。한국어",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 ❤️ ✨",
    "mixed 🙂 text with é and 中 and 1️⃣",
    "<s> literal special tokens </s> and <|im_start|>user\nhi<|im_end|>",
    "<pad>",
    "code: def f(x):\n    return x ** 2  # square\n",
    "URL https://example.com/path?q=1&r=two#frag",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "",
    " ",
    "\n",
    "the the the the the the the the the the the the the the the the",
]

_WORDS = (
    "the of and to in a is that for it as was with be by on not he I this are or his from at which "
    "but have an they you were her she there been one all we their has would when if so no will "
    "more can out up about into them some could time what only other new very after than first "
    "also any two may these its over such like people year make just most back through much way "
    "well where good before little world house water small large long great old right place "
    "city river mountain garden morning evening light night day week story model token cache "
    "memory block attention layer value query key number system engine request prompt answer "
    "question simple quick brown fox lazy dog jumps reads writes runs walks thinks knows sees "
    "finds gives takes brings makes says goes comes learns teaches opens closes starts stops "
    "happy quiet bright dark warm cold early late green blue red yellow white black open"
).split()
_NAMES = "Alice Bob Carol Dave Eve Paris London Tokyo Monday Friday OpenVINO Rust Python".split()
_RARE = ["café", "naïve", "résumé", "Zürich", "東京", "😀", "👍", "—", "…", "€", "°C", "ß"]


def corpus(seed: int = 0, sentences: int = 3000) -> str:
    """Deterministic English-like text (about 70 characters a sentence): words of a fixed list,
    names, numbers, punctuation, quotes, contractions, line breaks and a few non-ASCII words."""
    rng = random.Random(seed)
    out = []
    for i in range(sentences):
        n = rng.randint(4, 16)
        words = []
        for _ in range(n):
            r = rng.random()
            if r < 0.06:
                words.append(rng.choice(_NAMES))
            elif r < 0.10:
                words.append(str(rng.choice([rng.randint(0, 9), rng.randint(10, 99),
                                             rng.randint(100, 9999)])))
            elif r < 0.12:
                words.append(rng.choice(_RARE))
            elif r < 0.14:
                words.append(rng.choice(["don't", "it's", "I'm", "we're", "they'll", "can't"]))
            else:
                # Zipf-like: early words are frequent.
                words.append(_WORDS[min(int(rng.paretovariate(0.8)) - 1, len(_WORDS) - 1)
                                    if rng.random() < 0.5 else rng.randrange(len(_WORDS))])
        words[0] = words[0][:1].upper() + words[0][1:]
        for _ in range(rng.randint(0, 2)):
            j = rng.randrange(1, n) if n > 1 else 0
            words[j] += rng.choice([",", ";", ":"])
        s = " ".join(words) + rng.choice([".", ".", ".", "!", "?"])
        if rng.random() < 0.05:
            s = '"' + s + '"'
        out.append(s)
        out.append("\n\n" if rng.random() < 0.1 else ("\n" if rng.random() < 0.1 else " "))
    return "".join(out)


def train_tokenizer(vocab: int, seed: int = 0):
    """A byte-level BPE ``tokenizers.Tokenizer`` of exactly ``vocab`` entries (special tokens
    first, the 256 byte symbols, merges), trained on ``corpus(seed)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    base = len(SPECIAL_TOKENS) + 256
    if vocab <= base:
        raise ValueError(f"vocab {vocab} leaves no merges (specials + 256 bytes = {base})")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, min_frequency=2, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text = corpus(seed)
    chunk = 4096
    tok.train_from_iterator((text[i:i + chunk] for i in range(0, len(text), chunk)), trainer)
    got = tok.get_vocab_size()
    if got != vocab:  # the corpus ran out of pairs seen twice
        raise RuntimeError(f"trained {got} entries, wanted {vocab}: enlarge corpus()")
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B:1", special_tokens=[(BOS, BOS_ID)])
    return tok


def hf_config(cfg: Config) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab,
        "hidden_size": cfg.hidden,
        "intermediate_size": cfg.intermediate,
        "num_hidden_layers": cfg.layers,
        "num_attention_heads": cfg.heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_position_embeddings,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rms_norm_eps": cfg.eps,
        "sliding_window": cfg.sliding_window or None,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "torch_dtype": "float32",
        "use_cache": True,
        # Not HF Llama fields: what the graph does beyond config.json's reach (its SDPA scale).
        "tiny_llm": {"name": cfg.name, "seed": cfg.seed, "sdpa_scale": cfg.scale},
    }


def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_tokenizer_files(out_dir: Path, vocab: int, seed: int = 0) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json, openvino_tokenizer.xml/.bin,
    openvino_detokenizer.xml/.bin."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(vocab, seed)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": True} for i, t in enumerate(SPECIAL_TOKENS)}
    _write_json(out_dir / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": None,
        "add_bos_token": True, "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "chat_template": CHAT_TEMPLATE,
    })
    _write_json(out_dir / "special_tokens_map.json", {
        "bos_token": BOS, "eos_token": EOS, "pad_token": PAD,
        "additional_special_tokens": [IM_START, IM_END],
    })
    write_openvino_tokenizers(out_dir)


def write_openvino_tokenizers(out_dir: Path) -> None:
    """openvino_tokenizer/detokenizer IRs from the HF files in out_dir, as optimum-cli makes them."""
    import openvino as ov
    from openvino_tokenizers import convert_tokenizer
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(out_dir))
    ov_tok, ov_detok = convert_tokenizer(hf, with_detokenizer=True)
    ov.save_model(ov_tok, out_dir / "openvino_tokenizer.xml")
    ov.save_model(ov_detok, out_dir / "openvino_detokenizer.xml")


def write_model_dir(out_dir, cfg: Config) -> Path:
    """Writes the complete model directory of ``cfg`` into ``out_dir`` (made if missing)."""
    import openvino as ov

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ov.save_model(tiny_llm.build(cfg), out_dir / "openvino_model.xml", compress_to_fp16=False)
    _write_json(out_dir / "config.json", hf_config(cfg))
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID,
        "do_sample": False, "max_length": cfg.max_position_embeddings,
    })
    write_tokenizer_files(out_dir, cfg.vocab)
    return out_dir


def check_tokenizer(model_dir, texts=CHECK_TEXTS) -> list[str]:
    """Mismatches between openvino_tokenizer/detokenizer.xml and tokenizer.json on ``texts``:
    ids with special tokens (BOS first), and the detokenized text of those ids (special tokens
    skipped) against ``Tokenizer.decode(ids, skip_special_tokens=True)``; also decode of the ids
    without BOS back to the text. Empty when everything agrees."""
    import numpy as np
    import openvino as ov
    import openvino_tokenizers  # noqa: F401  (registers the tokenizer ops)
    from tokenizers import Tokenizer

    model_dir = Path(model_dir)
    hf = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    core = ov.Core()
    enc = core.compile_model(model_dir / "openvino_tokenizer.xml", "CPU")
    dec = core.compile_model(model_dir / "openvino_detokenizer.xml", "CPU")
    bad = []
    for text in texts:
        want = hf.encode(text, add_special_tokens=True).ids
        got = [int(t) for t in enc([text])["input_ids"][0]]
        if got != want:
            bad.append(f"encode {text!r}: openvino {got} != tokenizers {want}")
        want_text = hf.decode(want, skip_special_tokens=True)
        got_text = str(dec(np.array([want], dtype=np.int64))["string_output"][0])
        if got_text != want_text:
            bad.append(f"decode {want}: openvino {got_text!r} != tokenizers {want_text!r}")
        plain = hf.encode(text, add_special_tokens=False).ids
        if not any(s in text for s in SPECIAL_TOKENS) and hf.decode(plain) != text:
            bad.append(f"round trip {text!r}: tokenizers decodes {hf.decode(plain)!r}")
    return bad


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--variant", choices=sorted(ALL_VARIANTS), action="append",
                    help="variant(s) to write (default: the tiny ones: %s)" % ", ".join(sorted(VARIANTS)))
    ap.add_argument("--check", action="store_true",
                    help="compare the OpenVINO tokenizer with tokenizer.json on CHECK_TEXTS")
    args = ap.parse_args()
    failed = False
    for name in args.variant or sorted(VARIANTS):
        t0 = time.perf_counter()
        d = write_model_dir(args.out_dir / name, ALL_VARIANTS[name])
        print(f"{d} ({time.perf_counter() - t0:.1f} s)")
        if args.check:
            bad = check_tokenizer(d)
            for b in bad:
                print("  MISMATCH", b)
            print(f"  tokenizer check: {len(CHECK_TEXTS)} texts, {len(bad)} mismatches")
            failed |= bool(bad)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
