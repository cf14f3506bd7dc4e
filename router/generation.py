"""Running the choices of one API request against the orchestrator.

Each `Choice` is one `GenerateRequest` streamed from `Orchestrator.generate`; its tokens go
through the incremental detokenizer and the stop-string matcher. A `ChoiceSet` pumps every choice
in its own task into one queue, so the n choices run concurrently and a stream interleaves them.
`ChoiceSet.close()` cancels the pumps, and each pump closes (`aclose()`) its upstream generator,
which aborts the request upstream and frees its KV blocks: the one cleanup path for normal ends,
stop strings, errors and client disconnects.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from mtpserve.router.errors import APIError, from_exception
from mtpserve.router.protocol import (
    ChatLogprobs,
    ChatLogprobToken,
    CompletionLogprobs,
    MTPStats,
    TopLogprob,
)
from mtpserve.router.reasoning import ReasoningSplit
from mtpserve.router.types import Orchestrator
from mtpserve.workers.detokenizer import IncrementalDetokenizer, StopStringMatcher
from mtpserve.workers.messages import ERROR_REQUEST, GenerateRequest, TokenChunk, TokenLogprobs
from mtpserve.workers.structured.healing import strip_healed

logger = logging.getLogger(__name__)


class Choice:
    """Text, token ids and counters of one sequence; `feed` mutates them chunk by chunk."""

    def __init__(self, index: int, request: GenerateRequest, tokenizer: Any,
                 stop: list[str], skip_ids: frozenset[int] | None = None) -> None:
        self.index = index
        self.request = request
        # `skip_ids`: decode the format's markers as text even where they are special tokens
        # (chat with tools or a reasoning parser: IngressState.marker_skip_ids).
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_token_ids,
                                                  skip_ids=skip_ids)
        self.stops = StopStringMatcher(stop)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        # Chat with a reasoning parser (router.reasoning): it detokenizes in place of
        # `detokenizer` and splits the reasoning off; `text` is then the content alone.
        self.reasoning: ReasoningSplit | None = None
        self.reasoning_parts: list[str] = []
        self.last_reasoning = ""  # the reasoning text the last chunk added
        self.finish_reason: str | None = None
        self.num_drafted = self.num_accepted = self.num_rounds = 0
        self.num_cached_tokens = 0  # prompt tokens a prefix cache held
        self.logprobs: list[TokenLogprobs] = []  # one per token id, when requested
        # Token healing: the prompt tail the output re-generates, stripped from the text.
        self.strip_prefix = ""
        self._text_offset = 0  # completions' text_offset of the next token

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def reasoning_text(self) -> str | None:
        """The reasoning (None: no reasoning block in this choice's output)."""
        if self.reasoning is None or not self.reasoning.saw_block:
            return None
        return "".join(self.reasoning_parts)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.request.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids)

    def mtp_stats(self) -> MTPStats:
        return MTPStats.of(self.num_drafted, self.num_accepted, self.num_rounds)

    @property
    def wants_logprobs(self) -> bool:
        return self.request.params.logprobs is not None

    def _token_text(self, token_id: int) -> str:
        return self.detokenizer.tokenizer.decode([token_id])

    def completion_logprobs(self, entries: list[TokenLogprobs] | None
                            ) -> CompletionLogprobs | None:
        """`entries` (a chunk's, or all of them) in the completions format; text offsets run
        on across the calls of a stream, so call it once per chunk, in order."""
        if not self.wants_logprobs:
            return None
        out = CompletionLogprobs()
        for e in entries or []:
            text = self._token_text(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(e.logprob)
            out.top_logprobs.append({self._token_text(t): lp for t, lp in e.top})
            out.text_offset.append(self._text_offset)
            self._text_offset += len(text)
        return out

    def chat_logprobs(self, entries: list[TokenLogprobs] | None) -> ChatLogprobs | None:
        if not self.wants_logprobs:
            return None

        def top(t: int, lp: float) -> TopLogprob:
            text = self._token_text(t)
            return TopLogprob(token=text, logprob=lp, bytes=list(text.encode()))

        return ChatLogprobs(content=[
            ChatLogprobToken(**top(e.token_id, e.logprob).model_dump(),
                             top_logprobs=[top(t, lp) for t, lp in e.top])
            for e in entries or []])

    def feed(self, chunk: TokenChunk) -> str:
        """Consume one chunk; returns the new text to show. Raises APIError on a failed chunk."""
        if chunk.finish_reason == "error":
            if chunk.error_kind == ERROR_REQUEST:  # its own inputs: a client error
                raise APIError(f"the request cannot be generated: {chunk.error}", 400)
            raise APIError(f"generation failed: {chunk.error or 'engine error'}", 500,
                           type="server_error")
        if chunk.finish_reason == "abort":
            raise APIError("the request was aborted by the server", 503,
                           code="service_unavailable")
        self.token_ids += chunk.token_ids
        if chunk.logprobs:
            self.logprobs += chunk.logprobs
        # Counters are running totals of the sequence; max() because a backend may not know
        # them any more on the final chunk (the engine has already dropped the request).
        self.num_drafted = max(self.num_drafted, chunk.num_drafted)
        self.num_accepted = max(self.num_accepted, chunk.num_accepted)
        self.num_rounds = max(self.num_rounds, chunk.num_rounds)
        self.num_cached_tokens = max(self.num_cached_tokens, chunk.num_cached_tokens)
        if self.reasoning is not None:
            self.last_reasoning, text = self.reasoning.feed(chunk.token_ids, chunk.finished)
            self.reasoning_parts.append(self.last_reasoning)
        else:
            text = self.detokenizer.add(chunk.token_ids)
            if chunk.finished:
                text += self.detokenizer.flush()
        text, self.strip_prefix = strip_healed(text, self.strip_prefix)
        out = self.stops.feed(text)
        if self.stops.stopped:
            self.finish_reason = "stop"
        elif chunk.finished:
            out += self.stops.flush()
            self.finish_reason = "length" if chunk.finish_reason == "length" else "stop"
        self.text_parts.append(out)
        return out


@dataclass
class ChoiceEvent:
    """What one chunk changed, captured when it arrived (the choice itself moves on)."""

    choice: Choice
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # of `token_ids`, when requested
    stamps: dict[str, float] | None = None  # per-hop times (workers/hop_trace.py, opt-in)
    reasoning: str = ""  # the reasoning text this chunk added (router.reasoning)

    def trace(self) -> dict[str, float] | None:
        """The hop stamps plus `sse_out` (now), for the SSE event; None when not traced."""
        return None if self.stamps is None else {**self.stamps, "sse_out": time.time()}


async def _aclose(stream: AsyncIterator[TokenChunk]) -> None:
    close = getattr(stream, "aclose", None)
    if close is None:
        return
    try:
        await close()
    except Exception:  # closing is best effort; the request is gone either way
        logger.exception("closing an orchestrator stream failed")


class ChoiceSet:
    """The choices of one API request, generated concurrently. Use `start()`, then
    `next_event()` until it returns None, and always `close()` (idempotent)."""

    def __init__(self, orchestrator: Orchestrator, choices: list[Choice]) -> None:
        self.orchestrator = orchestrator
        self.choices = choices
        self.error: APIError | None = None  # a failure before every choice had a chunk
        self._queue: asyncio.Queue[ChoiceEvent | APIError] = asyncio.Queue()
        self._tasks: list[asyncio.Task] = []
        self._num_open = len(choices)
        self._num_without_first = len(choices)
        self._ready = asyncio.Event()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._pump(c), name=f"choice-{c.request.request_id}")
                       for c in self.choices]

    async def _pump(self, choice: Choice) -> None:
        stream: AsyncIterator[TokenChunk] | None = None
        first = True
        try:
            stream = self.orchestrator.generate(choice.request)
            async for chunk in stream:
                text = choice.feed(chunk)
                self._queue.put_nowait(ChoiceEvent(choice, text, chunk.token_ids,
                                                   choice.finish_reason, chunk.logprobs,
                                                   chunk.stamps, choice.last_reasoning))
                if first:
                    first = False
                    self._num_without_first -= 1
                    if self._num_without_first == 0:
                        self._ready.set()
                if choice.finished:
                    break  # a stop string may end it early: the finally aborts upstream
            if not choice.finished:
                raise APIError("the generation stream ended before the request finished", 500,
                               type="server_error")
        except asyncio.CancelledError:
            raise
        except Exception as e:
            err = from_exception(e)
            if self._num_without_first and self.error is None:
                self.error = err  # before the stream could start: an HTTP error status
            self._queue.put_nowait(err)
            self._ready.set()
        finally:
            if stream is not None:
                await _aclose(stream)

    async def wait_first(self) -> None:
        """Until every choice has its first chunk; raises the first error instead."""
        await self._ready.wait()
        if self.error is not None:
            raise self.error

    async def next_event(self) -> ChoiceEvent | None:
        """The next event of any choice; None once every choice finished. Raises APIError."""
        if self._num_open == 0:
            return None
        item = await self._queue.get()
        if isinstance(item, APIError):
            raise item
        if item.finish_reason is not None:
            self._num_open -= 1
        return item

    async def run_to_end(self) -> None:
        while await self.next_event() is not None:
            pass

    async def close(self) -> None:
        """Cancel unfinished pumps; each closes its upstream stream (aborting the request).
        The cleanup runs in the pump tasks themselves, so it completes even if this await is
        cancelled too (a disconnecting client cancels the caller)."""
        pending = [t for t in self._tasks if not t.done()]
        for t in pending:
            t.cancel()
        if pending:
            await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
