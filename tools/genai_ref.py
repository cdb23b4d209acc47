"""Reference generation with OpenVINO GenAI's ``ContinuousBatchingPipeline`` (CPU) on a model
directory (tools/model_dir.py writes them; optimum-cli's layout): greedy tokens and text per prompt,
and a timed mode (time to first token, time per output token, throughput).

CLI::

    python tools/genai_ref.py MODEL_DIR --prompts prompts.json [--max-new-tokens 64]
        [--cache-type f32|u8|u4|f16|bf16] [--precision f32|bf16|f16] [--threads N] [--chat]
        [--ignore-eos] [--json] [--timed [--arrival-steps 0,0,3,...]]
    python tools/genai_ref.py MODEL_DIR --make-prompts prompts.json   # the 8 standard prompts

prompts.json: a JSON list (or ``{"prompts": [...]}``) whose items are a string, ``{"prompt": str}``
or ``{"token_ids": [int, ...]}`` (ids used as they are: no BOS added, no template). Output: one
JSON object per prompt and line, in input order, ``{"index": i, "token_ids": [generated ids only],
"text": "..."}`` (``--json``: also ``prompt_ids``, ``finish_reason``; ``--timed``: a summary line
``{"summary": {...}}`` after the per-request lines, which then carry ``ttft_ms``, ``tpot_ms``).

What GenAI does (openvino-genai 2026.4.1.0, found on tools/model_dir.py's directories):

- It loads the stateful ``openvino_model.xml`` and applies ``SDPAToPagedAttention`` itself (the
  sliding window of the gpt-oss-form mask is found: the ``sliding_window`` variant's
  PagedAttentionExtension gets window 40). Block size 32 on CPU.
- KV cache precision: the CPU plugin's default is u8 (``KV_CACHE_PRECISION`` unset gives 10240 bytes
  a block on gqa4 = u8 data + f32 scale/zero point per 32 values, the same as ``u8``); ``f32`` is
  honoured (32768 bytes a block on gqa4: 2 layers x K,V x 2 KV heads x 32 x 32 x 4 bytes), and
  so is ``u4`` (the plugin's u4 layout: key ``u4 [?, 2, 48, 32]``, value ``u4 [?, 2, 32, 48]`` on
  gqa4, 6144 bytes a block; its greedy ids leave the f32 ids on every standard prompt). The
  plugin refuses an f32 cache with bf16 inference and a bf16 cache with f32 inference; f16 and u8
  go with either. ``INFERENCE_PRECISION_HINT`` defaults to bf16 on CPUs with bf16 support, hence
  this tool's defaults: ``--precision f32 --cache-type f32``. With f32/f32 the greedy ids equal
  ``stateful_greedy``'s (``--check-stateful``) on gqa1, gqa4 and sliding_window (64 tokens, the
  8 standard prompts, with or without prefix caching and prompt chunks of 64). ``--precision f16``
  is broken on a CPU without native f16 (Xeon with AMX-BF16, 2026.4.1): the built-in
  PagedAttention gives NaN logits for a multi-token prefill (also outside GenAI, on
  ``pa_convert.to_paged`` graphs), so its tokens are noise; bf16 differs from f32 by near-ties only.
- Tokenization: ``generate(list[str], ...)`` applies the tokenizer's chat template by default
  (``GenerationConfig.apply_chat_template`` is True) and then tokenizes WITHOUT special tokens (the
  template writes BOS); with ``apply_chat_template=False`` it tokenizes with ``add_special_tokens=
  True`` (BOS first, as ``tokenizer.json``'s post-processor). The string overload returns decoded
  text only (``GenerationResult.m_generation_ids`` is a list of str), so this tool tokenizes itself
  with ``pipe.get_tokenizer().encode(text)`` (BOS first) -- or ``apply_chat_template`` +
  ``encode(add_special_tokens=False)`` with ``--chat``, which is what the string overload does --
  and calls ``generate(list[ov.Tensor], configs)``, whose ``EncodedGenerationResult.m_generation_ids``
  holds the generated ids only (prompt not echoed).
- Generation configs start from ``pipe.get_config()`` (generation_config.json: eos 2) so EOS stops a
  request only when the model emits it (``finish_reason`` STOP, else LENGTH); a bare
  ``GenerationConfig()`` has ``eos_token_id`` -1. ``--ignore-eos`` sets ``ignore_eos``.
- Streaming/handle API: ``handle = pipe.add_request(request_id, ids_tensor, config)``, then
  ``pipe.step()`` while ``pipe.has_non_finished_requests()``; after each step
  ``handle.can_read()`` / ``handle.read()`` gives ``{0: GenerationOutput}`` whose
  ``generated_ids`` are the tokens produced since the last read; ``handle.get_status()``.
  ``run_timed`` times those: a request's TTFT is from its ``add_request`` to the end of the step
  that produced its first token (prompts longer than ``max_num_batched_tokens``, default 256, are
  prefilled over several steps).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

BLOCK_SIZE = 32  # GenAI's KV block on CPU


@dataclass
class Options:
    max_new_tokens: int = 64
    cache_type: str = "f32"  # KV_CACHE_PRECISION; "" = the plugin's default (u8)
    precision: str = "f32"  # INFERENCE_PRECISION_HINT; "" = the plugin's default
    threads: int = 0  # INFERENCE_NUM_THREADS; 0 = the plugin's default
    chat: bool = False
    ignore_eos: bool = False
    max_batched_tokens: int = 256  # SchedulerConfig.max_num_batched_tokens (GenAI's default 256)
    num_kv_blocks: int = 0  # 0: sized from the prompts
    cache_gb: float = 0.0  # SchedulerConfig.cache_size, when > 0 (instead of num_kv_blocks)
    prefix_caching: bool = False
    # GenerationConfig's penalties (1, 0, 0: none)
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    extra_properties: dict = field(default_factory=dict)


def load_prompts(path) -> list:
    """Items of prompts.json: str or list[int] (token ids)."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if isinstance(data, dict):
        data = data["prompts"]
    out = []
    for item in data:
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict) and "token_ids" in item:
            out.append([int(t) for t in item["token_ids"]])
        elif isinstance(item, dict) and "prompt" in item:
            out.append(item["prompt"])
        elif isinstance(item, list):
            out.append([int(t) for t in item])
        else:
            raise ValueError(f"prompt item not understood: {item!r}")
    return out


