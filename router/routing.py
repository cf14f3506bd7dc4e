"""Replica choice: least-loaded first, by live queue lengths combined with what replicas report
in `record_routing_stats()` (refreshed every `ROUTING_STATS_PERIOD_S`).

Decode load is counted in expected tokens (what requests typically generate on that replica,
capped by their max_tokens), not in the clamped context window a chat request carries. The
routing stats lag by up to a period, so requests sent since the snapshot are added from
Serve's live queue-length cache (incremented on every send, decremented when a request ends):
a burst spreads over replicas instead of landing on the one that looked idle a second ago.

A Ray Serve custom request router: the ranked list goes most- to least-preferred, so Serve
falls back to the next replica when the first rejects (queue full).

A call with the keyword `TARGET_REPLICA` (workers.messages) goes to exactly that replica: the
orchestrator's `PrefillServer.release` must reach the prefill replica holding the KV. When that
replica is gone, the call goes to the least-loaded one, which holds nothing under that request
id and answers False (a no-op; the holder's KV went with it). Serve's FIFO fulfilment hands a
chosen replica to the oldest pending call, which may be another call's: it skips calls pinned to
a different live replica, so a pinned call is only ever given its own replica.
"""

from __future__ import annotations

from collections.abc import Callable

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from mtpserve.workers.messages import TARGET_REPLICA

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


def target_of(pending_request: PendingRequest | None) -> str | None:
    """The replica id a call is pinned to (its `TARGET_REPLICA` keyword), or None."""
    kwargs = getattr(pending_request, "kwargs", None) or {}
    target = kwargs.get(TARGET_REPLICA)
    return target if isinstance(target, str) and target else None


def unique_id(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


class LeastLoadedRouter(FIFOMixin, RequestRouter):
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        target = target_of(pending_request)
        if target is not None:
            pinned = [r for r in candidate_replicas if unique_id(r) == target]
            if pinned:
                return [pinned]
            # Gone: any replica answers (nothing is held there under that id).
        return rank_by_load(candidate_replicas, self._queue_len)

    def _fulfill_next_pending_request(self, replica: RunningReplica, request_metadata=None
                                      ) -> None:
        """FIFOMixin's hand-out (the oldest pending call gets the chosen replica), skipping
        calls pinned to another live replica. Overrides a private hook of Ray 2.60's
        RequestRouter (pyproject pins ray 2.60.x; tests/test_routing.py covers it)."""
        queue = self._pending_requests_to_fulfill
        while queue and queue[0].future.done():  # lazily dropped (cancelled or fulfilled)
            queue.popleft()
        chosen = unique_id(replica)
        live = {unique_id(r) for r in getattr(self, "_replicas", {}).values()}
        for i, pr in enumerate(queue):
            if pr.future.done():
                continue
            target = target_of(pr)
            if target is not None and target != chosen and target in live:
                continue
            del queue[i]
            self._cancel_routing_task_for_pending_request(pr)
            self._record_queue_wait_time(pr)
            pr.future.set_result(replica)
            self._remove_pending_request_from_indices(pr)
            return

    def _queue_len(self, replica: RunningReplica) -> int | None:
        cache = getattr(self, "_replica_queue_len_cache", None)
        return cache.get(replica.replica_id) if cache is not None else None
