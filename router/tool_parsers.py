"""Tool-call formats: parsing calls out of generated text, whole or streamed, one class per
format (vLLM's parser names).

- `hermes` (Hermes, Qwen2.5 / Qwen3):
  `<tool_call>\n{"name": N, "arguments": {...}}\n</tool_call>`
- `qwen3_coder` (Qwen3-Coder, Qwen3.5):
  `<tool_call>\n<function=N>\n<parameter=P>\nVALUE\n</parameter>\n...</function>\n</tool_call>`
- `glm45` (GLM-4.5 and later):
  `<tool_call>N\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n...</tool_call>`
- `deepseek_v3` (DeepSeek-V3.1 layout): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>N<｜tool▁sep｜>`
  `{json}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; V3-0324's
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\n```json\n{...}\n```<｜tool▁call▁end｜>` too.

Every parser has one interface: `parse(text) -> (content, calls)` for a whole message, and the
streaming state machine `feed(delta_text, final) -> [ToolDelta]`. `parse` is `feed` over the
whole text, so the two agree by construction. Several calls per message. XML parameter values
(qwen3_coder, glm45) are typed by the tool's JSON schema: strings stay raw text, numbers,
booleans, null, objects and arrays are parsed (raw text when they do not parse).

Streaming: text that may begin a call is held back; a call is announced (index, id, name) once
its name is complete and names a listed function, then its `arguments` grow as they are
generated: a fragment per JSON chunk (hermes, deepseek_v3: the raw argument text), one per
completed parameter (qwen3_coder, glm45: `{"k": v` then `, "k2": v2` then `}`). The fragments
concatenate to the final `arguments`, the same string `parse` returns.

Unknown function names (vLLM filters calls whose name is not in `tools`): such a call is not
returned; its block stays in `content` (in a DeepSeek block that also holds listed calls, it
is dropped). `max_calls=1` (`parallel_tool_calls: false`): calls after the first are dropped.
A block still open when the text ends (finish "length") stays content unless its call was
already announced in a stream.

Markers as special tokens: each parser reads its format's markers (`MARKERS[fmt]`) as text, so
the router decodes a choice with those tokens kept even where the checkpoint registers them as
special added tokens (`workers.detokenizer.marker_skip_ids`), while other special tokens (EOS,
BOS, pad, role tokens) stay out of the text; forced calls (xgrammar) match a special marker by
its text too (`workers.structured.grammars`). Which checkpoints mark them special, from memory
of the published tokenizer files (not checkable offline here, so nothing depends on it):
Qwen3 / Qwen3.5 add `<tool_call>`, `</tool_call>`, `<think>`, `</think>` with `"special":
false`; DeepSeek-V3 / V3.1's `<｜tool▁calls▁begin｜>` family are added tokens we believe to be
`"special": false` (vLLM's deepseek_v3 parser reads them with skipping on); GLM-4.5 / 4.6 add
`<tool_call>`, `<arg_key>`, `<arg_value>` (and closers) and `<think>` as added tokens whose
flag we could not confirm (vLLM's GLM parser turns `skip_special_tokens` off for tool requests
for this reason); Mistral's `[TOOL_CALLS]` is special. A re-export or fine-tune may flip the
flag. Either way the served text is the same.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

PARSERS = ("hermes", "qwen3_coder", "glm45", "deepseek_v3")


@dataclass
class ParsedCall:
    id: str
    name: str
    arguments: str  # JSON text, as OpenAI sends it


@dataclass
class ToolDelta:
    """One streamed piece: content text, or a tool call's start / argument fragment."""

    content: str | None = None
    index: int | None = None  # tool call index (with the fields below)
    id: str | None = None
    name: str | None = None
    arguments: str | None = None


@dataclass
class ScanCall:
    """One call of a block as far as it was generated."""

    name: str | None = None  # None until the name is complete
    args: str = ""  # a prefix of the final arguments JSON text
    done: bool = False  # args is final
    ok: bool = True  # False: malformed (the block is not a call)


