"""Replica choice: least-loaded first, by live queue lengths combined with what replicas report
in `record_routing_stats()` (refreshed every `ROUTING_STATS_PERIOD_S`).

Decode load is counted in expected tokens (what requests typically generate on that replica,
capped by their max_tokens), not in the clamped context window a chat request carries. The
routing stats lag by up to a period, so requests sent since the snapshot are added from
Serve's live queue-length cache (incremented on every send, decremented when a request ends):
a burst spreads over replicas instead of landing on the one that looked idle a second ago.

A Ray Serve custom request router: the ranked list goes most- to least-preferred, so Serve
falls back to the next replica when the first rejects (queue full).
"""

from __future__ import annotations

from collections.abc import Callable

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

# How often Serve refreshes each replica's routing stats (RequestRouterConfig).
ROUTING_STATS_PERIOD_S = 1.0


def load_score(routing_stats: dict, queue_len: int | None) -> float:
    """Lower is better. `queue_len`: the replica's live ongoing requests (None: unknown)."""
    live = queue_len or 0
    if "ongoing_tokens" in routing_stats:  # decode: expected tokens still to generate
        reported = int(routing_stats.get("num_requests", 0))
        per_request = float(routing_stats.get("tokens_per_request", 1))
        unseen = max(live - reported, 0)  # sent after the stats snapshot
        return float(routing_stats["ongoing_tokens"]) + unseen * per_request
    if "inflight" in routing_stats:  # prefill: requests being prefilled
        return float(max(int(routing_stats["inflight"]), live))
    return float(live)


def rank_by_load(replicas: list, queue_len: Callable[[object], int | None]) -> list[list]:
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

    def _queue_len(self, replica: RunningReplica) -> int | None:
        cache = getattr(self, "_replica_queue_len_cache", None)
        return cache.get(replica.replica_id) if cache is not None else None