def properties(opts: Options) -> dict:
    props = dict(opts.extra_properties)
    if opts.cache_type:
        props["KV_CACHE_PRECISION"] = opts.cache_type
    if opts.precision:
        props["INFERENCE_PRECISION_HINT"] = opts.precision
    if opts.threads:
        props["INFERENCE_NUM_THREADS"] = int(opts.threads)
    return props


def make_pipeline(model_dir, opts: Options, prompt_lens=()):
    """The ContinuousBatchingPipeline on CPU. KV blocks: ``opts.num_kv_blocks``, else ``cache_gb``
    GB, else every prompt's blocks at once (prompt + new tokens, rounded up to 32) plus 64 spare."""
    import openvino_genai as ov_genai

    sc = ov_genai.SchedulerConfig()
    sc.max_num_batched_tokens = opts.max_batched_tokens
    sc.enable_prefix_caching = opts.prefix_caching
    sc.dynamic_split_fuse = True
    if opts.num_kv_blocks:
        sc.num_kv_blocks = opts.num_kv_blocks
    elif opts.cache_gb:
        sc.cache_size = opts.cache_gb
    else:
        need = sum(math.ceil((n + opts.max_new_tokens + 1) / BLOCK_SIZE) for n in prompt_lens)
        sc.num_kv_blocks = 2 * need + 64
    return ov_genai.ContinuousBatchingPipeline(str(model_dir), sc, "CPU", properties(opts))


