"""OpenAI-style errors at the HTTP boundary: `{"error": {"message", "type", "param", "code"}}`.

Every failure a client can see goes through here, so status codes and the JSON shape are decided
in one place: validation → 400, auth → 401, unknown model → 404, engine failure → 500/503, and
anything unexpected → 500 with a short message (the traceback goes to the log, never the body).
In a stream the same body is sent as one `data:` event, after which the stream closes.
"""

from __future__ import annotations

import json
import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    499: "invalid_request_error",
    501: "not_implemented_error",
    503: "server_error",
    504: "timeout_error",
}
# Matched by class name (anywhere in the MRO) so the router never imports the engine (torch) or
# Ray; Ray re-raises remote errors as subclasses of the original class, so the MRO still shows it.
# The one definition of these names: the orchestrator decides retries with them too.
BAD_REQUEST_NAMES = frozenset({"EngineError"})  # the request itself is invalid: never retried
BUSY_NAMES = frozenset({"BackPressureError"})  # Serve's max_queued_requests is full
UNAVAILABLE_NAMES = frozenset({
    "DeploymentUnavailableError", "RayActorError", "ActorDiedError", "ActorUnavailableError",
    "ReplicaUnavailableError",
})
KV_TRANSFER_NAMES = frozenset({"KVTransferFailed"})


def error_names(exc: BaseException) -> set[str]:
    """The class names in `exc`'s MRO (what the sets above are matched against)."""
    return {cls.__name__ for cls in type(exc).__mro__}


RETRY_AFTER_S = 1
_MAX_MESSAGE_CHARS = 500
# Internal endpoints in server-side failures (KV peers, rendezvous stores, actor addresses):
# never shown to clients. IPv4[:port], bracketed IPv6[:port], scheme://host[:port].
_ADDRESS = re.compile(r"[a-z][a-z0-9+.-]*://[^\s,;)'\"]+"
                      r"|\[[0-9a-f.]*:[0-9a-f:.]*\](?::\d+)?"
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"
                      r"|\b[a-z0-9-]+(?:\.[a-z0-9-]+){2,}:\d+\b", re.IGNORECASE)


def redact_addresses(text: str) -> str:
    """`text` with internal network addresses replaced by `<internal>`."""
    return _ADDRESS.sub("<internal>", text)


class APIError(Exception):
    """An error the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        # A server-side failure's text may quote internal peers; the client never sees them.
        self.message = redact_addresses(message) if status >= 500 else message
        self.status = status
        self.type = type or _TYPES.get(status, "server_error" if status >= 500 else
                                       "invalid_request_error")
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        headers = dict(self.headers)
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.body(), status_code=self.status, headers=headers or None)

    def sse(self) -> str:
        """The error as one server-sent event (the stream is closed after it)."""
        return f"data: {json.dumps(self.body())}\n\n"


def overloaded(message: str, retry_after_s: int = RETRY_AFTER_S) -> APIError:
    """429 with Retry-After: the server is at capacity, the request may be retried as is."""
    return APIError(message, 429, code="rate_limit_exceeded",
                    headers={"Retry-After": str(retry_after_s)})


def _short(text: str) -> str:
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[: _MAX_MESSAGE_CHARS - 3] + "..."


def from_exception(exc: BaseException) -> APIError:
    """Classify an exception raised while generating: APIError as is, an engine rejection → 400,
    an unavailable backend → 503, anything else → 500. Unexpected ones are logged here."""
    if isinstance(exc, APIError):
        return exc
    names = error_names(exc)
    # Ray's remote errors carry the remote traceback in str(): only the last line is shown.
    lines = str(exc).strip().splitlines()
    detail = _short(f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__)
    if names & BAD_REQUEST_NAMES:
        return APIError(_short(str(exc).strip().splitlines()[-1] if str(exc).strip() else detail),
                        400)
    if names & BUSY_NAMES:
        return overloaded("the server is at capacity; retry after a short wait")
    if isinstance(exc, (TimeoutError, ConnectionError)) or names & UNAVAILABLE_NAMES:
        logger.warning("generation backend unavailable: %s", detail)
        return APIError(f"the generation backend is unavailable ({detail})", 503,
                        code="service_unavailable")
    logger.error("generation failed", exc_info=exc)
    return APIError(f"generation failed ({detail})", 500, type="server_error")


_VALIDATOR_TAG = re.compile(r"^function-(?:after|before|wrap|plain)\[.*, (\w+)\]$")


def _param(loc: tuple) -> str | None:
    """`('body', 'messages', 0, 'content')` → `messages[0].content`."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, str):  # a validated type's tag: `function-after[check_text(), str]`
            part = _VALIDATOR_TAG.sub(r"\1", part)
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or None


def validation_error(exc: RequestValidationError, request: Request) -> APIError:
    """The first validation error as a 400 naming the bad field (FastAPI would answer 422)."""
    errors = exc.errors()
    if not errors:
        return APIError("invalid request body", 400)
    err = errors[0]
    kind, loc, msg = err.get("type", ""), tuple(err.get("loc", ())), err.get("msg", "invalid")
    if kind == "json_invalid":
        reason = (err.get("ctx") or {}).get("error", "JSON decode error")
        pos = loc[1] if len(loc) > 1 else "?"
        return APIError(f"malformed JSON in request body: {reason} (at character {pos})", 400)
    param = _param(loc)
    if param is None:
        content_type = request.headers.get("content-type", "")
        if kind == "missing":
            return APIError("request body is required (a JSON object)", 400)
        if "json" not in content_type:
            return APIError("request body must be JSON with 'Content-Type: application/json'",
                            400)
        return APIError(f"request body must be a JSON object: {msg}", 400)
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return APIError(f"invalid value for '{param}': {msg}{more}", 400, param=param)


def install_error_handlers(app: FastAPI) -> None:
    """Route every error a request can raise to OpenAI-style JSON."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        code = "not_found" if exc.status_code == 404 else None
        return APIError(message, exc.status_code, code=code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError("internal server error", 500, type="server_error").response()
