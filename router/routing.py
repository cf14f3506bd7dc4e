"""Replica choice: least-loaded first, by what each replica reports in
`record_routing_stats()` (decode: tokens still to generate; prefill: requests in flight).

A Ray Serve custom request router: the ranked list goes most- to least-preferred, so Serve
falls back to the next replica when the first rejects (queue full).
"""

from __future__ import annotations

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica


def load_score(routing_stats: dict, queue_len: int) -> float:
    """Lower is better: reported load when the replica has reported, else its queue."""
    if "ongoing_tokens" in routing_stats:
        return float(routing_stats["ongoing_tokens"])
    if "inflight" in routing_stats:
        return float(routing_stats["inflight"])
    return float(queue_len)


def rank_by_load(replicas: list, queue_len) -> list[list]:
    """Most- to least-preferred, one replica per rank (Serve tries them in order)."""
    ranked = sorted(replicas, key=lambda r: load_score(r.routing_stats or {}, queue_len(r)))
    return [[r] for r in ranked]


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        return rank_by_load(candidate_replicas, self._queue_len)

    def _queue_len(self, replica: RunningReplica) -> int:
        cache = getattr(self, "_replica_queue_len_cache", None)
        value = cache.get(replica.replica_id) if cache is not None else None
        return value or 0
