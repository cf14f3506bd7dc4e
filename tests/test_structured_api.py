"""Structured outputs and tool calls through the OpenAI API, served in-process over a real
engine on the embedded default model with MTP on (k = 2): `response_format` json_object /
json_schema, vLLM's `structured_outputs`, `tools` / `tool_choice` (with the real `openai`
client), streamed tool calls, token healing, `/tokenize` + `/detokenize`, and the 400s.
"""

from __future__ import annotations

import functools
import json

import httpx
import jsonschema
import openai
import pytest
from test_router_api import Server

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.local_orchestrator import LocalOrchestrator
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.tokenizer import load_tokenizer

MODEL = "tiny-code-mtp"
PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object",
                                  "properties": {"a": {"type": "integer", "maximum": 999},
                                                 "b": {"type": "integer", "maximum": 999}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def engine(default_model):
    eng = AsyncEngine(Engine(EngineConfig(model=str(default_model), num_speculative_tokens=2,
                                          num_kv_blocks=256)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def server_state(engine, default_model) -> IngressState:
    return IngressState(
        orchestrator=LocalOrchestrator(engine), tokenizer=load_tokenizer(str(default_model)),
        model_name=MODEL, max_model_len=engine.engine.max_model_len,
        vocab_size=engine.engine.model_config.vocab_size)


@pytest.fixture(scope="module")
def server(server_state):
    srv = Server(create_app(server_state))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:
        yield c


def _person_format() -> dict:
    return {"type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


# The openai SDK's structured-output and tool-calling examples, as a client writes them; run
# here in-process and by tests/test_cli_up.py against `mtpserve up` (default config, MTP on).
def json_schema_example(client: openai.OpenAI, seed: int | None = None) -> None:
    kw = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=80,
                                       response_format=_person_format(), **kw)
    c = r.choices[0]
    assert c.finish_reason == "stop", c
    jsonschema.validate(json.loads(c.message.content), PERSON)
    assert r.model_extra["mtp_stats"]["num_drafted"] > 0  # generated under speculation


def json_object_example(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=60,
                                       temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # ran out of tokens inside the object: still a prefix of one
        assert c.finish_reason == "length" and c.message.content.startswith("{")


def test_structured_outputs_on_completions(http) -> None:
    for so, check in [({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
                      ({"regex": "[0-9]{3}-[a-z]{2}"},
                       lambda t: len(t) == 6 and t[:3].isdigit() and t[3] == "-"),
                      ({"grammar": 'root ::= "x" ("y" | "z")'}, lambda t: t in ("xy", "xz"))]:
        r = http.post("/v1/completions", json={"prompt": "def f(x):\n", "max_tokens": 20,
                                               "temperature": 0, "structured_outputs": so})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and check(choice["text"]), (so, choice)


def tool_call_example(client: openai.OpenAI) -> None:
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=80,
                                           temperature=0, tools=[WEATHER, ADD],
                                           tool_choice=choice)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        fn = {"get_weather": WEATHER, "add": ADD}[call.function.name]["function"]
        if isinstance(choice, dict):
            assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), fn["parameters"])
        assert call.id.startswith("call_") and call.type == "function"


def streamed_tool_call_example(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, messages=MSGS, max_tokens=80, temperature=0, tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    finish = None
    deltas = 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                deltas += 1
                if d.id:  # the first delta of a call: id, type and name
                    assert d.index not in calls and d.type == "function" and d.function.name
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                calls[d.index]["arguments"] += d.function.arguments or ""
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and deltas >= 2
    assert calls == {0: {"name": whole.function.name, "arguments": whole.function.arguments}}


def test_tool_history_renders_and_auto_answers(client) -> None:
    msgs = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8,
                                       temperature=0, tools=[WEATHER])
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_constraints_are_400s(http) -> None:
    cases = [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"structured_outputs": {"regex": "("}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]},
         "tools"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]
    for extra, param in cases:
        r = http.post("/v1/chat/completions", json={"messages": MSGS, "max_tokens": 4, **extra})
        assert r.status_code == 400, (extra, r.text)
        assert r.json()["error"]["param"].startswith(param), (extra, r.text)


def test_grammar_that_cannot_finish_ends_with_length(http) -> None:
    r = http.post("/v1/completions", json={
        "prompt": "x = ", "max_tokens": 3, "temperature": 0,
        "structured_outputs": {"regex": "a{40}"}})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["finish_reason"] == "length" and set(c["text"]) <= {"a"}


def test_tokenize_detokenize_round_trip(http) -> None:
    text = "def add(a, b):\n    return a + b\n"
    t = http.post("/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert t["count"] == len(t["tokens"]) == len(t["token_strs"]) > 0
    assert t["max_model_len"] > 0
    d = http.post("/detokenize", json={"tokens": t["tokens"]}).json()
    assert d["prompt"] == text
    chat = http.post("/tokenize", json={"messages": MSGS}).json()
    assert chat["count"] > 0
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400


def test_compile_is_bounded_in_time_and_size(http, monkeypatch) -> None:
    import mtpserve.router.structured as structured

    monkeypatch.setattr(structured, "COMPILE_TIMEOUT_S", 1e-4)
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, "structured_outputs":
                                           {"regex": "[a-z]{300}[0-9]{300}"}})
    assert r.status_code == 400 and "did not compile within" in r.json()["error"]["message"]
    monkeypatch.undo()
    big = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(4000)}}
    r = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                           "structured_outputs": {"json": big}})
    assert r.status_code == 400 and "characters" in r.json()["error"]["message"], r.text
    assert http.get("/health").status_code == 200  # the ingress kept serving


