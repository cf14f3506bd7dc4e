"""Ray side of a TP group: rank 0 lives in the Serve replica, ranks >= 1 are actors placed in
the replica's own placement-group bundles (so they die with the replica)."""

from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import replace
from datetime import timedelta

import ray
import torch.distributed as dist
from ray.util import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from mtpserve.workers.kv_transfer.channel import listen_store
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


class Rendezvous:
    """Rank 0's TP rendezvous store, open only while the group forms.

    All bundles of a replica are STRICT_PACKed on one node, so the store listens on that
    node's loopback address only (`init_process_group(init_method="tcp://...")` would have
    rank 0 host it on every interface, for the replica's life). `close()` once every rank
    has joined: the groups (gloo connections, NCCL communicators built eagerly by RankCore)
    no longer need it, and nothing outside the replica can then reach it."""

    def __init__(self, host: str = "127.0.0.1", timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        self.host = host
        self._timeout = timedelta(seconds=timeout_s)
        self._server: dist.TCPStore | None = listen_store(host, 0, self._timeout)
        self.port = self._server.port
        self.init_method = f"tcp://{host}:{self.port}"  # what ranks >= 1 join through

    def client(self) -> dist.TCPStore:
        """A client of the store, for rank 0 (RankCore(spec, 0, store=...))."""
        return dist.TCPStore(self.host, self.port, None, False, self._timeout)

    def close(self) -> None:
        """Stop listening (the server goes with its last reference, held only here)."""
        self._server = None

    @property
    def closed(self) -> bool:
        return self._server is None


def spawn_workers(spec: RankSpec, cpus_per_rank: float, gpus_per_rank: float
                  ) -> tuple[RankSpec, list, list, Rendezvous]:
    """Ranks 1..tp-1 as actors in this replica's bundles 1..tp-1, joining the rendezvous
    store this process hosts. Returns (the spec with its `init_method`, the actors, their
    pending `init` results: KV sender addresses, the rendezvous to close once every rank
    joined). Rank 0 joins from here (`start_group`) or from an engine core process."""
    # All bundles of a replica are STRICT_PACKed on one node, so loopback reaches them.
    rendezvous = Rendezvous()
    spec = replace(spec, init_method=rendezvous.init_method)
    pg = get_current_placement_group()
    workers = []
    for rank in range(1, spec.tp_size):
        strategy = (PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=rank,
            placement_group_capture_child_tasks=True) if pg is not None else None)
        workers.append(TPWorker.options(
            num_cpus=cpus_per_rank, num_gpus=gpus_per_rank, scheduling_strategy=strategy,
        ).remote(spec, rank))
    return spec, workers, [w.init.remote() for w in workers], rendezvous


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
    spec, workers, pending, rendezvous = spawn_workers(spec, cpus_per_rank, gpus_per_rank)
    # Rank 0 joins the group on a helper thread so that the wait below is bounded.
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tp-rank0-init")
    rank0 = pool.submit(RankCore, spec, 0, rendezvous.client())
    pool.shutdown(wait=False)
    try:
        addresses = ray.get(pending, timeout=startup_timeout_s)
        core = rank0.result(timeout=startup_timeout_s)
    except (ray.exceptions.GetTimeoutError, concurrent.futures.TimeoutError) as e:
        for w in workers:
            ray.kill(w)
        raise TimeoutError(f"TP group of {tp} ranks did not start within "
                           f"{startup_timeout_s:.0f}s") from e
    finally:
        rendezvous.close()  # every rank has joined (or the replica fails to start)
    return TPDriver(core), workers, [core.kv_address, *addresses]
