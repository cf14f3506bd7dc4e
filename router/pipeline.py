"""The one pipeline behind `/v1/completions` and `/v1/chat/completions`.

Both endpoints check the body, turn it into prompts (token ids), run the choices and answer as a
stream of SSE chunks or as one JSON response. Only the shapes differ: a `Shape` says how a choice
is written in a chunk and in the final response, and what opens a stream (chat announces the
assistant role first). Everything else (caps, window checks, choices, usage, streaming, errors)
is written once here.

Constraints ride along the same way: the caller passes the request's `StructuredSpec` (from
`response_format`, `structured_outputs` or a forced tool choice), compiled here first (a 400 if
it does not compile in time), and the chat shape turns `<tool_call>` blocks into `tool_calls`
(whole, or as streamed deltas) when the request has tools. Token healing (text prompts of
completions) backs off each prompt's healable tail; the choice strips the re-generated tail
from its text, so the client sees a plain continuation.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from mtpserve.router.generation import Choice, ChoiceEvent, ChoiceSet
from mtpserve.router.ingress_state import (
    IngressState,
    build_choices,
    check_choices,
    check_max_tokens,
    check_model,
    check_token_ids,
    check_window,
    max_tokens,
    total_mtp_stats,
    usage_of,
)
from mtpserve.router.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatStreamChoice,
    CompletionChoice,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    SamplingRequest,
    ToolCall,
)
from mtpserve.router.reasoning import Reasoner
from mtpserve.router.responses import json_response, run_to_end, sse_event, stream_response
from mtpserve.router.structured import check_compiles, heal
from mtpserve.router.tools import ToolCallStream, ToolSetup, parse_tool_calls
from mtpserve.workers.structured.spec import StructuredSpec


@dataclass
class Call:
    """One API call on its way: the body, its prompts and the choices running them."""

    state: IngressState
    body: SamplingRequest
    prompts: list[list[int]]
    response_id: str
    created: int
    choices: ChoiceSet
    tools: ToolSetup | None = None  # chat with tools (tool_choice not "none")
    tool_streams: dict[int, ToolCallStream] = dataclasses.field(default_factory=dict)

    @property
    def want_ids(self) -> bool:
        return bool(self.body.return_token_ids)

    @property
    def parses_tools(self) -> bool:
        return self.tools is not None and self.tools.active


class Shape:
    """How one endpoint writes choices, chunks and responses."""

    id_prefix: str
    param: str  # what a prompt error names: "prompt" or "messages"

    def opening(self, call: Call) -> list[BaseModel]:
        return []

    def stream_choice(self, call: Call, ev: ChoiceEvent) -> BaseModel:
        raise NotImplementedError

    def stream_choices(self, call: Call, ev: ChoiceEvent) -> list[BaseModel]:
        """The stream choices (one chunk each) an event makes."""
        return [self.stream_choice(call, ev)]

    def chunk(self, call: Call, choices: list[Any], **kw: Any) -> BaseModel:
        raise NotImplementedError

    def response(self, call: Call) -> BaseModel:
        raise NotImplementedError


class CompletionShape(Shape):
    id_prefix, param = "cmpl", "prompt"

    def stream_choice(self, call: Call, ev: ChoiceEvent) -> CompletionChoice:
        return CompletionChoice(
            index=ev.choice.index, text=ev.text, finish_reason=ev.finish_reason,
            logprobs=ev.choice.completion_logprobs(ev.logprobs),
            token_ids=ev.token_ids if call.want_ids else None,
            mtp_stats=ev.choice.mtp_stats() if ev.finish_reason else None,
            mtpserve_trace=ev.trace())

    def chunk(self, call: Call, choices: list[Any], **kw: Any) -> CompletionResponse:
        return CompletionResponse(id=call.response_id, created=call.created,
                                  model=call.state.model_name, choices=choices, **kw)

    def response(self, call: Call) -> CompletionResponse:
        return self.chunk(call, [
            CompletionChoice(index=c.index, text=c.text, finish_reason=c.finish_reason,
                             logprobs=c.completion_logprobs(c.logprobs),
                             token_ids=c.token_ids if call.want_ids else None,
                             mtp_stats=c.mtp_stats()) for c in call.choices.choices],
            usage=usage_of(call.prompts, call.choices),
            mtp_stats=total_mtp_stats(call.choices),
            prompt_token_ids=call.prompts if call.want_ids else None)


class ChatShape(Shape):
    id_prefix, param = "chatcmpl", "messages"

    def opening(self, call: Call) -> list[BaseModel]:
        # OpenAI opens each choice with the role.
        return [self.chunk(call, [ChatStreamChoice(
            index=c.index, delta=DeltaMessage(role="assistant", content=""))])
            for c in call.choices.choices]

    def stream_choice(self, call: Call, ev: ChoiceEvent) -> ChatStreamChoice:
        return ChatStreamChoice(
            index=ev.choice.index, delta=DeltaMessage(content=ev.text or None,
                                                      **_reasoning(ev.reasoning)),
            finish_reason=ev.finish_reason, logprobs=ev.choice.chat_logprobs(ev.logprobs),
            token_ids=ev.token_ids if call.want_ids else None,
            mtp_stats=ev.choice.mtp_stats() if ev.finish_reason else None,
            mtpserve_trace=ev.trace())

    def stream_choices(self, call: Call, ev: ChoiceEvent) -> list[BaseModel]:
        if not call.parses_tools:
            return [self.stream_choice(call, ev)]
        i = ev.choice.index
        stream = call.tool_streams.setdefault(i, ToolCallStream(call.tools))
        out: list[BaseModel] = []
        if ev.reasoning:  # the reasoning comes before any content or call it precedes
            out.append(ChatStreamChoice(index=i, delta=DeltaMessage(**_reasoning(ev.reasoning))))
        for d in stream.feed(ev.text, final=ev.finish_reason is not None):
            if d.content is not None:
                delta = DeltaMessage(content=d.content)
            else:
                delta = DeltaMessage(tool_calls=[DeltaToolCall(
                    index=d.index, id=d.id, type="function" if d.id else None,
                    function=DeltaFunctionCall(name=d.name, arguments=d.arguments))])
            out.append(ChatStreamChoice(index=i, delta=delta))
        if ev.finish_reason or not out:
            last = self.stream_choice(call, ev)
            last.delta = DeltaMessage()
            if ev.finish_reason and stream.num_calls:
                last.finish_reason = "tool_calls"
            if ev.finish_reason or call.want_ids or ev.choice.wants_logprobs:
                out.append(last)
        return out

    def chunk(self, call: Call, choices: list[Any], **kw: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=call.response_id, created=call.created,
                                   model=call.state.model_name, choices=choices, **kw)

    def response(self, call: Call) -> ChatCompletionResponse:
        def choice(c: Choice) -> ChatChoice:
            reasoning = _reasoning(c.reasoning_text)
            # With a reasoning block, content that is only whitespace is no content.
            content = c.text if not reasoning or c.text.strip() else None
            message, finish = AssistantMessage(content=content, **reasoning), c.finish_reason
            if call.parses_tools:
                content, calls = parse_tool_calls(c.text, call.tools)
                if calls:
                    message = AssistantMessage(content=content, **reasoning, tool_calls=[
                        ToolCall(id=t.id, function=FunctionCall(name=t.name,
                                                                arguments=t.arguments))
                        for t in calls])
                    finish = "tool_calls"
            return ChatChoice(index=c.index, message=message, finish_reason=finish,
                              logprobs=c.chat_logprobs(c.logprobs),
                              token_ids=c.token_ids if call.want_ids else None,
                              mtp_stats=c.mtp_stats())

        (ids,) = call.prompts
        return ChatCompletionResponse(
            id=call.response_id, created=call.created, model=call.state.model_name,
            choices=[choice(c) for c in call.choices.choices],
            usage=usage_of(call.prompts, call.choices),
            mtp_stats=total_mtp_stats(call.choices),
            prompt_token_ids=ids if call.want_ids else None)


COMPLETION, CHAT = CompletionShape(), ChatShape()


def _reasoning(text: str | None) -> dict[str, str]:
    """The reasoning fields of a message or delta: vLLM's `reasoning_content` and its
    current name `reasoning`, the same text."""
    return {"reasoning_content": text, "reasoning": text} if text else {}


def admit(state: IngressState, body: SamplingRequest, num_prompts: int,
          max_tokens_param: str) -> None:
    """The checks that need no tokenizer, before any prompt is tokenized."""
    body.check_supported()
    check_model(state, body.model)
    check_max_tokens(state, body.max_output_tokens, max_tokens_param)
    check_token_ids(state, list(body.stop_token_ids or []), "stop_token_ids")
    check_choices(state, num_prompts, body.n or 1)


def _in_reasoning(body: SamplingRequest) -> bool:
    """`structured_outputs.enable_in_reasoning` (vLLM's name): the constraint covers the
    reasoning block too (a grammar written for the whole output)."""
    so = getattr(body, "structured_outputs", None)
    return bool(so.get("enable_in_reasoning")) if isinstance(so, dict) else False


async def respond(request: Request, state: IngressState, body: SamplingRequest,
                  prompts: list[list[int]], shape: Shape, requested: int | None,
                  spec: tuple[str, StructuredSpec] | None = None,
                  tools: ToolSetup | None = None, healing: list[bool] | None = None,
                  heal_any: bool = True, reasoning: Reasoner | None = None,
                  template_kwargs: dict[str, Any] | None = None) -> Any:
    """Run `prompts` (token ids) with `body`'s settings; `requested`: the max_tokens asked for
    (None: the rest of the window). `spec`: (the parameter it came from, the constraint);
    `healing[i]`: heal prompt i (`heal_any`: any healable tail, else line breaks only).
    `reasoning`: split each choice's reasoning off its content (chat; `template_kwargs` are the
    request's `chat_template_kwargs`, which deepseek_v3 reads). A stream of SSE chunks, or one
    JSON response."""
    for ids in prompts:
        check_token_ids(state, ids, shape.param)
        check_window(state, ids, shape.param)
    if spec is not None:
        await check_compiles(state, spec[1], spec[0])
    healed = [heal(state, ids, heal_any) if healing and healing[i] and spec is None
              else (ids, None, "") for i, ids in enumerate(prompts)]
    rid = f"{shape.id_prefix}-{uuid.uuid4().hex}"
    # Chat with tools or a reasoning parser: their markers decode as text, special or not.
    skip_ids = state.marker_skip_ids(tools.format if tools is not None and tools.active
                                     else None, reasoning is not None)
    built = build_choices(state, body, rid, [h[0] for h in healed],
                          [max_tokens(state, requested, len(h[0])) for h in healed], skip_ids)
    n = len(built) // max(len(prompts), 1)
    for c in built:
        _, prefix, text = healed[c.index // n]
        constraint = spec[1] if spec is not None else prefix
        if constraint is not None:
            c.request.params = dataclasses.replace(c.request.params, structured=constraint)
        c.strip_prefix = text
        if reasoning is not None:
            c.reasoning = reasoning.split(c.request.prompt_token_ids, template_kwargs,
                                          skip_ids)
            if spec is not None and not _in_reasoning(body):  # grammar after the block
                after, opener = reasoning.grammar_gate(c.request.prompt_token_ids,
                                                       template_kwargs)
                c.request.params = dataclasses.replace(
                    c.request.params, structured_after=after, structured_opener=opener)
    choices = ChoiceSet(state.orchestrator, built)
    call = Call(state, body, prompts, rid, int(time.time()), choices, tools)
    if body.stream:
        async def events() -> AsyncIterator[str]:
            for opening in shape.opening(call):
                yield sse_event(opening)
            while (ev := await choices.next_event()) is not None:
                if ev.text or ev.reasoning or ev.finish_reason or (
                        (call.want_ids or ev.choice.wants_logprobs) and ev.token_ids):
                    for sc in shape.stream_choices(call, ev):
                        yield sse_event(shape.chunk(call, [sc]))
            if body.include_usage:
                yield sse_event(shape.chunk(call, [], usage=usage_of(prompts, choices),
                                            mtp_stats=total_mtp_stats(choices)))
            yield "data: [DONE]\n\n"

        return await stream_response(request, choices, events)
    await run_to_end(request, choices)
    return json_response(shape.response(call))
