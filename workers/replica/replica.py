"""What the prefill and decode Serve deployments share: a TP group driving an engine on a
background thread, plus health and stats for routing and autoscaling."""

from __future__ import annotations

import logging
import os

from mtpserve.workers.async_engine import AsyncEngine, Poller
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.replica.addresses import resolve_kv_endpoint
from mtpserve.workers.replica.tp_group import RankSpec
from mtpserve.workers.replica.tp_workers import start_group

logger = logging.getLogger(__name__)

# check_health fails if the engine thread has not answered a ping of every TP rank within
# this long (it waits behind the current step, so it must exceed the longest step).
HEALTH_DEADLINE_S = float(os.environ.get("MTPSERVE_HEALTH_DEADLINE_S", "30"))


def fault_injection_enabled() -> bool:
    return os.environ.get("MTPSERVE_ENABLE_FAULT_INJECTION") == "1"


class ReplicaUnavailableError(RuntimeError):
    """This replica's TP group failed: it refuses new work until Serve replaces it (the
    orchestrator retries such a refusal on another replica, as for a dead one)."""


class EngineReplica:
    """Base of the prefill and decode deployments.

    `cfg` is the cluster's validated config (`mtpserve.cluster.config.ClusterConfig`), passed
    in by the app builder and read by attribute: the shells never import the cluster layer
    (dependencies point one way, docs/architecture.md)."""

    role: str

    def __init__(self, cfg) -> None:
        side = cfg.prefill if self.role == "prefill" else cfg.decode
        self.cfg = cfg
        kv = cfg.kv_transfer
        host, interface = resolve_kv_endpoint(
            getattr(kv, "host", None) or os.environ.get("MTPSERVE_KV_HOST"),
            getattr(kv, "interface", None))
        spec = RankSpec(
            model=cfg.model, role=self.role, tp_size=side.tp_size,
            num_kv_blocks=side.num_kv_blocks, block_size=cfg.block_size, dtype=cfg.dtype,
            device=cfg.device, kv_backend=kv.backend, kv_host=host, kv_interface=interface,
            kv_timeout_s=kv.timeout_s, kv_hold_ttl_s=kv.hold_ttl_s,
            kv_max_concurrent_pulls=kv.max_concurrent_pulls, kv_max_pairs=kv.max_pairs_per_rank,
            kv_send_buffer_budget_mib=kv.send_buffer_budget_mib,
            kv_store_port_range=kv.store_port_range,
            num_threads=max(1, int(side.cpus_per_rank)),
            draft_vocab_size=cfg.speculation.draft_vocab_size, compile=cfg.engine.compile,
            compile_cache_dir=cfg.engine.compile_cache_dir,
            attention_backend=cfg.engine.attention_backend,
            # Of the rank's share of its GPU: two ranks at 0.5 GPU each split one device.
            kv_cache_memory_fraction=cfg.engine.kv_cache_memory_fraction
            * min(1.0, side.gpus_per_rank or 1.0),
            kv_secret=getattr(kv, "secret", None),
            num_state_slots=getattr(side, "max_num_seqs", 64),
        )
        self.driver, self.workers, self.kv_addresses = start_group(
            spec, side.cpus_per_rank, side.gpus_per_rank)
        engine = Engine(EngineConfig(
            model=cfg.model, dtype=cfg.dtype, device=cfg.device,
            num_speculative_tokens=cfg.speculation.num_speculative_tokens,
            adaptive_k=cfg.speculation.adaptive and self.role == "decode",
            block_size=cfg.block_size,
            # The pool the ranks built (sized from memory on CUDA when not configured).
            num_kv_blocks=self.driver.runner.kv_cache.num_blocks,
            max_num_seqs=getattr(side, "max_num_seqs", 64),
            max_num_batched_tokens=getattr(side, "max_num_batched_tokens", 512),
            max_model_len=cfg.max_model_len, role=self.role, compile=cfg.engine.compile,
            warmup_budget_s=cfg.engine.warmup_budget_s,
            warmup_restart_budget_s=cfg.engine.warmup_restart_budget_s,
            compile_cache_dir=cfg.engine.compile_cache_dir,
            attention_backend=cfg.engine.attention_backend,
            prefix_caching=cfg.prefix_caching.enabled,
        ), runner=self.driver)  # warms up the decode graphs before Serve sees it ready
        self.poller = self._make_poller()
        self.poller.engine = engine
        self.engine = AsyncEngine(engine, self.poller)
        self.driver.core.on_event = self.engine.wake  # transfer threads wake the engine

    async def prefix_summary(self) -> dict | None:
        """The cached block hashes this replica publishes in its routing stats (None with
        prefix caching off or routing by load only)."""
        pc = self.cfg.prefix_caching
        if not pc.enabled or pc.routing != "cache_aware":
            return None
        return await self.engine.acall(
            lambda e: e.block_manager.summary(pc.published_blocks))

    def _make_poller(self) -> Poller:
        raise NotImplementedError

    def _check_alive(self) -> None:
        if self.driver.failed or self.driver.core.failed:
            raise ReplicaUnavailableError("this replica's TP group failed; it is being replaced")

    async def stats(self) -> dict:
        s = await self.engine.acall(lambda e: e.stats())
        s["replica"] = replica_tag()  # which replica answered (Serve routes each call to one)
        s["node_id"], s["node_address"] = replica_node()  # the address only for admins
        return s

    async def check_health(self) -> None:
        """Ping every TP rank over the control group (on the engine thread, with a deadline);
        raises if a rank died, hangs or reported a failure, so Serve replaces the replica."""
        await self.engine.ping(lambda e: self.driver.ping(), HEALTH_DEADLINE_S)

    async def _fault(self, delay_s: float, count: int) -> None:
        from mtpserve.workers.replica.tp_commands import InjectFault

        if not fault_injection_enabled():
            raise RuntimeError("fault injection is disabled (MTPSERVE_ENABLE_FAULT_INJECTION)")
        await self.engine.acall(lambda e: self.driver.run(InjectFault(delay_s, count)))

    def __del__(self) -> None:
        try:
            self.engine.shutdown()
        except Exception:
            pass


def replica_node() -> tuple[str | None, str | None]:
    """(Ray node id, node IP) of this replica's node: where its TP group runs."""
    try:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # outside Ray
        return None, None


def replica_tag() -> str | None:
    """Serve's unique id of this replica (its actor is SERVE_REPLICA::<app>#<Deployment>#<id>)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (tests that build the server class directly)
        return None