def tokenize(tokenizer, prompt, chat: bool) -> list[int]:
    """The ids GenAI's string overload would feed: BOS + tokens (``add_special_tokens`` True), or
    with ``chat`` the chat template (which writes BOS) tokenized without special tokens."""
    if isinstance(prompt, list):
        return list(prompt)
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             add_generation_prompt=True)
        enc = tokenizer.encode(text, add_special_tokens=False)
    else:
        enc = tokenizer.encode(prompt)
    return [int(t) for t in enc.input_ids.data[0]]


def _tensor(ids):
    import openvino as ov

    return ov.Tensor(np.array([ids], dtype=np.int64))


def generation_config(pipe, opts: Options):
    """Greedy, ``max_new_tokens``, EOS from generation_config.json (stops only when emitted).
    ``pipe``: a ``ContinuousBatchingPipeline`` or an ``LLMPipeline``."""
    cfg = pipe.get_config() if hasattr(pipe, "get_config") else pipe.get_generation_config()
    cfg.max_new_tokens = opts.max_new_tokens
    cfg.do_sample = False
    cfg.num_beams = 1
    cfg.ignore_eos = opts.ignore_eos
    cfg.apply_chat_template = False
    cfg.echo = False
    cfg.repetition_penalty = opts.repetition_penalty
    cfg.presence_penalty = opts.presence_penalty
    cfg.frequency_penalty = opts.frequency_penalty
    return cfg


def _lens_for_sizing(model_dir, prompts):
    """Rough prompt lengths (for sizing the cache before the pipeline, and its tokenizer, exist)."""
    return [len(p) if isinstance(p, list) else len(p.encode("utf-8")) + 64 for p in prompts]


def run(model_dir, prompts, opts: Options | None = None) -> list[dict]:
    """Greedy generation of every prompt, all submitted as one batch
    (``generate([ids tensors], [config] * n)``). Returns per prompt, in order: ``index``,
    ``prompt_ids``, ``token_ids`` (generated only), ``text`` (decoded, special tokens skipped),
    ``finish_reason``."""
    opts = opts or Options()
    pipe = make_pipeline(model_dir, opts, _lens_for_sizing(model_dir, prompts))
    tok = pipe.get_tokenizer()
    ids = [tokenize(tok, p, opts.chat) for p in prompts]
    cfg = generation_config(pipe, opts)
    results = pipe.generate([_tensor(i) for i in ids], [cfg] * len(ids))
    out = []
    for i, (pid, res) in enumerate(zip(ids, results)):
        gen = [int(t) for t in res.m_generation_ids[0]]
        reasons = getattr(res, "finish_reasons", None)
        out.append({"index": i, "prompt_ids": pid, "token_ids": gen, "text": tok.decode(gen),
                    "finish_reason": reasons[0].name if reasons else None})
    return out


