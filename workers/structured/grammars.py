"""Compiling a `StructuredSpec` against a tokenizer with xgrammar, cached.

One `GrammarCompiler` per tokenizer (its `TokenizerInfo`: the vocabulary as bytes, the stop
tokens); compiled grammars are cached per spec, so a schema many requests share compiles once
per process. Compilation can fail (an unsupported or invalid schema, regex or grammar): that is
a `GrammarError` naming the problem, which the router turns into a 400 before the request runs.
The `prefix` kind (token healing) needs no compilation; it is served by `PrefixConstraint`.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from mtpserve.workers.structured.spec import (
    TOOL_CALL_BEGIN,
    TOOL_CALL_END,
    GrammarError,
    StructuredSpec,
)

__all__ = ["GrammarCache", "GrammarError", "spec_grammar", "tool_call_schema"]

MAX_CACHED_GRAMMARS = 256


def _literal(text: str) -> xgr.Grammar:
    # json.dumps escapes quotes, backslashes and control characters the way EBNF reads them.
    return xgr.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def tool_call_schema(name: str, parameters: dict | None) -> dict:
    """The JSON schema of one `{"name": ..., "arguments": ...}` call of function `name`."""
    return {"type": "object",
            "properties": {"name": {"const": name},
                           "arguments": parameters if parameters else {"type": "object"}},
            "required": ["name", "arguments"], "additionalProperties": False}


def spec_grammar(spec: StructuredSpec) -> xgr.Grammar:
    """The xgrammar `Grammar` of a spec (not compiled to a tokenizer yet)."""
    try:
        if spec.kind == "json":
            schema = json.loads(spec.value)
            # Compact separators and no free whitespace: a small model given free whitespace
            # can emit it forever inside a valid object and never close it.
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            options = json.loads(spec.value)
            if not options or not all(isinstance(o, str) and o for o in options):
                raise GrammarError("choice needs a non-empty list of non-empty strings")
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(
                json.dumps(o, ensure_ascii=False) for o in options))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.value)
        if spec.kind == "tool_calls":
            # value: {"schemas": [call schema, ...]}: one call of any listed function,
            # wrapped in the Hermes / Qwen tags (router.tools writes and parses them).
            schemas = json.loads(spec.value)["schemas"]
            body = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
            return xgr.Grammar.concat(
                _literal(TOOL_CALL_BEGIN),
                xgr.Grammar.from_json_schema(body, any_whitespace=False),
                _literal(TOOL_CALL_END))
    except GrammarError:
        raise
    except json.JSONDecodeError as e:
        raise GrammarError(f"the {spec.kind} constraint is not valid JSON: {e}") from None
    except Exception as e:  # xgrammar raises RuntimeError / ValueError with the reason
        raise GrammarError(f"invalid {spec.kind} constraint: {_reason(e)}") from None
    raise GrammarError(f"the {spec.kind} constraint needs no grammar")


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
    return text.split(": ", 1)[1] if text.startswith("[") and ": " in text else text


class GrammarCache:
    """Compiled grammars of one tokenizer, most recently used kept (thread-safe: the router
    compiles on worker threads, the engine on its own thread)."""

    def __init__(self, info: xgr.TokenizerInfo, stop_token_ids: list[int]) -> None:
        self.info = info
        self.vocab_size = info.vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache: OrderedDict[StructuredSpec, xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._token_bytes: list[bytes] | None = None

    @classmethod
    def of_tokenizer(cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]
                     ) -> GrammarCache:
        """For a `transformers` tokenizer; `vocab_size`: the model's (may exceed the
        tokenizer's: the extra ids are never allowed)."""
        return cls(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=list(stop_token_ids)),
                   stop_token_ids)

    @classmethod
    def of_vocab(cls, tokens: list[str], stop_token_ids: list[int]) -> GrammarCache:
        """For a plain vocabulary (token i is the text tokens[i]): models without a
        tokenizer (tests)."""
        return cls(xgr.TokenizerInfo(tokens, xgr.VocabType.RAW,
                                     stop_token_ids=list(stop_token_ids)), stop_token_ids)

    @property
    def token_bytes(self) -> list[bytes]:
        """Each token's bytes (b"" for special tokens), for prefix constraints and healing."""
        if self._token_bytes is None:
            special = set(self.info.special_token_ids) | set(self.stop_token_ids)
            vocab = [bytes(b) for b in self.info.decoded_vocab]
            vocab += [b""] * (self.vocab_size - len(vocab))
            self._token_bytes = [b"" if i in special else b for i, b in enumerate(vocab)]
        return self._token_bytes

    def compile(self, spec: StructuredSpec) -> xgr.CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        grammar = spec_grammar(spec)
        try:
            compiled = self.compiler.compile_grammar(grammar)
        except Exception as e:
            raise GrammarError(f"the {spec.kind} constraint does not compile: {_reason(e)}"
                               ) from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return compiled
