"""What the prefill and decode Serve deployments share: a TP group driving an engine on a
background thread, plus stats for routing and autoscaling."""

from __future__ import annotations

import logging

from cluster.config import ClusterConfig
from workers.async_engine import AsyncEngine
from workers.engine import Engine, EngineConfig
from workers.tp_group import RankSpec
from workers.tp_workers import start_group

logger = logging.getLogger(__name__)


class EngineReplica:
    role: str

    def __init__(self, cfg: ClusterConfig) -> None:
        import os

        side = cfg.prefill if self.role == "prefill" else cfg.decode
        self.cfg = cfg
        spec = RankSpec(
            model=cfg.model, role=self.role, tp_size=side.tp_size,
            num_kv_blocks=side.num_kv_blocks, block_size=cfg.block_size, dtype=cfg.dtype,
            device=cfg.device, kv_backend=cfg.kv_transfer.backend,
            kv_host=os.environ.get("MTPSERVE_KV_HOST", "127.0.0.1"),
            kv_timeout_s=cfg.kv_transfer.timeout_s, kv_hold_ttl_s=cfg.kv_transfer.hold_ttl_s,
            num_threads=max(1, int(side.cpus_per_rank)),
        )
        self.driver, self.workers, self.kv_addresses = start_group(
            spec, side.cpus_per_rank, side.gpus_per_rank)
        engine = Engine(EngineConfig(
            model=cfg.model, dtype=cfg.dtype, device=cfg.device,
            num_speculative_tokens=cfg.speculation.num_speculative_tokens,
            adaptive_k=cfg.speculation.adaptive and self.role == "decode",
            block_size=cfg.block_size, num_kv_blocks=side.num_kv_blocks,
            max_num_seqs=getattr(side, "max_num_seqs", 64),
            max_num_batched_tokens=getattr(side, "max_num_batched_tokens", 512),
            max_model_len=cfg.max_model_len, role=self.role,
        ), runner=self.driver)
        self.engine = AsyncEngine(engine)

    async def stats(self) -> dict:
        return await self.engine.acall(lambda e: e.stats())

    def check_health(self) -> None:
        if not self.engine._thread.is_alive():
            raise RuntimeError("engine thread died")

    def __del__(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            pass
