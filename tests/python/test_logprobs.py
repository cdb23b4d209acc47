"""Log-probabilities on a trained model (SmolLM2-135M-Instruct, smollm2_model.py) through the
official ``openai`` client against ``pa serve`` (f32 inference and KV cache, 2 threads).

The goldens are independent of the engine:
- the exact log-softmax (float64) of the logits of the stateful ``openvino_model.xml`` run by plain
  OpenVINO over the whole sequence (``genai_ref.stateful_logits``);
- GenAI's own values (``GenerationConfig.logprobs``, ``GenerationOutput.generated_log_probs``;
  with ``echo`` the prompt's too). GenAI sums ``exp(x - max)`` over the vocabulary in a running
  float32 sum, which loses the small terms, so its values sit up to about 2e-4 above the exact
  ones (``genai_ref.log_softmax_genai`` reproduces them from the reference logits to 1e-5). Ours
  are compared with GenAI's once that error of GenAI's, computed from the reference logits, is
  taken out; the raw difference is printed.

Checked: the greedy token is the most likely of its ``top_logprobs`` (sorted, bytes the token's
UTF-8); the generated tokens' logprobs (4 prompts x 32 tokens, served concurrently) and ids equal
both goldens, and so do ``pa generate --logprobs``'s; ``echo`` returns the prompt text and its
tokens' logprobs (the first ``null``), equal to both goldens, for a short prompt and a 300-token
one prefilled in chunks, also when asked again with its prefix cached (echo skips the prefix
cache); streamed chunks carry exactly the non-streamed logprobs; out-of-range values are 400s
naming the field; a repetition penalty gives GenAI's greedy ids.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

import genai_ref
from serve_proc import NAME, Server
from smollm2_model import smollm2  # noqa: F401  (the session fixture)
from test_smollm2 import PLAIN

PROMPTS = PLAIN[:4]
NEW = 32
TOL = 1e-4
OPTS = dict(max_new_tokens=NEW, cache_type="f32", precision="f32", threads=2, ignore_eos=True)


@pytest.fixture(scope="module")
def server(smollm2):  # noqa: F811
    # 128 token rows a step: the long prompt is prefilled in three chunks.
    s = Server(smollm2, "--max-batched-tokens", "128")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)


@pytest.fixture(scope="module")
def tok(smollm2):  # noqa: F811
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2 / "tokenizer.json"))


ECHO_PROMPTS = [PROMPTS[0], PLAIN[9]]  # a short prompt, and about 300 tokens (chunked prefill)
ECHO_NEW = 4
PENALTY = 1.3
PENALTY_PROMPTS = PROMPTS[2:4]


@pytest.fixture(scope="module")
def genai(smollm2):  # noqa: F811
    """GenAI's answers (one pipeline): "plain" (PROMPTS), "echo" (ECHO_PROMPTS with echo),
    "penalty" (PENALTY_PROMPTS with the repetition penalty); and "logits", the reference logits
    of the plain and echo sequences (``genai_ref.stateful_logits``)."""
    plain, penalty, echo = genai_ref.run_logprobs(smollm2, [
        [(p, {}) for p in PROMPTS],
        [(p, {"repetition_penalty": PENALTY}) for p in PENALTY_PROMPTS],
        # alone: in some batches GenAI's echo logprobs go wrong (genai_ref.run_logprobs)
        [(p, {"echo": True, "max_new_tokens": ECHO_NEW}) for p in ECHO_PROMPTS],
    ], genai_ref.Options(**OPTS))
    a = len(PROMPTS)
    out = {"plain": plain, "echo": echo, "penalty": penalty}
    seqs = [g["prompt_ids"] + g["token_ids"] for g in out["plain"]]
    seqs += [g["token_ids"] for g in out["echo"]]  # echo: prompt and generated already
    logits = genai_ref.stateful_logits(smollm2, seqs, threads=2)
    out["logits"] = {"plain": logits[:a], "echo": logits[a:]}
    return out


@pytest.fixture(scope="module")
def greedy(client):
    """Our greedy completions of PROMPTS with logprobs (served concurrently)."""
    return concurrently(lambda p: complete(client, p, max_tokens=NEW, logprobs=1), PROMPTS)


def names(tok, ids):
    return [tok.decode([t], skip_special_tokens=False) for t in ids]


def concurrently(fn, items):
    with ThreadPoolExecutor(len(items)) as ex:
        return list(ex.map(fn, items))


def complete(client, prompt, **kw):
    kw.setdefault("extra_body", {"ignore_eos": True})
    return client.completions.create(model=NAME, prompt=prompt, temperature=0, **kw)


def check_against_goldens(ref, ours, genai, ids, positions, what):
    """``ours[k]`` and ``genai[k]`` are the logprobs of token ``ids[positions[k]]``, ``ref`` the
    reference logits of ``ids``; compares both with the reference and returns
    (max |ours - exact|, max |ours - GenAI| raw)."""
    rows = ref[np.array(positions) - 1]
    picked = np.array([ids[p] for p in positions])
    exact = genai_ref.log_softmax_f64(rows)[np.arange(len(picked)), picked]
    as_genai = genai_ref.log_softmax_genai(rows)[np.arange(len(picked)), picked]
    ours, genai = np.array(ours, dtype=np.float64), np.array(genai, dtype=np.float64)
    # GenAI's arithmetic on the reference logits gives GenAI's values: both see the same model.
    assert np.abs(genai - as_genai).max() <= TOL, f"{what}: GenAI vs its own arithmetic"
    d_exact = np.abs(ours - exact)
    assert d_exact.max() <= TOL, f"{what}: worst {d_exact.max():.2e} at {d_exact.argmax()}"
    d_genai = np.abs(ours - (genai - (as_genai - exact)))
    assert d_genai.max() <= TOL, f"{what}: worst vs GenAI {d_genai.max():.2e}"
    raw = np.abs(ours - genai).max()
    print(f"{what}: max |ours - exact| {d_exact.max():.2e}, max |ours - GenAI| {raw:.2e}, "
          f"{d_genai.max():.2e} without GenAI's f32 sum error (up to "
          f"{np.abs(as_genai - exact).max():.2e})")
    return d_exact.max(), raw


def test_greedy_token_is_the_most_likely_of_its_top_logprobs(client):
    def ask(p):
        return client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0,
            logprobs=True, top_logprobs=5)

    for r in concurrently(ask, ["What is the capital of France?", "Write a haiku about the sea."]):
        content = r.choices[0].logprobs.content
        assert len(content) == r.usage.completion_tokens > 0
        for c in content:
            top = c.top_logprobs
            assert len(top) == 5
            assert top[0].token == c.token and top[0].logprob == c.logprob
            assert c.logprob == max(t.logprob for t in top) <= 0
            assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
            assert c.bytes == list(c.token.encode()) and top[1].bytes == list(top[1].token.encode())
            assert sum(np.exp(t.logprob) for t in top) <= 1 + 1e-6
    # Not asked: none.
    r = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, temperature=0)
    assert r.choices[0].logprobs is None


def test_generated_logprobs_equal_genai_and_the_exact_log_softmax(greedy, genai, tok):
    for i, (o, g, lg) in enumerate(zip(greedy, genai["plain"], genai["logits"]["plain"])):
        lp = o.choices[0].logprobs
        assert lp.tokens == names(tok, g["token_ids"]), f"prompt {i}: tokens differ from GenAI's"
        assert len(lp.token_logprobs) == NEW
        seq = g["prompt_ids"] + g["token_ids"]
        n = len(g["prompt_ids"])
        check_against_goldens(lg, lp.token_logprobs, g["log_probs"], seq,
                              list(range(n, n + NEW)), f"prompt {i}")
        # Completions' top_logprobs: the top token and the chosen one, the chosen greedy = top.
        for t, top, v in zip(lp.tokens, lp.top_logprobs, lp.token_logprobs):
            assert top == {t: v}


def test_echo_returns_the_prompt_and_its_logprobs(client, genai, tok):
    # The long prompt is asked again after the first answer has filled the prefix cache, which
    # echo must not use. (GenAI is asked each prompt once.)
    prompts = ECHO_PROMPTS + ECHO_PROMPTS[1:]
    echo = lambda p: complete(client, p, max_tokens=ECHO_NEW, logprobs=2, echo=True)  # noqa: E731
    ours = concurrently(echo, ECHO_PROMPTS) + [echo(prompts[2])]
    ref = genai["echo"] + genai["echo"][1:]
    logits = genai["logits"]["echo"] + genai["logits"]["echo"][1:]
    for i, (p, o, g, lg) in enumerate(zip(prompts, ours, ref, logits)):
        c = o.choices[0]
        seq = g["token_ids"]  # GenAI's echo: prompt then generated
        n = len(g["prompt_ids"])
        assert seq[:n] == g["prompt_ids"] and len(seq) == n + ECHO_NEW
        assert c.text == p + tok.decode(seq[n:]), f"prompt {i}"
        lp = c.logprobs
        assert lp.tokens == names(tok, seq), f"prompt {i}"
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(len(t) in (2, 3) for t in lp.top_logprobs[1:])
        assert lp.text_offset[0] == 0 and lp.text_offset[n] == len("".join(lp.tokens[:n]))
        check_against_goldens(lg, lp.token_logprobs[1:], g["log_probs"][1:], seq,
                              list(range(1, len(seq))), f"echo {i}")
    # Echo without logprobs: the text only.
    r = complete(client, prompts[0], max_tokens=2, echo=True)
    assert r.choices[0].text.startswith(prompts[0]) and r.choices[0].logprobs is None


def test_streamed_logprobs_equal_the_whole_answer(client):
    # Prompts under one KV block (32 tokens): the second request does not start from the
    # first's cached prefix, so it computes exactly the same logits.
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Give me three tips for staying healthy."}]
    kw = dict(model=NAME, messages=msgs, max_tokens=24, temperature=0, logprobs=True,
              top_logprobs=3)
    whole = client.chat.completions.create(**kw)
    assert whole.usage.prompt_tokens < 32
    whole = whole.choices[0]
    streamed = []
    text = ""
    for ch in client.chat.completions.create(**kw, stream=True):
        for c in ch.choices:
            text += c.delta.content or ""
            if c.logprobs and c.logprobs.content:
                streamed.extend(c.logprobs.content)
    assert text == whole.message.content
    assert [c.model_dump() for c in streamed] == [c.model_dump() for c in whole.logprobs.content]
    # Completions with echo: the prompt's logprobs come in the stream too.
    ckw = dict(model=NAME, prompt=PROMPTS[2], max_tokens=12, temperature=0, logprobs=3, echo=True)
    w = client.completions.create(**ckw).choices[0].logprobs
    got = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for ch in client.completions.create(**ckw, stream=True):
        for c in ch.choices:
            if c.logprobs:
                for k in got:
                    got[k].extend(getattr(c.logprobs, k))
    assert got == {k: getattr(w, k) for k in got}


def test_pa_generate_prints_the_same_logprobs(smollm2, genai, tmp_path):  # noqa: F811
    from test_engine import ENGINE, run_engine

    _, lines, _ = run_engine(ENGINE, smollm2, PROMPTS[:1], "--cache-type", "f32", "--precision",
                             "f32", "--threads", "2", "--kv-cache-size", "0.05",
                             "--max-new-tokens", str(NEW), "--ignore-eos", "--logprobs", "3",
                             tmp_path=tmp_path)
    (o,) = lines
    g = genai["plain"][0]
    assert o["token_ids"] == g["token_ids"]
    lps = o["logprobs"]
    assert [x["token"] for x in lps] == o["token_ids"]
    for x in lps:
        assert len(x["top_logprobs"]) == 3 and x["top_logprobs"][0] == [x["token"], x["logprob"]]
    n = len(g["prompt_ids"])
    check_against_goldens(genai["logits"]["plain"][0], [x["logprob"] for x in lps],
                          g["log_probs"], g["prompt_ids"] + g["token_ids"],
                          list(range(n, n + NEW)), "pa generate")


@pytest.mark.parametrize("path,extra,param", [
    ("chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("chat/completions", {"logprobs": 3}, "logprobs"),
    ("chat/completions", {"echo": True}, "echo"),
    ("completions", {"logprobs": 6}, "logprobs"),
    ("completions", {"logprobs": True}, "logprobs"),
    ("completions", {"echo": "yes"}, "echo"),
])
def test_out_of_range_is_refused_by_name(server, path, extra, param):
    body = {"model": NAME, "max_tokens": 2, **extra}
    body.update({"prompt": "x"} if path == "completions" else {"messages": [{"role": "user", "content": "x"}]})
    r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_repetition_penalty_gives_genai_ids(client, greedy, genai, tok):
    ours = concurrently(lambda p: complete(client, p, max_tokens=NEW, logprobs=0, extra_body={
        "ignore_eos": True, "repetition_penalty": PENALTY}), PENALTY_PROMPTS)
    plain = [greedy[PROMPTS.index(p)] for p in PENALTY_PROMPTS]
    for i, (p, o, g) in enumerate(zip(plain, ours, genai["penalty"])):
        assert o.choices[0].logprobs.tokens == names(tok, g["token_ids"]), f"prompt {i}"
        assert o.choices[0].text == g["text"]
        assert p.choices[0].logprobs.tokens != o.choices[0].logprobs.tokens, \
            f"prompt {i}: the penalty changed nothing"
