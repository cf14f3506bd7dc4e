"""How a request's choices become an HTTP response: JSON when they all ended, or an SSE stream
whose cleanup runs however it ends; a client that disconnects cancels the work."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.types import Receive, Scope, Send

from mtpserve.router.errors import APIError
from mtpserve.router.generation import ChoiceSet

logger = logging.getLogger(__name__)
T = TypeVar("T")



def json_response(model: Any) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json", exclude_none=True))


def sse_event(model: Any) -> str:
    return f"data: {model.model_dump_json(exclude_none=True)}\n\n"


# Running -----------------------------------------------------------------------------------
async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
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


async def run_to_end(request: Request, choices: ChoiceSet) -> None:
    """Non-streaming: every choice to its end; upstreams are closed whatever happens."""
    choices.start()
    try:
        await cancel_on_disconnect(request, choices.run_to_end())
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


async def stream_response(request: Request, choices: ChoiceSet,
                  events: Callable[[], AsyncIterator[str]]) -> SSEResponse:
    """Start the choices and wait for each one's first chunk, so a request the backend refuses
    still gets a proper status code; then stream."""
    choices.start()
    try:
        await cancel_on_disconnect(request, choices.wait_first())
    except BaseException:
        await choices.close()
        raise
    return SSEResponse(guarded_events(events()), choices.close)


async def guarded_events(events: AsyncIterator[str]) -> AsyncIterator[str]:
    """Turn a failure mid-stream into one error event (then the stream ends)."""
    try:
        async for event in events:
            yield event
    except APIError as e:
        yield e.sse()
    except Exception:
        logger.exception("streaming failed")
        yield APIError("internal server error", 500, type="server_error").sse()


