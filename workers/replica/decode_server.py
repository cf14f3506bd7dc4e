"""Decode deployment: one replica = one TP group running speculative rounds with continuous
batching. Requests arrive with `KVTransferParams`; every rank pulls its KV-head slice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ray import serve

from mtpserve.workers import hop_trace
from mtpserve.workers.block_manager import blocks_for
from mtpserve.workers.engine import Engine, EngineError
from mtpserve.workers.hop_trace import stamp
from mtpserve.workers.messages import (
    ERROR_KV_TRANSFER,
    GenerateRequest,
    KVTransferParams,
    TokenChunk,
)
from mtpserve.workers.replica.arrivals import KVArrivals
from mtpserve.workers.replica.metrics import EMA, attach_replica_metrics
from mtpserve.workers.replica.replica import EngineReplica
from mtpserve.workers.replica.tp_commands import ProbeKV
from mtpserve.workers.request import Request
from mtpserve.workers.scheduler import decode_slots


class KVTransferFailed(RuntimeError):
    pass


# A request's expected output before this replica has seen any finish (routing load only).
DEFAULT_EXPECTED_TOKENS = 256


@serve.deployment(name="DecodeServer")
class DecodeServer(EngineReplica):
    role = "decode"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        # Metrics and windowed autoscaling signals (decode-only TPOT, acceptance per
        # position, batch, k, the round-time model); profiles the engine once here.
        self.recorder = attach_replica_metrics(self, "decode")
        self.output_len = EMA(alpha=0.1)  # tokens a finished request generated here
        self.expected: dict[str, list[int]] = {}  # live request -> [expected, produced]

    def _make_poller(self) -> KVArrivals:
        # A failed pull ends the stream with a typed error: the orchestrator then applies
        # kv_transfer.failure_policy (recompute or fail) instead of migrating.
        return KVArrivals(self.driver, self.cfg.kv_transfer.timeout_s,
                          on_failed=lambda rid, msg: self.engine.fail(rid, msg,
                                                                      ERROR_KV_TRANSFER))

    def _add_transferred(self, engine: Engine, req: GenerateRequest,
                         params: KVTransferParams) -> Request:
        """Engine thread: validate and park the request as waiting-for-KV; its pull starts
        when the scheduler admits it (a sequence slot and blocks are free)."""
        r = engine.make_request(req.request_id, req.prompt_token_ids + req.resume_token_ids,
                                req.params)
        r.output_token_ids.append(params.first_token_id)
        r.num_computed_tokens = params.num_computed_tokens
        # Prefill drafts at most k (fewer when max_tokens leaves no room); the first round
        # verifies what it got, later rounds draft k again.
        if params.num_drafts > r.num_speculative_tokens:
            raise EngineError(f"prefill drafted {params.num_drafts} tokens, this replica "
                              f"drafts at most k={r.num_speculative_tokens}")
        slots = max(params.num_tokens, decode_slots(r))
        if blocks_for(slots, engine.block_manager.block_size) > engine.block_manager.num_blocks:
            raise EngineError("the request's KV does not fit this decode replica's cache")
        self.poller.park(engine, r, params, slots)
        return r

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
        add = None if params is None else (lambda e: self._add_transferred(e, req, params))
        # Routing load in expected tokens: what requests typically generate here, capped by
        # max_tokens (a chat request without max_tokens carries the whole window).
        typical = self.output_len.value or DEFAULT_EXPECTED_TOKENS
        load = self.expected[req.request_id] = [min(req.params.max_tokens, int(typical)), 0]
        last = None
        try:
            async for chunk in _with_heartbeats(self.engine.generate(req, add=add),
                                                self.cfg.migration.stall_timeout_s / 4):
                if not chunk.heartbeat:
                    last = chunk
                    load[1] += len(chunk.token_ids)
                yield stamp(chunk, "decode_out")
        finally:
            self.expected.pop(req.request_id, None)
            hop_trace.forget(req.request_id)
        if last is not None and last.finished and last.finish_reason != "error":
            self.output_len.update(last.num_output_tokens)

    async def kv_probe(self, sender_address: str, num_bytes: int) -> dict:
        # Rank 0's receiver, off the engine thread; the channel's lock orders it with pulls.
        return await asyncio.to_thread(
            self.driver.core.handle_object, ProbeKV(sender_address, num_bytes))

    async def stats(self) -> dict:
        s = await super().stats()
        s["kv_receiver"] = self.driver.core.receiver.stats()
        s["kv_puller"] = self.driver.core.puller.stats()  # receive + scatter, rank 0
        s["num_waiting_for_kv"] = await self.engine.acall(
            lambda e: len(e.scheduler.awaiting_kv) + len(e.scheduler.receiving))
        s["autoscaling"] = self.recorder.autoscaling_stats(s)
        return s

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
        return self.recorder.autoscaling_stats(await self.engine.acall(lambda e: e.stats()))


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
