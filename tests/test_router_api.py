"""The OpenAI HTTP API (router.api) served by uvicorn over a real in-process engine.

Happy paths go through the real `openai` client; error cases through httpx, checking status and
error JSON. Only the engine-failure tests swap in a failing orchestrator: they test the HTTP
error mapping, not the engine.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import httpx
import openai
import pytest
import uvicorn
from tiny_tokenizer import make_checkpoint_with_tokenizer

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.chat_template import apply_chat_template
from mtpserve.router.local_orchestrator import LocalOrchestrator
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.llm import LLM
from mtpserve.workers.messages import GenerateRequest, TokenChunk
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.tokenizer import load_tokenizer

API_KEY = "sk-test-123"
ADMIN_KEY = "sk-admin-456"
MODEL = "tiny-mtp"
NUM_KV_BLOCKS = 256


class Server:
    """uvicorn on 127.0.0.1 and a free port, on a background thread."""

    def __init__(self, app) -> None:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started, "uvicorn to start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


class RecordingOrchestrator(LocalOrchestrator):
    """The real local orchestrator, noting how each upstream stream ended."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(engine)
        self.outcomes: dict[str, str] = {}

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        inner = super().generate(request)
        finished = False
        try:
            async for chunk in inner:
                finished = chunk.finished
                yield chunk
        finally:
            self.outcomes[request.request_id] = "finished" if finished else "closed"
            await inner.aclose()


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint_with_tokenizer(tmp_path_factory.mktemp("api") / "tiny")


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = AsyncEngine(Engine(EngineConfig(model=str(ckpt), num_speculative_tokens=2,
                                          num_kv_blocks=NUM_KV_BLOCKS)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def orchestrator(engine):
    return RecordingOrchestrator(engine)


@pytest.fixture(scope="module")
def server(engine, orchestrator, ckpt):
    srv = Server(create_app(IngressState(
        orchestrator=orchestrator, tokenizer=load_tokenizer(str(ckpt)), model_name=MODEL,
        max_model_len=engine.engine.max_model_len, api_key=API_KEY, admin_api_key=ADMIN_KEY,
        enable_kv_probe=True)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture(scope="module")
def offline(ckpt):
    """The offline engine, same configuration: the reference for greedy outputs."""
    return LLM(str(ckpt), num_speculative_tokens=2, num_kv_blocks=NUM_KV_BLOCKS)


def greedy(offline: LLM, prompt: str | list[int], max_tokens: int):
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return offline.generate([prompt], params)[0]


def engine_idle(engine: AsyncEngine) -> bool:
    state = engine.call(lambda e: (e.has_unfinished(), e.block_manager.num_free_blocks))
    busy, free = state.result(timeout=10)
    return not busy and free == NUM_KV_BLOCKS


def extra(obj, name: str):
    return obj.model_extra[name]


# Happy paths (openai client) ---------------------------------------------------------------
def test_completion_greedy_equals_offline_engine(client, offline):
    ref = greedy(offline, "def hello world", 24)
    resp = client.completions.create(model=MODEL, prompt="def hello world", max_tokens=24,
                                     temperature=0, extra_body={"ignore_eos": True,
                                                                "return_token_ids": True})
    choice = resp.choices[0]
    assert extra(choice, "token_ids") == ref.output_token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert resp.usage.completion_tokens == 24
    assert resp.usage.total_tokens == len(ref.prompt_token_ids) + 24
    assert resp.model == MODEL and resp.object == "text_completion"


def test_chat_greedy_equals_offline_engine(client, offline, ckpt):
    messages = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "print hello"}]}]
    ids = apply_chat_template(load_tokenizer(str(ckpt)), [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "print hello"}])
    ref = greedy(offline, ids, 20)
    resp = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20,
                                          temperature=0, extra_body={"ignore_eos": True})
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.usage.completion_tokens == 20


