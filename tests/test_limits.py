"""Server caps and backpressure at the HTTP edge (router.limits, router.api), over uvicorn.

The orchestrator behind the app is a stand-in that streams a few token ids and can be held
open, so concurrency is under the test's control: what is tested is the admission in front.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest
from test_router_api import Server
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.errors import from_exception
from mtpserve.router.limits import Limits
from mtpserve.workers.messages import GenerateRequest, TokenChunk
from mtpserve.workers.tokenizer import load_tokenizer

MAX_MODEL_LEN = 256


class HeldOrchestrator:
    """Streams `max_tokens` copies of token 65, one per chunk, waiting while `hold` is set."""

    def __init__(self) -> None:
        self.hold = threading.Event()
        self.started = 0

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        self.started += 1
        for i in range(request.params.max_tokens):
            while self.hold.is_set():
                await asyncio.sleep(0.01)
            last = i == request.params.max_tokens - 1
            yield TokenChunk([65], finished=last, finish_reason="length" if last else None,
                             num_output_tokens=i + 1)

    async def stats(self) -> dict:
        return {}

    async def kv_probe(self, num_bytes: int) -> dict:
        raise NotImplementedError


LIMITS = Limits(max_tokens=32, max_n=2, max_prompt_tokens=40, max_request_bytes=64 << 10,
                max_concurrent_requests=2, retry_after_s=3)


@pytest.fixture(scope="module")
def orchestrator() -> HeldOrchestrator:
    return HeldOrchestrator()


@pytest.fixture(scope="module")
def server(tmp_path_factory, orchestrator):
    tok = load_tokenizer(str(make_tokenizer(tmp_path_factory.mktemp("tok"))))
    app = create_app(IngressState(orchestrator=orchestrator, tokenizer=tok, model_name="m",
                                  max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE,
                                  limits=LIMITS))
    srv = Server(app)
    srv.app = app
    yield srv
    srv.stop()


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param
    return err


def post(server, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url + "/v1/completions", json=body, timeout=30, **kw)


def test_caps_are_400(server) -> None:
    ok = post(server, {"prompt": "hello world", "max_tokens": 32})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 32
    err = assert_openai_error(post(server, {"prompt": "hi", "max_tokens": 33}), 400,
                              "max_tokens")
    assert "at most 32" in err["message"]
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1000})
    assert_openai_error(chat, 400, "max_completion_tokens")
    assert_openai_error(post(server, {"prompt": "hi", "n": 3}), 400, "n")
    err = assert_openai_error(post(server, {"prompt": [5] * 41, "max_tokens": 1}), 400, "prompt")
    assert err["code"] == "context_length_exceeded"
    # Token ids outside the vocabulary are the client's mistake, never a 500.
    assert_openai_error(post(server, {"prompt": [5, VOCAB_SIZE], "max_tokens": 1}), 400,
                        "prompt")
    assert_openai_error(post(server, {"prompt": [5, 2**62], "max_tokens": 1}), 400, "prompt")
    # So are stop token ids outside it (found by the API fuzzer: they indexed the logits).
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
        for bad in ([VOCAB_SIZE], [-1]):
            r = httpx.post(server.url + path, timeout=30,
                           json=body | {"max_tokens": 1, "stop_token_ids": bad})
            assert_openai_error(r, 400, "stop_token_ids")


def test_default_max_tokens_is_capped_not_the_window(server) -> None:
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 200
    assert chat.json()["usage"]["completion_tokens"] == LIMITS.max_tokens


def test_declared_huge_body_is_413_before_reading(server) -> None:
    resp = httpx.post(server.url + "/v1/completions", timeout=30,
                      content=b"{" + b" " * (LIMITS.max_request_bytes + 10) + b"}",
                      headers={"content-type": "application/json"})
    assert_openai_error(resp, 413)


def upload_until_answered(port: int, total: int, headers: bytes = b"") -> tuple[str, int, float]:
    """POST a chunked body of `total` bytes to /v1/completions on 127.0.0.1:`port`, stopping
    as soon as the server answers: (reply, bytes sent, seconds)."""
    piece = b"x" * (16 << 10)
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nTransfer-Encoding: chunked\r\n" + headers + b"\r\n")
        t0 = time.monotonic()
        while sent < total:
            if select.select([s], [], [], 0)[0]:
                break  # the server answered
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except OSError:
                break
            sent += len(piece)
        reply = s.recv(65536).decode(errors="replace")
        return reply, sent, time.monotonic() - t0


def test_streamed_huge_body_is_refused_while_it_streams_in(server) -> None:
    """A chunked 50 MB upload: the 413 comes once the limit is passed, long before the end."""
    reply, sent, took = upload_until_answered(server.port, 50 << 20)
    assert reply.startswith("HTTP/1.1 413"), reply[:200]
    assert sent < 8 * LIMITS.max_request_bytes + (4 << 20)  # socket buffers hold a few MB
    assert took < 10
    assert '"code":"request_too_large"' in reply  # the OpenAI-style body


def test_too_many_concurrent_requests_is_429(server, orchestrator) -> None:
    orchestrator.hold.set()
    results: list[httpx.Response] = []
    started = orchestrator.started

    def call() -> None:
        results.append(post(server, {"prompt": "hi", "max_tokens": 4}))

    threads = [threading.Thread(target=call) for _ in range(LIMITS.max_concurrent_requests)]
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while orchestrator.started < started + len(threads):
            assert time.monotonic() < deadline, "the held requests did not start"
            time.sleep(0.01)
        busy = post(server, {"prompt": "hi", "max_tokens": 4})
        err = assert_openai_error(busy, 429)
        assert err["type"] == "rate_limit_error" and busy.headers["retry-after"] == "3"
    finally:
        orchestrator.hold.clear()
        for t in threads:
            t.join(timeout=30)
    assert [r.status_code for r in results] == [200] * len(threads)
    assert post(server, {"prompt": "hi", "max_tokens": 4}).status_code == 200  # room again


def test_serve_backpressure_maps_to_429() -> None:
    class BackPressureError(Exception):  # named like ray.serve.exceptions.BackPressureError
        pass

    err = from_exception(BackPressureError("Request dropped due to backpressure"))
    resp = err.response()
    assert resp.status_code == 429 and resp.headers["retry-after"] == "1"
    assert json.loads(resp.body)["error"]["type"] == "rate_limit_error"


def test_draining_refuses_new_requests_and_finishes_running_ones(server, orchestrator) -> None:
    orchestrator.hold.set()
    result: list[httpx.Response] = []
    started = orchestrator.started
    t = threading.Thread(target=lambda: result.append(
        post(server, {"prompt": "hi", "max_tokens": 4})))
    t.start()
    try:
        while orchestrator.started == started:
            time.sleep(0.01)
        server.app.state.gate.draining = True
        refused = post(server, {"prompt": "hi", "max_tokens": 4})
        assert_openai_error(refused, 503)
        assert refused.headers["retry-after"] == "3"
        assert httpx.get(server.url + "/health").status_code == 503
        assert server.app.state.gate.num_inflight == 1
    finally:
        orchestrator.hold.clear()
        t.join(timeout=30)
        server.app.state.gate.draining = False
    assert result[0].status_code == 200  # the running request finished normally
    assert server.app.state.gate.num_inflight == 0