@dataclass
class Scan:
    end: int | None  # index just past the block when it is closed
    calls: list[ScanCall]


@dataclass
class _Sent:
    index: int | None  # the call's index in the message; None: not returned
    sent: int = 0  # characters of its arguments sent


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def json_value_end(s: str, start: int) -> int | None:
    """Scan the JSON object or array at s[start]; the index past it, or None (not closed yet).
    Strings and escapes are honoured, so braces inside strings do not count."""
    depth, in_str, esc = 0, False, False
    for i in range(start, len(s)):
        ch = s[i]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


# Typing XML parameter values by the schema --------------------------------------------------
def _schema_types(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    types = {t} if isinstance(t, str) else {x for x in t if isinstance(x, str)} if isinstance(
        t, list) else set()
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            types |= _schema_types(sub)
    for v in ([schema["const"]] if "const" in schema else []) + list(schema.get("enum") or []):
        types.add({str: "string", bool: "boolean", int: "integer", float: "number",
                   type(None): "null", dict: "object", list: "array"}.get(type(v), "string"))
    return types


_STRIPPED = ("enum", "const", "maxLength", "minLength", "pattern", "format")


def typed_value(text: str, schema: Any) -> Any:
    """An XML parameter's text as the value its schema types it: strings raw, the rest parsed
    as JSON (raw text when it does not parse as the schema's type)."""
    types = _schema_types(schema)
    if not types or "string" in types:
        if "null" in types and text.strip() == "null":
            return None
        # A constrained string (enum, const, length, pattern) is read without the whitespace
        # around it, as xgrammar's XML styles frame it; free text keeps it (code, files).
        if isinstance(schema, dict) and any(k in schema for k in _STRIPPED):
            return text.strip()
        return text
    s = text.strip()
    if "boolean" in types and s.lower() in ("true", "false"):
        return s.lower() == "true"
    try:
        v = json.loads(s, strict=False)
    except ValueError:
        if {"object", "array"} & types:
            import ast

            try:
                v = ast.literal_eval(s)
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                return text
        else:
            return text
    kinds = {"integer": (int,), "number": (int, float), "boolean": (bool,), "null": (type(None),),
             "object": (dict,), "array": (list,)}
    for t in types:
        if isinstance(v, kinds.get(t, ())) and not (t in ("integer", "number")
                                                    and isinstance(v, bool)):
            return v
    if "integer" in types and isinstance(v, float) and v.is_integer():
        return int(v)
    return text


def _value_text(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)


# The parsers --------------------------------------------------------------------------------
class ToolParser:
    """A format's parser for one message: `parse` a whole text, or `feed` it in pieces."""

    name = ""
    start = ""  # the marker that opens a block
    markers: tuple[str, ...] = ()  # the format's marker tokens, kept in decoded text
    separator = "\n"  # between blocks when several calls are rendered

    def __init__(self, tools: dict[str, Any], max_calls: int | None = None) -> None:
        self.tools = tools  # function name -> its parameters schema (or None)
        self.max_calls = max_calls
        self.buffer = ""
        self.num_calls = 0
        self._in_block = False
        self._sent: list[_Sent] = []
        self._held = ""  # whitespace after a call, sent only if more content follows

    # Format-specific ----------------------------------------------------------------------
    def scan(self, block: str, final: bool) -> Scan:
        raise NotImplementedError

    def render(self, calls: list[tuple[str, Any]]) -> str:
        """The text of these calls (name, arguments object), as the model writes them."""
        raise NotImplementedError

    # Shared -------------------------------------------------------------------------------
    def params(self, name: str | None) -> dict[str, Any]:
        schema = self.tools.get(name) if name is not None else None
        props = schema.get("properties") if isinstance(schema, dict) else None
        return props if isinstance(props, dict) else {}

    def xml_args(self, name: str | None, pairs: list[tuple[str, str]], done: bool) -> str:
        props = self.params(name)
        body = ", ".join(f"{json.dumps(k)}: {json.dumps(typed_value(v, props.get(k)))}"
                         for k, v in pairs)
        return "{" + body + ("}" if done else "")

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]]:
        """(content without the call blocks, or None if nothing else; the calls)."""
        p = type(self)(self.tools, self.max_calls)
        content: list[str] = []
        calls: dict[int, ParsedCall] = {}
        for d in p.feed(text, final=True):
            if d.content is not None:
                content.append(d.content)
            elif d.id is not None:
                calls[d.index] = ParsedCall(d.id, d.name or "", d.arguments or "")
            else:
                calls[d.index].arguments += d.arguments or ""
        text_out = "".join(content)
        if calls:
            text_out = text_out.strip()
        return (text_out or None), [calls[i] for i in sorted(calls)]

    def _content(self, out: list[ToolDelta], text: str) -> None:
        if not text:
            return
        if self.num_calls:
            self._held += text
            if not self._held.strip():
                return
            text, self._held = self._held, ""
        out.append(ToolDelta(content=text))

    def feed(self, text: str, final: bool = False) -> list[ToolDelta]:
        self.buffer += text
        out: list[ToolDelta] = []
        while True:
            if not self._in_block:
                start = self.buffer.find(self.start)
                if start < 0:
                    keep = 0 if final else partial_tag(self.buffer, self.start)
                    cut = len(self.buffer) - keep
                    self._content(out, self.buffer[:cut])
                    self.buffer = self.buffer[cut:]
                    break
                self._content(out, self.buffer[:start])
                self.buffer = self.buffer[start:]
                self._in_block, self._sent = True, []
            scan = self.scan(self.buffer, final)
            closed = scan.end is not None
            announced = any(s.index is not None for s in self._sent)
            if not announced:
                valid = closed and all(c.ok and c.done for c in scan.calls) and any(
                    c.name in self.tools for c in scan.calls)
                if (closed or final) and not valid:  # not a call: plain text
                    end = scan.end if closed else len(self.buffer)
                    self._content(out, self.buffer[:end])
                    self.buffer = self.buffer[end:]
                    self._in_block = False
                    if closed:
                        continue
                    break
            for j, c in enumerate(scan.calls):
                if c.name is None:
                    break
                if j == len(self._sent):
                    keep = c.name in self.tools and c.ok and (
                        self.max_calls is None or self.num_calls < self.max_calls)
                    self._sent.append(_Sent(self.num_calls if keep else None))
                    if keep:
                        self.num_calls += 1
                        out.append(ToolDelta(index=self._sent[j].index, id=call_id(),
                                             name=c.name, arguments=""))
                s = self._sent[j]
                if s.index is not None and len(c.args) > s.sent:
                    out.append(ToolDelta(index=s.index, arguments=c.args[s.sent:]))
                    s.sent = len(c.args)
            if closed:
                self.buffer = self.buffer[scan.end:]
                self._in_block = False
                continue
            if final:  # an announced call cut short (length): what was sent stays
                self.buffer = ""
                self._in_block = False
            break
        if final:
            self._held = ""
        return out


