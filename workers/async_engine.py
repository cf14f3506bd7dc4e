"""An `Engine` on a background thread, driven from asyncio.

The engine (and, in a TP group, every collective it triggers) runs only on this thread: async
callers submit actions (add, abort, arbitrary calls such as KV pulls) through a queue and
receive `TokenChunk`s through per-request asyncio queues. This is the shape of vLLM's
AsyncLLM and of Ray Serve LLM's engine wrapper.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from mtpserve.workers.engine import Engine, EngineError, RequestOutput
from mtpserve.workers.hop_trace import stamp
from mtpserve.workers.messages import (
    ERROR_ENGINE,
    ERROR_REQUEST,
    GenerateRequest,
    TokenChunk,
    merge_chunks,
)
from mtpserve.workers.request import Request

logger = logging.getLogger(__name__)


def to_chunk(out: RequestOutput) -> TokenChunk:
    return TokenChunk(
        token_ids=out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
        num_drafted=out.num_drafted, num_accepted=out.num_accepted,
        num_rounds=out.num_rounds, num_cached_tokens=out.num_cached_tokens,
        logprobs=out.logprobs, error=out.error,
        error_kind=ERROR_REQUEST if out.error is not None else None,
    )


class Poller(Protocol):
    """Engine-thread work besides steps: KV arrivals (decode) or hold releases (prefill)."""

    def next_poll_in(self) -> float | None:
        """0: poll now; > 0: poll again after that many seconds; None: nothing to poll."""

    def poll(self) -> bool:
        """Run on the engine thread; True if it changed something (blocks, requests)."""


# Longest sleep of an idle engine thread: it wakes at once for any action, so this only
# bounds how late it notices `shutdown`.
_IDLE_WAIT_S = 0.5


class AsyncEngine:
    """`sink` (an engine core in its own process, workers/replica/engine_core_proc.py): chunks
    of requests registered with `register` go to `sink(rid, chunk)` on the engine thread
    instead of an asyncio queue, and `on_tick` runs after each batch of actions and each step,
    so the sink can ship what piled up as one message per wake-up."""

    def __init__(self, engine: Engine, poller: Poller | None = None,
                 sink: Callable[[str, TokenChunk], None] | None = None,
                 on_tick: Callable[[], None] | None = None) -> None:
        self.engine = engine
        self.poller = poller
        self.sink = sink
        self.on_tick = on_tick
        # Called on the engine thread after each step with (engine, outputs, seconds): metrics
        # and autoscaling signals (workers/replica/metrics.py EngineRecorder).
        self.step_observers: list[Callable[[Engine, list[RequestOutput], float], None]] = []
        # Engine thread: completes a step's chunk before it is published (prefill: the hold).
        self.annotate: Callable[[str, TokenChunk], None] | None = None
        self._actions: queue.Queue[Callable[[], None]] = queue.Queue()
        # None: the request streams to `sink`.
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None] = {}
        self._stop = threading.Event()
        # A grammar compiled off the engine thread wakes the loop (an empty action).
        engine.on_wake = lambda: self._actions.put(lambda: None)
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()
        self.errors = 0

    # Called from any thread ----------------------------------------------------------------
    def call(self, fn: Callable[[Engine], Any]) -> concurrent.futures.Future:
        """Run `fn(engine)` on the engine thread; the future holds its result."""
        fut: concurrent.futures.Future = concurrent.futures.Future()

        def action() -> None:
            if not fut.set_running_or_notify_cancel():  # the caller gave up while queued
                return
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:  # handed to the caller, never kills the loop
                fut.set_exception(e)

        self._actions.put(action)
        return fut

    async def acall(self, fn: Callable[[Engine], Any]) -> Any:
        return await asyncio.wrap_future(self.call(fn))

    def wake(self) -> None:
        """Make the engine thread look at its poller now (thread-safe, e.g. a transfer
        thread that finished a pull)."""
        self._actions.put(_noop)

    async def ping(self, fn: Callable[[Engine], Any], deadline_s: float) -> Any:
        """Run `fn` on the engine thread, failing (TimeoutError) if it has not returned
        within `deadline_s`: the thread may be stuck in a collective with a dead peer."""
        if not self._thread.is_alive():
            raise RuntimeError("engine thread died")
        fut = self.call(fn)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), deadline_s)
        except asyncio.TimeoutError as e:
            fut.cancel()
            raise TimeoutError(f"engine thread did not answer within {deadline_s:.1f}s") from e

    def fail(self, rid: str, message: str, kind: str = ERROR_ENGINE) -> None:
        """Engine thread: end a request's stream with an error (its engine state is gone);
        `kind` tells the orchestrator what failed (workers.messages.ERROR_*)."""
        self._publish(rid, TokenChunk([], finished=True, finish_reason="error", error=message,
                                      error_kind=kind))

    def register(self, rid: str) -> None:
        """Engine thread: stream `rid`'s chunks to `sink` (before its request is added)."""
        self._listeners[rid] = None

    def unregister(self, rid: str) -> None:
        """Engine thread: its consumer left (it is aborted separately)."""
        self._listeners.pop(rid, None)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        self._stop.set()
        self._actions.put(lambda: None)
        self._thread.join(timeout=30)

    # Streaming -----------------------------------------------------------------------------
    async def generate(
        self,
        req: GenerateRequest,
        add: Callable[[Engine], Request] | None = None,
        abort_on_exit: bool = True,
        interval_s: float = 0.0,
    ) -> AsyncIterator[TokenChunk]:
        """Stream a request's tokens. `add` (default: a fresh request with the prompt plus
        any resumed tokens) runs on the engine thread and may raise `EngineError`;
        `interval_s` paces the stream (`coalesced`)."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = req.request_id

        def default_add(engine: Engine) -> Request:
            return engine.add_resumed(rid, req.prompt_token_ids, req.params,
                                      list(req.resume_token_ids))

        def register_and_add(engine: Engine) -> Request:
            self._listeners[rid] = (loop, q)
            try:
                return (add or default_add)(engine)
            except BaseException:
                self._listeners.pop(rid, None)
                raise

        finished = False
        try:
            # Inside the try: a caller cancelled while the add is queued still aborts it.
            await self.acall(register_and_add)
            async for chunk in coalesced(q, interval_s):
                finished = chunk.finished
                yield chunk
        finally:
            if not finished:
                self._listeners.pop(rid, None)
                if abort_on_exit:
                    self.call(lambda e: e.abort(rid))

    # Engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        stalled = False  # the last step could schedule nothing: wait for a change
        while not self._stop.is_set():
            self._tick()  # what a poll or a failure published, before any wait
            due = self.poller.next_poll_in() if self.poller is not None else None
            grammar_due = self.engine.grammar_wait_s()
            if grammar_due is not None:  # a compile deadline: step then at the latest
                due = grammar_due if due is None else min(due, grammar_due)
                stalled = stalled and grammar_due > 0
            runnable = self.engine.has_unfinished() and not stalled
            if runnable or due == 0:
                timeout = None  # do not block
            else:
                timeout = min(due, _IDLE_WAIT_S) if due is not None else _IDLE_WAIT_S
            if self._run_actions(timeout):
                stalled = False
                self._tick()
            if self.poller is not None:
                due = self.poller.next_poll_in()
                if due is not None and due <= 0:
                    try:
                        if self.poller.poll():
                            stalled = False
                    except Exception as e:  # the group's control plane broke
                        logger.exception("engine poll failed")
                        self.errors += 1
                        self._fail_all(f"engine poll failed: {e}")
            if self._stop.is_set() or not self.engine.has_unfinished() or stalled:
                continue
            try:
                t_step = time.perf_counter()
                outputs = self.engine.step()
            except Exception as e:  # a broken step fails its requests, not the replica
                logger.exception("engine step failed")
                self.errors += 1
                self._fail_all(f"engine step failed: {e}")
                continue
            self._observe(outputs, time.perf_counter() - t_step)
            stalled = not outputs and self.engine.scheduler.idle
            for out in outputs:
                chunk = stamp(to_chunk(out), "engine", out.request_id)
                if self.annotate is not None and out.request_id in self._listeners:
                    try:
                        self.annotate(out.request_id, chunk)
                    except Exception:  # the chunk goes as it is; its consumer copes
                        logger.exception("chunk annotation failed")
                self._publish(out.request_id, chunk)
            self._tick()

    def _tick(self) -> None:
        if self.on_tick is not None:
            try:
                self.on_tick()
            except Exception:  # the sink's channel broke: its owner notices and stops us
                logger.exception("engine tick hook failed")

    def _observe(self, outputs: list[RequestOutput], seconds: float) -> None:
        for fn in self.step_observers:
            try:
                fn(self.engine, outputs, seconds)
            except Exception:  # monitoring must never stop the engine
                logger.exception("step observer failed")

    def _run_actions(self, timeout: float | None) -> bool:
        """Run queued actions, waiting up to `timeout` for the first (None: no wait)."""
        try:
            action = self._actions.get(block=timeout is not None, timeout=timeout)
        except queue.Empty:
            return False
        action()
        while True:  # drain the rest without blocking
            try:
                self._actions.get_nowait()()
            except queue.Empty:
                return True

    def _publish(self, rid: str, chunk: TokenChunk) -> None:
        if rid not in self._listeners:
            return
        target = self._listeners.pop(rid) if chunk.finished else self._listeners[rid]
        if target is None:
            self.sink(rid, chunk)
            return
        loop, q = target
        loop.call_soon_threadsafe(q.put_nowait, chunk)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._listeners):
            self.engine.abort(rid)
            self._publish(rid, TokenChunk([], finished=True, finish_reason="error",
                                          error=message, error_kind=ERROR_ENGINE))


async def coalesced(q: asyncio.Queue, interval_s: float = 0.0) -> AsyncIterator[TokenChunk]:
    """A request's chunks from its queue until the finished one. A consumer slower than the
    engine gets what piled up as one chunk (one message through Serve, the ingress and the
    proxy instead of one per round); a failure stays a chunk of its own (the tokens before it
    were emitted).

    `interval_s` > 0 paces the stream: the first chunk and the finished one go at once, any
    other waits until `interval_s` after the previous send and takes every round that came
    meanwhile (each hop downstream costs CPU per message, not per token: Ray Serve LLM's
    stream batching, vLLM's stream_interval)."""
    loop = asyncio.get_running_loop()
    next_send = 0.0
    while True:
        chunks: list[TokenChunk] = [await q.get()]
        while not chunks[-1].finished:
            if not q.empty():
                chunks.append(q.get_nowait())
                continue
            wait = next_send - loop.time()
            if wait <= 0:
                break
            try:
                chunks.append(await asyncio.wait_for(q.get(), wait))
            except asyncio.TimeoutError:
                break
        failed = chunks.pop() if (len(chunks) > 1 and chunks[-1].finish_reason
                                  in ("error", "abort")) else None
        for chunk in (merge_chunks(chunks), failed):
            if chunk is None:
                continue
            yield chunk
            if chunk.finished:
                return
        if interval_s > 0:
            next_send = loop.time() + interval_s


def _noop() -> None:
    pass


__all__ = ["AsyncEngine", "EngineError", "coalesced", "to_chunk"]