def test_token_healing_continues_a_newline_prompt(http) -> None:
    prompt = "def add(a, b):\n"
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True}
    healed = http.post("/v1/completions", json={**body, "token_healing": True}).json()
    c = healed["choices"][0]
    assert c["text"].strip(), c  # a continuation, not an immediate end of text
    # The first token re-spells the healed "\n" (stripped from the text): the prompt plus the
    # text is exactly what decoding the prompt's head and the generated ids gives.
    assert healed["usage"]["prompt_tokens"] == len(healed["prompt_token_ids"][0])
    ids = healed["prompt_token_ids"][0][:-1] + c["token_ids"]  # the tail backed off
    decoded = http.post("/detokenize", json={"tokens": ids}).json()["prompt"]
    assert decoded.replace("<|endoftext|>", "") == prompt + c["text"]
    off = http.post("/v1/completions", json={**body, "token_healing": False}).json()
    assert off["choices"][0]["token_ids"] != c["token_ids"]


def test_token_healing_default_heals_line_breaks_only(http, server_state) -> None:
    """With the server default on, an unset option heals a line-break tail (as `true` does)
    and leaves other prompts' tokens alone (as `false` does)."""
    server_state.token_healing = True
    def ids(prompt: str, **kw) -> list[int]:
        r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6,
                                               "temperature": 0, "return_token_ids": True, **kw})
        return r.json()["choices"][0]["token_ids"]

    try:
        assert ids("import os\n") == ids("import os\n", token_healing=True)
        assert ids("def hello") == ids("def hello", token_healing=False)
    finally:
        server_state.token_healing = False


def sdk_parse_example(client: openai.OpenAI) -> None:
    """The SDK's own structured-output and tool helpers: `parse` with a pydantic model (strict
    json_schema; `beta.chat.completions.parse` is what the SDK's guide writes) and
    `pydantic_function_tool`."""
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=10)
        age: int = Field(ge=0, le=150)

    r = client.beta.chat.completions.parse(model=MODEL, messages=MSGS,
                                           response_format=Person, temperature=0,
                                           max_tokens=60)
    assert isinstance(r.choices[0].message.parsed, Person)

    class GetWeather(BaseModel):
        city: str = Field(max_length=12)

    r = client.chat.completions.parse(
        model=MODEL, messages=MSGS, temperature=0, max_tokens=60,
        tools=[openai.pydantic_function_tool(GetWeather)],
        tool_choice={"type": "function", "function": {"name": "GetWeather"}})
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)


OPENAI_EXAMPLES = {
    "json_schema_greedy": json_schema_example,
    "json_schema_seed_1": functools.partial(json_schema_example, seed=1),
    "json_schema_seed_2": functools.partial(json_schema_example, seed=2),
    "json_object": json_object_example,
    "named_and_required_tool_calls": tool_call_example,
    "streamed_tool_call": streamed_tool_call_example,
    "sdk_parse_pydantic": sdk_parse_example,
}


@pytest.mark.parametrize("example", list(OPENAI_EXAMPLES))
def test_openai_examples_run_unchanged(client, example: str) -> None:
    OPENAI_EXAMPLES[example](client)
