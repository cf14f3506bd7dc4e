"""Tool calls in each family's own format through the OpenAI API, in-process (no Ray) over a
real engine (k = 2) on tiny checkpoints whose chat templates follow Qwen3 (hermes), Qwen3-Coder
(XML), GLM-4.5 and DeepSeek-V3 (tests/chat_models.py): `auto` detects the format, forced calls
(`required`, a named function) are written in it (the raw tokens parse back with that family's
parser) and valid under the schema, greedy and sampled, greedy identical at k = 0 and k = 2;
`parallel_tool_calls` false gives exactly one call; streamed arguments arrive in pieces and
assemble to the whole answer's; `tools` + `response_format` compose; oversized tools are a 400.

The same again for glm45 and deepseek_v3 checkpoints whose markers (`<tool_call>`,
`<arg_key>`, `<｜tool▁calls▁begin｜>`, ..., `<think>`) are special added tokens
(`special_markers=True`, the `-special` params): the forced grammar still writes them, the served
text keeps them for the parser (other special tokens stay skipped), and the reasoning split
works on the special `<think>` / `</think>` ids.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch
from chat_models import END_TOKENS, make_chat_checkpoint
from test_router_api import Server

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.local_orchestrator import LocalOrchestrator
from mtpserve.router.reasoning import END, START, Reasoner
from mtpserve.router.tool_parsers import MARKERS, make_parser
from mtpserve.router.tools import check_tools, served_format
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.structured.constraint import GrammarConstraint
from mtpserve.workers.structured.grammars import GrammarCache
from mtpserve.workers.tokenizer import load_tokenizer

STYLES = {"qwen3": "hermes", "qwen3_coder": "qwen3_coder", "glm45": "glm45",
          "deepseek_v3": "deepseek_v3"}
MARKER = {"hermes": "<tool_call>", "qwen3_coder": "<tool_call>\n<function=",
          "glm45": "<tool_call>", "deepseek_v3": "<｜tool▁calls▁begin｜>"}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "maxLength": 8},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                  "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "days", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object",
                                  "properties": {"a": {"type": "integer", "maximum": 99},
                                                 "b": {"type": "boolean"}},
                                  "required": ["a", "b"], "additionalProperties": False}}}
SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "add": ADD["function"]["parameters"]}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
# Thinking off where the template has the switch (the grammar is then the answer's from its
# first token on).
NO_THINK = {"chat_template_kwargs": {"enable_thinking": False, "thinking": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}},
          "required": ["name"], "additionalProperties": False}


# (style, markers special): every style as its template has it, and two with special markers.
VARIANTS = [(style, False) for style in STYLES] + [("glm45", True), ("deepseek_v3", True)]


@pytest.fixture(scope="module", params=VARIANTS,
                ids=[f"{s}-special" if sp else s for s, sp in VARIANTS])
def served(request, tmp_path_factory):
    style, special = request.param
    path = make_chat_checkpoint(tmp_path_factory.mktemp(style), style, family="qwen3",
                                special_markers=special)
    eng = AsyncEngine(Engine(EngineConfig(model=str(path), num_speculative_tokens=2,
                                          num_kv_blocks=256)))
    tok = load_tokenizer(str(path))
    state = IngressState(
        orchestrator=LocalOrchestrator(eng), tokenizer=tok, model_name="m",
        max_model_len=eng.engine.max_model_len, vocab_size=eng.engine.model_config.vocab_size,
        tool_call_parser=served_format("auto", tok))
    srv = Server(create_app(state))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0,
                           timeout=120)
    yield style, state, client, srv
    srv.stop()
    eng.shutdown()


def _create(client: openai.OpenAI, k: int | None = None, **kw):
    extra = dict(NO_THINK, return_token_ids=True)
    if k is not None:
        extra["mtp"] = {"num_speculative_tokens": k}
    kw.setdefault("max_tokens", 160)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="m", messages=MSGS, extra_body=extra, **kw)


def _loads(text: str):
    # strict=False: xgrammar's length-limited strings admit raw control characters (its JSON
    # rule, the same under response_format alone); the random model writes them.
    return json.loads(text, strict=False)


def _raw(state: IngressState, ids: list[int]) -> str:
    """The generated text with every token as its text (special markers too) but the end of
    generation, independently of the server's decoding."""
    tok = state.tokenizer
    ends = {tok.convert_tokens_to_ids(t) for style in END_TOKENS for t in END_TOKENS[style]
            if t in tok.get_vocab()}
    return tok.decode([t for t in ids if t not in ends], skip_special_tokens=False)