def run_logprobs(model_dir, batches, opts: Options | None = None) -> list[list[dict]]:
    """Greedy generation with GenAI's log-probabilities (``GenerationConfig.logprobs`` = 1) in
    one pipeline (the handle API): each batch's requests are added together and run to their end
    before the next batch's are added. A request is ``(prompt, overrides)``, ``overrides`` a dict
    of ``GenerationConfig`` fields on top of ``opts`` (``echo``, ``repetition_penalty``,
    ``max_new_tokens``...). Per batch and request: ``prompt_ids``, ``token_ids`` and
    ``log_probs`` (``GenerationOutput.generated_log_probs``; see ``log_softmax_genai`` for how
    GenAI computes them), ``text``. With ``echo`` the ids and log_probs start with the prompt's
    (GenAI puts 1.0 for the prompt's first token, which has no log-probability). Run echo
    requests in a batch of their own (openvino-genai 2026.4.1): an echo request batched after
    six others, and the second of two echo requests with the same 300-token prompt, got prompt
    log-probabilities up to 25 off (two echo requests with different prompts were right)."""
    opts = opts or Options()
    prompts = [p for batch in batches for p, _ in batch]
    pipe = make_pipeline(model_dir, opts, _lens_for_sizing(model_dir, prompts))
    tok = pipe.get_tokenizer()
    out = []
    for batch in batches:
        ids = [tokenize(tok, p, opts.chat) for p, _ in batch]
        handles = []
        for pid, (_, overrides) in zip(ids, batch):
            cfg = generation_config(pipe, opts)
            cfg.logprobs = 1
            for k, v in overrides.items():
                setattr(cfg, k, v)
            handles.append(pipe.add_request(len(handles) + 1000 * len(out), _tensor(pid), cfg))
        while pipe.has_non_finished_requests():
            pipe.step()
        got = []
        for pid, h, (_, overrides) in zip(ids, handles, batch):
            (o,) = h.read_all()
            gen = [int(t) for t in o.generated_ids]
            text = tok.decode(gen[len(pid):] if overrides.get("echo") else gen)
            got.append({"prompt_ids": pid, "token_ids": gen, "text": text,
                        "log_probs": [float(x) for x in o.generated_log_probs]})
        out.append(got)
    return out


def run_timed(model_dir, prompts, arrival_steps=None, opts: Options | None = None,
              warmup: bool = True) -> dict:
    """Generation through the handle API with timing. Request i is added before step
    ``arrival_steps[i]`` (default: all before step 0); steps run until every request finishes.

    Returns ``{"requests": [{index, prompt_len, token_ids, text, ttft_ms, tpot_ms, token_times_ms}],
    "summary": {requests, prompt_tokens, output_tokens, wall_s, output_tokens_per_s,
    total_tokens_per_s, steps, ttft_ms_mean, ttft_ms_max, tpot_ms_mean, load_s}}``. TTFT: from the
    request's add_request to the end of the step that gave its first token; TPOT: (last token time
    - first token time) / (tokens - 1); token_times_ms: each token's arrival after the add. A
    warm-up request (8 tokens, 2 new) runs first unless ``warmup`` is False."""
    opts = opts or Options()
    t0 = time.perf_counter()
    pipe = make_pipeline(model_dir, opts, _lens_for_sizing(model_dir, prompts))
    load_s = time.perf_counter() - t0
    tok = pipe.get_tokenizer()
    ids = [tokenize(tok, p, opts.chat) for p in prompts]
    cfg = generation_config(pipe, opts)
    if warmup:
        import openvino_genai as ov_genai

        w = ov_genai.GenerationConfig(max_new_tokens=2, do_sample=False, ignore_eos=True)
        pipe.generate([_tensor(ids[0][:8] or [1])], [w])
    arrival = list(arrival_steps) if arrival_steps is not None else [0] * len(ids)
    assert len(arrival) == len(ids)
    order = sorted(range(len(ids)), key=lambda i: arrival[i])
    handles, added, times, toks = {}, {}, {i: [] for i in range(len(ids))}, {i: [] for i in range(len(ids))}
    step, nxt = 0, 0
    start = time.perf_counter()
    while nxt < len(order) or pipe.has_non_finished_requests():
        while nxt < len(order) and arrival[order[nxt]] <= step:
            i = order[nxt]
            added[i] = time.perf_counter()
            handles[i] = pipe.add_request(1000 + i, _tensor(ids[i]), cfg)
            nxt += 1
        if not pipe.has_non_finished_requests():
            step += 1  # idle step: nothing to run until the next arrival
            continue
        pipe.step()
        now = time.perf_counter()
        step += 1
        for i, h in handles.items():
            while h.can_read():
                for o in h.read().values():
                    new = [int(t) for t in o.generated_ids]
                    toks[i].extend(new)
                    times[i].extend([now] * len(new))
    wall = time.perf_counter() - start
    reqs = []
    for i in range(len(ids)):
        tt = times[i]
        ttft = (tt[0] - added[i]) * 1e3 if tt else None
        tpot = (tt[-1] - tt[0]) * 1e3 / (len(tt) - 1) if len(tt) > 1 else None
        reqs.append({"index": i, "prompt_len": len(ids[i]), "token_ids": toks[i],
                     "text": tok.decode(toks[i]), "ttft_ms": ttft, "tpot_ms": tpot,
                     "token_times_ms": [(t - added[i]) * 1e3 for t in tt]})
    out_tokens = sum(len(t) for t in toks.values())
    prompt_tokens = sum(len(i) for i in ids)
    ttfts = [r["ttft_ms"] for r in reqs if r["ttft_ms"] is not None]
    tpots = [r["tpot_ms"] for r in reqs if r["tpot_ms"] is not None]
    summary = {
        "requests": len(ids), "prompt_tokens": prompt_tokens, "output_tokens": out_tokens,
        "wall_s": wall, "output_tokens_per_s": out_tokens / wall,
        "total_tokens_per_s": (out_tokens + prompt_tokens) / wall, "steps": step,
        "ttft_ms_mean": float(np.mean(ttfts)) if ttfts else None,
        "ttft_ms_max": max(ttfts) if ttfts else None,
        "tpot_ms_mean": float(np.mean(tpots)) if tpots else None,
        "load_s": load_s, "properties": properties(opts),
        "max_num_batched_tokens": opts.max_batched_tokens,
    }
    return {"requests": reqs, "summary": summary}


