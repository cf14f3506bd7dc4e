"""The ingress's state and what it checks before a request runs: model name, window, server
caps, token ids; then the request becomes its choices (one `GenerateRequest` each)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from mtpserve.router.auth import key_matches
from mtpserve.router.chat_template import apply_chat_template, check_template_kwargs
from mtpserve.router.errors import APIError
from mtpserve.router.generation import Choice, ChoiceSet
from mtpserve.router.limits import Limits
from mtpserve.router.protocol import (
    MAX_CHOICES,
    MTPStats,
    PromptTokensDetails,
    SamplingRequest,
    Usage,
)
from mtpserve.router.reasoning import END, START, Reasoner, resolve_parser, template_text
from mtpserve.router.tool_parsers import MARKERS
from mtpserve.router.types import Orchestrator
from mtpserve.workers.detokenizer import marker_skip_ids
from mtpserve.workers.messages import GenerateRequest
from mtpserve.workers.sampling_params import SamplingParams

_REDACTED_KEYS = ("addr", "host", "port", "peer", "store")
# Requests with more text than this are tokenized (and chat-templated) on a worker thread, so
# one large body never stalls the event loop that streams everyone's tokens.
_TOKENIZE_INLINE_CHARS = 8192


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
    token_healing: bool = False  # heal when a request leaves it unset (the model's default)
    tool_call_parser: str = "auto"  # the tool-call format (router.tool_parsers); auto: detect
    # Chat reasoning split (router.reasoning): the config's `reasoning_parser` and the
    # checkpoint's model_type, which `auto` reads with the chat template.
    reasoning_parser: str = "auto"
    model_type: str | None = None
    _reasoner: Any = field(default=None, init=False, repr=False)
    _skip_ids: dict = field(default_factory=dict, init=False, repr=False)

    def reasoner(self) -> Reasoner | None:
        """The reasoning parser bound to the tokenizer (None: output is not split)."""
        if self._reasoner is None:
            name = resolve_parser(self.reasoning_parser, self.model_type,
                                  template_text(self.tokenizer))
            self._reasoner = (False if name is None
                              else Reasoner.build(name, self.tokenizer))
        return self._reasoner or None

    def marker_skip_ids(self, tool_format: str | None, reasoning: bool
                        ) -> frozenset[int] | None:
        """How a chat choice is decoded: the tool-call format's markers (`tool_format`, tools
        active) and `<think>` / `</think>` (`reasoning`) kept as text where the checkpoint
        has them as special tokens, every other special token skipped; None: plain
        `skip_special_tokens` decoding (no kept marker is special). Cached per shape."""
        key = (tool_format, reasoning)
        if key not in self._skip_ids:
            markers = list(MARKERS.get(tool_format, ())) if tool_format else []
            if reasoning:
                markers += [START, END]
            self._skip_ids[key] = marker_skip_ids(self.tokenizer, markers) if markers else None
        return self._skip_ids[key]


def ingress_state(request: Request) -> IngressState:
    state = request.app.state.ingress
    if state is None:
        raise APIError("the server is starting", 503, code="service_unavailable")
    return state


def check_model(state: IngressState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise APIError(f"the model '{model}' does not exist; this server serves "
                       f"'{state.model_name}'", 404, param="model", code="model_not_found")


def check_window(state: IngressState, prompt_ids: list[int], param: str) -> None:
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


def check_max_tokens(state: IngressState, requested: int | None, param: str) -> None:
    cap = state.limits.max_tokens
    if requested is not None and requested > cap:
        raise APIError(f"'{param}' is {requested}; this server allows at most {cap}", 400,
                       param=param)


def check_token_ids(state: IngressState, ids: list[int], param: str) -> None:
    if not ids:
        return
    vocab = state.vocab_size
    if min(ids) < 0 or (vocab is not None and max(ids) >= vocab):
        what = param.replace("_", " ") if param != "prompt" else "prompt token ids"
        raise APIError(f"{what} must be in [0, {vocab})" if vocab is not None
                       else f"{what} must be >= 0", 400, param=param)


async def encode_prompts(state: IngressState, prompts: list[str | list[int]]
                         ) -> list[list[int]]:
    """Token ids of each prompt (text is tokenized, ids are kept), off the event loop when
    the texts are long."""

    def encode() -> list[list[int]]:
        return [list(state.tokenizer.encode(p)) if isinstance(p, str) else list(p)
                for p in prompts]

    if sum(len(p) for p in prompts if isinstance(p, str)) <= _TOKENIZE_INLINE_CHARS:
        return encode()
    return await asyncio.to_thread(encode)


async def render_chat(state: IngressState, messages: list[dict[str, Any]], *,
                      tools: list[dict] | None = None, add_generation_prompt: bool = True,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """The chat template applied to `messages` (token ids), off the event loop when long.
    `template_kwargs`: the request's `chat_template_kwargs` (a reserved name is a 400)."""
    try:
        check_template_kwargs(template_kwargs)
    except ValueError as e:
        raise APIError(str(e), 400, param="chat_template_kwargs") from None

    def render() -> list[int]:
        try:
            return apply_chat_template(state.tokenizer, messages, tools=tools,
                                       add_generation_prompt=add_generation_prompt,
                                       template_kwargs=template_kwargs)
        except Exception as e:  # a template may reject a conversation (roles must alternate)
            raise APIError(f"the chat template failed on these messages: {e}", 400,
                           param="messages") from None

    if sum(len(m.get("content") or "") for m in messages) <= _TOKENIZE_INLINE_CHARS:
        return render()
    return await asyncio.to_thread(render)


