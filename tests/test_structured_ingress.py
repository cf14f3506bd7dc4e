"""The ingress's own compile pool (router/structured.py `check_compiles`, issue 43 item 6):
identical specs compile once however many requests wait for them, compiles run on the pool's
threads (never the event loop's shared executor), past MAX_PENDING_COMPILES distinct
compiles a new one is a 429 with Retry-After, and a request that times out leaves nothing
behind once its compile ends. The compile is the real one, held by a gate the test opens."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

import mtpserve.router.structured as rs
from mtpserve.router.errors import APIError
from mtpserve.workers.structured.spec import StructuredSpec
from mtpserve.workers.tokenizer import load_tokenizer


@pytest.fixture
def gated(default_model, monkeypatch):
    tok = load_tokenizer(str(default_model))
    state = SimpleNamespace(tokenizer=tok, vocab_size=len(tok))
    cache = rs.grammar_cache(state)
    gate, threads, real = threading.Event(), [], cache.compile

    def slow(spec):
        threads.append(threading.current_thread().name)
        assert gate.wait(60)
        return real(spec)

    monkeypatch.setattr(cache, "compile", slow)
    yield state, cache, gate, threads
    gate.set()


def _spec(i: int) -> StructuredSpec:
    return StructuredSpec("regex", f"(x|y){{{i},{i + 30}}}z")


def test_one_compile_for_identical_specs_on_the_pool(gated) -> None:
    state, cache, gate, threads = gated
    spec = _spec(100)

    async def main():
        waits = [asyncio.create_task(rs.check_compiles(state, spec, "response_format"))
                 for _ in range(5)]
        await asyncio.sleep(0)
        while not threads:
            await asyncio.sleep(0.01)
        gate.set()
        await asyncio.gather(*waits)

    asyncio.run(main())
    assert len(threads) == 1 and threads[0].startswith("ingress-grammar")
    assert cache.cached(spec) and not rs._inflight


def test_past_the_pending_bound_a_new_compile_is_429(gated, monkeypatch) -> None:
    state, cache, gate, threads = gated
    monkeypatch.setattr(rs, "COMPILE_TIMEOUT_S", 0.2)

    async def main():
        timed_out = await asyncio.gather(
            *(rs.check_compiles(state, _spec(200 + i), "response_format")
              for i in range(rs.MAX_PENDING_COMPILES)), return_exceptions=True)
        assert all(isinstance(e, APIError) and e.status == 400 for e in timed_out)
        with pytest.raises(APIError) as info:  # the timed-out compiles still hold the pool
            await rs.check_compiles(state, _spec(999), "response_format")
        assert info.value.status == 429 and "Retry-After" in info.value.headers

    asyncio.run(main())
    gate.set()
    for f in list(rs._inflight.values()):
        f.result(timeout=60)
    assert not rs._inflight  # each compile ended and let go of its slot


def test_json_whitespace_is_compact_unless_asked() -> None:
    """structured_outputs.disable_any_whitespace (vLLM's name): absent, compact JSON (ours);
    false, free whitespace as vLLM allows by default; anything but a boolean is a 400."""
    from xgrammar.testing import _is_grammar_accept_string

    from mtpserve.workers.structured.grammars import spec_grammar

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    compact = rs.structured_outputs_spec({"json": schema})
    free = rs.structured_outputs_spec({"json": schema, "disable_any_whitespace": False})
    strict = rs.structured_outputs_spec({"json": schema, "disable_any_whitespace": True})
    assert compact == strict and not compact.any_whitespace and free.any_whitespace
    pretty = '{\n  "a": 1\n}'
    assert _is_grammar_accept_string(spec_grammar(free), pretty)
    assert not _is_grammar_accept_string(spec_grammar(compact), pretty)
    assert _is_grammar_accept_string(spec_grammar(compact), '{"a": 1}')
    with pytest.raises(APIError) as info:
        rs.structured_outputs_spec({"json": schema, "disable_any_whitespace": "no"})
    assert info.value.status == 400