def _check_calls(state: IngressState, choice, fmt: str) -> list:
    """The choice's calls: valid under their schemas, and its raw text (the generated ids) is
    the family's format, which that family's parser reads back as the same calls."""
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and all(c.id.startswith("call_") and c.type == "function" for c in calls)
    for c in calls:
        jsonschema.validate(_loads(c.function.arguments), SCHEMAS[c.function.name])
    raw = _raw(state, choice.model_extra["token_ids"])
    assert raw.lstrip().startswith(MARKER[fmt]), raw
    _, back = make_parser(fmt, SCHEMAS).parse(raw)
    assert [(b.name, b.arguments) for b in back] == [(c.function.name, c.function.arguments)
                                                     for c in calls]
    return calls


def test_auto_detects_the_family_format(served) -> None:
    style, state, _, _ = served
    assert state.tool_call_parser == STYLES[style]


def test_forced_calls_in_the_family_format_exact_under_speculation(served) -> None:
    style, state, client, _ = served
    fmt = STYLES[style]
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        runs = [_create(client, k, tools=[WEATHER, ADD], tool_choice=choice,
                        parallel_tool_calls=False) for k in (0, 2)]
        for r in runs:
            (call,) = _check_calls(state, r.choices[0], fmt)
            if isinstance(choice, dict):
                assert call.function.name == "get_weather"
        assert runs[0].choices[0].model_extra["token_ids"] == \
            runs[1].choices[0].model_extra["token_ids"]  # k = 0 == k = 2, greedy
        assert runs[1].model_extra["mtp_stats"]["num_drafted"] > 0
    for seed in (1, 2):  # sampled: valid, in format, and reproducible for a seed
        a, b = (_create(client, 2, tools=[WEATHER, ADD], tool_choice="required",
                        parallel_tool_calls=False, temperature=1.0, seed=seed)
                for _ in range(2))
        _check_calls(state, a.choices[0], fmt)
        assert a.choices[0].model_extra["token_ids"] == b.choices[0].model_extra["token_ids"]


def test_parallel_tool_calls_one_or_more(served) -> None:
    style, state, client, _ = served
    r = _create(client, tools=[WEATHER, ADD], tool_choice="required", max_tokens=200,
                parallel_tool_calls=True, temperature=1.0, seed=3)
    c = r.choices[0]
    if c.finish_reason == "tool_calls":  # the model chose to stop after one or more calls
        assert len(_check_calls(state, c, STYLES[style])) >= 1
    else:  # still calling at max_tokens: every closed call is valid
        assert c.finish_reason == "length"
        for call in c.message.tool_calls or []:
            jsonschema.validate(_loads(call.function.arguments),
                                SCHEMAS[call.function.name])


def test_streamed_arguments_arrive_in_pieces(served) -> None:
    style, _, client, _ = served
    kw = dict(tools=[WEATHER], tool_choice={"type": "function",
                                            "function": {"name": "get_weather"}},
              parallel_tool_calls=False)
    whole = _create(client, **kw).choices[0].message.tool_calls[0]
    calls: dict[int, dict] = {}
    pieces, finish = 0, None
    for chunk in _create(client, stream=True, **kw):
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                if d.id:
                    assert d.index not in calls and d.function.name == "get_weather"
                    calls[d.index] = {"name": d.function.name, "arguments": ""}
                if d.function.arguments:
                    pieces += 1
                    calls[d.index]["arguments"] += d.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls"
    assert calls == {0: {"name": "get_weather", "arguments": whole.function.arguments}}
    assert pieces >= 3, pieces  # one per parameter at least (XML), per chunk (JSON)


def test_tools_and_response_format_compose(served) -> None:
    style, state, client, _ = served
    rf = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    for seed in range(4):  # auto: each answer is a call or the schema's JSON
        c = _create(client, tools=[ADD], response_format=rf, temperature=1.0, seed=seed,
                    max_tokens=120).choices[0]
        if c.finish_reason == "tool_calls":
            _check_calls(state, c, STYLES[style])
        elif c.finish_reason == "stop":
            jsonschema.validate(_loads(c.message.content), PERSON)
    c = _create(client, tools=[ADD], response_format=rf, tool_choice="required",
                parallel_tool_calls=False).choices[0]
    _check_calls(state, c, STYLES[style])


