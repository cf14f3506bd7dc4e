"""Prefill deployment: chunked prefill through the main model and the MTP module(s); returns
the first token, holds the KV (main + MTP) and the first k drafts for a decode replica."""

from __future__ import annotations

import time

from ray import serve

from mtpserve.workers.engine import EngineError
from mtpserve.workers.messages import (
    ERROR_REQUEST,
    GenerateRequest,
    KVTransferParams,
    TokenChunk,
)
from mtpserve.workers.replica.metrics import EMA
from mtpserve.workers.replica.replica import EngineReplica


@serve.deployment(name="PrefillServer")
class PrefillServer(EngineReplica):
    role = "prefill"

    def __init__(self, cfg) -> None:
        # The engine core holds the metrics (TTFT histogram) and the windowed autoscaling
        # signals (prompt compute, queue); `self.replica_id` goes in every KVTransferParams
        # (the orchestrator's `release` is routed back here).
        super().__init__(cfg)
        self.latency_ms = EMA()
        self.inflight = 0

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        """Free a held request's KV at once (decode will not pull it: the first token ended
        the request, the client left between stages, or decode refused). False if the
        request is not held here (already pulled, released or unknown). `target_replica`
        (workers.messages.TARGET_REPLICA) is the routing hint that brought the call here."""
        return await self.core.call("release", request_id)

    async def renew(self, request_id: str, target_replica: str | None = None) -> bool:
        """Extend a held request's lease by `kv_transfer.hold_ttl_s` from now on every rank:
        the decode deployment is busy and the orchestrator is still offering the transfer.
        False if it is not held here (pulled, released, expired or unknown)."""
        return await self.core.call("renew", request_id)

    async def inject_fault(self, send_delay_s: float = 0.0, count: int = 1) -> None:
        """Tests only (MTPSERVE_ENABLE_FAULT_INJECTION=1): the next `count` KV sends on every
        prefill rank sleep `send_delay_s` first."""
        await self._fault(send_delay_s, count)

    async def prefill(self, req: GenerateRequest
                      ) -> tuple[TokenChunk, KVTransferParams | None]:
        """Run the prompt (plus any resumed tokens): the first token as the client's first
        chunk, and the params of the KV held for the decode side (None when that token
        already ended the request: nothing is held)."""
        self._check_alive()
        t0 = time.perf_counter()
        rid = req.request_id
        self.inflight += 1
        try:
            first = None
            async for chunk in self.core.generate(req, abort_on_exit=False):
                first = chunk
                break
            if first is not None and first.error_kind == ERROR_REQUEST:
                raise EngineError(first.error)  # its own inputs: a 400, never retried
            if first is None or first.finish_reason == "error":
                raise RuntimeError(first.error if first else "prefill produced no token")
            self.latency_ms.update((time.perf_counter() - t0) * 1000)
            if first.finished:
                return first, None
            # Held on the engine thread with the token (PrefillCore._annotate); the command
            # is the fallback should that have failed.
            params, first.kv_transfer = first.kv_transfer, None
            return first, params or await self.core.call("hold", rid, first.token_ids[0])
        except BaseException:
            # Cancelled (client gone) or failed: free the blocks now (a no-op if the request
            # is already gone); a hold that was already handed to the senders is released.
            self.core.cast("release_or_abort", rid)
            raise
        finally:
            self.inflight -= 1

    async def stats(self) -> dict:
        s = await super().stats()  # with the sender's stats (`PrefillCore.stats`)
        s["kv_addresses"] = self.kv_addresses
        s["prefill_latency_ms"] = self.latency_ms.value
        return s

    async def record_routing_stats(self) -> dict:
        return {"inflight": self.inflight, "prefix": await self.prefix_summary()}

    async def record_autoscaling_stats(self) -> dict:
        # Window aggregates that empty when idle (workers/replica/signals.py).
        return await self.core.call("autoscaling_stats")
