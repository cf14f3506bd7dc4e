"""One request must never hurt another: hostile sampling settings are normalised at admission,
and a step that still raises fails only the request whose inputs caused it while the rest of
its batch continues, token for token as if nothing had happened.

Engine level here (offline engine, the default model); the HTTP fuzz with running streams is at
the end of the file (uvicorn on loopback, the real local orchestrator and engine)."""

from __future__ import annotations

import dataclasses
import json
import threading

import httpx
import pytest
from helpers import drain, greedy, make_engine
from test_router_api import Server

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.local_orchestrator import LocalOrchestrator
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.sampling_params import MIN_TOP_P, SamplingParams
from mtpserve.workers.tokenizer import load_tokenizer

PROMPTS = [[12, 40, 7, 300, 9, 41], [5, 17, 99, 3, 250, 7, 42], [8, 1, 77, 31, 2]]
HUGE = 9223372036854775808  # 2**63: a valid JSON integer, overflows int64


def seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 24, "temperature": 0.8, "seed": seed,
                             "ignore_eos": True, **kw})


def _run(eng, items: list[tuple[str, list[int], SamplingParams]]) -> dict[str, list[int]]:
    reqs = {rid: eng.add_request(rid, p, sp) for rid, p, sp in items}
    drain(eng)
    return {rid: r.output_token_ids for rid, r in reqs.items()}


BYSTANDERS = [("g0", PROMPTS[0], greedy(24)), ("s1", PROMPTS[1], seeded(7)),
              ("g2", PROMPTS[2], greedy(24))]


@pytest.fixture(scope="module")
def reference(default_model) -> dict[str, list[int]]:
    return _run(make_engine(default_model, 2), BYSTANDERS)


@pytest.mark.parametrize("hostile, same_as", [
    (seeded(3, top_k=HUGE), seeded(3)),  # top_k past the vocabulary: no filter
    (seeded(3, top_k=HUGE * HUGE), seeded(3)),
    (seeded(3, top_p=1e-50), greedy(24)),  # underflows float32: keeps the top token
    (seeded(3, top_p=MIN_TOP_P / 10), greedy(24)),
    (seeded(3, min_tokens=HUGE), seeded(3, min_tokens=24)),
    (seeded(3, num_speculative_tokens=HUGE), seeded(3)),
])
def test_hostile_settings_are_normalised(default_model, reference, hostile, same_as) -> None:
    """Batched with greedy and seeded bystanders, a hostile request neither raises nor changes
    their tokens, and generates what the equivalent sane settings generate."""
    eng = make_engine(default_model, 2)
    out = _run(eng, [*BYSTANDERS, ("x", PROMPTS[0], hostile)])
    assert {k: v for k, v in out.items() if k != "x"} == reference
    alone = _run(make_engine(default_model, 2), [("x", PROMPTS[0], same_as)])
    assert out["x"] == alone["x"]
    assert eng.block_manager.num_used_blocks == 0


def test_non_finite_settings_are_refused() -> None:
    for bad in ({"temperature": float("nan")}, {"top_p": float("inf")},
                {"temperature": float("inf")}):
        with pytest.raises(ValueError, match="finite"):
            SamplingParams(**bad)


def test_a_step_that_raises_fails_only_its_culprit(default_model, reference) -> None:
    """A request whose settings slipped past admission (set after it, as a bug elsewhere could)
    makes the batched sampling step raise: it alone fails with an error output; its batch is
    rolled back and recomputed, with the same tokens as a run without it; nothing leaks."""
    eng = make_engine(default_model, 2)
    reqs = {rid: eng.add_request(rid, p, sp) for rid, p, sp in BYSTANDERS}
    bad = eng.add_request("bad", PROMPTS[1], seeded(5))
    for _ in range(3):  # everyone is decoding when the poison lands
        eng.step()
    bad.params = dataclasses.replace(bad.params, top_k=HUGE)  # bypasses for_vocab
    outs = drain(eng)
    failed = [o for o in outs if o.request_id == "bad" and o.finish_reason == "error"]
    assert len(failed) == 1 and "bad" not in eng.requests
    assert "invalid sampling settings" in failed[0].error
    assert {rid: r.output_token_ids for rid, r in reqs.items()} == reference
    assert all(o.finish_reason != "error" for o in outs if o.request_id != "bad")
    assert eng.block_manager.num_used_blocks == 0 and not eng.requests


def test_an_engine_fault_still_raises(default_model) -> None:
    """A step failure no request's settings explain is an engine fault: it propagates (the
    replica fails the batch over to another replica) instead of blaming a request."""
    eng = make_engine(default_model, 2)
    eng.add_request("a", PROMPTS[0], seeded(1))
    eng.step()

    def broken(*a, **kw):
        raise RuntimeError("device lost")

    eng.runner.execute = broken
    eng.runner.greedy_round = broken
    with pytest.raises(RuntimeError, match="device lost"):
        eng.step()


# HTTP: hostile values for every field while streams run ----------------------------------------