def test_oversized_tools_are_a_400(served) -> None:
    style, _, _, srv = served
    if style != "qwen3":
        pytest.skip("one format is enough: the check is before any grammar")
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": "d" * 40,
        "parameters": {"type": "object", "properties": {
            f"p{j}": {"type": "string", "description": "x" * 60} for j in range(20)}}}}
        for i in range(40)]
    r = httpx.post(srv.url + "/v1/chat/completions", timeout=60, json={
        "messages": MSGS, "tools": tools, "tool_choice": "required", "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"


def test_special_markers_reasoning_split_and_decoding(served) -> None:
    """Special markers: `skip_special_tokens` decoding would lose them (what the variant is
    for). A regex forces a `<think>` block first (the NO_THINK prompt closed its own): the
    served split equals the parser run over the returned ids, streamed too; on the seeds whose
    block opens with the special `<think>` id (the regex also admits it spelled out of
    ordinary tokens: then it is content, as on ids it must be), the reasoning is the text
    between the two ids and neither marker is in either text."""
    style, state, client, _ = served
    tok = state.tokenizer
    start, end = tok.convert_tokens_to_ids(START), tok.convert_tokens_to_ids(END)
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    if not {start, end} <= special:
        pytest.skip("markers are not special in this variant")
    assert tok.decode([start, end], skip_special_tokens=True) == ""
    kw = dict(model="m", messages=MSGS, max_tokens=30, temperature=2.0,
              extra_body=dict(NO_THINK, return_token_ids=True, structured_outputs={
                  "regex": "<think>[a-z ]{1,12}</think>[a-z ]{1,12}"}))
    on_ids = 0
    for seed in range(16):  # temperature 2: the tiny model takes either spelling
        if on_ids == 2:
            break
        r = client.chat.completions.create(seed=seed, **kw)
        ids = r.choices[0].model_extra["token_ids"]
        split = Reasoner.build("qwen3", tok).split(r.model_extra["prompt_token_ids"],
                                                   NO_THINK["chat_template_kwargs"])
        want = split.feed(ids, final=True)
        msg = r.choices[0].message
        content = want[1] if not want[0] or want[1].strip() else ""  # whitespace: null
        assert (msg.model_extra.get("reasoning_content") or "", msg.content or "") == (
            want[0], content)
        if ids[0] != start or end not in ids:
            continue
        on_ids += 1
        assert want[0] and want[0] == tok.decode(ids[1:ids.index(end)])
        assert not any(m in t for m in (START, END) for t in want), want
        reasoning, content = [], []
        for chunk in client.chat.completions.create(seed=seed, stream=True, **kw):
            for c in chunk.choices:
                reasoning.append(c.delta.model_extra.get("reasoning_content") or "")
                content.append(c.delta.content or "")
        assert ("".join(reasoning), "".join(content)) == want
    assert on_ids, "no seed opened the block with the special <think> id"


def test_special_marker_ids_are_what_the_forced_grammar_accepts(served) -> None:
    """The forced grammar matches a special marker token by its text: the call the server
    forced, tokenized as a model trained on the markers writes it (each marker one special
    id), is accepted token by token from the first mask (which allows the opening marker's
    id) to the end of generation."""
    style, state, client, _ = served
    tok, fmt = state.tokenizer, STYLES[style]
    special = {i for i, t in tok.added_tokens_decoder.items() if t.special}
    marker_ids = {tok.convert_tokens_to_ids(m) for m in MARKERS[fmt]} & special
    if not marker_ids:
        pytest.skip("markers are not special in this variant")
    r = _create(client, tools=[WEATHER, ADD], tool_choice="required", parallel_tool_calls=False)
    _check_calls(state, r.choices[0], fmt)
    ids = tok.encode(_raw(state, r.choices[0].model_extra["token_ids"]),
                     add_special_tokens=False)
    assert ids[0] in marker_ids and len(marker_ids & set(ids)) >= 3, ids
    eos = [tok.convert_tokens_to_ids(t) for t in END_TOKENS[style]]
    spec = check_tools([WEATHER, ADD], "required", False, fmt).spec()
    c = GrammarConstraint(GrammarCache.of_tokenizer(tok, state.vocab_size, eos, disk_dir=None)
                          .compile(spec), eos)
    bm = torch.zeros(1, -(-state.vocab_size // 32), dtype=torch.int32)
    assert c.fill(bm, 0) and int(bm[0, ids[0] // 32]) >> (ids[0] % 32) & 1
    assert all(c.accept(t) for t in ids) and c.accept(eos[0]) and c.terminated
