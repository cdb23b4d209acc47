"""Tool calls on a trained model (SmolLM2-135M-Instruct), through the official openai client
against ``pa serve``:

- with two tools and ``tool_choice: "required"``, every answer is a ``tool_calls`` message whose
  arguments parse and validate (the ``jsonschema`` package) against the called tool's schema and
  are compact JSON (``json.dumps``'s separators, as ``response_format``),
  greedy and sampled, whole and streamed (the stream reassembled by the openai client's own
  ``ChatCompletionStreamState``, as ``client.chat.completions.stream`` does);
- a named function is the one called;
- a round trip (the call, then its result as a ``tool`` message) ends in a text answer;
- ``tool_choice: "none"`` answers with text;
- malformed tools get a 400 naming the field at fault.

SmolLM2's chat template does not render tools: the server describes them in the system message
in the Hermes form (``<tool_call>``), and enforces ``required`` and named calls with a grammar.
Requests run concurrently, one server for the module."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from serve_proc import NAME, Server
from smollm2_model import smollm2  # noqa: F401  (the session fixture)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "minLength": 1},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer", "minimum": 0}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "The current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Adds two integers",
                                      "parameters": ADD}},
]
QUESTIONS = [
    "What is the weather like in Paris right now?",
    "What is 17 plus 25?",
    "Is it raining in Tokyo? Answer in fahrenheit.",
    "Add 3 and 4 for me.",
]
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def client(smollm2):  # noqa: F811
    server = Server(smollm2)
    try:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                            timeout=300)
    finally:
        server.stop()


def ask(client, messages, stream=False, **kw):
    """The answer (a ChatCompletion), streamed and reassembled when `stream`."""
    kw = {"model": NAME, "messages": messages, "max_tokens": MAX_TOKENS, **kw}
    if not stream:
        return client.chat.completions.create(**kw)
    state = ChatCompletionStreamState()
    firsts = {}
    for chunk in client.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            for d in choice.delta.tool_calls or []:
                # OpenAI's shape: a call's first delta carries its id, type and name.
                if d.index not in firsts:
                    firsts[d.index] = d
                    assert d.id and d.type == "function" and d.function.name, d
                else:
                    assert d.id is None and d.function.name is None, d
        state.handle_chunk(chunk)
    return state.get_final_completion()


def check_calls(answer, names=SCHEMAS):
    """The answer is a tool_calls message; each call's arguments validate; returns the calls."""
    choice = answer.choices[0]
    calls = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls", (choice.finish_reason, choice.message)
    assert calls, choice.message
    assert len({c.id for c in calls}) == len(calls), calls
    for c in calls:
        assert c.type == "function"
        assert c.function.name in names, c
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
        # Enforced calls are compact JSON, as json.dumps writes it (response_format's rule).
        assert c.function.arguments == json.dumps(json.loads(c.function.arguments)), c
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls]


def run_all(jobs):
    with ThreadPoolExecutor(max_workers=8) as pool:
        return list(pool.map(lambda job: job(), jobs))


def user(q):
    return [{"role": "user", "content": q}]


def test_required_answers_are_calls_that_validate(client):
    # One call each (parallel calls off): greedy and sampled, whole and streamed.
    settings = [dict(temperature=0), dict(temperature=1.0, seed=7)]
    jobs = [
        (lambda q=q, s=s, st=st: ask(client, user(q), stream=st, tools=TOOLS,
                                     tool_choice="required", parallel_tool_calls=False, **s))
        for q in QUESTIONS for s in settings for st in (False, True)
    ]
    # Parallel calls allowed (the default): the model may make several.
    jobs += [(lambda st=st: ask(client, user(QUESTIONS[1]), stream=st, tools=TOOLS,
                                tool_choice="required", temperature=0, max_tokens=160))
             for st in (False, True)]
    answers = run_all(jobs)
    calls = [check_calls(a) for a in answers]
    assert all(len(c) == 1 for c in calls[:-2]), calls
    # Greedy, the stream and the whole answer are the same tokens: the same calls.
    for i in [*range(0, len(calls) - 2, 4), len(calls) - 2]:
        assert calls[i] == calls[i + 1], (calls[i], calls[i + 1])


def test_a_named_function_is_the_one_called(client):
    choice = {"type": "function", "function": {"name": "add"}}
    answers = run_all([
        (lambda q=q, st=st: ask(client, user(q), stream=st, tools=TOOLS, tool_choice=choice,
                                temperature=0))
        for q in QUESTIONS[:2] for st in (False, True)
    ])
    for a in answers:
        assert [name for name, _ in check_calls(a, names={"add"})] == ["add"]


def test_a_round_trip_ends_in_text_and_none_gives_text(client):
    first = ask(client, user(QUESTIONS[0]), tools=TOOLS, tool_choice="required", temperature=0)
    call = first.choices[0].message.tool_calls[0]
    conversation = user(QUESTIONS[0]) + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id,
         "content": json.dumps({"temperature": 21, "condition": "sunny"})},
    ]
    answers = run_all([
        lambda: ask(client, conversation, tools=TOOLS, temperature=0),
        lambda: ask(client, conversation, stream=True, tools=TOOLS, temperature=0),
        lambda: ask(client, user(QUESTIONS[1]), tools=TOOLS, tool_choice="none",
                    temperature=0),
        lambda: ask(client, user(QUESTIONS[1]), stream=True, tools=TOOLS, tool_choice="none",
                    temperature=0),
    ])
    for a in answers:
        choice = a.choices[0]
        assert choice.finish_reason in ("stop", "length"), choice
        assert not choice.message.tool_calls, choice.message
        assert choice.message.content and choice.message.content.strip(), choice.message
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
    # The tool's result reached the model (this small model tends to repeat it).
    assert "21" in answers[0].choices[0].message.content


def tool(name="f", parameters=None):
    return {"type": "function", "function": {"name": name, "parameters": parameters or {}}}


@pytest.mark.parametrize("fields, param", [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools[0].function.name"),
    ({"tools": [tool(), {"type": "function"}]}, "tools[1].function"),
    ({"tools": [tool(parameters={"type": "object", "properties": {"x": {"type": "texte"}}})]},
     "tools[0].function.parameters"),
    ({"tools": [tool(parameters={"type": "object", "required": "x"})]},
     "tools[0].function.parameters"),
    # A schema the grammar library cannot compile, where the calls are enforced.
    ({"tools": [tool(parameters={"type": "object",
                                 "properties": {"x": {"type": "string", "pattern": "(("}}})],
      "tool_choice": "required"}, "tools"),
    ({"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [tool()], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": user("hi") + [{"role": "tool", "content": "42"}]},
     "messages.[1].tool_call_id"),
])
def test_bad_tools_get_a_400_naming_the_field(client, fields, param):
    body = {"messages": user("hi"), **fields}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=NAME, max_tokens=4, **body)
    assert e.value.param == param, e.value.body
