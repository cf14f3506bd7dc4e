"""Tool calling without a server: the tool prompt (the model's template when it renders
`tools`, else the documented default), parsing calls out of text, and the streamed split,
which must assemble to the same calls whatever the chunk boundaries."""

from __future__ import annotations

import json

import pytest
import transformers

from mtpserve.router.errors import APIError
from mtpserve.router.tools import (
    DEFAULT_TOOL_PROMPT,
    ToolCallStream,
    check_tools,
    parse_tool_calls,
    render_with_tools,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}}
TEXT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>')


@pytest.fixture
def tok(default_model):
    # A fresh instance: load_tokenizer's cached one is shared with other tests.
    return transformers.AutoTokenizer.from_pretrained(str(default_model))


def test_default_tool_prompt_lists_the_tools_and_the_history(tok) -> None:
    setup = check_tools([WEATHER], "auto", None)
    msgs = [{"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function",
                 "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]
    text = tok.decode(render_with_tools(tok, msgs, setup))
    assert "Be terse." in text and json.dumps(setup.tools[0]) in text
    assert DEFAULT_TOOL_PROMPT.splitlines()[0] in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<|tool|>\nsunny" in text


def test_a_template_that_renders_tools_is_used(tok) -> None:
    tok.chat_template = ("{% for t in tools or [] %}TOOL:{{ t.function.name }}\n{% endfor %}"
                         "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                         "assistant:")
    text = tok.decode(render_with_tools(tok, [{"role": "user", "content": "hi"}],
                                        check_tools([WEATHER], "auto", None)))
    assert text.startswith("TOOL:get_weather\nuser: hi\n")
    none = tok.decode(render_with_tools(tok, [{"role": "user", "content": "hi"}],
                                        check_tools([WEATHER], "none", None)))
    assert "TOOL:" not in none


def test_parse_and_stream_agree_at_any_chunking() -> None:
    setup = check_tools([WEATHER], "auto", None)
    content, calls = parse_tool_calls(TEXT, setup)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    for size in (1, 3, 7, 64):
        stream = ToolCallStream(setup)
        pieces = [TEXT[i: i + size] for i in range(0, len(TEXT), size)]
        deltas = [d for j, p in enumerate(pieces)
                  for d in stream.feed(p, final=j == len(pieces) - 1)]
        text = "".join(d.content for d in deltas if d.content is not None)
        got: dict[int, list[str]] = {}
        for d in deltas:
            if d.index is not None:
                if d.id:
                    assert d.index not in got and d.name == "get_weather"
                    got[d.index] = [d.name, ""]
                got[d.index][1] += d.arguments or ""
        assert text.strip() == content, size
        assert [tuple(v) for v in got.values()] == [(c.name, c.arguments) for c in calls]


def test_unknown_functions_and_bad_json_stay_content() -> None:
    setup = check_tools([WEATHER], "auto", None)
    text = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call> <tool_call>{oops'
    content, calls = parse_tool_calls(text, setup)
    assert calls == [] and content == text


@pytest.mark.parametrize("tools,choice", [
    ([{"type": "retrieval"}], None),
    ([{"type": "function", "function": {"name": "a b"}}], None),
    ([WEATHER, WEATHER], None),
    ([WEATHER], {"type": "function", "function": {"name": ["x"]}}),
    ([WEATHER], "sometimes"),
])
def test_malformed_tools_are_400s(tools, choice) -> None:
    with pytest.raises(APIError) as e:
        check_tools(tools, choice, None)
    assert e.value.status == 400 and e.value.param in ("tools", "tool_choice")
