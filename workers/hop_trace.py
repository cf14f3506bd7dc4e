"""Where a streamed token's time goes: wall-clock stamps per hop on each chunk (opt-in).

With `MTPSERVE_TRACE_HOPS=1` in the servers' environment (read at import, in every process:
`mtpserve up` passes its environment to the replicas), each chunk with tokens collects
`time.time()` at every hop it passes: `engine` (the engine thread turned the round's outputs
into a chunk), `decode_out` (the decode replica's Serve streaming generator yields it),
`ingress_in` (the ingress's orchestrator received it over the Serve handle), `sse_out` (the
ingress wrote its SSE event), and the event carries them to the client as `mtpserve_trace`.
All hops of one machine share its clock; across machines the stamps differ by clock skew.
Off (the default), nothing is allocated or added on the hot path.

A transferred request's first decode-side chunk also carries the decode replica's arrival
hops (`ARRIVAL_HOPS`), noted per request before any chunk exists: `decode_in` (the decode
replica got the request), `pull_start` / `pull_end` (rank 0's transfer lane took the pull /
finished the scatter into the cache), `activated` (the engine thread moved it into the
decode rounds).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

ENV = "MTPSERVE_TRACE_HOPS"
ENABLED = os.environ.get(ENV) == "1"
HOPS = ("engine", "decode_out", "ingress_in", "sse_out")
ARRIVAL_HOPS = ("decode_in", "pull_start", "pull_end", "activated")

_lock = threading.Lock()
_pending: dict[str, dict[str, float]] = {}  # request id -> arrival hops, until its first chunk


def note(request_id: str, hop: str) -> None:
    """Record an arrival hop of `request_id`; its next chunk with tokens carries it."""
    if ENABLED:
        with _lock:
            _pending.setdefault(request_id, {})[hop] = time.time()


def forget(request_id: str) -> None:
    """The request ended (its notes would otherwise stay behind)."""
    if ENABLED:
        with _lock:
            _pending.pop(request_id, None)


def stamp(chunk: Any, hop: str, request_id: str | None = None) -> Any:
    """Record `hop` on a chunk that carries tokens (heartbeats are not timed), with the
    arrival hops noted for `request_id` when given."""
    if ENABLED and chunk.token_ids:
        noted = {}
        if request_id is not None:
            with _lock:
                noted = _pending.pop(request_id, {})
        chunk.stamps = {**(chunk.stamps or {}), **noted, hop: time.time()}
    return chunk
