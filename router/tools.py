"""Tool calling: checking `tools`, the tool prompt, and parsing calls out of generated text.

Formats (router.tool_parsers, vLLM's names): `hermes` (JSON in `<tool_call>` blocks),
`qwen3_coder` (Qwen3-Coder / Qwen3.5 XML), `glm45` (GLM-4.5 `<arg_key>` / `<arg_value>`),
`deepseek_v3` (DeepSeek's `<｜tool▁calls▁begin｜>` tokens). The served format is the config's
`tool_call_parser` (`auto`: `tool_parsers.detect_format`, from the chat template's markers and
the checkpoint's family; `hermes` where nothing else matches).

The prompt: the model's chat template when it renders `tools` (its text mentions `tools`);
otherwise `DEFAULT_TOOL_PROMPT` in a system message ahead of the conversation (merged into the
first system message if there is one), listing each tool as JSON and showing a call in the
served format. History: assistant `tool_calls` are written back in that format after the
message's content; `tool` messages are ordinary turns with role `tool`.

`tool_choice`: "none" (tools neither shown nor parsed), "auto" (default: the model decides;
whatever calls it writes are parsed; with `response_format` the output is a call or the
schema's JSON, a grammar of both), "required" or a named function: the output is constrained by a
grammar (workers.structured, kind `tool_calls`: xgrammar structural tags in the served format)
to calls of the allowed functions, arguments valid under their `parameters` schema, so even a
small model answers with valid calls: one or more (`parallel_tool_calls` true or unset) or
exactly one (false). `parallel_tool_calls: false` also keeps only the first call that `auto`
parses. Calls of functions not in `tools` are not returned (vLLM filters them); their text stays
content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from mtpserve.router.errors import APIError
from mtpserve.router.tool_parsers import (
    PARSERS,
    ParsedCall,
    ToolDelta,
    ToolParser,
    detect_format,
    make_parser,
)
from mtpserve.workers.structured.spec import MAX_SPEC_CHARS, StructuredSpec

__all__ = ["ParsedCall", "ToolCallStream", "ToolDelta", "ToolSetup", "check_tools",
           "parse_tool_calls", "render_with_tools", "served_format"]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
MAX_TOOLS = 128

DEFAULT_TOOL_PROMPT = (
    "You may call functions to help with the user's request. The functions, as JSON:\n"
    "{tools}\n"
    "To call a function, reply with one block per call, for example:\n"
    "{example}\n")


@dataclass
class ToolSetup:
    """The tools of one chat request, checked: what the prompt lists, what gets parsed."""

    tools: list[dict]  # [{"type": "function", "function": {...}}], normalised
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True
    format: str = "hermes"  # the served tool-call format (router.tool_parsers)

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def allowed(self) -> list[dict]:
        return [t["function"] for t in self.tools
                if self.choice != "named" or t["function"]["name"] == self.named]

    def forces(self) -> bool:
        return self.choice in ("required", "named")

    def spec(self, content: StructuredSpec | None = None) -> StructuredSpec | None:
        """The grammar of the request's output: forced calls (`required` / named), or under
        `auto` with a `content` JSON constraint (response_format), a call or that JSON; else
        None. A spec over the size cap is a 400 naming `tools`."""
        if not self.active or not (self.forces() or content is not None):
            return None
        value: dict[str, Any] = {
            "format": self.format, "parallel": self.parallel,
            "tools": [{"name": f["name"], "parameters": f.get("parameters")}
                      for f in self.allowed()]}
        if not self.forces() and content is not None:
            value["content"] = json.loads(content.value)
        text = json.dumps(value)
        if len(text) > MAX_SPEC_CHARS:
            raise APIError(f"the tools' grammar has {len(text)} characters of schemas; at most "
                           f"{MAX_SPEC_CHARS} (fewer or smaller tools, or tool_choice 'auto')",
                           400, param="tools")
        return StructuredSpec("tool_calls", text)

    def parser(self) -> ToolParser:
        """A fresh parser of this request's format (one per choice)."""
        return make_parser(self.format, {f["name"]: f.get("parameters")
                                         for f in self.allowed()},
                           max_calls=None if self.parallel else 1)


def served_format(setting: str | None, tokenizer: Any, model_type: str | None = None) -> str:
    """The config's `tool_call_parser`: a parser name, or `auto` (from the checkpoint)."""
    if setting and setting != "auto":
        if setting not in PARSERS:
            raise ValueError(f"unknown tool_call_parser {setting!r}; one of auto, "
                             f"{', '.join(PARSERS)}")
        return setting
    return detect_format(getattr(tokenizer, "chat_template", None), model_type)


