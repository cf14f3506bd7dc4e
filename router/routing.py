"""Replica choice: least-loaded first, by live queue lengths combined with what replicas report
in `record_routing_stats()` (refreshed every `ROUTING_STATS_PERIOD_S`).

Decode load is counted in expected tokens (what requests typically generate on that replica,
capped by their max_tokens), not in the clamped context window a chat request carries. The
routing stats lag by up to a period, so requests sent since the snapshot are added from
Serve's live queue-length cache (incremented on every send, decremented when a request ends):
a burst spreads over replicas instead of landing on the one that looked idle a second ago.

Cache-aware (prefix caching on, the default): each replica publishes the 8-byte heads of its
cached block hashes (`prefix` in its routing stats, workers/block_manager.py `summary`). The
router hashes the request's prompt the same way (chained over the replica's salt) and puts
first the replica holding the longest cached prefix, unless it is more than `max_load_gap`
requests busier than the least-loaded replica (then load decides: a hot prefix must not pile
every request onto one replica), and only if the cached prefix covers at least
`min_hit_fraction` of the prompt's full blocks. Routing works on block hashes, never on prompt text.

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

import time
from collections.abc import Callable, Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from mtpserve.workers.messages import TARGET_REPLICA, GenerateRequest
from mtpserve.workers.prefix_cache import block_hashes, short_hash

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


def load_in_requests(routing_stats: dict, queue_len: int | None) -> float:
    """`load_score` in requests (decode: expected tokens / tokens per request), the unit of
    the cache-aware load gap."""
    score = load_score(routing_stats, queue_len)
    if "ongoing_tokens" in routing_stats:
        return score / max(float(routing_stats.get("tokens_per_request", 1)), 1.0)
    return score


def rank_by_load(replicas: list, queue_len: Callable[[object], int | None]) -> list[list]:
    """Most- to least-preferred, one replica per rank (Serve tries them in order)."""
    ranked = sorted(replicas, key=lambda r: load_score(r.routing_stats or {}, queue_len(r)))
    return [[r] for r in ranked]


class PublishedPrefixes:
    """What the router believes each replica caches: the block hashes it published (as a set,
    rebuilt only when its stats change) plus those of the prompts routed to it since, for
    `routed_ttl_s` (the published stats lag by up to a refresh period; without this, two
    requests of a new prefix within a second would both look uncached and could split)."""

    def __init__(self, routed_ttl_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.routed_ttl_s = routed_ttl_s
        self.clock = clock
        self._sets: dict[object, tuple[tuple, set[int]]] = {}
        self._routed: dict[object, dict[int, float]] = {}  # replica -> hash -> expiry

    @staticmethod
    def _rid(replica) -> object:
        return getattr(replica, "replica_id", id(replica))

    def hashes(self, replica, tokens: Sequence[int],
               memo: dict[tuple[str, int], list[int]]) -> list[int] | None:
        """`tokens`' block hashes as `replica` names them (None before it has published)."""
        summary = (replica.routing_stats or {}).get("prefix")
        if not summary:
            return None
        key = (summary["salt"], int(summary["block_size"]))
        if key not in memo:
            memo[key] = [short_hash(h) for h in
                         block_hashes(tokens, key[1], bytes.fromhex(key[0]))]
        return memo[key]

    def _published(self, replica) -> set[int]:
        summary = (replica.routing_stats or {}).get("prefix") or {}
        names = summary.get("hashes") or []
        version = (summary.get("version"), len(names))
        rid = self._rid(replica)
        cached = self._sets.get(rid)
        if cached is None or cached[0] != version:
            cached = (version, set(names))
            self._sets[rid] = cached
        return cached[1]

    def _recent(self, replica) -> dict[int, float]:
        now = self.clock()
        routed = self._routed.get(self._rid(replica), {})
        for h in [h for h, t in routed.items() if t <= now]:
            del routed[h]
        return routed

    def cached_blocks(self, replica, tokens: Sequence[int],
                      memo: dict[tuple[str, int], list[int]]) -> int:
        """Leading blocks of `tokens` that `replica` is believed to cache."""
        hashes = self.hashes(replica, tokens, memo)
        if not hashes:
            return 0
        published, recent = self._published(replica), self._recent(replica)
        n = 0
        for h in hashes:
            if h not in published and h not in recent:
                break
            n += 1
        return n

    def num_cached(self, replica) -> int:
        return len(self._published(replica)) + len(self._recent(replica))

    def note_routed(self, replica, tokens: Sequence[int],
                    memo: dict[tuple[str, int], list[int]]) -> None:
        hashes = self.hashes(replica, tokens, memo)
        if hashes:
            expiry = self.clock() + self.routed_ttl_s
            self._routed.setdefault(self._rid(replica), {}).update(
                dict.fromkeys(hashes, expiry))