def stateful_greedy(model_dir, prompt_ids, max_new_tokens=64, eos_token_id=None, threads=0):
    """Independent check of GenAI: greedy tokens of the stateful ``openvino_model.xml`` itself
    (plain OpenVINO, f32, one request at a time, no paging): per prompt ids, the generated ids,
    stopping after ``eos_token_id`` when given (as GenAI without ignore_eos). KV_CACHE_PRECISION
    must be f32 here too: the CPU plugin's stateful SDPA fusion (which matches gqa1's graph, not
    gqa4's or sliding_window's) otherwise keeps the state in u8, and decode logits then differ from
    a full prefill by up to 2e-2 (greedy ids diverge after ~50 tokens)."""
    import openvino as ov

    core = ov.Core()
    cfg = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    if threads:
        cfg["INFERENCE_NUM_THREADS"] = threads
    compiled = core.compile_model(Path(model_dir) / "openvino_model.xml", "CPU", cfg)
    req = compiled.create_infer_request()
    outs = []
    for ids in prompt_ids:
        req.reset_state()
        gen, cur, past = [], list(ids), 0
        for _ in range(max_new_tokens):
            n = len(cur)
            req.infer({
                "input_ids": np.array([cur], dtype=np.int64),
                "attention_mask": np.ones((1, past + n), dtype=np.int64),
                "position_ids": np.arange(past, past + n, dtype=np.int64)[None],
                "beam_idx": np.zeros(1, dtype=np.int32),
            })
            t = int(np.argmax(req.get_tensor("logits").data[0, -1]))
            gen.append(t)
            past += n
            cur = [t]
            if eos_token_id is not None and t == eos_token_id:
                break
        outs.append(gen)
    return outs


def stateful_logits(model_dir, sequences, threads=0):
    """Independent reference for log-probabilities: the stateful ``openvino_model.xml`` (plain
    OpenVINO, f32 inference and state, no paging) run once over each whole token sequence. Per
    sequence its float32 logits ``[len, vocab]``: row ``i`` predicts token ``i + 1``."""
    import openvino as ov

    cfg = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"}
    if threads:
        cfg["INFERENCE_NUM_THREADS"] = threads
    req = ov.Core().compile_model(Path(model_dir) / "openvino_model.xml", "CPU",
                                  cfg).create_infer_request()
    out = []
    for ids in sequences:
        n = len(ids)
        req.reset_state()
        req.infer({"input_ids": np.array([ids], dtype=np.int64),
                   "attention_mask": np.ones((1, n), dtype=np.int64),
                   "position_ids": np.arange(n, dtype=np.int64)[None],
                   "beam_idx": np.zeros(1, dtype=np.int32)})
        out.append(np.array(req.get_tensor("logits").data[0], dtype=np.float32))
    return out


