"""Ray side of a TP group: rank 0 lives in the Serve replica, ranks >= 1 are actors placed in
the replica's own placement-group bundles (so they die with the replica)."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
from dataclasses import replace

import ray
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mtpserve.workers.replica.tp_group import RankCore, RankSpec, TPDriver, worker_loop

# Longest a replica waits for its TP workers to be placed, load their shards and join the
# group; past it the replica fails to start (Serve retries it) instead of hanging.
STARTUP_TIMEOUT_S = 600.0


@ray.remote(max_concurrency=2)
class TPWorker:
    """Ranks >= 1. `init` builds the shard (joins the TP group) and starts the rank loop."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        self.core: RankCore | None = None
        self.thread: threading.Thread | None = None

    def init(self) -> str | None:
        self.core = RankCore(self.spec, self.rank)
        self.thread = threading.Thread(target=worker_loop, args=(self.core,), daemon=True,
                                       name=f"tp-rank{self.rank}")
        self.thread.start()
        return self.core.kv_address

    def ping(self) -> bool:
        """Alive and its rank loop has not failed (the control-group ping is the real test)."""
        return (self.core is not None and not self.core.failed
                and self.thread is not None and self.thread.is_alive())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_group(spec: RankSpec, cpus_per_rank: float, gpus_per_rank: float,
                startup_timeout_s: float = STARTUP_TIMEOUT_S
                ) -> tuple[TPDriver, list, list[str | None]]:
    """Build rank 0 here and ranks 1..tp-1 as actors in this replica's bundles 1..tp-1.

    Returns (driver, worker handles, KV sender address of every rank). Raises TimeoutError
    (after killing the workers) if the group is not up within `startup_timeout_s`."""
    tp = spec.tp_size
    if tp == 1:
        core = RankCore(spec, 0)
        return TPDriver(core), [], [core.kv_address]
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
    # Rank 0 joins the group on a helper thread so that the wait below is bounded.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tp-rank0-init")
    rank0 = pool.submit(RankCore, spec, 0)
    pool.shutdown(wait=False)
    try:
        addresses = ray.get(pending, timeout=startup_timeout_s)
        core = rank0.result(timeout=startup_timeout_s)
    except (ray.exceptions.GetTimeoutError, concurrent.futures.TimeoutError) as e:
        for w in workers:
            ray.kill(w)
        raise TimeoutError(f"TP group of {tp} ranks did not start within "
                           f"{startup_timeout_s:.0f}s") from e
    return TPDriver(core), workers, [core.kv_address, *addresses]
