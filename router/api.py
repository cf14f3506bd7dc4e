"""The OpenAI-compatible HTTP API as a FastAPI app over any `Orchestrator`.

`create_app(IngressState(...))` wires the routes; the Serve ingress and the tests build it the
same way. Behaviour clients can rely on:

- Prompts are tokenized once, here. A prompt of `max_model_len` tokens or more is a 400 naming
  the limit (`code: context_length_exceeded`): prompt + at least one generated token must fit.
- `max_tokens` (default 16 for completions; the rest of the window for chat) beyond the window is
  CLAMPED to `max_model_len - prompt_tokens`, not rejected; such a choice ends with
  finish_reason "length" at the window's edge.
- Server caps (router.limits.Limits, from the config's `limits:`): `max_tokens` above
  `limits.max_tokens`, `n` above `limits.max_n` or a prompt above `limits.max_prompt_tokens` is a
  400 naming the limit; prompt token ids outside the vocabulary are a 400. Bodies above
  `max_request_bytes` are a 413 and too many requests in flight a 429 with Retry-After
  (router.limits, before the body is parsed).
- `/v1/mtpserve/stats` hides network addresses unless the admin key is presented;
  `/v1/mtpserve/kv_probe` is off unless enabled, needs the admin key, and is capped in size.
- `model` may be omitted; any name other than the served one is a 404 `model_not_found`.
- `n` choices (per prompt) are n independent `GenerateRequest`s with request ids `{id}-{index}`,
  run concurrently; with a `seed`, choice i uses `seed + i` so the choices differ.
- Stop strings end a choice with finish_reason "stop" and close its upstream stream, which
  aborts the request there; a client that disconnects does the same for every choice.
- Errors are OpenAI-style JSON (router.errors); a stream that fails after it started sends one
  `data: {"error": ...}` event and closes without `[DONE]`.
- Extensions (`mtp`, `ignore_eos`, `return_token_ids`; `mtp_stats` in responses): router.protocol.

Routes read `app.state.ingress` per request, so the state may also be set after the app is built.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from mtpserve.router.auth import APIKeyMiddleware, key_matches
from mtpserve.router.chat_template import apply_chat_template
from mtpserve.router.errors import APIError, install_error_handlers
from mtpserve.router.generation import Choice, ChoiceSet
from mtpserve.router.limits import AdmissionGate, Limits, LimitsMiddleware
from mtpserve.router.metrics_api import metrics_router
from mtpserve.router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    KVProbeRequest,
    ModelCard,
    ModelList,
    MTPStats,
    SamplingRequest,
    Usage,
)
from mtpserve.router.types import Orchestrator
from mtpserve.workers.messages import GenerateRequest
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 64  # prompts x n in one request
_TOKENIZE_INLINE_CHARS = 8192  # longer prompts are tokenized off the event loop
_REDACTED_KEYS = ("addr", "host", "port", "peer", "store")


@dataclass
class IngressState:
    """What the HTTP layer needs: the backend, the tokenizer and the served model's limits."""

    orchestrator: Orchestrator
    tokenizer: Any  # a `transformers` tokenizer
    model_name: str
    max_model_len: int
    api_key: str | None = None
    admin_api_key: str | None = None
    vocab_size: int | None = None  # None: the engine checks token ids
    limits: Limits = field(default_factory=Limits)
    enable_kv_probe: bool = False
    kv_probe_max_bytes: int = 16 << 20


# Request → choices ---------------------------------------------------------------------------
def _state(request: Request) -> IngressState:
    state = request.app.state.ingress
    if state is None:
        raise APIError("the server is starting", 503, code="service_unavailable")
    return state