def test_streaming_completion_with_usage(client, offline):
    ref = greedy(offline, "import value", 30)
    chunks = list(client.completions.create(
        model=MODEL, prompt="import value", max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.text
    ids = [i for c in chunks if c.choices for i in extra(c.choices[0], "token_ids")]
    assert ids == ref.output_token_ids
    assert len([c for c in chunks if c.choices]) > 2  # it really streamed
    finals = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason]
    assert [f.finish_reason for f in finals] == ["length"]
    assert extra(finals[0], "mtp_stats")["num_rounds"] > 0
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 30
    assert usage_chunk.usage.prompt_tokens == len(ref.prompt_token_ids)


def test_streaming_chat(client, offline, ckpt):
    messages = [{"role": "user", "content": "hello café"}]
    ref = greedy(offline, apply_chat_template(load_tokenizer(str(ckpt)), messages), 25)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=25, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    assert chunks[-1].usage.completion_tokens == 25
    assert any(c.choices and c.choices[0].finish_reason == "length" for c in chunks)


def test_n_choices_are_independent_and_seeded(client):
    def run():
        return client.completions.create(model=MODEL, prompt="class", max_tokens=12, n=2,
                                         temperature=1.0, seed=7,
                                         extra_body={"ignore_eos": True})

    a, b = run(), run()
    assert sorted(c.index for c in a.choices) == [0, 1]
    texts = [c.text for c in sorted(a.choices, key=lambda c: c.index)]
    assert texts[0] != texts[1]  # seed + i: the choices differ
    assert texts == [c.text for c in sorted(b.choices, key=lambda c: c.index)]  # reproducible
    assert a.usage.completion_tokens == 24


def test_usage_reports_prefix_cached_prompt_tokens(client):
    """OpenAI's usage.prompt_tokens_details.cached_tokens: 0 for a cold prompt, the shared
    full blocks when the same long prompt comes again."""
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)\n" * 8

    def run():
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=4,
                                         temperature=0, extra_body={"ignore_eos": True})

    cold, warm = run(), run()
    n = cold.usage.prompt_tokens
    assert n > 40
    assert cold.usage.prompt_tokens_details.cached_tokens in (0, (n - 1) // 16 * 16)
    assert warm.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16
    assert warm.choices[0].text == cold.choices[0].text


def test_batched_prompts_give_prompt_major_choices(client, offline):
    prompts = ["def", "hello world"]
    refs = [greedy(offline, p, 6) for p in prompts]
    resp = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, n=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    by_index = {c.index: c.text for c in resp.choices}
    assert by_index == {0: refs[0].text, 1: refs[0].text, 2: refs[1].text, 3: refs[1].text}
    assert resp.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)


def test_stop_string_cuts_text_and_aborts_upstream(client, offline, orchestrator, engine):
    full = greedy(offline, "for value in", 40).text
    stop = full[12:15]
    expected = full[: full.find(stop)]
    resp = client.completions.create(model=MODEL, prompt="for value in", max_tokens=1500,
                                     temperature=0, stop=[stop, "never-in-output"],
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].text == expected
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage.completion_tokens < 100
    assert orchestrator.outcomes[resp.id + "-0"] == "closed"
    wait_for(lambda: engine_idle(engine), "the aborted request's KV blocks to be freed")