def rank_cache_aware(replicas: list, queue_len: Callable[[object], int | None],
                     tokens: Sequence[int] | None, prefixes: PublishedPrefixes,
                     max_load_gap: float, min_hit_fraction: float = 0.5) -> list[list]:
    """`rank_by_load`, with the replica holding the longest cached prefix of `tokens` moved
    first if it is at most `max_load_gap` requests busier than the least-loaded one. When
    none holds any of it, the least-loaded replica caching the fewest blocks goes first, so
    that new prefixes spread over the replicas' caches instead of evicting each other."""
    ranked = rank_by_load(replicas, queue_len)
    if not tokens or len(ranked) < 2:
        return ranked
    loads = {id(g[0]): load_in_requests(g[0].routing_stats or {}, queue_len(g[0]))
             for g in ranked}
    least = min(loads.values())
    memo: dict[tuple[str, int], list[int]] = {}
    best, best_hits = None, 0
    for g in ranked:  # least loaded first: ties go to the idler replica
        r = g[0]
        if loads[id(r)] > least + max_load_gap:
            continue
        hits = prefixes.cached_blocks(r, tokens, memo)
        total = len(prefixes.hashes(r, tokens, memo) or ())
        # A short shared head (a license header, a chat template's first block) is no reason
        # to give up load balance: the hit must cover a good part of the prompt.
        if hits > best_hits and hits >= min_hit_fraction * total:
            best, best_hits = g, hits
    if best is None:
        idle = [g for g in ranked if loads[id(g[0])] == least]
        best = min(idle, key=lambda g: prefixes.num_cached(g[0]))
    prefixes.note_routed(best[0], tokens, memo)
    if best is ranked[0]:
        return ranked
    return [best] + [g for g in ranked if g is not best]


def request_tokens(pending_request: PendingRequest | None) -> list[int] | None:
    """The token ids a prefill or decode call is about (its GenerateRequest argument)."""
    args = getattr(pending_request, "args", None) or ()
    req = args[0] if args else None
    if isinstance(req, GenerateRequest):
        return list(req.prompt_token_ids) + list(req.resume_token_ids)
    return None


def target_of(pending_request: PendingRequest | None) -> str | None:
    """The replica id a call is pinned to (its `TARGET_REPLICA` keyword), or None."""
    kwargs = getattr(pending_request, "kwargs", None) or {}
    target = kwargs.get(TARGET_REPLICA)
    return target if isinstance(target, str) and target else None


def unique_id(replica: RunningReplica) -> str:
    return replica.replica_id.unique_id


class CacheAwareRouter(FIFOMixin, RequestRouter):
    """Least-loaded, or cache-aware (module docstring); `request_router_kwargs`: `routing`
    ("cache_aware" | "least_loaded") and `max_load_gap` (requests)."""

    def initialize_state(self, routing: str = "cache_aware", max_load_gap: float = 4.0,
                         min_hit_fraction: float = 0.5, **_: object) -> None:
        self.routing = routing
        self.max_load_gap = max_load_gap
        self.min_hit_fraction = min_hit_fraction
        self.prefixes = PublishedPrefixes()

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
        if getattr(self, "routing", "least_loaded") == "cache_aware":
            return rank_cache_aware(candidate_replicas, self._queue_len,
                                    request_tokens(pending_request), self.prefixes,
                                    self.max_load_gap, self.min_hit_fraction)
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
