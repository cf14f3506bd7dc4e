"""Where a streamed token's time goes: wall-clock stamps per hop on each chunk (opt-in).

With `MTPSERVE_TRACE_HOPS=1` in the servers' environment (read at import, in every process:
`mtpserve up` passes its environment to the replicas), each chunk with tokens collects
`time.time()` at every hop it passes: `engine` (the engine thread turned the round's outputs
into a chunk), `decode_out` (the decode replica's Serve streaming generator yields it),
`ingress_in` (the ingress's orchestrator received it over the Serve handle), `sse_out` (the
ingress wrote its SSE event), and the event carries them to the client as `mtpserve_trace`.
All hops of one machine share its clock; across machines the stamps differ by clock skew.
Off (the default), nothing is allocated or added on the hot path.
"""

from __future__ import annotations

import os
import time
from typing import Any

ENV = "MTPSERVE_TRACE_HOPS"
ENABLED = os.environ.get(ENV) == "1"
HOPS = ("engine", "decode_out", "ingress_in", "sse_out")


def stamp(chunk: Any, hop: str) -> Any:
    """Record `hop` on a chunk that carries tokens (heartbeats are not timed)."""
    if ENABLED and chunk.token_ids:
        chunk.stamps = {**(chunk.stamps or {}), hop: time.time()}
    return chunk
