"""Speculative decoding (``pa-engine generate --speculative prompt-lookup``, and ``--speculative
draft --draft-model DIR``) on the trained SmolLM2-135M-Instruct: greedy ids equal those of a run
without speculation (10 prompts x 128 tokens, one batch, some of them asking to repeat a given
text so that drafts are accepted), and the block manager's state after them equals that of the
run without (no block held, the same prefix-cache contents: no rejected draft cached), from the
CLI's --stats figures, read once the engine has stopped; a seeded sampled run repeats; greedy
structured output (a JSON schema, a regex) with speculation equals its run without, with drafts
accepted. The draft models are SmolLM2's first 6 layers (tools/gguf_model.py --layers 6: an
early-exit copy, weak but sharing the tokenizer) and SmolLM2 itself (which must agree with itself
nearly always); a draft with another vocabulary is refused. The tiny-model twin of these checks
and the unit tests of the proposer and the acceptance rule are Rust's (engine/tests/engine.rs,
engine/src/speculative.rs, engine/src/sampling.rs).
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import gguf_model
import pytest
from smollm2_model import smollm2  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
ENGINE = Path(os.environ.get("PA_ENGINE", ROOT / "target/release/pa-engine"))
# Fixed drafts within 40 rows: ten sequences still draft (up to 3 each); the default (adaptive
# drafts within 16 rows) backs off at this batch size.
ADAPTIVE = ["--speculative", "prompt-lookup", "--num-speculative-tokens", "4", "--max-ngram-size",
            "3"]
SPEC = [*ADAPTIVE, "--speculative-max-rows", "40", "--speculative-draft-length", "fixed"]
BASE = ["--cache-type", "f32", "--precision", "f32", "--threads", "2", "--kv-cache-size", "1",
        "--json", "--stats", "--chat"]

SOURCE = (ROOT / "src/cache/pool.rs").read_text()[:1500]
PROMPTS = [
    f"Repeat the following code exactly.\n\n{SOURCE[:900]}",
    "Write a short story about a lighthouse keeper.",
    f"Copy the following text, renaming `block` to `page`.\n\n{SOURCE[200:1100]}",
    "Explain how photosynthesis works.",
    "List the days of the week, then list them again in reverse order.",
    f"Summarise the following code.\n\n{SOURCE[500:1400]}",
    "Count from one to thirty in words.",
    "What is the capital of France? Answer in one sentence.",
    f"Repeat this sentence three times: {SOURCE[:120]}",
    "Give three tips for learning to cook.",
]


def generate(model, tmp_path, name, *flags, prompts=PROMPTS):
    pfile = tmp_path / f"{name}.json"
    pfile.write_text(json.dumps(prompts))
    p = subprocess.run([str(ENGINE), "generate", str(model), "--prompts", str(pfile), *BASE,
                        *flags], capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    outs = [json.loads(l) for l in p.stdout.splitlines() if l.startswith("{")]
    line = next(l for l in p.stderr.splitlines() if "draft tokens" in l)
    drafted, accepted = map(int, re.search(r"(\d+) draft tokens, (\d+) accepted", line).groups())
    used, prefix, digest = re.search(
        r"after the run (\d+) blocks used, prefix cache (\d+) blocks \(digest ([0-9a-f]+)\)",
        line).groups()
    return ([o["token_ids"] for o in sorted(outs, key=lambda o: o["index"])],
            {"drafted": drafted, "accepted": accepted,
             "blocks": {"used": int(used), "prefix": int(prefix), "digest": digest}})


@pytest.fixture(scope="module")
def plain_greedy(smollm2, tmp_path_factory):
    """The greedy ids and --stats figures of a run without speculation, 128 tokens each."""
    ids, stats = generate(smollm2, tmp_path_factory.mktemp("plain"), "plain",
                          "--max-new-tokens", "128")
    assert stats["drafted"] == 0
    assert stats["blocks"]["prefix"] > 0, stats
    return ids, stats


@pytest.fixture(scope="module")
def early_exit_draft():
    return gguf_model.smollm2_dir(layers=6)


def assert_same_run(plain_greedy, spec, ss):
    """Greedy ids as without speculation, and the block manager left as without it: nothing
    leaked, and the prefix cache holds what the run without speculation left (its digest sums
    the blocks' content hashes), no rejected draft."""
    plain, ps = plain_greedy
    for i, (a, b) in enumerate(zip(plain, spec)):
        assert a == b, f"prompt {i}: first difference at token " \
            f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y) if a[:len(b)] != b[:len(a)] else min(len(a), len(b))}"
    assert len(plain) == len(spec) == len(PROMPTS)
    assert ss["blocks"]["used"] == 0, ss
    assert ss["blocks"] == ps["blocks"], (ps, ss)


