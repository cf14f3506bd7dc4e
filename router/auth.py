"""API keys: `Authorization: Bearer <key>` on every route but the open ones.

Open: `/health` (load balancers and probes carry no key) and `/metrics` (Prometheus scrapes
without one, as with vLLM); who may reach them is the network's job (the chart's NetworkPolicy).

A pure ASGI middleware rather than a FastAPI dependency, so a request without the key is
refused before its body is read or validated (a bad key never learns whether its JSON parsed).
Keys are read per request through `get_keys`, so they can be set after the app is built.

Fails closed: an empty bearer never matches, comparisons are constant-time
(`hmac.compare_digest`), and the admin key, when configured, is accepted wherever the API key is
(admin routes check for it themselves with `is_admin`). Where the keys come from (config,
environment) and refusing to start without them is `cluster.config.AuthSettings.resolve`.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from mtpserve.router.errors import APIError

OPEN_PATHS = frozenset({"/health", "/metrics"})


def bearer_token(header: str | None) -> str | None:
    """The token of a `Bearer <token>` header; None when absent, malformed or empty."""
    scheme, _, token = (header or "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def key_matches(header: str | None, key: str | None) -> bool:
    """Constant-time comparison of a `Bearer` header with a configured key. An empty token or
    an empty/absent key never matches."""
    token = bearer_token(header)
    if not key or token is None:
        return False
    return hmac.compare_digest(token.encode(), key.encode())


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp,
                 get_keys: Callable[[], tuple[str | None, str | None]],
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.get_keys = get_keys  # () -> (api key, admin key); None: not configured
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        key, admin = self.get_keys()
        if key is None:  # no API key configured: open API (admin routes still check theirs)
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        # Both comparisons always run: the time taken does not tell which key was close.
        ok = [key_matches(header, key), key_matches(header, admin)]
        if any(ok):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if not header
                   else "incorrect API key provided")
        await APIError(message, 401, code="invalid_api_key").response()(scope, receive, send)

    @staticmethod
    def _path(scope: Scope) -> str:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        return path[len(root) :] if root and path.startswith(root) else path
