"""Optional API key: `Authorization: Bearer <key>` on every route but the open ones.

A pure ASGI middleware rather than a FastAPI dependency, so a request without the key is
refused before its body is read or validated (a bad key never learns whether its JSON parsed).
The key is read per request through `get_key`, so it can be set after the app is built.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from router.errors import APIError

OPEN_PATHS = frozenset({"/health"})


def key_matches(header: str | None, key: str) -> bool:
    """Constant-time comparison of a `Bearer` header with the configured key."""
    scheme, _, token = (header or "").partition(" ")
    ok_scheme = scheme.lower() == "bearer"
    return hmac.compare_digest(token.strip().encode(), key.encode()) and ok_scheme


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, get_key: Callable[[], str | None],
                 open_paths: frozenset[str] = OPEN_PATHS) -> None:
        self.app = app
        self.get_key = get_key
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = self.get_key() if scope["type"] == "http" else None
        if key is None or self._path(scope) in self.open_paths:
            await self.app(scope, receive, send)
            return
        header = Headers(scope=scope).get("authorization")
        if key_matches(header, key):
            await self.app(scope, receive, send)
            return
        message = ("missing API key: send 'Authorization: Bearer <key>'" if not header
                   else "incorrect API key provided")
        await APIError(message, 401, code="invalid_api_key").response()(scope, receive, send)

    @staticmethod
    def _path(scope: Scope) -> str:
        path, root = scope.get("path", ""), scope.get("root_path", "")
        return path[len(root) :] if root and path.startswith(root) else path
