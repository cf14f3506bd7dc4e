"""What the prefill and decode Serve deployments share: an engine core (a TP group driving an
engine on a background thread, in this process or in a child process: `engine_core`), plus
health and stats for routing and autoscaling."""

from __future__ import annotations

import logging
import os
import threading

from mtpserve.workers.replica.engine_core import (
    HOSTS,
    ReplicaUnavailableError,
    ThreadCore,
    rank_spec,
    role_settings,
)
from mtpserve.workers.replica.tp_workers import start_group

logger = logging.getLogger(__name__)

# check_health fails if the engine thread has not answered a ping of every TP rank within
# this long (it waits behind the current step, so it must exceed the longest step).
HEALTH_DEADLINE_S = float(os.environ.get("MTPSERVE_HEALTH_DEADLINE_S", "30"))


def fault_injection_enabled() -> bool:
    return os.environ.get("MTPSERVE_ENABLE_FAULT_INJECTION") == "1"


class EngineReplica:
    """Base of the prefill and decode deployments.

    `cfg` is the cluster's validated config (`mtpserve.cluster.config.ClusterConfig`), passed
    in by the app builder and read by attribute: the shells never import the cluster layer
    (dependencies point one way, docs/architecture.md).

    `self.core` is the engine core (workers/replica/engine_core.py): named commands in,
    token chunks out. With `engine_core: thread` it runs here and `driver`, `engine`
    (`AsyncEngine`), `poller` and `recorder` are its parts, for tests to inspect; with
    `engine_core: process` they live in the child process and are None here."""

    role: str

    def __init__(self, cfg) -> None:
        side = role_settings(cfg, self.role)
        self.cfg = cfg
        self.replica_id = replica_tag()  # prefill: put in every KVTransferParams (`release`)
        self.engine_core = (os.environ.get("MTPSERVE_ENGINE_CORE")
                            or side.engine_core)
        self.driver = self.engine = self.poller = self.recorder = None
        if self.engine_core == "process":
            from mtpserve.workers.replica.engine_core_proc import ProcessCore
            from mtpserve.workers.replica.metrics import replica_key

            self.core = ProcessCore(cfg, self.role, self.replica_id)
            self.workers, self.kv_addresses = self.core.workers, self.core.kv_addresses
            self._pusher = start_core_pusher(self.core, replica_key(self.role))
            return
        self.driver, self.workers, self.kv_addresses = start_group(
            rank_spec(cfg, self.role), side.cpus_per_rank, side.gpus_per_rank)
        host = HOSTS[self.role](cfg, self.driver, self.kv_addresses, self.replica_id)
        self.core = ThreadCore(host)
        self.engine, self.poller, self.recorder = host.engine, host.poller, host.recorder

    async def prefix_summary(self) -> dict | None:
        """The cached block hashes this replica publishes in its routing stats (None with
        prefix caching off or routing by load only)."""
        pc = self.cfg.prefix_caching
        if not pc.enabled or pc.routing != "cache_aware":
            return None
        return await self.core.call("prefix_summary", pc.published_blocks)

    def _check_alive(self) -> None:
        core = getattr(self, "core", None)
        if (self.driver.failed or self.driver.core.failed) if core is None else core.failed:
            raise ReplicaUnavailableError("this replica's TP group or engine core failed; it "
                                          "is being replaced")

    async def stats(self) -> dict:
        s = await self.core.call("stats")
        s["replica"] = replica_tag()  # which replica answered (Serve routes each call to one)
        s["node_id"], s["node_address"] = replica_node()  # the address only for admins
        return s

    async def check_health(self) -> None:
        """Ping every TP rank over the control group (on the engine thread, with a deadline);
        raises if a rank died, hangs or reported a failure, or the engine core process died
        or stopped its heartbeat, so Serve replaces the replica."""
        await self.core.ping(HEALTH_DEADLINE_S)

    async def _fault(self, delay_s: float, count: int) -> None:
        if not fault_injection_enabled():
            raise RuntimeError("fault injection is disabled (MTPSERVE_ENABLE_FAULT_INJECTION)")
        await self.core.call("fault", delay_s, count)

    def shutdown(self) -> None:
        """Stop the engine core (a child process is stopped and waited for)."""
        pusher = getattr(self, "_pusher", None)
        if pusher is not None:
            pusher.set()
        core = getattr(self, "core", None)
        if core is not None:
            core.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:
            pass


def start_core_pusher(core, key: str, interval_s: float = 1.0) -> threading.Event:
    """`engine_core: process`: push the core's metrics snapshot to the hub every
    `interval_s` (the recorder lives in the core; the shell has the Ray connection)."""
    stop = threading.Event()

    def loop() -> None:
        import ray

        from mtpserve.workers.replica.metrics import hub

        while not stop.wait(interval_s):
            if not ray.is_initialized() or core.dead:
                continue
            try:
                hub().push.remote(core.call_sync("metrics", key, timeout_s=5.0))
            except Exception:  # monitoring must never take the replica down
                logger.debug("metrics push failed", exc_info=True)

    threading.Thread(target=loop, name="metrics-push", daemon=True).start()
    return stop


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