class HermesParser(ToolParser):
    name, start = "hermes", "<tool_call>"
    close = "</tool_call>"
    markers = ("<tool_call>", "</tool_call>")
    _HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')

    def scan(self, block: str, final: bool) -> Scan:
        end = block.find(self.close, len(self.start))
        body = block[len(self.start): end if end >= 0 else len(block)]
        m = self._HEAD.match(body)
        if m and body[m.end():m.end() + 1] == "{":
            stop = json_value_end(body, m.end())
            call = ScanCall(m.group(1), body[m.end(): stop if stop is not None else len(body)],
                            done=stop is not None)
            if end >= 0:  # the whole block must be one {"name", "arguments"} object
                call.ok = call.done and _is_object(call.args) and _is_object(body.strip())
                call.done = True
        elif end >= 0:  # another shape ("arguments" first, as a string, ...): whole at the end
            call = _hermes_whole(body)
        else:
            call = ScanCall()
        return Scan(end + len(self.close) if end >= 0 else None, [call])

    def render(self, calls: list[tuple[str, Any]]) -> str:
        return self.separator.join(
            f"{self.start}\n{json.dumps({'name': n, 'arguments': a})}\n{self.close}"
            for n, a in calls)


def _is_object(text: str) -> bool:
    # strict=False: xgrammar's length-limited JSON strings admit raw control characters
    try:
        return isinstance(json.loads(text, strict=False), dict)
    except ValueError:
        return False


