"""What a request's output must match: plain, picklable data carried in `SamplingParams`.

The spec names the constraint, never a compiled object: it crosses Ray handles with the
request, and every engine that runs the request (prefill, decode, a replica it migrates to)
compiles it against its own tokenizer (cached), then rebuilds the matcher from the tokens
already generated. No xgrammar import here: the router and the sampling params import this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

# json: a JSON schema (its JSON text; "{}" or an object schema for json_object);
# regex: a regular expression; choice: a JSON list of strings, the output is one of them;
# grammar: an EBNF (GBNF) grammar, root rule `root`; prefix: the output must begin with
# these bytes (hex), then anything (token healing); tool_calls: calls of the listed functions
# in a family's own format (JSON: {"format": "hermes" | "qwen3_coder" | "glm45" | "deepseek_v3",
# "tools": [{"name", "parameters"}], "parallel": one or more calls, else exactly one,
# "content": optional JSON schema the output may follow instead}; grammars.py builds it as an
# xgrammar structural tag).
KINDS = ("json", "regex", "choice", "grammar", "prefix", "tool_calls")
MAX_SPEC_CHARS = 64 * 1024  # a schema / grammar larger than this is refused before compiling
TOOL_CALL_BEGIN = "<tool_call>\n"  # the Hermes / Qwen tool-call block (router.tools)
TOOL_CALL_END = "\n</tool_call>"


class GrammarError(ValueError):
    """The spec cannot be compiled: the message says why (for a 400)."""


@dataclass(frozen=True)
class StructuredSpec:
    kind: str
    value: str
    # json: free whitespace between tokens (vLLM's default); False (ours): compact separators
    # only, since a small model given free whitespace can emit it forever.
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}; one of {KINDS}")
        if len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"the {self.kind} constraint has {len(self.value)} characters; "
                             f"at most {MAX_SPEC_CHARS}")

    @classmethod
    def json_schema(cls, schema: dict | bool | str) -> StructuredSpec:
        # Key order kept: xgrammar emits properties in the order the schema lists them.
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text)

    @classmethod
    def json_object(cls) -> StructuredSpec:
        return cls("json", '{"type": "object"}')

    @classmethod
    def choice(cls, options: list[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def prefix(cls, data: bytes) -> StructuredSpec:
        return cls("prefix", data.hex())

    @property
    def prefix_bytes(self) -> bytes:
        return bytes.fromhex(self.value)
