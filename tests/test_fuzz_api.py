"""Fuzzing the HTTP API from its own OpenAPI schema (schemathesis), in process over ASGI, with
the real local orchestrator and engine behind it.

Whatever the generated request, the server must answer: no status >= 500, no hang, and every
4xx carries an OpenAI-style error body. Limits are small so generation stays cheap.
"""

from __future__ import annotations

import collections
import time

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402
from tiny_tokenizer import make_checkpoint_with_tokenizer  # noqa: E402

from mtpserve.router.api import IngressState, create_app  # noqa: E402
from mtpserve.router.limits import Limits  # noqa: E402
from mtpserve.router.local_orchestrator import LocalOrchestrator  # noqa: E402
from mtpserve.workers.async_engine import AsyncEngine  # noqa: E402
from mtpserve.workers.engine import Engine, EngineConfig  # noqa: E402
from mtpserve.workers.tokenizer import load_tokenizer  # noqa: E402

EXAMPLES_PER_ENDPOINT = 150
MAX_SECONDS_PER_CALL = 30.0


# The schema is read at collection; the backend is attached per module run (routes read
# `app.state.ingress` per request), so collecting this file starts no engine.
APP = create_app()
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
CALLS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def backend(tmp_path_factory):
    ckpt = make_checkpoint_with_tokenizer(tmp_path_factory.mktemp("fuzz") / "tiny",
                                          max_positions=256)
    engine = AsyncEngine(Engine(EngineConfig(model=str(ckpt), num_speculative_tokens=2,
                                             num_kv_blocks=256)))
    APP.state.ingress = IngressState(
        orchestrator=LocalOrchestrator(engine), tokenizer=load_tokenizer(str(ckpt)),
        model_name="tiny", max_model_len=engine.engine.max_model_len,
        vocab_size=engine.engine.model_config.vocab_size,
        limits=Limits(max_tokens=8, max_n=2, max_prompt_tokens=128, max_request_bytes=1 << 16,
                      max_concurrent_requests=64))
    yield
    APP.state.ingress = None
    engine.shutdown()


@schema.parametrize()
@settings(max_examples=EXAMPLES_PER_ENDPOINT, deadline=None,
          suppress_health_check=list(HealthCheck))
def test_api_never_fails_server_side(case) -> None:
    t0 = time.monotonic()
    response = case.call()
    CALLS[f"{case.method} {case.path}"] += 1
    took = time.monotonic() - t0
    assert took < MAX_SECONDS_PER_CALL, f"{case.method} {case.path} took {took:.1f}s"
    assert response.status_code < 500, (case.body, response.text[:500])
    if 400 <= response.status_code < 500:
        body = response.json()
        assert set(body) == {"error"}, body
        assert set(body["error"]) == {"message", "type", "param", "code"}, body
        assert isinstance(body["error"]["message"], str) and body["error"]["message"]
        assert "Traceback" not in response.text


def test_enough_requests_were_made() -> None:
    """Runs after the fuzzing (file order): every endpoint got its share of requests."""
    if not CALLS:
        pytest.skip("the fuzz test did not run (selected out)")
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/mtpserve/kv_probe"):
        assert CALLS[f"POST {path}"] >= EXAMPLES_PER_ENDPOINT, dict(CALLS)
