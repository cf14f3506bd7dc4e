"""The request's constraint: from `response_format`, `structured_outputs` or `tool_choice` to
one `StructuredSpec`, compiled here once (off the event loop, bounded in time) so that a bad or
pathological schema is a 400 before anything runs; and token healing of text prompts.

The engines compile the same spec again against the same tokenizer (cached per process); a
spec that compiled here within `COMPILE_TIMEOUT_S` compiles there as fast.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mtpserve.router.errors import APIError, overloaded
from mtpserve.workers.structured.healing import HealingTable, heal_prompt, may_heal
from mtpserve.workers.structured.spec import MAX_SPEC_CHARS, GrammarError, StructuredSpec

COMPILE_TIMEOUT_S = 10.0
# Per tokenizer: (its GrammarCache, built on first use: xgrammar loads then; healing table).
_caches: dict[int, tuple[Any, HealingTable | None]] = {}
_lock = threading.Lock()


def grammar_cache(state: Any) -> Any:
    """The ingress tokenizer's compiler (one per tokenizer object)."""
    return _entry(state)[0]


def _entry(state: Any) -> tuple[Any, HealingTable | None]:
    from mtpserve.workers.structured.grammars import GrammarCache

    key = id(state.tokenizer)
    with _lock:
        hit = _caches.get(key)
    if hit is None:
        tok = state.tokenizer
        vocab = state.vocab_size or len(tok)
        eos = [t for t in [getattr(tok, "eos_token_id", None)] if t is not None]
        hit = (GrammarCache.of_tokenizer(tok, vocab, eos), None)
        with _lock:
            hit = _caches.setdefault(key, hit)
    return hit


def healing_table(state: Any) -> HealingTable:
    cache, table = _entry(state)
    if table is None:
        table = HealingTable(cache.token_bytes)
        with _lock:
            _caches[id(state.tokenizer)] = (cache, table)
    return table


def _spec_of_schema(schema: Any, param: str) -> StructuredSpec:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise APIError(f"{param}: the schema is not valid JSON", 400, param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise APIError(f"{param}: the schema must be a JSON object", 400, param=param)
    try:
        return StructuredSpec.json_schema(schema)
    except ValueError as e:
        raise APIError(f"{param}: {e}", 400, param=param) from None


def response_format_spec(rf: dict[str, Any] | None) -> StructuredSpec | None:
    """OpenAI's `response_format`: text (None), json_object, or json_schema."""
    if not rf:
        return None
    kind = rf.get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec.json_object()
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict) or "schema" not in js and "json_schema" not in js:
            raise APIError("response_format json_schema needs 'json_schema': {'name', "
                           "'schema'}", 400, param="response_format")
        name = js.get("name")
        if name is not None and not isinstance(name, str):
            raise APIError("response_format.json_schema.name must be a string", 400,
                           param="response_format")
        return _spec_of_schema(js.get("schema", js.get("json_schema")),
                               "response_format.json_schema.schema")
    raise APIError(f"response_format type '{kind}' is not supported (text, json_object, "
                   "json_schema)", 400, param="response_format")


def structured_outputs_spec(so: dict[str, Any] | None) -> StructuredSpec | None:
    """vLLM's `structured_outputs` extension: exactly one of json, regex, choice, grammar
    (or json_object: true)."""
    if not so:
        return None
    keys = [k for k in ("json", "regex", "choice", "grammar", "json_object")
            if so.get(k) not in (None, False)]
    if len(keys) != 1:
        raise APIError("structured_outputs needs exactly one of 'json', 'regex', 'choice', "
                       "'grammar', 'json_object'", 400, param="structured_outputs")
    (k,) = keys
    if not isinstance(so.get("enable_in_reasoning", False), bool):
        raise APIError("structured_outputs.enable_in_reasoning must be a boolean", 400,
                       param="structured_outputs.enable_in_reasoning")
    spec = _structured(k, so[k], f"structured_outputs.{k}")
    # vLLM's name; absent: compact JSON (our default), false: free whitespace as in vLLM.
    ws = so.get("disable_any_whitespace")
    if ws is not None:
        if not isinstance(ws, bool):
            raise APIError("structured_outputs.disable_any_whitespace must be a boolean", 400,
                           param="structured_outputs.disable_any_whitespace")
        if k in ("json", "json_object") and not ws:
            spec = dataclasses.replace(spec, any_whitespace=True)
    return spec


def _structured(k: str, v: Any, param: str) -> StructuredSpec:
    """One constraint of kind `k`; every bad value (a wrong type, over MAX_SPEC_CHARS) is a 400
    naming `param`, never a ValueError escaping to a 500."""
    if k == "json":
        return _spec_of_schema(v, param)
    if k == "json_object":
        return StructuredSpec.json_object()
    if k == "choice":
        if (not isinstance(v, list) or not v
                or not all(isinstance(o, str) and o for o in v)):
            raise APIError(f"{param} must be a non-empty list of non-empty strings", 400,
                           param=param)
        value = json.dumps(list(v))
    else:
        if not isinstance(v, str) or not v:
            raise APIError(f"{param} must be a non-empty string", 400, param=param)
        value = v
    if len(value) > MAX_SPEC_CHARS:
        raise APIError(f"{param} is too large ({len(value)} characters; at most "
                       f"{MAX_SPEC_CHARS})", 400, param=param)
    try:
        return StructuredSpec(k, value)
    except ValueError as e:
        raise APIError(f"{param}: {e}", 400, param=param) from None


