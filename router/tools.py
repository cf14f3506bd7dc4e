"""Tool calling: checking `tools`, the tool prompt, and parsing calls out of generated text.

Format (the Hermes / Qwen convention): the model writes each call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

The prompt: the model's chat template when it renders `tools` (its text mentions `tools`);
otherwise `DEFAULT_TOOL_PROMPT` in a system message ahead of the conversation (merged into the
first system message if there is one), listing each tool as JSON. History: assistant
`tool_calls` are written back as such blocks after the message's content; `tool` messages are
ordinary turns with role `tool`.

`tool_choice`: "none" (tools neither shown nor parsed), "auto" (default: the model decides;
whatever blocks it writes are parsed), "required" or a named function: the output is
constrained by a grammar (workers.structured, kind `tool_calls`) to exactly one block of one of
the allowed functions, arguments valid under its `parameters` schema, so even a small model
answers with a valid call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from mtpserve.router.errors import APIError
from mtpserve.workers.structured.spec import TOOL_CALL_BEGIN, TOOL_CALL_END, StructuredSpec

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)
MAX_TOOLS = 128

DEFAULT_TOOL_PROMPT = (
    "You may call functions to help with the user's request. The functions, as JSON:\n"
    "{tools}\n"
    "To call a function, reply with one block per call:\n"
    + TOOL_CALL_BEGIN + '{{"name": <function name>, "arguments": <arguments as a JSON object>}}'
    + TOOL_CALL_END + "\n")


@dataclass
class ToolSetup:
    """The tools of one chat request, checked: what the prompt lists, what gets parsed."""

    tools: list[dict]  # [{"type": "function", "function": {...}}], normalised
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.choice != "none" and bool(self.tools)

    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def spec(self) -> StructuredSpec | None:
        """The grammar forcing a call (`required` / named), else None."""
        if self.choice not in ("required", "named"):
            return None
        from mtpserve.workers.structured.grammars import tool_call_schema

        fns = [t["function"] for t in self.tools
               if self.choice == "required" or t["function"]["name"] == self.named]
        return StructuredSpec("tool_calls", json.dumps(
            {"schemas": [tool_call_schema(f["name"], f.get("parameters")) for f in fns]}))


def check_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None
                ) -> ToolSetup | None:
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
    return ToolSetup(out, choice, named, True if parallel is None else bool(parallel))


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


def call_block(name: str, arguments: Any) -> str:
    return TOOL_CALL_BEGIN + json.dumps({"name": name, "arguments": arguments}) + TOOL_CALL_END


def template_renders_tools(tokenizer: Any) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "tools" in template


def default_tool_messages(messages: list[dict[str, Any]], setup: ToolSetup | None
                          ) -> list[dict[str, str]]:
    """Messages for a template that knows nothing of tools: calls in the history written as
    blocks, and (tools active) the tool list in a system message."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        for c in m.get("tool_calls", []):
            content += ("\n" if content else "") + call_block(c["function"]["name"],
                                                              c["function"]["arguments"])
        out.append({"role": m["role"], "content": content})
    if setup is not None and setup.active:
        listing = "\n".join(json.dumps(t) for t in setup.tools)
        text = DEFAULT_TOOL_PROMPT.format(tools=listing)
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


# Parsing -----------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_block(body: str, names: set[str]) -> ParsedCall | None:
    """One block's JSON as a call of a known function, or None."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedCall(_call_id(), obj["name"], json.dumps(args))


def parse_tool_calls(text: str, setup: ToolSetup) -> tuple[str | None, list[ParsedCall]]:
    """(content without the call blocks, or None if nothing else; the calls). A block that
    does not parse as a call of a listed function stays in the content."""
    names = set(setup.names())
    calls: list[ParsedCall] = []
    kept: list[str] = []
    pos = 0
    for m in _BLOCK.finditer(text):
        call = parse_block(m.group(1), names)
        if call is None:
            continue
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append(call)
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


@dataclass
class ToolDelta:
    """One streamed piece: content text, or a tool call's start / argument fragment."""

    content: str | None = None
    index: int | None = None  # tool call index (with the fields below)
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ToolCallStream:
    """Splits a choice's streamed text into content and tool-call deltas. Text that may be
    the start of a `<tool_call>` block is held back; a block is sent once it closes: first the
    call's id, type and name, then its arguments in fragments."""

    setup: ToolSetup
    fragment_chars: int = 16
    buffer: str = ""
    num_calls: int = 0
    pending: list[ToolDelta] = field(default_factory=list)

    def feed(self, text: str, final: bool = False) -> list[ToolDelta]:
        self.buffer += text
        out: list[ToolDelta] = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                # Keep back a tail that could begin the open tag.
                keep = 0 if final else _partial_tag(self.buffer, OPEN)
                cut = len(self.buffer) - keep
                if cut > 0:
                    out.append(ToolDelta(content=self.buffer[:cut]))
                self.buffer = self.buffer[cut:]
                break
            if start > 0:
                out.append(ToolDelta(content=self.buffer[:start]))
                self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                if final:  # an unclosed block (length): plain content
                    out.append(ToolDelta(content=self.buffer))
                    self.buffer = ""
                break
            block, self.buffer = self.buffer[: end + len(CLOSE)], self.buffer[end + len(CLOSE):]
            call = parse_block(block[len(OPEN): -len(CLOSE)].strip(), set(self.setup.names()))
            if call is None:
                out.append(ToolDelta(content=block))
                continue
            i = self.num_calls
            self.num_calls += 1
            out.append(ToolDelta(index=i, id=call.id, name=call.name, arguments=""))
            a = call.arguments
            out += [ToolDelta(index=i, arguments=a[j: j + self.fragment_chars])
                    for j in range(0, len(a), self.fragment_chars)]
        # Whitespace between blocks is not content once a call was made.
        if self.num_calls:
            out = [d for d in out if d.content is None or d.content.strip()]
        return out


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
