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
from collections.abc import AsyncIterator, Callable
from typing import Any

from router.types import GenerateRequest, TokenChunk
from workers.engine import Engine, EngineError, RequestOutput
from workers.request import Request
from workers.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def sampling_params(req: GenerateRequest) -> SamplingParams:
    return SamplingParams(
        max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
        top_k=req.top_k, seed=req.seed, stop_token_ids=tuple(req.stop_token_ids),
        ignore_eos=req.ignore_eos, num_speculative_tokens=req.num_speculative_tokens,
    )


def to_chunk(out: RequestOutput) -> TokenChunk:
    return TokenChunk(
        token_ids=out.new_token_ids, finished=out.finished, finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
        num_drafted=out.num_drafted, num_accepted=out.num_accepted,
        num_rounds=out.num_rounds,
    )


class AsyncEngine:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._actions: queue.Queue[Callable[[], None]] = queue.Queue()
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
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
    ) -> AsyncIterator[TokenChunk]:
        """Stream a request's tokens. `add` (default: a fresh request with the prompt plus
        any resumed tokens) runs on the engine thread and may raise `EngineError`."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = req.request_id

        def default_add(engine: Engine) -> Request:
            return engine.add_request(rid, req.prompt_token_ids + req.resume_token_ids,
                                      sampling_params(req))

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
            while True:
                chunk: TokenChunk = await q.get()
                finished = chunk.finished
                yield chunk
                if finished:
                    return
        finally:
            if not finished:
                self._listeners.pop(rid, None)
                if abort_on_exit:
                    self.call(lambda e: e.abort(rid))

    # Engine thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            block = not self.engine.has_unfinished()
            try:
                action = self._actions.get(block=block, timeout=0.5 if block else None)
                action()
                while True:  # drain the rest without blocking
                    self._actions.get_nowait()()
            except queue.Empty:
                pass
            if self._stop.is_set() or not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # a broken step fails its requests, not the replica
                logger.exception("engine step failed")
                self.errors += 1
                self._fail_all(f"engine step failed: {e}")
                continue
            for out in outputs:
                self._publish(out.request_id, to_chunk(out))

    def _publish(self, rid: str, chunk: TokenChunk) -> None:
        target = self._listeners.get(rid)
        if target is None:
            return
        if chunk.finished:
            self._listeners.pop(rid, None)
        loop, q = target
        loop.call_soon_threadsafe(q.put_nowait, chunk)

    def _fail_all(self, message: str) -> None:
        for rid in list(self._listeners):
            self.engine.abort(rid)
            self._publish(rid, TokenChunk([], finished=True, finish_reason="error",
                                          error=message))


__all__ = ["AsyncEngine", "EngineError", "sampling_params", "to_chunk"]
