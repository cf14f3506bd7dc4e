"""The tool-call parsers of router/tool_parsers.py as functions: each format round-trips the
calls it can write (several calls, schema-typed parameters, content before the calls), streamed
at any chunking (1 character, random splits, whole) to the same final calls with arguments
arriving incrementally; unknown names, `max_calls`, cut-off blocks; the forcing grammars accept
exactly the calls the parser reads back (xgrammar's matcher, no model)."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from mtpserve.router.errors import APIError
from mtpserve.router.tool_parsers import (
    PARSERS,
    ToolDelta,
    detect_format,
    make_parser,
    typed_value,
)
from mtpserve.router.tools import check_tools
from mtpserve.workers.structured.grammars import tool_calls_structural_tag

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
    "ratio": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "note": {"type": ["string", "null"]}}, "required": ["city"]}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"]}
TOOLS = {"get_weather": WEATHER, "add": ADD}
CALLS = [("get_weather", {"city": "Paris {x} </p>\nline 2", "days": 3, "metric": True,
                          "ratio": 0.5, "opts": {"a": [1, 2]}, "tags": ["x"], "note": None}),
         ("add", {"a": 1, "b": 2}),
         ("add", {})]


def _chunks(text: str, mode: str, seed: int = 0) -> list[str]:
    if mode == "1":
        return list(text)
    if mode == "whole":
        return [text]
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 12)
        out.append(text[i:i + n])
        i += n
    return out


def _assemble(deltas: list[ToolDelta]) -> tuple[str, list[tuple[str, str]], dict[int, int]]:
    content = "".join(d.content for d in deltas if d.content is not None)
    calls: dict[int, list[str]] = {}
    pieces: dict[int, int] = {}
    for d in deltas:
        if d.index is None:
            continue
        if d.id is not None:
            assert d.index not in calls and d.id.startswith("call_") and d.name
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments or ""
        pieces[d.index] = pieces.get(d.index, 0) + bool(d.arguments)
    return content, [(n, a) for n, a in calls.values()], pieces


@pytest.mark.parametrize("fmt", PARSERS)
def test_round_trip_whole_and_streamed(fmt: str) -> None:
    text = "Let me check.\n" + make_parser(fmt, TOOLS).render(CALLS)
    content, calls = make_parser(fmt, TOOLS).parse(text)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    for mode in ("1", "random", "whole"):
        for seed in range(3 if mode == "random" else 1):
            p = make_parser(fmt, TOOLS)
            pieces = _chunks(text, mode, seed)
            deltas = [d for i, c in enumerate(pieces)
                      for d in p.feed(c, final=i == len(pieces) - 1)]
            got_content, got, n_pieces = _assemble(deltas)
            assert got_content.strip() == content, (mode, got_content)
            assert got == [(c.name, c.arguments) for c in calls], mode
            assert p.num_calls == 3
            if mode == "1":  # incremental: the first call's arguments in several deltas
                assert n_pieces[0] >= (len(CALLS[0][1]) if fmt in ("qwen3_coder", "glm45")
                                       else 20), n_pieces


def test_schema_types_xml_values() -> None:
    assert typed_value("3", {"type": "integer"}) == 3
    assert typed_value(" 2.5 ", {"type": "number"}) == 2.5
    assert typed_value("True", {"type": "boolean"}) is True
    assert typed_value("007", {"type": "string"}) == "007"
    assert typed_value('{"a": 1}', {"type": "object"}) == {"a": 1}
    assert typed_value("{'a': 1}", {"type": "object"}) == {"a": 1}
    assert typed_value("null", {"type": ["string", "null"]}) is None
    assert typed_value("abc", {"type": "integer"}) == "abc"  # does not parse: raw text
    assert typed_value("2", {"enum": [1, 2]}) == 2
    assert typed_value("5", None) == "5"  # a parameter the schema does not list: a string


def test_xml_formats_as_models_write_them() -> None:
    qwen = ("I'll look.\n<tool_call>\n<function=add>\n<parameter=a>\n12\n</parameter>\n"
            "<parameter=b>\n30\n</parameter>\n</function>\n</tool_call>")
    content, (call,) = make_parser("qwen3_coder", TOOLS).parse(qwen)
    assert content == "I'll look." and json.loads(call.arguments) == {"a": 12, "b": 30}
    glm = ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n"
           "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>")
    content, (call,) = make_parser("glm45", TOOLS).parse(glm)
    assert content is None and json.loads(call.arguments) == {"city": "Oslo", "days": 2}


def test_deepseek_v3_0324_layout() -> None:
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n"
            '{"a": 1, "b": 2}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
            '<｜tool▁sep｜>get_weather\n```json\n{"city": "Rome"}\n```<｜tool▁call▁end｜>'
            "<｜tool▁calls▁end｜>")
    for mode in ("1", "whole"):
        p = make_parser("deepseek_v3", TOOLS)
        pieces = _chunks(text, mode)
        content, calls, _ = _assemble([d for i, c in enumerate(pieces)
                                       for d in p.feed(c, final=i == len(pieces) - 1)])
        assert content == "" and [(n, json.loads(a)) for n, a in calls] == [
            ("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]


@pytest.mark.parametrize("fmt", PARSERS)
def test_unknown_names_max_calls_and_cut_off_blocks(fmt: str) -> None:
    p = make_parser(fmt, TOOLS)
    unknown = p.render([("nope", {"a": 1})])
    content, calls = p.parse("Hi " + unknown)
    assert calls == [] and content == "Hi " + unknown  # not a call: it stays content
    mixed = p.render([("nope", {"a": 1}), ("add", {"a": 1, "b": 2})])
    _, calls = p.parse(mixed)
    assert [c.name for c in calls] == ["add"]
    _, calls = make_parser(fmt, TOOLS, max_calls=1).parse(p.render(CALLS))
    assert [c.name for c in calls] == ["get_weather"]
    cut = p.render(CALLS[1:2])[:-5]  # finish "length" inside the block
    assert p.parse("x " + cut) == ("x " + cut, [])


def test_detect_format_from_template_and_family() -> None:
    assert detect_format("{{ '<tool_call>\\n<function=' }}{{ '<parameter=' }}") == "qwen3_coder"
    assert detect_format("<arg_key>{{ k }}</arg_key>") == "glm45"
    assert detect_format("<｜tool▁calls▁begin｜>") == "deepseek_v3"
    assert detect_format("<tool_call>\\n{{ tool | tojson }}") == "hermes"
    assert detect_format(None, "glm4_moe") == "glm45"
    assert detect_format("{{ messages }}", "llama") == "hermes"


@pytest.mark.parametrize("fmt", PARSERS)
@pytest.mark.parametrize("parallel", [True, False])
def test_forcing_grammar_accepts_what_the_parser_reads(fmt: str, parallel: bool) -> None:
    """The grammar of tool_choice required accepts the format's calls valid under their
    schema, one or more (parallel) or exactly one, and nothing else; with a content schema
    (auto + response_format) it accepts that JSON too."""
    tools = {"add": ADD, "get_weather": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}
    p = make_parser(fmt, tools)
    one, two = [("add", {"a": 1, "b": 2})], [("add", {"a": 1, "b": 2}),
                                              ("get_weather", {"city": "Oslo", "days": 2})]
    content = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    for schema in (None, content):
        st = tool_calls_structural_tag({"format": fmt, "parallel": parallel, "content": schema,
                                        "tools": [{"name": n, "parameters": s}
                                                  for n, s in tools.items()]})
        g = xgr.Grammar.from_structural_tag(json.dumps(st))
        assert accepts(g, p.render(one))
        assert accepts(g, p.render(two)) == parallel
        assert not accepts(g, p.render([("add", {"a": "x", "b": 1})]))  # schema violated
        assert not accepts(g, p.render([("sub", {"a": 1, "b": 2})]))  # not a listed function
        assert not accepts(g, "hello")
        assert accepts(g, '{"x": 1}') == (schema is not None)
        for _, c in [p.parse(p.render(two))]:
            for call in c:
                jsonschema.validate(json.loads(call.arguments), tools[call.name])


def test_oversized_tools_grammar_is_a_400() -> None:
    big = [{"type": "function", "function": {"name": f"tool_{i}", "description": "d" * 40,
                                             "parameters": {"type": "object", "properties": {
                                                 f"p{j}": {"type": "string",
                                                           "description": "x" * 60}
                                                 for j in range(20)}}}} for i in range(40)]
    setup = check_tools(big, "required", None, "qwen3_coder")
    with pytest.raises(APIError) as e:
        setup.spec()
    assert e.value.status == 400 and e.value.param == "tools"
