"""Prefill deployment: chunked prefill through the main model and the MTP module(s); returns
the first token, holds the KV (main + MTP) and the first k drafts for a decode replica."""

from __future__ import annotations

import time

import torch
from ray import serve

from mtpserve.workers.engine import Engine, EngineError
from mtpserve.workers.messages import (
    ERROR_REQUEST,
    GenerateRequest,
    KVTransferParams,
    TokenChunk,
)
from mtpserve.workers.replica.arrivals import PrefillHolds
from mtpserve.workers.replica.metrics import EMA, attach_replica_metrics
from mtpserve.workers.replica.replica import EngineReplica, replica_tag
from mtpserve.workers.replica.tp_commands import HoldKV
from mtpserve.workers.scheduler import draft_slots


@serve.deployment(name="PrefillServer")
class PrefillServer(EngineReplica):
    role = "prefill"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.latency_ms = EMA()
        self.inflight = 0
        # Metrics (TTFT histogram) and windowed autoscaling signals (prompt compute, queue).
        self.recorder = attach_replica_metrics(self, "prefill")
        # Put in every KVTransferParams: the orchestrator's `release` is routed back here.
        self.replica_id = replica_tag()

    def _make_poller(self) -> PrefillHolds:
        # Frees held blocks once every rank's sender released them (acked, expired, failed).
        return PrefillHolds(self.driver)

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        """Free a held request's KV at once (decode will not pull it: the first token ended
        the request, the client left between stages, or decode refused). False if the
        request is not held here (already pulled, released or unknown). `target_replica`
        (workers.messages.TARGET_REPLICA) is the routing hint that brought the call here."""
        return await self.engine.acall(lambda e: self.poller.release(request_id))

    async def renew(self, request_id: str, target_replica: str | None = None) -> bool:
        """Extend a held request's lease by `kv_transfer.hold_ttl_s` from now on every rank:
        the decode deployment is busy and the orchestrator is still offering the transfer.
        False if it is not held here (pulled, released, expired or unknown)."""
        from mtpserve.workers.replica.tp_commands import RenewKV

        def renew(e) -> bool:
            if request_id not in self.driver.core.holds:
                return False
            return bool(self.driver.run(RenewKV(request_id)))

        return await self.engine.acall(renew)

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
            async for chunk in self.engine.generate(req, abort_on_exit=False):
                first = chunk
                break
            if first is not None and first.error_kind == ERROR_REQUEST:
                raise EngineError(first.error)  # its own inputs: a 400, never retried
            if first is None or first.finish_reason == "error":
                raise RuntimeError(first.error if first else "prefill produced no token")
            self.latency_ms.update((time.perf_counter() - t0) * 1000)
            if first.finished:
                return first, None
            return first, await self.engine.acall(
                lambda e: self._hold(e, rid, first.token_ids[0]))
        except BaseException:
            # Cancelled (client gone) or failed: free the blocks now (a no-op if the request
            # is already gone); a hold that was already handed to the senders is released.
            self.engine.call(lambda e: self.poller.release(rid) or e.abort(rid))
            raise
        finally:
            self.inflight -= 1

    def _hold(self, engine: Engine, rid: str, first_token: int) -> KVTransferParams:
        r = engine.prefilled[rid]
        extras = {"draft_token_ids": torch.tensor(r.draft_token_ids, dtype=torch.long)}
        if r.draft_probs is not None:
            extras["draft_probs"] = r.draft_probs.float().contiguous()
        slots = draft_slots(r)  # committed prompt + the k-1 speculative MTP entries
        state_slot = engine.block_manager.state_slot(r) if engine.hybrid else None
        self.driver.run(HoldKV(rid, list(r.block_ids), slots, extras, state_slot))
        return KVTransferParams(
            request_id=rid, sender_addresses=self.kv_addresses,
            prefill_tp_size=self.driver.tp_size,
            num_kv_heads=engine.model_config.num_cache_heads, num_tokens=slots,
            num_computed_tokens=r.num_computed_tokens, first_token_id=first_token,
            num_drafts=len(r.draft_token_ids), prefill_replica=self.replica_id,
        )

    async def stats(self) -> dict:
        s = await super().stats()
        s["kv_sender"] = self.driver.core.sender.stats()
        s["kv_addresses"] = self.kv_addresses
        s["prefill_latency_ms"] = self.latency_ms.value
        return s

    async def record_routing_stats(self) -> dict:
        return {"inflight": self.inflight, "prefix": await self.prefix_summary()}

    async def record_autoscaling_stats(self) -> dict:
        # Window aggregates that empty when idle (workers/replica/signals.py).
        return self.recorder.autoscaling_stats(await self.engine.acall(lambda e: e.stats()))