def check_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None,
                fmt: str = "hermes") -> ToolSetup | None:
    """The request's tools, validated (a malformed one is a 400 naming it); None: no tools."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise APIError("'tool_choice' needs 'tools'", 400, param="tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise APIError(f"at most {MAX_TOOLS} tools", 400, param="tools")
    out, seen = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type", "function") != "function":
            raise APIError(f"{where}: only tools of type 'function' are supported", 400,
                           param="tools")
        fn = t.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"{where}: 'function' must be an object", 400, param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(f"{where}: function name must be 1-64 letters, digits, '_' or '-'",
                           400, param="tools")
        if name in seen:
            raise APIError(f"{where}: duplicate function name '{name}'", 400, param="tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise APIError(f"{where}: 'parameters' must be a JSON schema object", 400,
                           param="tools")
        desc = fn.get("description")
        if desc is not None and not isinstance(desc, str):
            raise APIError(f"{where}: 'description' must be a string", 400, param="tools")
        out.append({"type": "function", "function": {
            k: v for k, v in (("name", name), ("description", desc), ("parameters", params))
            if v is not None}})
    named = None
    if tool_choice is None or tool_choice == "auto":
        choice = "auto"
    elif tool_choice in ("none", "required"):
        choice = tool_choice
    elif (isinstance(tool_choice, dict) and tool_choice.get("type") == "function"
          and isinstance(tool_choice.get("function"), dict)):
        choice, named = "named", tool_choice["function"].get("name")
        if not isinstance(named, str) or named not in seen:
            raise APIError(f"tool_choice names function '{named}', which is not in 'tools'",
                           400, param="tool_choice")
    else:
        raise APIError("tool_choice must be 'none', 'auto', 'required' or "
                       '{"type": "function", "function": {"name": ...}}', 400,
                       param="tool_choice")
    return ToolSetup(out, choice, named, True if parallel is None else bool(parallel), fmt)


# Prompt ------------------------------------------------------------------------------------
def history_message(m: Any) -> dict[str, Any]:
    """One request message as a template dict: assistant `tool_calls` kept (HF templates read
    them), tool results with their call id."""
    d: dict[str, Any] = {"role": m.role, "content": m.text}
    calls = getattr(m, "tool_calls", None)
    if calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.function.name, "arguments": _args_object(c.function.arguments)}}
            for c in calls]
    if getattr(m, "tool_call_id", None):
        d["tool_call_id"] = m.tool_call_id
    return d


def _args_object(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except (TypeError, ValueError):
        return arguments


def call_block(name: str, arguments: Any, fmt: str = "hermes") -> str:
    return make_parser(fmt, {}).render([(name, arguments)])


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def default_tool_messages(messages: list[dict[str, Any]], setup: ToolSetup | None
                          ) -> list[dict[str, str]]:
    """Messages for a template that knows nothing of tools: calls in the history written as
    blocks, and (tools active) the tool list in a system message."""
    fmt = setup.format if setup is not None else "hermes"
    out = []
    for m in messages:
        content = m.get("content") or ""
        calls = [(c["function"]["name"], c["function"]["arguments"])
                 for c in m.get("tool_calls", [])]
        if calls:
            content += ("\n" if content else "") + make_parser(fmt, {}).render(calls)
        out.append({"role": m["role"], "content": content})
    if setup is not None and setup.active:
        listing = "\n".join(json.dumps(t) for t in setup.tools)
        first = setup.tools[0]["function"]
        example = call_block(first["name"], _example_args(first.get("parameters")), fmt)
        text = DEFAULT_TOOL_PROMPT.format(tools=listing, example=example)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_with_tools(tokenizer: Any, messages: list[dict[str, Any]],
                      setup: ToolSetup | None) -> list[int]:
    """Prompt ids of a conversation with tools (see the module docstring)."""
    from mtpserve.router.chat_template import apply_chat_template

    if template_renders_tools(tokenizer):
        text = tokenizer.apply_chat_template(
            messages, tools=setup.tools if setup is not None and setup.active else None,
            tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return apply_chat_template(tokenizer, default_tool_messages(messages, setup))


def _example_args(parameters: Any) -> dict[str, Any]:
    props = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(props, dict):
        return {}
    fill = {"integer": 1, "number": 1.5, "boolean": True, "array": [], "object": {}}
    return {k: fill.get(v.get("type") if isinstance(v, dict) else None, "...")
            for k, v in list(props.items())[:3]}


# Parsing -----------------------------------------------------------------------------------
def parse_tool_calls(text: str, setup: ToolSetup) -> tuple[str | None, list[ParsedCall]]:
    """(content without the call blocks, or None if nothing else; the calls), in the request's
    format. A block that does not parse as a call of a listed function stays in the content."""
    return setup.parser().parse(text)


class ToolCallStream:
    """Splits a choice's streamed text into content and tool-call deltas (the format's
    streaming parser): text that may start a call is held back; a call is announced with its
    id and name, then its arguments follow as they are generated."""

    def __init__(self, setup: ToolSetup) -> None:
        self.parser = setup.parser()

    @property
    def num_calls(self) -> int:
        return self.parser.num_calls

    def feed(self, text: str, final: bool = False) -> list[ToolDelta]:
        return self.parser.feed(text, final)
