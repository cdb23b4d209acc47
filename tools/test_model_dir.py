"""pytest: tools/model_dir.py's model directories and tools/genai_ref.py's GenAI reference.

- The OpenVINO tokenizer/detokenizer IRs agree with tokenizer.json (ids with BOS, decoded text) on
  model_dir.CHECK_TEXTS and on 300 random texts; training is deterministic; config.json matches
  the graph's Config.
- GenAI's ContinuousBatchingPipeline (f32 cache and inference) on gqa4 and sliding_window gives the
  greedy ids of the stateful model run by plain OpenVINO, for the 8 standard prompts (1 to 301
  tokens, two sharing 280), both with EOS and ignore_eos; the handle API (run_timed) gives the same
  ids; GenAI's own string tokenization is what genai_ref.tokenize does (BOS + tokens, or the chat
  template without special tokens).

Skipped when openvino_genai / openvino_tokenizers / tokenizers / transformers are not installed
(scripts/setup.sh installs only openvino).
"""
import json
import random
import sys
from pathlib import Path

import pytest

for mod in ("openvino_genai", "openvino_tokenizers", "tokenizers", "transformers"):
    pytest.importorskip(mod)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import genai_ref  # noqa: E402
import model_dir  # noqa: E402

NEW = 24  # new tokens per request: enough to decode past sliding_window's 40 on most prompts


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: model_dir.write_model_dir(root / name, model_dir.ALL_VARIANTS[name])
            for name in ("gqa4", "sliding_window")}


@pytest.fixture(scope="module")
def prompts(dirs):
    return genai_ref.standard_prompts(dirs["gqa4"])


def test_files_and_config(dirs):
    d = dirs["sliding_window"]
    for f in ("openvino_model.xml", "openvino_model.bin", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "config.json", "generation_config.json",
              "openvino_tokenizer.xml", "openvino_tokenizer.bin", "openvino_detokenizer.xml",
              "openvino_detokenizer.bin"):
        assert (d / f).is_file(), f
    cfg = model_dir.ALL_VARIANTS["sliding_window"]
    c = json.loads((d / "config.json").read_text())
    assert (c["vocab_size"], c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
            c["head_dim"], c["num_hidden_layers"], c["sliding_window"]) == \
        (cfg.vocab, cfg.hidden, cfg.heads, cfg.kv_heads, cfg.head_size, cfg.layers, 40)
    assert json.loads((dirs["gqa4"] / "config.json").read_text())["sliding_window"] is None
    tc = json.loads((d / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["pad_token"]) == ("<s>", "</s>", "<pad>")
    assert "messages" in tc["chat_template"] and "add_generation_prompt" in tc["chat_template"]


def test_training_is_deterministic():
    assert model_dir.train_tokenizer(512).to_str() == model_dir.train_tokenizer(512).to_str()


def test_openvino_tokenizer_matches_tokenizer_json(dirs):
    d = dirs["gqa4"]
    assert model_dir.check_tokenizer(d) == []
    rng = random.Random(5)
    text = model_dir.corpus(seed=99, sentences=300)
    alphabet = [chr(c) for c in list(range(32, 127)) + [9, 10, 13, 0xA0, 0xE9, 0x4E2D, 0x1F600,
                                                       0x200D, 0xFE0F, 0x3000, 0x2028, 0x85]]
    texts = []
    for i in range(300):
        if i % 2:
            a = rng.randrange(len(text))
            texts.append(text[a:a + rng.randrange(1, 300)])
        else:
            texts.append("".join(rng.choice(alphabet) for _ in range(rng.randrange(60))))
    assert model_dir.check_tokenizer(d, texts) == []


def test_bos_first(dirs):
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(dirs["gqa4"] / "tokenizer.json"))
    ids = tk.encode("Hello world").ids
    assert ids[0] == model_dir.BOS_ID and ids[1:] == tk.encode("Hello world", add_special_tokens=False).ids
    assert tk.decode(ids, skip_special_tokens=True) == "Hello world"


def test_standard_prompts(dirs, prompts):
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(dirs["gqa4"] / "tokenizer.json"))
    ids = [tk.encode(p).ids for p in prompts]
    assert [len(i) for i in ids[:6]] == [1, 4, 12, 33, 70, 150]
    assert ids[6][:280] == ids[7][:280] and ids[6] != ids[7] and min(len(ids[6]), len(ids[7])) > 285


@pytest.mark.parametrize("name", ["gqa4", "sliding_window"])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_genai_matches_stateful(dirs, prompts, name, ignore_eos):
    d = dirs[name]
    opts = genai_ref.Options(max_new_tokens=NEW, ignore_eos=ignore_eos)
    res = genai_ref.run(d, prompts, opts)
    assert [r["index"] for r in res] == list(range(len(prompts)))
    ref = genai_ref.stateful_greedy(d, [r["prompt_ids"] for r in res], NEW,
                                    None if ignore_eos else model_dir.EOS_ID)
    assert [r["token_ids"] for r in res] == ref
    for r in res:
        assert r["prompt_ids"][0] == model_dir.BOS_ID
        if ignore_eos:
            assert len(r["token_ids"]) == NEW
        else:  # stops at EOS only when the model emits it
            assert len(r["token_ids"]) == NEW or r["token_ids"][-1] == model_dir.EOS_ID


def test_timed_gives_the_same_ids(dirs, prompts):
    opts = genai_ref.Options(max_new_tokens=NEW, ignore_eos=True)
    want = [r["token_ids"] for r in genai_ref.run(dirs["gqa4"], prompts, opts)]
    t = genai_ref.run_timed(dirs["gqa4"], prompts, [0, 0, 1, 2, 3, 5, 8, 8], opts, warmup=False)
    assert [r["token_ids"] for r in t["requests"]] == want
    assert t["summary"]["output_tokens"] == NEW * len(prompts)
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in t["requests"])


def test_string_overload_tokenizes_as_genai_ref(dirs):
    """GenAI's generate(list[str]) with apply_chat_template False / True gives the text of
    genai_ref.run without / with chat (BOS + tokens; template without special tokens)."""
    import openvino_genai as ov_genai

    d = dirs["gqa4"]
    texts = ["Hello world", "The quick brown fox."]
    for chat in (False, True):
        opts = genai_ref.Options(max_new_tokens=12, ignore_eos=True, chat=chat)
        want = [r["text"] for r in genai_ref.run(d, texts, opts)]
        pipe = genai_ref.make_pipeline(d, opts, [64, 64])
        cfg = genai_ref.generation_config(pipe, opts)
        cfg.apply_chat_template = chat
        got = [r.m_generation_ids[0] for r in pipe.generate(texts, [cfg] * len(texts))]
        assert got == want, chat
        assert isinstance(pipe, ov_genai.ContinuousBatchingPipeline)