HOSTILE_FIELDS: list[dict] = [
    {"top_k": HUGE, "temperature": 0.8}, {"top_k": -HUGE}, {"top_k": HUGE * HUGE},
    {"top_p": 1e-50, "temperature": 0.8}, {"top_p": 0}, {"top_p": -1}, {"top_p": 2},
    {"temperature": -1}, {"temperature": 1e308}, {"temperature": 1e-320},
    {"max_tokens": HUGE}, {"max_tokens": 0}, {"max_tokens": -HUGE},
    {"min_tokens": HUGE}, {"min_tokens": -1}, {"seed": HUGE * HUGE}, {"seed": -HUGE},
    {"n": HUGE}, {"n": 0}, {"logprobs": HUGE}, {"logprobs": -1},
    {"stop_token_ids": [HUGE]}, {"stop_token_ids": [-1]}, {"stop": ["x" * 100_000]},
    {"stop": ["a"] * 1000}, {"mtp": {"num_speculative_tokens": HUGE}},
    {"prompt": [HUGE]}, {"prompt": [[-1]]}, {"prompt": "\ud800 lone surrogate"},
    {"prompt": [[]]}, {"presence_penalty": HUGE}, {"echo": "yes"},
]


@pytest.fixture(scope="module")
def served(default_model):
    engine = AsyncEngine(make_engine(default_model, 2, num_kv_blocks=512))
    srv = Server(create_app(IngressState(
        orchestrator=LocalOrchestrator(engine), tokenizer=load_tokenizer(str(default_model)),
        model_name="m", max_model_len=engine.engine.max_model_len,
        vocab_size=engine.engine.model_config.vocab_size)))
    yield srv, engine
    srv.stop()
    engine.shutdown()


def _stream_text(url: str, body: dict) -> str:
    text = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
    return "".join(text)


def test_hostile_fields_never_hurt_running_streams(served) -> None:
    srv, engine = served
    body = {"prompt": "def add(a, b):\n    return", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    expected = _stream_text(srv.url, body)
    results: list[str] = []
    streams = [threading.Thread(target=lambda: results.append(_stream_text(srv.url, body)))
               for _ in range(3)]
    for t in streams:
        t.start()
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        for fields in HOSTILE_FIELDS:
            req = {"prompt": "x = 1", "max_tokens": 4, **fields}
            # json.dumps escapes the lone surrogate; the server must refuse it, not crash.
            r = c.post("/v1/completions", content=json.dumps(req),
                       headers={"Content-Type": "application/json"})
            assert r.status_code < 500, (fields, r.text[:300])
            if r.status_code >= 400:
                assert set(r.json()) == {"error"}, r.text[:300]
    for t in streams:
        t.join(timeout=120)
    assert results == [expected] * 3
    stats = engine.call(lambda e: e.stats()).result(timeout=30)
    assert stats["used_blocks"] == 0


def test_stop_matcher_holds_exactly_the_longest_partial_stop() -> None:
    """The fast partial-match search agrees with the brute-force definition."""
    import random

    from mtpserve.workers.detokenizer import StopStringMatcher

    rng = random.Random(0)
    for _ in range(3000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 6)))
                 for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 12)))
        brute = max([k for s in stops for k in range(1, min(len(s) - 1, len(text)) + 1)
                     if text.endswith(s[:k])], default=0)
        assert StopStringMatcher(stops)._partial_len(text) == brute, (stops, text)


class _CountingTokenizer:
    """The real tokenizer, counting encode calls (the ingress must not reach it)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls = inner, 0

    def encode(self, *a, **kw):
        self.calls += 1
        return self.inner.encode(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


@pytest.mark.parametrize("body, fragment", [
    ({"prompt": ["a"] * 200_000}, "at most 64 prompts"),
    ({"prompt": ["a"] * 40, "n": 2}, "at most 64 choices"),
    ({"prompt": "x", "stop": ["s" * 600]}, "at most 512 characters"),
    ({"prompt": "x \ud800"}, "not valid Unicode"),
    ({"prompt": "x", "stop": "\udfff"}, "not valid Unicode"),
])
def test_ingress_refuses_before_tokenizing(served, body, fragment) -> None:
    srv, _ = served
    state = srv.server.config.app.state.ingress
    counting = _CountingTokenizer(state.tokenizer)
    state.tokenizer = counting
    try:
        r = httpx.post(srv.url + "/v1/completions", content=json.dumps(body),
                       headers={"Content-Type": "application/json"}, timeout=60)
    finally:
        state.tokenizer = counting.inner
    assert r.status_code == 400, r.text[:300]
    assert fragment in r.json()["error"]["message"]
    assert counting.calls == 0


def test_chat_with_a_lone_surrogate_is_400(served) -> None:
    srv, _ = served
    body = {"messages": [{"role": "user", "content": "hi \ud800"}], "max_tokens": 2}
    r = httpx.post(srv.url + "/v1/chat/completions", content=json.dumps(body),
                   headers={"Content-Type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "Unicode" in r.json()["error"]["message"], r.text[:300]


def test_held_requests_count_as_duplicates(default_model) -> None:
    """A prefill-only engine holding a request's KV for transfer refuses the same id again
    (a retry must come under its own id), and the retry's id is admitted and freed alone."""
    from mtpserve.workers.engine import EngineError

    eng = make_engine(default_model, 2, role="prefill")
    eng.add_request("a", PROMPTS[0], greedy(8))
    drain(eng)
    assert "a" in eng.prefilled
    held = eng.block_manager.num_used_blocks
    with pytest.raises(EngineError, match="duplicate"):
        eng.add_request("a", PROMPTS[0], greedy(8))
    eng.add_request("a#p1", PROMPTS[0], greedy(8))
    drain(eng)
    assert eng.release_prefilled("a#p1")
    assert eng.block_manager.num_used_blocks == held and "a" in eng.prefilled
    assert eng.release_prefilled("a") and eng.block_manager.num_used_blocks == 0