def _hermes_whole(body: str) -> ScanCall:
    try:
        obj = json.loads(body, strict=False)
    except ValueError:
        return ScanCall(ok=False, done=True)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ScanCall(ok=False, done=True)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            return ScanCall(ok=False, done=True)
    if not isinstance(args, dict):
        return ScanCall(ok=False, done=True)
    return ScanCall(obj["name"], json.dumps(args), done=True)


class Qwen3CoderParser(ToolParser):
    name, start = "qwen3_coder", "<tool_call>"
    close = "</tool_call>"
    markers = ("<tool_call>", "</tool_call>")  # `<function=`, `<parameter=` are plain text
    _FUNC = re.compile(r"\s*<function=([^>\n]*)>")
    _PARAM = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|"
                        r"(?=</function>))", re.DOTALL)

    def scan(self, block: str, final: bool) -> Scan:
        end = block.find(self.close, len(self.start))
        body = block[len(self.start): end if end >= 0 else len(block)]
        m = self._FUNC.match(body)
        if m is None:
            return Scan(end + len(self.close) if end >= 0 else None,
                        [ScanCall(ok=False, done=end >= 0)] if end >= 0 else [])
        name = m.group(1).strip()
        fend = body.find("</function>", m.end())
        inner = body[m.end(): fend if fend >= 0 else len(body)]
        done = fend >= 0 or end >= 0
        if done and fend < 0:
            inner += "</function>"  # the lookahead ends the last parameter
        pairs = [(p.group(1).strip(), _strip_nl(p.group(2)))
                 for p in self._PARAM.finditer(inner)]
        call = ScanCall(name, self.xml_args(name, pairs, done), done)
        return Scan(end + len(self.close) if end >= 0 else None, [call])

    def render(self, calls: list[tuple[str, Any]]) -> str:
        out = []
        for n, a in calls:
            params = "".join(f"<parameter={k}>\n{_value_text(v)}\n</parameter>\n"
                             for k, v in (a if isinstance(a, dict) else {}).items())
            out.append(f"{self.start}\n<function={n}>\n{params}</function>\n{self.close}")
        return self.separator.join(out)


def _strip_nl(v: str) -> str:
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


class Glm45Parser(ToolParser):
    name, start = "glm45", "<tool_call>"
    close = "</tool_call>"
    markers = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>")
    _ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)

    def scan(self, block: str, final: bool) -> Scan:
        end = block.find(self.close, len(self.start))
        body = block[len(self.start): end if end >= 0 else len(block)]
        lead = len(body) - len(body.lstrip())
        stops = [i for i in (body.find("\n", lead), body.find("<arg_key>", lead)) if i >= 0]
        if end >= 0:
            stops.append(len(body))
        if not stops:
            return Scan(None, [])
        cut = min(stops)
        name = body[lead:cut].strip()
        if not name or "<" in name or "{" in name:
            return Scan(end + len(self.close) if end >= 0 else None,
                        [ScanCall(ok=False, done=True)] if end >= 0 else [])
        pairs = [(k.strip(), v) for k, v in self._ARG.findall(body, cut)]
        done = end >= 0
        call = ScanCall(name, self.xml_args(name, pairs, done), done)
        return Scan(end + len(self.close) if done else None, [call])

    def render(self, calls: list[tuple[str, Any]]) -> str:
        out = []
        for n, a in calls:
            args = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_value_text(v)}</arg_value>\n"
                           for k, v in (a if isinstance(a, dict) else {}).items())
            out.append(f"{self.start}{n}\n{args}{self.close}")
        return self.separator.join(out)


