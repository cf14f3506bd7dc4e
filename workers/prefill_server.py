"""Prefill deployment: chunked prefill through the main model and the MTP module(s); returns
the first token, holds the KV (main + MTP) and the first k drafts for a decode replica."""

from __future__ import annotations

import time

import torch
from ray import serve

from cluster.metrics import EMA, metrics
from router.types import GenerateRequest, KVTransferParams
from workers.engine import Engine
from workers.replica import EngineReplica
from workers.scheduler import draft_slots
from workers.tp_group import AwaitRelease, HoldKV


@serve.deployment(name="PrefillServer")
class PrefillServer(EngineReplica):
    role = "prefill"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.driver.core.release_callback = self._on_release
        self.latency_ms = EMA()
        self.inflight = 0

    def _on_release(self, request_id: str, reason: str) -> None:
        # Called on rank 0's sender thread; the engine and the other ranks act on the engine
        # thread, in order with everything else.
        def release(engine: Engine) -> None:
            if self.driver.tp_size > 1:
                self.driver.run(AwaitRelease(request_id, self.cfg.kv_transfer.timeout_s))
            engine.release_prefilled(request_id)

        self.engine.call(release)

    async def prefill(self, req: GenerateRequest) -> KVTransferParams:
        """Run the prompt (plus any resumed tokens) and hold its KV for the decode side."""
        t0 = time.perf_counter()
        rid = req.request_id
        self.inflight += 1
        try:
            first = None
            async for chunk in self.engine.generate(req, abort_on_exit=False):
                first = chunk
                break
            if first is None or first.finish_reason == "error":
                raise RuntimeError(first.error if first else "prefill produced no token")
            self.latency_ms.update((time.perf_counter() - t0) * 1000)
            metrics()["ttft_ms"].observe(self.latency_ms.value)
            n_prompt = len(req.prompt_token_ids) + len(req.resume_token_ids)
            if first.finished:
                return KVTransferParams(rid, self.kv_addresses, self.driver.tp_size, 0, 0,
                                        n_prompt, first.token_ids[0], 0, True,
                                        first.finish_reason)
            return await self.engine.acall(lambda e: self._hold(e, rid, first.token_ids[0]))
        except BaseException:
            # Cancelled (client gone) or failed before the KV was handed to the sender: free
            # the blocks now; a no-op if the request is already gone.
            self.engine.call(lambda e: e.abort(rid))
            raise
        finally:
            self.inflight -= 1

    def _hold(self, engine: Engine, rid: str, first_token: int) -> KVTransferParams:
        r = engine.prefilled[rid]
        extras = {"draft_token_ids": torch.tensor(r.draft_token_ids, dtype=torch.long)}
        if r.draft_probs is not None:
            extras["draft_probs"] = r.draft_probs.float().contiguous()
        slots = draft_slots(r)  # committed prompt + the k-1 speculative MTP entries
        self.driver.run(HoldKV(rid, list(r.block_ids), slots, extras))
        return KVTransferParams(
            request_id=rid, sender_addresses=self.kv_addresses,
            prefill_tp_size=self.driver.tp_size,
            num_kv_heads=engine.model_config.num_key_value_heads, num_tokens=slots,
            num_computed_tokens=r.num_computed_tokens, first_token_id=first_token,
            num_drafts=len(r.draft_token_ids),
        )

    async def stats(self) -> dict:
        s = await super().stats()
        s["kv_sender"] = self.driver.core.sender.stats()
        s["kv_addresses"] = self.kv_addresses
        s["prefill_latency_ms"] = self.latency_ms.value
        return s

    def record_routing_stats(self) -> dict:
        return {"inflight": self.inflight}

    async def record_autoscaling_stats(self) -> dict:
        s = await self.engine.acall(lambda e: e.stats())
        out = {"queue": float(s["num_waiting"] + s["num_prefilling"] + self.inflight),
               "kv_usage": s["used_blocks"] / s["num_blocks"]}
        if self.latency_ms.value is not None:
            out["ttft_ms"] = self.latency_ms.value
        return out
