"""Decode deployment: one replica = one TP group running speculative rounds with continuous
batching. Requests arrive with `KVTransferParams`; every rank pulls its KV-head slice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray import serve

from mtpserve.workers import hop_trace
from mtpserve.workers.hop_trace import stamp
from mtpserve.workers.messages import GenerateRequest, KVTransferParams, TokenChunk
from mtpserve.workers.replica.metrics import EMA
from mtpserve.workers.replica.replica import EngineReplica


class KVTransferFailed(RuntimeError):
    pass


# A request's expected output before this replica has seen any finish (routing load only).
DEFAULT_EXPECTED_TOKENS = 256


@serve.deployment(name="DecodeServer")
class DecodeServer(EngineReplica):
    role = "decode"

    def __init__(self, cfg) -> None:
        # The engine core (in this process or its own) holds the metrics recorder and the
        # windowed autoscaling signals and profiles the engine once at start.
        super().__init__(cfg)
        self.output_len = EMA(alpha=0.1)  # tokens a finished request generated here
        self.expected: dict[str, list[int]] = {}  # live request -> [expected, produced]

    async def inject_fault(self, pull_delay_s: float = 0.0, count: int = 1) -> None:
        """Tests only (MTPSERVE_ENABLE_FAULT_INJECTION=1): the next `count` KV pulls on every
        rank's transfer thread sleep `pull_delay_s` first."""
        await self._fault(pull_delay_s, count)

    async def generate(self, req: GenerateRequest, params: KVTransferParams | None = None
                       ) -> AsyncIterator[TokenChunk]:
        """Stream tokens after the first one (which the prefill side produced). Without
        `params` the request is recomputed here from its prompt and resumed tokens."""
        self._check_alive()
        hop_trace.note(req.request_id, "decode_in")
        # Routing load in expected tokens: what requests typically generate here, capped by
        # max_tokens (a chat request without max_tokens carries the whole window).
        typical = self.output_len.value or DEFAULT_EXPECTED_TOKENS
        load = self.expected[req.request_id] = [min(req.params.max_tokens, int(typical)), 0]
        last = None
        try:
            stream = self.core.generate(req, params,
                                        interval_s=self.cfg.decode.stream_interval_ms / 1e3)
            async for chunk in _with_heartbeats(stream, self.cfg.migration.stall_timeout_s / 4):
                if not chunk.heartbeat:
                    last = chunk
                    load[1] += len(chunk.token_ids)
                # With the request id: an engine core in its own process took no arrival
                # notes of this process (decode_in) to its first chunk.
                yield stamp(chunk, "decode_out", req.request_id)
        finally:
            self.expected.pop(req.request_id, None)
            hop_trace.forget(req.request_id)
        if last is not None and last.finished and last.finish_reason != "error":
            self.output_len.update(last.num_output_tokens)

    async def kv_probe(self, sender_address: str, num_bytes: int) -> dict:
        # Rank 0's receiver, off the engine thread; the channel's lock orders it with pulls.
        return await self.core.call("kv_probe", sender_address, num_bytes)

    @property
    def ongoing_tokens(self) -> int:
        """Tokens still expected across this replica's live requests."""
        return sum(max(e - p, 1) for e, p in list(self.expected.values()))

    async def record_routing_stats(self) -> dict:
        # Read by the router together with Serve's live queue lengths (router/routing.py).
        n = len(self.expected)
        return {"ongoing_tokens": self.ongoing_tokens, "num_requests": n,
                "tokens_per_request": int(self.output_len.value or DEFAULT_EXPECTED_TOKENS),
                "prefix": await self.prefix_summary()}

    async def record_autoscaling_stats(self) -> dict:
        # Window aggregates that empty when idle (workers/replica/signals.py) + the perf model.
        return await self.core.call("autoscaling_stats")


async def _with_heartbeats(chunks: AsyncIterator[TokenChunk], every_s: float
                           ) -> AsyncIterator[TokenChunk]:
    """`chunks`, plus a heartbeat chunk whenever `every_s` pass without one: a request that
    waits here (for KV blocks, its pull, a busy engine) is not mistaken for a stalled replica
    and migrated. A frozen or dead replica sends nothing, heartbeats included."""
    it = chunks.__aiter__()
    pending: asyncio.Future | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(it.__anext__())
            done, _ = await asyncio.wait({pending}, timeout=every_s)
            if not done:
                yield TokenChunk([], heartbeat=True)
                continue
            try:
                chunk = pending.result()
            except StopAsyncIteration:
                return
            finally:
                pending = None
            yield chunk
    finally:
        if pending is not None:
            pending.cancel()
            try:
                await pending
            except (asyncio.CancelledError, StopAsyncIteration, Exception):
                pass
        await it.aclose()