# vLLM's older request fields for the same constraints (one at most; none with
# `structured_outputs`: one_spec names the second).
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar", "guided_json_object": "json_object"}


def guided_spec(body: Any) -> tuple[str, StructuredSpec | None]:
    """(the guided_* field given, its constraint) or ("guided_json", None) when none is.
    `guided_whitespace_pattern` is a 400 (not implemented); `guided_decoding_backend` may
    only name xgrammar (or auto)."""
    if getattr(body, "guided_whitespace_pattern", None) is not None:
        raise APIError("'guided_whitespace_pattern' is not supported", 400,
                       param="guided_whitespace_pattern")
    backend = getattr(body, "guided_decoding_backend", None)
    if backend is not None and backend not in ("xgrammar", "auto"):
        raise APIError("'guided_decoding_backend' must be 'xgrammar' (the only backend)", 400,
                       param="guided_decoding_backend")
    given = [f for f in GUIDED if getattr(body, f, None) not in (None, False)]
    if not given:
        return "guided_json", None
    if len(given) > 1:
        raise APIError(f"use only one of {', '.join(given)}", 400, param=given[1])
    (f,) = given
    return f, _structured(GUIDED[f], getattr(body, f), f)


def one_spec(*named: tuple[str, StructuredSpec | None]) -> StructuredSpec | None:
    given = [(n, s) for n, s in named if s is not None]
    if len(given) > 1:
        raise APIError(f"use only one of {', '.join(n for n, _ in given)}", 400,
                       param=given[1][0])
    return given[0][1] if given else None


# The ingress compiles on a pool of its own, not the event loop's shared default executor:
# a compile cannot be stopped once it runs (xgrammar's C++), so a flood of slow or abandoned
# grammars must not take the threads the rest of the server uses. The same spec compiling
# for several requests runs once; past MAX_PENDING_COMPILES distinct ones, new ones are 429.
COMPILE_WORKERS = 2
MAX_PENDING_COMPILES = 16
_compile_pool = ThreadPoolExecutor(COMPILE_WORKERS, thread_name_prefix="ingress-grammar")
_inflight: dict[tuple[int, StructuredSpec], concurrent.futures.Future] = {}


def _compile_future(cache: Any, spec: StructuredSpec) -> concurrent.futures.Future:
    key = (id(cache), spec)
    with _lock:
        fut = _inflight.get(key)
        if fut is not None:
            return fut
        if len(_inflight) >= MAX_PENDING_COMPILES:
            raise overloaded(f"{len(_inflight)} constraints are compiling on this ingress; "
                              "retry shortly")
        fut = _compile_pool.submit(cache.compile, spec)
        _inflight[key] = fut

    def done(_: concurrent.futures.Future) -> None:
        with _lock:
            _inflight.pop(key, None)

    fut.add_done_callback(done)
    return fut


async def check_compiles(state: Any, spec: StructuredSpec | None, param: str) -> None:
    """Compile `spec` for the served tokenizer on the ingress's compile pool: a spec that does
    not compile (or not within COMPILE_TIMEOUT_S) is a 400 naming the problem. The event loop
    keeps serving meanwhile; a request that gives up leaves the compile to finish for the
    cache (it cannot be interrupted) without holding anything else."""
    if spec is None or spec.kind == "prefix":
        return
    cache = grammar_cache(state)
    if cache.cached(spec):
        return
    try:
        fut = asyncio.wrap_future(_compile_future(cache, spec))
        await asyncio.wait_for(asyncio.shield(fut), COMPILE_TIMEOUT_S)
    except GrammarError as e:
        raise APIError(str(e), 400, param=param) from None
    except (TimeoutError, asyncio.TimeoutError):
        raise APIError(f"the {spec.kind} constraint did not compile within "
                       f"{COMPILE_TIMEOUT_S:g} s; simplify it", 400, param=param) from None


def healing_default(state: Any) -> bool:
    """Token healing when a request leaves `token_healing` unset: the ingress state's
    `token_healing`, which the Serve ingress sets from the model's default
    (`workers.structured.healing.model_default`; on for the embedded model). The offline
    `LLM.generate` heals the same way, so served and offline text stay equal."""
    return bool(getattr(state, "token_healing", False))


def preload_healing(state: Any) -> None:
    """Build the healing table (xgrammar's vocabulary bytes, ~2 s with its import) on a
    background thread when the server heals by default, so the first newline-ending prompt
    does not stall the event loop building it."""
    if healing_default(state):
        threading.Thread(target=healing_table, args=(state,), name="healing-table",
                         daemon=True).start()


def heal(state: Any, ids: list[int], any_tail: bool = True
         ) -> tuple[list[int], StructuredSpec | None, str]:
    """(healed prompt ids, the prefix constraint, its text) or (ids, None, ""). Without
    `any_tail` (the default setting, not the client's explicit request) only a tail of
    whitespace holding a line break is healed: the editor's prompt the default exists for,
    while other prompts keep their exact tokens (and never load the vocabulary's bytes)."""
    if not ids or not may_heal(state.tokenizer.decode(ids[-1:]), any_tail):
        return ids, None, ""
    h = heal_prompt(healing_table(state), ids, any_tail)
    return h.ids, (StructuredSpec.prefix(h.tail) if h.healed else None), h.text