def _check_model(state: IngressState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(f"the model '{model}' does not exist; this server serves "
                       f"'{state.model_name}'", 404, param="model", code="model_not_found")


def _check_window(state: IngressState, prompt_ids: list[int], param: str) -> None:
    if not prompt_ids:
        raise APIError("the prompt is empty", 400, param=param)
    cap = state.limits.max_prompt_tokens
    if cap is not None and len(prompt_ids) > cap:
        raise APIError(f"the prompt has {len(prompt_ids)} tokens; this server accepts at most "
                       f"{cap}", 400, param=param, code="context_length_exceeded")
    if len(prompt_ids) >= state.max_model_len:
        raise APIError(
            f"this model's maximum context length is {state.max_model_len} tokens, but the "
            f"prompt has {len(prompt_ids)} tokens (the prompt and at least one generated token "
            "must fit)", 400, param=param, code="context_length_exceeded")


def _check_max_tokens(state: IngressState, requested: int | None, param: str) -> None:
    cap = state.limits.max_tokens
    if requested is not None and requested > cap:
        raise APIError(f"'{param}' is {requested}; this server allows at most {cap}", 400,
                       param=param)


def _check_token_ids(state: IngressState, ids: list[int], param: str) -> None:
    if not ids:
        return
    vocab = state.vocab_size
    if min(ids) < 0 or (vocab is not None and max(ids) >= vocab):
        raise APIError(f"prompt token ids must be in [0, {vocab})" if vocab is not None
                       else "prompt token ids must be >= 0", 400, param=param)


async def _encode(state: IngressState, text: str) -> list[int]:
    if len(text) <= _TOKENIZE_INLINE_CHARS:
        return list(state.tokenizer.encode(text))
    return list(await asyncio.to_thread(state.tokenizer.encode, text))


def _max_tokens(state: IngressState, requested: int | None, prompt_len: int) -> int:
    """Clamp to the room left in the context window (None: all of it, within the server cap)."""
    room = state.max_model_len - prompt_len
    return min(room, state.limits.max_tokens) if requested is None else min(requested, room)


def _is_admin(state: IngressState, request: Request) -> bool:
    return key_matches(request.headers.get("authorization"), state.admin_api_key)


def redact(stats: Any) -> Any:
    """Stats without network addresses (stores, senders, peers): what a non-admin may see."""
    if isinstance(stats, dict):
        return {k: redact(v) for k, v in stats.items()
                if not any(word in str(k).lower() for word in _REDACTED_KEYS)}
    if isinstance(stats, list):
        return [redact(v) for v in stats]
    return stats


def _choices(state: IngressState, body: SamplingRequest, response_id: str,
             prompts: list[list[int]], max_tokens: list[int]) -> list[Choice]:
    n = body.n or 1
    if n > state.limits.max_n:
        raise APIError(f"'n' is {n}; this server allows at most {state.limits.max_n}", 400,
                       param="n")
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(f"at most {MAX_CHOICES} choices per request (prompts x n)", 400,
                       param="n")
    choices = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            request = GenerateRequest(
                request_id=f"{response_id}-{index}", prompt_token_ids=ids,
                max_tokens=max_tokens[p],
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                seed=None if body.seed is None else body.seed + index,
                ignore_eos=bool(body.ignore_eos),
                num_speculative_tokens=body.mtp.cap if body.mtp else None,
                **body.generate_options(),  # stop_token_ids, min_tokens, logprobs
            )
            choices.append(Choice(index, request, state.tokenizer, body.stop_strings))
    return choices


def _usage(prompts: list[list[int]], choices: ChoiceSet) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices.choices)
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens)


def _total_stats(choices: ChoiceSet) -> MTPStats:
    return MTPStats.total([c.mtp_stats() for c in choices.choices])