def log_softmax_f64(rows):
    """The exact log-softmax of float32 logits rows, in float64."""
    x = np.asarray(rows, dtype=np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def log_softmax_genai(rows):
    """The log-softmax as GenAI's sampler computes it (openvino-genai 2026.4.1, sampler.cpp
    ``log_softmax`` / ``_greedy_sample``): ``x - max - log(sum)`` in float32 with the sum of
    ``exp(x - max)`` accumulated one term after another in index order. Such a running f32 sum
    of a 49,152-token row drops the terms below half an ulp of the total, so its
    log-probabilities are too high by up to about 2e-4 on SmolLM2."""
    x = np.asarray(rows, dtype=np.float32)
    m = x.max(-1, keepdims=True)
    e = np.exp(x - m, dtype=np.float32)
    total = np.cumsum(e, axis=-1, dtype=np.float32)[..., -1:]  # sequential, unlike np.sum
    return (x - m) - np.log(total, dtype=np.float32)


def make_prompts(model_dir, lengths, shared_prefix=None, seed=3):
    """Texts whose encodings (BOS included) are ``lengths`` tokens (1 = the empty text: BOS alone;
    at most, and nearly, that many when no cut gives it exactly), cut at word boundaries from distinct places of
    ``model_dir.corpus(seed)``; with ``shared_prefix`` two more that share their first
    ``shared_prefix`` tokens and end differently. Lengths are measured with tokenizer.json."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from model_dir import corpus
    from tokenizers import Tokenizer

    tk = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    words = corpus(seed, sentences=200 + sum(lengths) // 10 + (shared_prefix or 0) // 10).split(" ")
    at = [0]

    def longest(start, n):  # most words from start with at most n tokens, and their count
        lo, hi = 0, min(len(words) - start, 4 * n + 8)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if len(tk.encode(" ".join(words[start:start + mid])).ids) <= n:
                lo = mid
            else:
                hi = mid - 1
        return lo, len(tk.encode(" ".join(words[start:start + lo])).ids)

    def text_of(n):  # exactly n tokens when one of 32 start words gives it
        if n <= 1:
            return ""
        best = None
        for shift in range(32):
            k, m = longest(at[0] + shift, n)
            if best is None or m > best[2]:
                best = (at[0] + shift, k, m)
            if m == n:
                break
        start, k, _ = best
        at[0] = start + k + 1
        return " ".join(words[start:start + k])

    out = [text_of(n) for n in lengths]
    if shared_prefix:
        prefix = text_of(shared_prefix)
        out.append(prefix + " The answer is yes.")
        out.append(prefix + " Bob walks to the river in the morning, 42 times!")
    return out


def standard_prompts(model_dir):
    """The 8 cross-check prompts: 1, 4, 12, 33, 70 and 150 tokens, and two of about 300 that share
    their first 280 tokens."""
    return make_prompts(model_dir, (1, 4, 12, 33, 70, 150), shared_prefix=280)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("--prompts", type=Path, help="prompts.json (list of str / {token_ids})")
    ap.add_argument("--make-prompts", type=Path, metavar="OUT",
                    help="write prompts to OUT as JSON and exit: standard_prompts(MODEL_DIR), or "
                         "with --lengths make_prompts(MODEL_DIR, lengths)")
    ap.add_argument("--lengths", default="",
                    help="--make-prompts: comma-separated token counts, e.g. 1024,1024,2048")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--cache-type", choices=["f32", "u8", "u4", "f16", "bf16", "default"], default="f32",
                    help="KV_CACHE_PRECISION (default f32; 'default' leaves the plugin's, u8)")
    ap.add_argument("--precision", choices=["f32", "bf16", "f16", "default"], default="f32",
                    help="INFERENCE_PRECISION_HINT (default f32)")
    ap.add_argument("--threads", type=int, default=0, help="INFERENCE_NUM_THREADS (0: plugin default)")
    ap.add_argument("--chat", action="store_true", help="apply the chat template to each prompt")
    ap.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    ap.add_argument("--max-batched-tokens", type=int, default=256,
                    help="SchedulerConfig.max_num_batched_tokens (GenAI default 256)")
    ap.add_argument("--num-kv-blocks", type=int, default=0)
    ap.add_argument("--cache-gb", type=float, default=0.0)
    ap.add_argument("--prefix-caching", action="store_true")
    ap.add_argument("--json", action="store_true",
                    help="also print prompt_ids and finish_reason per prompt")
    ap.add_argument("--check-stateful", action="store_true",
                    help="also run stateful_greedy (plain OpenVINO, f32, no paging) on the same ids and "
                         "report on stderr whether every request's ids agree (exit 1 if not)")
    ap.add_argument("--timed", action="store_true",
                    help="handle API with per-token timing; prints a summary line last")
    ap.add_argument("--arrival-steps", default="",
                    help="--timed: comma-separated step at which each request is added")
    args = ap.parse_args()
    if args.make_prompts:
        ps = (make_prompts(args.model_dir, [int(x) for x in args.lengths.split(",")])
              if args.lengths else standard_prompts(args.model_dir))
        args.make_prompts.write_text(json.dumps(ps, indent=1, ensure_ascii=False) + "\n",
                                     encoding="utf-8")
        print(f"wrote {len(ps)} prompts to {args.make_prompts}")
        return
    if not args.prompts:
        ap.error("--prompts is required")
    opts = Options(max_new_tokens=args.max_new_tokens,
                   cache_type="" if args.cache_type == "default" else args.cache_type,
                   precision="" if args.precision == "default" else args.precision,
                   threads=args.threads, chat=args.chat, ignore_eos=args.ignore_eos,
                   max_batched_tokens=args.max_batched_tokens, num_kv_blocks=args.num_kv_blocks,
                   cache_gb=args.cache_gb, prefix_caching=args.prefix_caching)
    prompts = load_prompts(args.prompts)
    if args.timed:
        arrival = [int(x) for x in args.arrival_steps.split(",")] if args.arrival_steps else None
        res = run_timed(args.model_dir, prompts, arrival, opts)
        for r in res["requests"]:
            r = dict(r)
            if not args.json:
                r.pop("token_times_ms")
            print(json.dumps(r, ensure_ascii=False))
        print(json.dumps({"summary": res["summary"]}, ensure_ascii=False))
        return
    results = run(args.model_dir, prompts, opts)
    for r in results:
        if not args.json:
            r = {"index": r["index"], "token_ids": r["token_ids"], "text": r["text"]}
        print(json.dumps(r, ensure_ascii=False))
    if args.check_stateful:
        eos = None if args.ignore_eos else json.loads(
            (args.model_dir / "generation_config.json").read_text())["eos_token_id"]
        ref = stateful_greedy(args.model_dir, [r["prompt_ids"] for r in results],
                              args.max_new_tokens, eos, args.threads)
        bad = [r["index"] for r, want in zip(results, ref) if r["token_ids"] != want]
        for i in bad:
            got, want = results[i]["token_ids"], ref[i]
            k = next((k for k, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            print(f"stateful check: request {i} differs from token {k}: genai {got[k:k + 4]} "
                  f"stateful {want[k:k + 4]}", file=sys.stderr)
        print(f"stateful check: {len(results) - len(bad)}/{len(results)} requests agree",
              file=sys.stderr)
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