def test_stop_string_in_stream(client, offline):
    full = greedy(offline, "print self", 40).text
    stop = full[10:13]
    chunks = list(client.completions.create(
        model=MODEL, prompt="print self", max_tokens=1000, temperature=0, stop=stop,
        stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == full[: full.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_mtp_extension_caps_speculation_and_reports_acceptance(client):
    def run(mtp):
        body = {"ignore_eos": True, **({"mtp": mtp} if mtp is not None else {})}
        return client.completions.create(model=MODEL, prompt="return self", max_tokens=30,
                                         temperature=0, extra_body=body)

    default, capped, off = run(None), run({"num_speculative_tokens": 1}), run({"disable": True})
    assert default.choices[0].text == capped.choices[0].text == off.choices[0].text
    s_default, s_capped, s_off = (extra(r.choices[0], "mtp_stats")
                                  for r in (default, capped, off))
    assert 0 < s_default["num_drafted"] <= 2 * s_default["num_rounds"]
    assert s_default["num_drafted"] > s_default["num_rounds"]  # k = 2 really used
    assert 0 < s_capped["num_drafted"] <= s_capped["num_rounds"]
    assert s_off["num_drafted"] == 0 and s_off["num_rounds"] > 0
    assert "acceptance_rate" not in s_off  # undefined without drafts
    rate = s_default["acceptance_rate"]
    assert rate == pytest.approx(s_default["num_accepted"] / s_default["num_drafted"])
    assert s_default["mean_accepted_length"] == pytest.approx(
        (s_default["num_accepted"] + s_default["num_rounds"]) / s_default["num_rounds"])
    assert extra(default, "mtp_stats") == s_default  # n = 1: response total == the choice


def test_models_health_and_stats(client, http, server, engine):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}  # no key needed
    stats = http.get("/v1/mtpserve/stats").json()
    assert stats["engine"]["num_speculative_tokens"] == 2


# Errors (httpx) ----------------------------------------------------------------------------
def assert_error(resp: httpx.Response, status: int, type_: str, param: str | None = None,
                 in_message: str = "") -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == type_
    assert err["param"] == param
    assert in_message in err["message"]
    assert "Traceback" not in resp.text
    return err


def test_malformed_json_is_400(http):
    resp = http.post("/v1/completions", content=b'{"prompt": "x",',
                     headers={"Content-Type": "application/json"})
    assert_error(resp, 400, "invalid_request_error", in_message="malformed JSON")


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/completions", {"prompt": "x", "mtp": {"num_spec_tokens": 1}}, "mtp.num_spec_tokens"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]},
     "messages[0].content.str"),
])
def test_wrong_types_are_400_naming_the_field(http, path, body, param):
    err = assert_error(http.post(path, json=body), 400, "invalid_request_error", param)
    assert param.split(".")[0].split("[")[0] in err["message"]


def test_body_that_is_not_an_object_is_400(http):
    assert_error(http.post("/v1/completions", json=[1, 2]), 400, "invalid_request_error",
                 in_message="JSON object")


def test_unknown_fields_are_ignored(http):
    resp = http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2,
                                              "some_future_field": {"a": 1}, "user": "u1"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] <= 2


def test_prompt_longer_than_context_window_is_400(http, engine):
    limit = engine.engine.max_model_len
    resp = http.post("/v1/completions", json={"prompt": [5] * limit, "max_tokens": 1})
    err = assert_error(resp, 400, "invalid_request_error", "prompt", in_message=str(limit))
    assert err["code"] == "context_length_exceeded"


def test_max_tokens_beyond_window_is_clamped(http, engine):
    limit = engine.engine.max_model_len
    resp = http.post("/v1/completions", json={"prompt": [5] * (limit - 3), "max_tokens": 500,
                                              "ignore_eos": True, "temperature": 0})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["usage"]["completion_tokens"] == 3
    assert body["choices"][0]["finish_reason"] == "length"


def test_engine_rejection_is_400(http):
    resp = http.post("/v1/completions", json={"prompt": [999_999], "max_tokens": 2})
    assert_error(resp, 400, "invalid_request_error", in_message="token ids")


def test_unknown_model_is_404(http):
    err = assert_error(http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}),
                       404, "invalid_request_error", "model", in_message="gpt-9")
    assert err["code"] == "model_not_found"


def test_api_key_required(server):
    body = {"prompt": "x", "max_tokens": 1}
    missing = httpx.post(server.url + "/v1/completions", json=body)
    err = assert_error(missing, 401, "authentication_error", in_message="API key")
    assert err["code"] == "invalid_api_key"
    wrong = httpx.post(server.url + "/v1/completions", json=body,
                       headers={"Authorization": "Bearer sk-wrong"})
    assert_error(wrong, 401, "authentication_error", in_message="incorrect")
    # Refused before the body is parsed: malformed JSON still gets 401, not 400.
    assert httpx.post(server.url + "/v1/models", content=b"{").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
])
def test_bad_logprobs_are_400(http, path, body, param):
    assert_error(http.post(path, json=body), 400, "invalid_request_error", param)


def test_kv_probe_without_channel_is_501(http):
    assert_error(http.post("/v1/mtpserve/kv_probe", json={"num_bytes": 1024},
                           headers={"Authorization": f"Bearer {ADMIN_KEY}"}), 501,
                 "not_implemented_error", in_message="KV channel")