def _json(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", exclude_none=True))


def _sse(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


# Running -----------------------------------------------------------------------------------
async def _cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it when the client disconnects first (vLLM's pattern)."""
    task = asyncio.ensure_future(work)
    disconnected = False

    async def watch() -> None:
        nonlocal disconnected
        while (await request.receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        task.cancel()

    watcher = asyncio.create_task(watch())
    try:
        return await task
    except asyncio.CancelledError:
        if disconnected:
            raise APIError("client disconnected", 499) from None
        raise
    finally:
        watcher.cancel()


async def _run(request: Request, choices: ChoiceSet) -> None:
    """Non-streaming: every choice to its end; upstreams are closed whatever happens."""
    choices.start()
    try:
        await _cancel_on_disconnect(request, choices.run_to_end())
    finally:
        await choices.close()


class SSEResponse(StreamingResponse):
    """A text/event-stream whose `on_close` runs however the response ends (done, error, client
    gone): the event generator may be left suspended at a `yield`, so it cannot own cleanup."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._on_close()
            finally:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()


async def _stream(request: Request, choices: ChoiceSet,
                  events: Callable[[], AsyncIterator[str]]) -> SSEResponse:
    """Start the choices and wait for each one's first chunk, so a request the backend refuses
    still gets a proper status code; then stream."""
    choices.start()
    try:
        await _cancel_on_disconnect(request, choices.wait_first())
    except BaseException:
        await choices.close()
        raise
    return SSEResponse(_guarded(events()), choices.close)


async def _guarded(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn a failure mid-stream into one error event (then the stream ends)."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield e.sse()
    except Exception:
        logger.exception("streaming failed")
        yield APIError("internal server error", 500, type="server_error").sse()


# App ---------------------------------------------------------------------------------------
def create_app(state: IngressState | None = None) -> FastAPI:
    """The FastAPI app serving the OpenAI API subset over `state.orchestrator`."""
    app = FastAPI(title="mtpserve", summary="OpenAI-compatible API with MTP speculative decoding")
    app.state.ingress = state
    app.state.gate = AdmissionGate()
    install_error_handlers(app)
    app.include_router(metrics_router())  # GET /metrics (Prometheus, all replicas)
    # Added first = inner: the key is checked before the body is read or counted.
    app.add_middleware(LimitsMiddleware, gate=app.state.gate,
                       get_limits=lambda: getattr(app.state.ingress, "limits", None))
    app.add_middleware(APIKeyMiddleware, get_keys=lambda: (
        getattr(app.state.ingress, "api_key", None),
        getattr(app.state.ingress, "admin_api_key", None)))

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        if request.app.state.ingress is None:
            return JSONResponse({"status": "starting"}, status_code=503)
        if request.app.state.gate.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        s = _state(request)
        return _json(ModelList(data=[ModelCard(id=s.model_name, created=int(time.time()),
                                               max_model_len=s.max_model_len)]))

    @app.get("/v1/mtpserve/stats")
    async def stats(request: Request) -> JSONResponse:
        s = _state(request)
        out = await s.orchestrator.stats()
        return JSONResponse(out if _is_admin(s, request) else redact(out))

    @app.post("/v1/mtpserve/kv_probe")
    async def kv_probe(body: KVProbeRequest, request: Request) -> JSONResponse:
        s = _state(request)
        if not s.enable_kv_probe:
            raise APIError("kv_probe is disabled on this server (admin.enable_kv_probe)", 404,
                           code="not_found")
        if not _is_admin(s, request):
            raise APIError("kv_probe needs the admin key", 403, code="permission_denied")
        if body.num_bytes > s.kv_probe_max_bytes:
            raise APIError(f"num_bytes is {body.num_bytes}; at most {s.kv_probe_max_bytes}",
                           400, param="num_bytes")
        try:
            return JSONResponse(await s.orchestrator.kv_probe(body.num_bytes))
        except NotImplementedError as e:
            raise APIError(str(e) or "this backend has no KV channel to probe", 501,
                           code="not_implemented") from None

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        s = _state(request)
        body.check_supported()
        _check_model(s, body.model)
        _check_max_tokens(s, body.max_tokens, "max_tokens")
        prompts = []
        for p in body.prompts:
            ids = await _encode(s, p) if isinstance(p, str) else list(p)
            _check_token_ids(s, ids, "prompt")
            _check_window(s, ids, "prompt")
            prompts.append(ids)
        requested = body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        choices = ChoiceSet(s.orchestrator, _choices(
            s, body, rid, prompts, [_max_tokens(s, requested, len(p)) for p in prompts]))
        want_ids = bool(body.return_token_ids)

        def chunk(cs: list[CompletionChoice], **kw: Any) -> CompletionResponse:
            return CompletionResponse(id=rid, created=created, model=s.model_name, choices=cs,
                                      **kw)

        if body.stream:
            async def events() -> AsyncIterator[str]:
                while (ev := await choices.next_event()) is not None:
                    if ev.text or ev.finish_reason or (
                            (want_ids or ev.choice.wants_logprobs) and ev.token_ids):
                        yield _sse(chunk([CompletionChoice(
                            index=ev.choice.index, text=ev.text, finish_reason=ev.finish_reason,
                            logprobs=ev.choice.completion_logprobs(ev.logprobs),
                            token_ids=ev.token_ids if want_ids else None,
                            mtp_stats=ev.choice.mtp_stats() if ev.finish_reason else None)]))
                if body.include_usage:
                    yield _sse(chunk([], usage=_usage(prompts, choices),
                                     mtp_stats=_total_stats(choices)))
                yield "data: [DONE]\n\n"

            return await _stream(request, choices, events)

        await _run(request, choices)
        return _json(chunk(
            [CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                              logprobs=c.completion_logprobs(c.logprobs),
                              token_ids=c.token_ids if want_ids else None,
                              mtp_stats=c.mtp_stats()) for c in choices.choices],
            usage=_usage(prompts, choices), mtp_stats=_total_stats(choices),
            prompt_token_ids=prompts if want_ids else None))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        s = _state(request)
        body.check_supported()
        _check_model(s, body.model)
        _check_max_tokens(s, body.max_output_tokens, "max_completion_tokens"
                          if body.max_completion_tokens else "max_tokens")
        messages = [{"role": m.role, "content": m.text} for m in body.messages]
        try:
            ids = apply_chat_template(s.tokenizer, messages)
        except Exception as e:  # a template may reject a conversation (roles must alternate)
            raise APIError(f"the chat template failed on these messages: {e}", 400,
                           param="messages") from None
        _check_window(s, ids, "messages")
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        choices = ChoiceSet(s.orchestrator, _choices(
            s, body, rid, [ids], [_max_tokens(s, body.max_output_tokens, len(ids))]))
        want_ids = bool(body.return_token_ids)

        def chunk(cs: list[ChatStreamChoice], **kw: Any) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, created=created, model=s.model_name, choices=cs,
                                       **kw)

        if body.stream:
            async def events() -> AsyncIterator[str]:
                for c in choices.choices:  # OpenAI opens each choice with the role
                    yield _sse(chunk([ChatStreamChoice(
                        index=c.index, delta=DeltaMessage(role="assistant", content=""))]))
                while (ev := await choices.next_event()) is not None:
                    if ev.text or ev.finish_reason or (
                            (want_ids or ev.choice.wants_logprobs) and ev.token_ids):
                        yield _sse(chunk([ChatStreamChoice(
                            index=ev.choice.index, delta=DeltaMessage(content=ev.text or None),
                            finish_reason=ev.finish_reason,
                            logprobs=ev.choice.chat_logprobs(ev.logprobs),
                            token_ids=ev.token_ids if want_ids else None,
                            mtp_stats=ev.choice.mtp_stats() if ev.finish_reason else None)]))
                if body.include_usage:
                    yield _sse(chunk([], usage=_usage([ids], choices),
                                     mtp_stats=_total_stats(choices)))
                yield "data: [DONE]\n\n"

            return await _stream(request, choices, events)

        await _run(request, choices)
        return _json(ChatCompletionResponse(
            id=rid, created=created, model=s.model_name,
            choices=[ChatChoice(index=c.index, message=AssistantMessage(content=c.text),
                                finish_reason=c.finish_reason,
                                logprobs=c.chat_logprobs(c.logprobs),
                                token_ids=c.token_ids if want_ids else None,
                                mtp_stats=c.mtp_stats()) for c in choices.choices],
            usage=_usage([ids], choices), mtp_stats=_total_stats(choices),
            prompt_token_ids=ids if want_ids else None))

    return app