def test_greedy_ids_equal_a_run_without_speculation(smollm2, plain_greedy, tmp_path):
    spec, ss = generate(smollm2, tmp_path, "spec", "--max-new-tokens", "128", *SPEC)
    assert_same_run(plain_greedy, spec, ss)
    assert ss["drafted"] > 0 and 0 < ss["accepted"] < ss["drafted"], ss


def test_greedy_ids_with_adaptive_drafts_equal_a_run_without_speculation(
        smollm2, plain_greedy, tmp_path):
    """The default: each draft as long as its acceptance so far pays for at this batch size."""
    spec, ss = generate(smollm2, tmp_path, "adaptive", "--max-new-tokens", "128", *ADAPTIVE)
    assert_same_run(plain_greedy, spec, ss)
    assert ss["drafted"] > 0 and ss["accepted"] > 0, ss


def test_greedy_ids_with_a_draft_model_equal_a_run_without_speculation(
        smollm2, plain_greedy, early_exit_draft, tmp_path):
    spec, ss = generate(smollm2, tmp_path, "draft", "--max-new-tokens", "128",
                        *draft_flags(early_exit_draft))
    assert_same_run(plain_greedy, spec, ss)
    assert ss["drafted"] > 0 and 0 < ss["accepted"] < ss["drafted"], ss


def draft_flags(draft):
    # Fixed drafts within 40 rows: ten sequences still draft 3 tokens each.
    return ["--speculative", "draft", "--draft-model", str(draft), "--num-speculative-tokens", "3",
            "--speculative-max-rows", "40", "--speculative-draft-length", "fixed"]


def test_a_seeded_sampled_run_with_the_model_as_its_own_draft_repeats(smollm2, tmp_path):
    flags = ["--max-new-tokens", "24", "--temperature", "0.8", "--top-p", "0.95", "--seed", "41",
             *draft_flags(smollm2)]
    a, sa = generate(smollm2, tmp_path, "a", *flags)
    b, _ = generate(smollm2, tmp_path, "b", *flags)
    assert a == b
    # A draft equal to the target is accepted with the target's probability of its argmax.
    assert sa["accepted"] > sa["drafted"] / 2, sa


def test_a_draft_model_with_another_vocabulary_is_refused(smollm2, tmp_path):
    tiny = tmp_path / "tiny"
    subprocess.run([sys.executable, str(ROOT / "tools/model_dir.py"), str(tiny), "--variant",
                    "gqa1"], check=True, capture_output=True, timeout=300)
    p = subprocess.run([str(ENGINE), "generate", str(smollm2), "--prompt", "Hi", *BASE,
                        "--speculative", "draft", "--draft-model", str(tiny / "gqa1")],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode != 0
    assert "vocabulary has 512 tokens" in p.stderr and "49152" in p.stderr, p.stderr[-1000:]


def test_a_seeded_sampled_run_with_speculation_repeats(smollm2, tmp_path):
    def flags(seed):
        return ["--max-new-tokens", "48", "--temperature", "0.8", "--top-p", "0.95", "--seed",
                str(seed), *SPEC]
    a, sa = generate(smollm2, tmp_path, "a", *flags(41))
    b, _ = generate(smollm2, tmp_path, "b", *flags(41))
    assert sa["accepted"] > 0, sa
    assert a == b
    c, _ = generate(smollm2, tmp_path, "c", *flags(42))
    assert a != c, "another seed gives the same samples"


RECORD = '{"name": "Ada Lovelace", "city": "London", "tags": ["math", "engine", "poetry", "notes"]}'
RECORD_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                   "tags": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "city", "tags"], "additionalProperties": False,
}
NUMBERS = "3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26"


def test_constrained_greedy_ids_equal_a_run_without_speculation(smollm2, tmp_path):
    """Drafts of a constrained output are cut to what its grammar allows and verified under the
    mask of the grammar's place after the drafts before them: the ids are those of a run
    without speculation, and drafts are accepted."""
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(RECORD_SCHEMA))
    cases = {
        "schema": (["--json-schema", str(schema)],
                   [f"Repeat this JSON exactly: {RECORD}",
                    f"Copy this record, changing the city to Paris: {RECORD}",
                    "Give me a JSON record of a famous scientist."]),
        "regex": (["--regex", r"[0-9]+(, [0-9]+)*"],
                  [f"Repeat these numbers exactly: {NUMBERS}",
                   f"Repeat these numbers, then add 100: {NUMBERS}",
                   "Count from one to twenty with digits, separated by commas."]),
    }
    for name, (constraint, prompts) in cases.items():
        common = ["--max-new-tokens", "64", *constraint]
        plain, _ = generate(smollm2, tmp_path, f"{name}-plain", *common, prompts=prompts)
        spec, ss = generate(smollm2, tmp_path, f"{name}-spec", *common, *SPEC, prompts=prompts)
        assert plain == spec, name
        assert ss["drafted"] > 0 and ss["accepted"] > 0, (name, ss)
