"""Structured output on a trained model (SmolLM2-135M-Instruct), through the official ``openai``
client against a running ``pa serve``:

- ``response_format`` ``json_schema`` with 5 schemas (nested objects, arrays, enums, numbers with
  ranges, required and optional fields): every answer parses and validates with the
  ``jsonschema`` package, 20/20 greedy (20 different prompts) and 20/20 at temperature 1.
- ``json_object`` returns a JSON object, on chat and completions, streamed too.
- A schema, regex or grammar the library cannot compile is a 400 naming the field.
- vLLM's extension fields: a regex (``guided_regex``, ``structured_outputs.regex``), a choice and
  a Lark grammar constrain the text as asked.

Requests run concurrently (8 at a time) so the module stays short.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from serve_proc import NAME, Server
from smollm2_model import smollm2  # noqa: F401  (the session fixture)

CONCURRENCY = 8

SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 16},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "maxLength": 16},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            },
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                     "minItems": 1, "maxItems": 3},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100},
                       "minItems": 2, "maxItems": 4},
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "size": {"type": "string", "enum": ["S", "M", "L", "XL"]},
            "in_stock": {"type": "boolean"},
        },
        "required": ["color", "size", "in_stock"],
        "additionalProperties": False,
    },
    "ranges": {
        "type": "object",
        "properties": {
            "temperature_c": {"type": "number", "minimum": -40, "maximum": 50},
            "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
            "rain_chance": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        },
        "required": ["temperature_c", "humidity", "rain_chance"],
        "additionalProperties": False,
    },
    "required": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "title": {"type": "string", "minLength": 1, "maxLength": 24},
            "done": {"type": "boolean"},
            "note": {"type": "string", "maxLength": 12},
        },
        "required": ["id", "title", "done"],
        "additionalProperties": False,
    },
}

ASK = {
    "nested": "Give the name and postal address of {} as JSON.",
    "arrays": "Give a few tags and test scores for {} as JSON.",
    "enums": "Describe the color and size of a T-shirt for {} as JSON.",
    "ranges": "Give the weather forecast for the home town of {} as JSON.",
    "required": "Write a to-do item for {} as JSON.",
}

SUBJECTS = ["a baker in Lyon", "a pilot", "a retired teacher", "a chess champion", "a child",
            "a nurse in Oslo", "a farmer", "a student of physics", "a jazz singer", "a sailor",
            "a software engineer", "a gardener", "a firefighter", "a librarian", "a tennis player",
            "a chef in Tokyo", "a painter", "a bus driver", "a doctor in Cairo", "a mountain guide"]

# Tokens: enough for each schema's longest answer (strings and arrays are bounded).
MAX_TOKENS = 120


@pytest.fixture(scope="module")
def server(smollm2):  # noqa: F811
    s = Server(smollm2)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=300, max_retries=0)


def concurrently(fn, items, workers=CONCURRENCY):
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(fn, items))


def schema_format(name):
    return {"type": "json_schema",
            "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


def check(name, choice):
    """The answer parses and validates; the grammar ended it (not max_tokens)."""
    assert choice.finish_reason == "stop", (name, choice)
    text = choice.message.content if hasattr(choice, "message") else choice.text
    value = json.loads(text)
    jsonschema.validate(value, SCHEMAS[name])
    return value


def test_json_schema_greedy_20_of_20_for_5_schemas(client):
    jobs = [(name, subject) for name in SCHEMAS for subject in SUBJECTS]

    def ask(job):
        name, subject = job
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": ASK[name].format(subject)}],
            response_format=schema_format(name), max_tokens=MAX_TOKENS, temperature=0)
        return name, r.choices[0]

    answers = concurrently(ask, jobs)
    values = {name: [] for name in SCHEMAS}
    for name, choice in answers:
        values[name].append(check(name, choice))
    # The model, not the grammar alone, fills the values: different people, different answers.
    for name, vs in values.items():
        assert len(vs) == 20
        assert len({json.dumps(v, sort_keys=True) for v in vs}) > 1, (name, vs)


def test_json_schema_temperature_1_20_of_20_for_5_schemas(client):
    # 5 requests of n=4 per schema, each with its own seed: 20 samples per schema; 2 requests at
    # a time (8 sequences), as the KV cache of the tests holds about 1,000 tokens.
    jobs = [(name, seed) for name in SCHEMAS for seed in range(5)]

    def ask(job):
        name, seed = job
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": ASK[name].format(SUBJECTS[seed])}],
            response_format=schema_format(name), max_tokens=MAX_TOKENS, temperature=1.0,
            n=4, seed=seed)
        return name, r.choices

    for name, choices in concurrently(ask, jobs, 2):
        assert len(choices) == 4
        for c in choices:
            check(name, c)


def test_json_object_on_chat_and_completions_streamed_too(client):
    def chat(_):
        r = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "List three fruits in JSON."}],
            response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].finish_reason, r.choices[0].message.content

    def completion(_):
        r = client.completions.create(
            model=NAME, prompt='A cat in JSON: {"name": "Tom", "age": 3}\nA dog in JSON:',
            max_tokens=MAX_TOKENS,
            temperature=0, extra_body={"response_format": {"type": "json_object"}})
        return r.choices[0].finish_reason, r.choices[0].text

    def streamed(_):
        stream = client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content":
                                      "Describe a book (title, author, year) as a JSON object."}],
            response_format={"type": "json_object"}, max_tokens=MAX_TOKENS, temperature=0,
            stream=True)
        parts, reason = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
                reason = chunk.choices[0].finish_reason or reason
        return reason, "".join(parts)

    results = concurrently(lambda f: f(None), [chat, completion, streamed])
    for reason, text in results:
        assert reason == "stop", text
        assert isinstance(json.loads(text), dict), text


def test_text_format_asks_nothing(client):
    r = client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": "Say hi."}],
        response_format={"type": "text"}, max_tokens=8, temperature=0)
    assert r.choices[0].message.content


def refusal(fn):
    with pytest.raises(openai.BadRequestError) as e:
        fn()
    err = e.value.response.json()["error"]
    return err["param"], err["message"]


def test_what_does_not_compile_is_a_400_naming_the_field(client):
    chat = dict(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8)
    cases = [
        # Unsatisfiable: no integer is >= 5 and <= 1.
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}),
         "response_format"),
        (dict(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}},
                                    "required": ["a"]}}}),
         "response_format"),
        (dict(extra_body={"guided_json": {"type": "strnig"}}), "guided_json"),
        (dict(extra_body={"guided_regex": "(unclosed"}), "guided_regex"),
        (dict(extra_body={"guided_grammar": "start: undefined_rule"}), "guided_grammar"),
        (dict(extra_body={"structured_outputs": {"regex": "[z-a]"}}), "structured_outputs"),
        (dict(response_format={"type": "yaml"}), "response_format"),
        (dict(response_format={"type": "json_object"}, extra_body={"guided_regex": "a"}),
         "guided_regex"),
    ]

    def ask(case):
        extra, field = case
        return field, refusal(lambda: client.chat.completions.create(**chat, **extra))

    for field, (param, message) in concurrently(ask, cases):
        assert param == field, message
        assert message


def test_regex_choice_and_grammar_constrain_the_text(client):
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    jobs = [
        ("regex", dict(extra_body={"guided_regex": phone}), phone),
        ("regex", dict(extra_body={"structured_outputs": {"regex": phone}}), phone),
        ("choice", dict(extra_body={"guided_choice": ["Paris", "London", "Berlin"]}),
         "(Paris|London|Berlin)"),
        ("grammar", dict(extra_body={"guided_grammar":
                                     'start: answer "."\nanswer: "yes" | "no" | "maybe"'}),
         r"(yes|no|maybe)\."),
    ]

    def ask(job):
        kind, extra, pattern = job
        r = client.completions.create(
            model=NAME, prompt="The capital of France? A phone number? Answer:", max_tokens=32,
            temperature=1.0, seed=3, n=4, **extra)
        return pattern, r.choices

    for pattern, choices in concurrently(ask, jobs):
        for c in choices:
            assert c.finish_reason == "stop", c
            assert re.fullmatch(pattern, c.text), (pattern, c.text)