class DeepSeekV3Parser(ToolParser):
    name = "deepseek_v3"
    start, close = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    markers = (start, call_begin, sep, call_end, close)
    separator = ""

    def scan(self, block: str, final: bool) -> Scan:
        end = block.find(self.close, len(self.start))
        body = block[len(self.start): end if end >= 0 else len(block)]
        calls: list[ScanCall] = []
        pos = 0
        while True:
            b = body.find(self.call_begin, pos)
            if b < 0:
                break
            head_at = b + len(self.call_begin)
            s = body.find(self.sep, head_at)
            if s < 0:
                if end >= 0:
                    calls.append(ScanCall(ok=False, done=True))
                break
            call, pos = self._call(body, body[head_at:s].strip(), s + len(self.sep))
            calls.append(call)
            if not call.done:
                break
        if end >= 0:
            if not calls or any(not c.done for c in calls):
                calls.append(ScanCall(ok=False, done=True))
            return Scan(end + len(self.close), calls)
        return Scan(None, calls)

    def _call(self, body: str, head: str, at: int) -> tuple[ScanCall, int]:
        rest_start = at
        name = head
        if head == "function" and not body[at:].lstrip().startswith("{"):
            nl = body.find("\n", at)  # V3-0324: function<sep>NAME\n```json\n{...}\n```
            if nl < 0:
                return ScanCall(), len(body)
            name, rest_start = body[at:nl].strip(), nl + 1
        brace = body.find("{", rest_start)
        if brace < 0:
            lead = body[rest_start:].strip()
            ok = "```json".startswith(lead) or lead == "```json"
            return ScanCall(name if ok else None, ok=ok), len(body)
        lead = body[rest_start:brace].strip()
        if lead not in ("", "```json", "```"):
            return ScanCall(name, ok=False, done=True), brace
        stop = json_value_end(body, brace)
        args = body[brace: stop if stop is not None else len(body)]
        if stop is None:
            return ScanCall(name, args), len(body)
        e = body.find(self.call_end, stop)
        if e < 0:  # arguments complete, the call's end tag not yet: hold the final brace back
            return ScanCall(name, args[:-1]), len(body)
        tail = body[stop:e].strip()
        ok = tail in ("", "```") and _is_object(args)
        return ScanCall(name, args, done=True, ok=ok), e + len(self.call_end)

    def render(self, calls: list[tuple[str, Any]]) -> str:
        inner = "".join(f"{self.call_begin}{n}{self.sep}{json.dumps(a)}{self.call_end}"
                        for n, a in calls)
        return f"{self.start}{inner}{self.close}"


PARSER_CLASSES: dict[str, type[ToolParser]] = {
    c.name: c for c in (HermesParser, Qwen3CoderParser, Glm45Parser, DeepSeekV3Parser)}
MARKERS: dict[str, tuple[str, ...]] = {n: c.markers for n, c in PARSER_CLASSES.items()}

# config.json model_type -> the family's format when the chat template says nothing.
_FAMILY_FORMATS = {"deepseek_v3": "deepseek_v3", "deepseek_v2": "deepseek_v3",
                   "glm4_moe": "glm45", "qwen3_5": "qwen3_coder", "qwen3_5_moe": "qwen3_coder"}


def detect_format(chat_template: Any, model_type: str | None = None) -> str:
    """`auto`: the chat template's tool-call markers, else the checkpoint's family, else
    `hermes`."""
    t = chat_template if isinstance(chat_template, str) else ""
    if "<function=" in t and "<parameter=" in t:
        return "qwen3_coder"
    if "<arg_key>" in t:
        return "glm45"
    if "tool▁calls▁begin" in t or "tool▁call▁begin" in t:
        return "deepseek_v3"
    if "<tool_call>" in t:
        return "hermes"
    return _FAMILY_FORMATS.get(model_type or "", "hermes")


def make_parser(fmt: str, tools: dict[str, Any], max_calls: int | None = None) -> ToolParser:
    return PARSER_CLASSES[fmt](tools, max_calls)
