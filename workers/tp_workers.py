"""Ray side of a TP group: rank 0 lives in the Serve replica, ranks >= 1 are actors placed in
the replica's own placement-group bundles (so they die with the replica)."""

from __future__ import annotations

import socket
import threading
from dataclasses import replace

import ray
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from workers.tp_group import RankCore, RankSpec, TPDriver, worker_loop


@ray.remote(max_concurrency=2)
class TPWorker:
    """Ranks >= 1. `init` builds the shard (joins the TP group); `start` runs the loop."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.core: RankCore | None = None

    def init(self) -> str | None:
        self.core = RankCore(self.spec, self.rank)
        threading.Thread(target=worker_loop, args=(self.core,), daemon=True,
                         name=f"tp-rank{self.rank}").start()
        return self.core.kv_address

    def ping(self) -> bool:
        return self.core is not None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(spec: RankSpec, cpus_per_rank: float, gpus_per_rank: float
                ) -> tuple[TPDriver, list, list[str | None]]:
    """Build rank 0 here and ranks 1..tp-1 as actors in this replica's bundles 1..tp-1.

    Returns (driver, worker handles, KV sender address of every rank)."""
    tp = spec.tp_size
    if tp > 1:
        # All bundles of a replica are STRICT_PACKed on one node, so loopback reaches them.
        spec = replace(spec, init_method=f"tcp://127.0.0.1:{_free_port()}")
    pg = get_current_placement_group()
    workers = []
    for rank in range(1, tp):
        strategy = (PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=True) if pg is not None else None)
        workers.append(TPWorker.options(
            num_cpus=cpus_per_rank, num_gpus=gpus_per_rank, scheduling_strategy=strategy,
        ).remote(spec, rank))
    pending = [w.init.remote() for w in workers]
    core = RankCore(spec, 0)  # joins the group together with the workers' init
    addresses = [core.kv_address] + ray.get(pending)
    return TPDriver(core), workers, addresses
