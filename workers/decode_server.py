"""Decode deployment: one replica = one TP group running speculative rounds with continuous
batching. Requests arrive with `KVTransferParams`; every rank pulls its KV-head slice."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from cluster.metrics import EMA, metrics
from router.types import GenerateRequest, KVTransferParams, TokenChunk
from workers.async_engine import sampling_params
from workers.engine import Engine, EngineError
from workers.replica import EngineReplica
from workers.request import Request
from workers.scheduler import decode_slots
from workers.tp_group import ProbeKV, PullKV


class KVTransferFailed(RuntimeError):
    pass


@serve.deployment(name="DecodeServer")
class DecodeServer(EngineReplica):
    role = "decode"

    def __init__(self, cfg) -> None:
        super().__init__(cfg)
        self.tpot_ms = EMA()
        self.acceptance = EMA(alpha=0.1)
        self.ongoing_tokens = 0  # tokens still to generate across running requests

    def _add_transferred(self, engine: Engine, req: GenerateRequest,
                         params: KVTransferParams) -> Request:
        r = engine.make_request(req.request_id, req.prompt_token_ids + req.resume_token_ids,
                                sampling_params(req))
        r.output_token_ids.append(params.first_token_id)
        r.num_computed_tokens = params.num_computed_tokens
        if r.num_speculative_tokens != params.num_drafts:
            raise EngineError(f"prefill drafted {params.num_drafts} tokens, this replica "
                              f"expects k={r.num_speculative_tokens}")
        if not engine.block_manager.ensure_capacity(r, max(params.num_tokens,
                                                           decode_slots(r))):
            raise EngineError("decode replica is out of KV blocks")
        ok, err, extras = self.driver.run(PullKV(
            req.request_id, params.sender_addresses, list(r.block_ids), params.num_kv_heads,
            self.cfg.kv_transfer.timeout_s))
        if not ok:
            engine.block_manager.free(r)
            raise KVTransferFailed(err)
        r.draft_token_ids = extras["draft_token_ids"].tolist()
        r.draft_probs = extras.get("draft_probs")
        engine.add_transferred(r)
        return r

    async def generate(self, req: GenerateRequest, params: KVTransferParams | None = None
                       ) -> AsyncIterator[TokenChunk]:
        """Stream tokens after the first one (which the prefill side produced). Without
        `params` the request is recomputed here from its prompt and resumed tokens."""
        add = None if params is None else (lambda e: self._add_transferred(e, req, params))
        remaining = req.max_tokens - len(req.resume_token_ids)
        self.ongoing_tokens += remaining
        t_first = time.perf_counter()
        last = None
        try:
            async for chunk in self.engine.generate(req, add=add):
                last = chunk
                metrics()["tokens"].inc(len(chunk.token_ids))
                yield chunk
        finally:
            self.ongoing_tokens -= remaining
        if last is not None and last.finished and last.num_output_tokens > 1:
            self.tpot_ms.update((time.perf_counter() - t_first) * 1000
                                / max(last.num_output_tokens - 1, 1))
            metrics()["tpot_ms"].observe(self.tpot_ms.value)
            if last.num_drafted:
                self.acceptance.update(last.num_accepted / last.num_drafted)
                metrics()["acceptance"].set(self.acceptance.value)

    async def kv_probe(self, sender_address: str, num_bytes: int) -> dict:
        # Rank 0 only, on the engine thread so it never interleaves with a KV pull.
        return await self.engine.acall(
            lambda e: self.driver.core.handle(ProbeKV(sender_address, num_bytes)))

    async def stats(self) -> dict:
        s = await super().stats()
        s["kv_receiver"] = self.driver.core.receiver.stats()
        s["tpot_ms"] = self.tpot_ms.value
        metrics()["kv_used"].set(s["used_blocks"])
        metrics()["k"].set(s["num_speculative_tokens"])
        return s

    def record_routing_stats(self) -> dict:
        return {"ongoing_tokens": self.ongoing_tokens}

    async def record_autoscaling_stats(self) -> dict:
        s = await self.engine.acall(lambda e: e.stats())
        out = {"kv_usage": s["used_blocks"] / s["num_blocks"],
               "running": float(s["num_running"] + s["num_waiting"])}
        if self.tpot_ms.value is not None:
            out["tpot_ms"] = self.tpot_ms.value
        if self.acceptance.value is not None:
            out["acceptance_rate"] = self.acceptance.value
        return out
