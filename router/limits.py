"""Admission at the HTTP edge: request-body size, concurrent requests, and draining.

A pure ASGI middleware, so a request is refused before anyone parses it:
- a body larger than `max_request_bytes` is answered 413 as soon as the declared
  Content-Length or the bytes received so far exceed it (never after reading 50 MB);
- beyond `max_concurrent_requests` in flight on this ingress replica: 429 with Retry-After;
- while draining (SIGTERM, scale-down): 503 with Retry-After and `Connection: close`, and
  /health answers 503 so load balancers stop sending; requests already in flight go on.
The in-flight count covers a streaming response until its last byte.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mtpserve.router.errors import APIError, overloaded

_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
_UNGATED_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes, even draining


@dataclass(frozen=True)
class Limits:
    """Server-side caps (cluster.config.LimitsSettings carries the same names)."""

    max_tokens: int = 8192
    max_n: int = 16
    max_prompt_tokens: int | None = None
    max_request_bytes: int = 4 << 20
    max_concurrent_requests: int = 512
    retry_after_s: int = 1


class AdmissionGate:
    """Requests in flight on this replica, and whether it is draining. Event-loop only."""

    def __init__(self) -> None:
        self.num_inflight = 0
        self.draining = False


class LimitsMiddleware:
    def __init__(self, app: ASGIApp, get_limits: Callable[[], Limits | None],
                 gate: AdmissionGate) -> None:
        self.app = app
        self.get_limits = get_limits
        self.gate = gate

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limits = self.get_limits() if scope["type"] == "http" else None
        if limits is None or scope.get("path", "") in _UNGATED_PATHS:
            await self.app(scope, receive, send)
            return
        if self.gate.draining:
            err = APIError("the server is shutting down; retry on another replica", 503,
                           code="service_unavailable",
                           headers={"Retry-After": str(limits.retry_after_s),
                                    "Connection": "close"})
            await err.response()(scope, receive, send)
            return
        if self.gate.num_inflight >= limits.max_concurrent_requests:
            await overloaded(f"too many concurrent requests (at most "
                             f"{limits.max_concurrent_requests}); retry after a short wait",
                             limits.retry_after_s).response()(scope, receive, send)
            return
        self.gate.num_inflight += 1
        try:
            if scope.get("method") in _BODY_METHODS:
                receive = await self._bounded_body(scope, receive, send, limits.max_request_bytes)
                if receive is None:
                    return
            await self.app(scope, receive, send)
        finally:
            self.gate.num_inflight -= 1

    @staticmethod
    async def _bounded_body(scope: Scope, receive: Receive, send: Send,
                            max_bytes: int) -> Receive | None:
        """Read the body up to `max_bytes` and return a `receive` that replays it; None once a
        413 (or nothing, if the client left) has been answered instead."""
        too_large = APIError(f"request body too large (at most {max_bytes} bytes)", 413,
                             code="request_too_large")
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            await too_large.response()(scope, receive, send)
            return None
        parts: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > max_bytes:
                await too_large.response()(scope, receive, send)
                return None
            parts.append(body)
            if not message.get("more_body", False):
                break
        replay: Message | None = {"type": "http.request", "body": b"".join(parts),
                                  "more_body": False}

        async def replaying_receive() -> Message:
            nonlocal replay
            if replay is not None:
                message, replay = replay, None
                return message
            return await receive()  # afterwards: http.disconnect, watched by the routes

        return replaying_receive
