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
- Structured outputs (`response_format`, `structured_outputs`), tools (`tools`, `tool_choice`)
  and token healing: router.structured and router.tools; a constraint that does not compile
  (or not in time) is a 400 naming the problem. `POST /tokenize` and `POST /detokenize` take
  and return vLLM's shapes.

Routes read `app.state.ingress` per request, so the state may also be set after the app is built.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from mtpserve.router.auth import APIKeyMiddleware
from mtpserve.router.errors import APIError, install_error_handlers
from mtpserve.router.ingress_state import (
    IngressState,
    check_model,
    check_token_ids,
    encode_prompts,
    ingress_state,
    is_admin,
    redact,
    render_chat,
)
from mtpserve.router.limits import AdmissionGate, LimitsMiddleware
from mtpserve.router.metrics_api import (
    metrics_data,
    metrics_router,
    orchestrator_totals,
    replica_caches,
)
from mtpserve.router.pipeline import CHAT, COMPLETION, admit, respond
from mtpserve.router.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    KVProbeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from mtpserve.router.responses import json_response
from mtpserve.router.structured import (
    guided_spec,
    healing_default,
    one_spec,
    response_format_spec,
    structured_outputs_spec,
)
from mtpserve.router.tools import (
    check_tools,
    default_tool_messages,
    history_message,
    render_with_tools,
    served_format,
    template_renders_tools,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


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
        s = ingress_state(request)
        return json_response(ModelList(data=[ModelCard(id=s.model_name, created=int(time.time()),
                                               max_model_len=s.max_model_len)]))

    @app.get("/v1/mtpserve/stats")
    async def stats(request: Request) -> JSONResponse:
        s = ingress_state(request)
        out = await s.orchestrator.stats()
        data = await metrics_data(request)
        # Every replica's prefix cache (the sampled replicas above are one per role), and the
        # orchestrator's counters over every ingress replica (this one's alone otherwise).
        out["replicas"] = replica_caches(data)
        if "orchestrator" in out:  # the disaggregated orchestrator's counters
            out["orchestrator"] = orchestrator_totals(
                data, out["orchestrator"], getattr(s.orchestrator, "replica_key", None))
        return JSONResponse(out if is_admin(s, request) else redact(out))

    @app.post("/v1/mtpserve/kv_probe")
    async def kv_probe(body: KVProbeRequest, request: Request) -> JSONResponse:
        s = ingress_state(request)
        if not s.enable_kv_probe:
            raise APIError("kv_probe is disabled on this server (admin.enable_kv_probe)", 404,
                           code="not_found")
        if not is_admin(s, request):
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
        s = ingress_state(request)
        admit(s, body, len(body.prompts), "max_tokens")
        named = [("structured_outputs", structured_outputs_spec(body.structured_outputs)),
                 guided_spec(body)]
        spec = one_spec(*named)
        param = next((n for n, x in named if x is not None), "")
        prompts = await encode_prompts(s, body.prompts)
        heal = healing_default(s) if body.token_healing is None else body.token_healing
        return await respond(request, s, body, prompts, COMPLETION,
                             body.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS,
                             spec=None if spec is None else (param, spec),
                             healing=[heal and isinstance(p, str) for p in body.prompts],
                             heal_any=body.token_healing is not None)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        s = ingress_state(request)
        admit(s, body, 1, "max_completion_tokens" if body.max_completion_tokens
              else "max_tokens")
        tools = check_tools(body.tools, body.tool_choice, body.parallel_tool_calls,
                            served_format(s.tool_call_parser, s.tokenizer))
        rf = response_format_spec(body.response_format)
        tool_param = "tool_choice"
        if tools is not None and tools.active and rf is not None:
            # Compose: under auto a call or the schema's JSON; forced: the calls alone.
            tool_spec, rf = tools.spec(content=rf), None
            tool_param = "tool_choice" if tools.forces() else "response_format"
        else:
            tool_spec = tools.spec() if tools is not None else None
        named = [("response_format", rf),
                 ("structured_outputs", structured_outputs_spec(body.structured_outputs)),
                 guided_spec(body), (tool_param, tool_spec)]
        spec = one_spec(*named)
        param = next((n for n, x in named if x is not None), "")
        kwargs = body.chat_template_kwargs
        if tools is not None or any(m.tool_calls for m in body.messages):
            ids = await _render_tools(s, body, tools, kwargs)
        else:
            ids = await render_chat(s, [{"role": m.role, "content": m.text}
                                        for m in body.messages], template_kwargs=kwargs)
        return await respond(request, s, body, [ids], CHAT, body.max_output_tokens,
                             spec=None if spec is None else (param, spec), tools=tools,
                             reasoning=s.reasoner(), template_kwargs=kwargs)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
        s = ingress_state(request)
        check_model(s, body.model)
        tok = s.tokenizer
        if body.messages is not None:
            # The prompt a chat completion of these messages (and tools) would run.
            msgs = [history_message(m) for m in body.messages]
            tools = check_tools(body.tools, None, None,
                                served_format(s.tool_call_parser, tok)) if body.tools else None
            opts = dict(add_generation_prompt=body.add_generation_prompt,
                        template_kwargs=body.chat_template_kwargs)
            if tools is None and not any(m.tool_calls for m in body.messages):
                ids = await render_chat(s, [{"role": m["role"], "content": m["content"]}
                                            for m in msgs], **opts)
            elif template_renders_tools(tok):
                ids = await render_chat(s, msgs, tools=tools.tools if tools else None, **opts)
            else:
                ids = await render_chat(s, default_tool_messages(msgs, tools), **opts)
        else:
            ids = await asyncio.to_thread(
                lambda: list(tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)))
        strs = tok.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return json_response(TokenizeResponse(count=len(ids), max_model_len=s.max_model_len,
                                              tokens=ids, token_strs=strs))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
        s = ingress_state(request)
        check_model(s, body.model)
        check_token_ids(s, list(body.tokens), "tokens")
        text = await asyncio.to_thread(s.tokenizer.decode, list(body.tokens))
        return json_response(DetokenizeResponse(prompt=text))

    return app


async def _render_tools(s: IngressState, body: ChatCompletionRequest, tools: Any,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids of a conversation with tools or tool calls (router.tools), on a thread.
    With `chat_template_kwargs`, a template that renders tools gets them too."""
    msgs = [history_message(m) for m in body.messages]
    if template_kwargs and template_renders_tools(s.tokenizer):
        active = tools is not None and tools.active
        return await render_chat(s, msgs, tools=tools.tools if active else None,
                                 template_kwargs=template_kwargs)
    try:
        return await asyncio.to_thread(render_with_tools, s.tokenizer, msgs, tools)
    except APIError:
        raise
    except Exception as e:  # a template may reject a conversation
        raise APIError(f"the chat template failed on these messages: {e}", 400,
                       param="messages") from None