def test_client_disconnect_mid_stream_frees_kv_blocks(server, engine, orchestrator):
    body = {"prompt": "hello world", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()  # kept alive: dropping it would close the connection
            first: list[dict] = []
            while len(first) < 2:
                line = next(lines)
                if line.startswith("data: "):
                    first.append(json.loads(line[6:]))
            running = engine.call(lambda e: list(e.requests.values())).result(timeout=10)
            assert [r.request_id for r in running] == [first[0]["id"] + "-0"]
            request = running[0]
            assert request.num_output_tokens < 1500
    # The connection is closed: the request must be aborted and every KV block come back.
    wait_for(lambda: engine_idle(engine), "KV blocks to return after the disconnect")
    assert request.status.value == "abort"
    assert request.num_output_tokens < 1500
    assert orchestrator.outcomes[request.request_id] == "closed"


def test_client_disconnect_without_stream_frees_kv_blocks(server, engine):
    body = {"prompt": "hello world", "max_tokens": 1900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=0.5,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    wait_for(lambda: engine_idle(engine), "KV blocks to return after the disconnect")


# Engine failures: a failing orchestrator behind the same app --------------------------------
class FailingOrchestrator:
    """Fails in the way named by the prompt's first token id (test hook, not an engine)."""

    def __init__(self, token_ids: list[int]) -> None:
        self.token_ids = token_ids  # what it emits before failing mid-stream

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        mode = request.prompt_token_ids[0]
        if mode == 1:
            raise RuntimeError("boom: no decode replica")
        return self._gen(mode)

    async def _gen(self, mode: int) -> AsyncIterator[TokenChunk]:
        if mode == 2:
            yield TokenChunk([], finished=True, finish_reason="error",
                             error="KV transfer timed out")
        elif mode == 3:
            raise TimeoutError("decode replica did not answer")
        elif mode == 4:  # fails after the stream started
            yield TokenChunk(self.token_ids, num_output_tokens=len(self.token_ids))
            yield TokenChunk([], finished=True, finish_reason="error", error="replica died")

    async def stats(self) -> dict:
        raise RuntimeError("secret internals")

    async def kv_probe(self, num_bytes: int) -> dict:
        return {"num_bytes": num_bytes, "gbps": 1.0}


@pytest.fixture(scope="module")
def failing(ckpt):
    tokenizer = load_tokenizer(str(ckpt))
    srv = Server(create_app(IngressState(
        orchestrator=FailingOrchestrator(tokenizer.encode("Hi there")), tokenizer=tokenizer,
        model_name=MODEL, max_model_len=64, admin_api_key=ADMIN_KEY, enable_kv_probe=True)))
    yield srv
    srv.stop()


@pytest.mark.parametrize("mode,status,in_message", [
    (1, 500, "boom"), (2, 500, "KV transfer timed out"), (3, 503, "did not answer")])
def test_engine_failure_is_5xx(failing, mode, status, in_message):
    resp = httpx.post(failing.url + "/v1/completions", json={"prompt": [mode]})
    assert_error(resp, status, "server_error", in_message=in_message)
    streamed = httpx.post(failing.url + "/v1/completions", json={"prompt": [mode],
                                                                  "stream": True})
    assert_error(streamed, status, "server_error", in_message=in_message)  # before the stream


def test_error_mid_stream_is_an_error_event_then_close(failing):
    with httpx.stream("POST", failing.url + "/v1/completions",
                      json={"prompt": [4], "stream": True}) as resp:
        assert resp.status_code == 200
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert json.loads(data[0])["choices"][0]["text"] == "Hi there"
    assert json.loads(data[-1])["error"]["message"] == "generation failed: replica died"
    assert "[DONE]" not in data
    assert len(data) == 2


def test_unexpected_exception_is_500_without_details(failing):
    resp = httpx.get(failing.url + "/v1/mtpserve/stats")
    assert_error(resp, 500, "server_error", in_message="internal server error")
    assert "secret" not in resp.text
    probe = httpx.post(failing.url + "/v1/mtpserve/kv_probe", json={"num_bytes": 8},
                       headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert probe.json() == {"num_bytes": 8, "gbps": 1.0}