def max_tokens(state: IngressState, requested: int | None, prompt_len: int) -> int:
    """Clamp to the room left in the context window (None: all of it, within the server cap)."""
    room = state.max_model_len - prompt_len
    return min(room, state.limits.max_tokens) if requested is None else min(requested, room)


def is_admin(state: IngressState, request: Request) -> bool:
    return key_matches(request.headers.get("authorization"), state.admin_api_key)


def redact(stats: Any) -> Any:
    """Stats without network addresses (stores, senders, peers): what a non-admin may see."""
    if isinstance(stats, dict):
        return {k: redact(v) for k, v in stats.items()
                if not any(word in str(k).lower() for word in _REDACTED_KEYS)}
    if isinstance(stats, list):
        return [redact(v) for v in stats]
    return stats


def check_choices(state: IngressState, num_prompts: int, n: int) -> None:
    """The choice caps, checked before any prompt is tokenized."""
    if n > state.limits.max_n:
        raise APIError(f"'n' is {n}; this server allows at most {state.limits.max_n}", 400,
                       param="n")
    if num_prompts * n > MAX_CHOICES:
        raise APIError(f"at most {MAX_CHOICES} choices per request (prompts x n)", 400,
                       param="n")


def build_choices(state: IngressState, body: SamplingRequest, response_id: str,
             prompts: list[list[int]], max_tokens: list[int],
             skip_ids: frozenset[int] | None = None) -> list[Choice]:
    n = body.n or 1
    check_choices(state, len(prompts), n)
    choices = []
    for p, ids in enumerate(prompts):
        for i in range(n):
            index = p * n + i
            try:
                params = SamplingParams(
                    max_tokens=max_tokens[p],
                    temperature=1.0 if body.temperature is None else body.temperature,
                    top_p=1.0 if body.top_p is None else body.top_p,
                    top_k=body.top_k or 0,
                    seed=None if body.seed is None else body.seed + index,
                    ignore_eos=bool(body.ignore_eos),
                    num_speculative_tokens=body.mtp.cap if body.mtp else None,
                    **body.generate_options(),  # stop_token_ids, min_tokens, logprobs
                )
            except ValueError as e:  # the protocol's bounds should have caught it first
                raise APIError(str(e), 400) from None
            request = GenerateRequest(f"{response_id}-{index}", ids, params,
                                      disaggregate=body.disaggregate)
            choices.append(Choice(index, request, state.tokenizer, body.stop_strings,
                                  skip_ids))
    return choices


def usage_of(prompts: list[list[int]], choices: ChoiceSet) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion_tokens = sum(c.num_output_tokens for c in choices.choices)
    # A prompt is counted once; its cached tokens are those of the choice that found the
    # least (with n > 1 one choice computes the prompt, the others reuse its blocks).
    n = max(len(choices.choices) // max(len(prompts), 1), 1)
    cached = sum(min(c.num_cached_tokens for c in choices.choices[i * n : (i + 1) * n])
                 for i in range(len(prompts)) if choices.choices[i * n : (i + 1) * n])
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def total_mtp_stats(choices: ChoiceSet) -> MTPStats:
    return MTPStats.total([c.mtp_stats() for c in choices.choices])
