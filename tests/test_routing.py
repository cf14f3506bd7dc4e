"""Least-loaded replica choice: routing stats (expected tokens) combined with live queues."""

from __future__ import annotations

from types import SimpleNamespace

from mtpserve.router.routing import load_score, rank_by_load


def test_load_score_counts_expected_tokens_plus_requests_sent_since_the_snapshot() -> None:
    stats = {"ongoing_tokens": 300, "num_requests": 2, "tokens_per_request": 100}
    assert load_score(stats, queue_len=2) == 300  # nothing new since the snapshot
    assert load_score(stats, queue_len=5) == 600  # three more requests, ~100 tokens each
    assert load_score(stats, queue_len=None) == 300
    assert load_score({"inflight": 2}, queue_len=5) == 5  # prefill: the live count wins
    assert load_score({"inflight": 4}, queue_len=1) == 4
    assert load_score({}, queue_len=3) == 3


def test_a_burst_spreads_over_replicas_between_stats_refreshes() -> None:
    # Both replicas reported idle a moment ago; the live queue cache has since seen 3 sends
    # to a: the next request must go to b, though the stale stats say they are equal.
    idle = {"ongoing_tokens": 0, "num_requests": 0, "tokens_per_request": 200}
    a = SimpleNamespace(name="a", routing_stats=dict(idle))
    b = SimpleNamespace(name="b", routing_stats=dict(idle))
    queues = {"a": 3, "b": 0}
    ranked = rank_by_load([a, b], lambda r: queues[r.name])
    assert [g[0].name for g in ranked] == ["b", "a"]


def test_rank_by_load_orders_least_loaded_first() -> None:
    a = SimpleNamespace(name="a", routing_stats={"ongoing_tokens": 500, "num_requests": 1})
    b = SimpleNamespace(name="b", routing_stats={"ongoing_tokens": 20, "num_requests": 1})
    c = SimpleNamespace(name="c", routing_stats=None)  # not reported yet: its queue counts
    queues = {"a": 1, "b": 1, "c": 100}
    ranked = rank_by_load([a, b, c], lambda r: queues[r.name])
    assert [group[0].name for group in ranked] == ["b", "c", "a"]
    assert all(len(group) == 1 for group in ranked)


# Calls pinned to one replica (the orchestrator's prefill release) ------------------------------

def _replica(uid: str, load: int) -> SimpleNamespace:
    from collections import namedtuple

    replica_id = namedtuple("ReplicaID", "unique_id")  # hashable, like Serve's
    return SimpleNamespace(replica_id=replica_id(uid),
                           routing_stats={"inflight": load})


def _pending(target: str | None = None) -> SimpleNamespace:
    import asyncio

    from mtpserve.workers.messages import TARGET_REPLICA

    loop = asyncio.new_event_loop()  # a future only needs a loop to exist
    return SimpleNamespace(args=["rid"], kwargs={TARGET_REPLICA: target} if target else {},
                           future=loop.create_future())


def _router(replicas: list) -> object:
    from collections import deque

    from mtpserve.router.routing import CacheAwareRouter

    router = CacheAwareRouter.__new__(CacheAwareRouter)  # Serve's constructor needs a cluster
    router._replicas = {r.replica_id.unique_id: r for r in replicas}
    router._replica_queue_len_cache = {}
    router._pending_requests_to_fulfill = deque()
    # Serve's bookkeeping around a hand-out (not what is tested here).
    router._cancel_routing_task_for_pending_request = lambda pr: None
    router._record_queue_wait_time = lambda pr: None
    router._remove_pending_request_from_indices = lambda pr: None
    return router


def test_a_pinned_call_goes_to_its_replica_or_anywhere_when_it_is_gone() -> None:
    import asyncio

    a, b = _replica("a", 0), _replica("b", 5)
    router = _router([a, b])
    choose = router.choose_replicas
    assert asyncio.run(choose([a, b], _pending("b"))) == [[b]]  # though a is less loaded
    assert asyncio.run(choose([a, b], _pending())) == [[a], [b]]
    assert asyncio.run(choose([a], _pending("b"))) == [[a]]  # b gone: a answers (no-op)


def test_fifo_hand_out_never_gives_a_pinned_call_another_replica() -> None:
    a, b = _replica("a", 0), _replica("b", 0)
    router = _router([a, b])
    pinned_b, free = _pending("b"), _pending()
    router._pending_requests_to_fulfill.extend([pinned_b, free])
    router._fulfill_next_pending_request(a)  # chosen for some call: the oldest eligible gets it
    assert not pinned_b.future.done() and free.future.result() is a
    router._fulfill_next_pending_request(b)
    assert pinned_b.future.result() is b
    gone = _pending("c")  # pinned to a replica that no longer exists: any replica will do
    router._pending_requests_to_fulfill.append(gone)
    router._fulfill_next_pending_request(a)
    assert gone.future.result() is a and not router._pending_requests_to_fulfill


# Cache-aware choice ------------------------------------------------------------------------------

def _cached(name: str, tokens: list[int], load: int, salt: bytes = b"m") -> SimpleNamespace:
    """A prefill replica that caches the full blocks of `tokens` (as its engine publishes)."""
    from mtpserve.workers.block_manager import BlockManager
    from mtpserve.workers.request import Request
    from mtpserve.workers.sampling_params import SamplingParams

    bm = BlockManager(64, 4, prefix_caching=True, salt=salt)
    r = Request("x", tokens, SamplingParams(), num_speculative_tokens=1)
    bm.ensure_capacity(r, len(tokens))
    bm.register(r, len(tokens))
    return SimpleNamespace(name=name, replica_id=name,
                           routing_stats={"inflight": load, "prefix": bm.summary(1000)})


def test_cache_aware_prefers_the_longest_cached_prefix_within_the_load_gap() -> None:
    from mtpserve.router.routing import PublishedPrefixes, rank_cache_aware

    p1, p2 = list(range(10, 50)), list(range(100, 140))
    a, b = _cached("a", p1, load=2), _cached("b", p2, load=0)
    queues = {"a": 2, "b": 0}

    def first(tokens, gap=4.0) -> str:  # a fresh router each time: published hashes only
        return rank_cache_aware([a, b], lambda r: queues[r.name], tokens, PublishedPrefixes(),
                                gap)[0][0].name

    assert first(p1 + [7, 7]) == "a"  # a holds it, 2 requests busier: within the gap
    assert first(p2 + [7, 7]) == "b"
    assert first([1, 2, 3, 4, 5, 6, 7, 8, 9]) == "b"  # nobody holds it: least loaded
    assert first(p1 + [7, 7], gap=1.0) == "b"  # a is too busy for its cache to count
    assert first(None) == "b"
    # Nobody holds it and the loads tie: the replica caching less takes the new prefix.
    queues["a"] = a.routing_stats["inflight"] = 0
    b.routing_stats["prefix"]["hashes"] += list(range(100))
    assert first([1, 2, 3, 4, 5, 6, 7, 8, 9]) == "a"
    a.routing_stats["prefix"]["hashes"] += list(range(200))
    assert first([1, 2, 3, 4, 5, 6, 7, 8, 9]) == "b"
    # Each replica's hashes are chained over its own salt (published with them).
    c = _cached("c", p1, load=1, salt=b"other")
    queues["c"] = 1
    assert rank_cache_aware([b, c], lambda r: queues[r.name], p1, PublishedPrefixes(),
                            4.0)[0][0].name == "c"


def test_prompts_routed_since_the_last_stats_count_until_they_expire() -> None:
    """Two new prefixes within one stats period: the second goes to the other replica, and a
    repeat of either follows its first request, before any replica has published it."""
    from mtpserve.router.routing import PublishedPrefixes, rank_cache_aware

    a, b = _cached("a", [], load=0), _cached("b", [], load=0)  # idle, nothing cached yet
    now = [0.0]
    prefixes = PublishedPrefixes(routed_ttl_s=10.0, clock=lambda: now[0])
    p1, p2 = list(range(10, 50)), list(range(100, 140))

    def first(tokens) -> str:
        return rank_cache_aware([a, b], lambda r: 0, tokens, prefixes, 4.0)[0][0].name

    assert [first(p1), first(p2), first(p1 + [1]), first(p2 + [2])] == ["a", "b", "a", "b"]
    now[0] = 11.0  # the notes expired and nothing was published: least-loaded again
    assert first(p2) == "a"


def test_request_tokens_reads_the_generate_request() -> None:
    from mtpserve.router.routing import request_tokens
    from mtpserve.workers.messages import GenerateRequest
    from mtpserve.workers.sampling_params import SamplingParams

    req = GenerateRequest("r", [1, 2, 3], SamplingParams(max_tokens=4), resume_token_ids=[9])
    assert request_tokens(SimpleNamespace(args=[req, None], kwargs={})) == [1, 2, 3, 9]
    assert request_tokens(SimpleNamespace(args=["rid"], kwargs={})) is None
    assert request_tokens(None) is None


def test_a_short_common_head_does_not_outweigh_load() -> None:
    """A hit on one block of a long prompt (a licence header) is below min_hit_fraction: load
    decides; a hit on most of it wins."""
    from mtpserve.router.routing import PublishedPrefixes, rank_cache_aware

    head, rest = list(range(10, 15)), list(range(100, 140))
    a, b = _cached("a", head + [7] * 3, load=1), _cached("b", [], load=0)
    queues = {"a": 1, "b": 0}

    def first(tokens) -> str:
        return rank_cache_aware([a, b], lambda r: queues[r.name], tokens, PublishedPrefixes(),
                                4.0, 0.5)[0][0].name

    assert first(head + [7] * 3 + rest) == "b"  # 1 of 11 blocks cached on a
    a2 = _cached("a", head + [7] * 3 + rest[:30], load=1)
    assert rank_cache_aware([a2, b], lambda r: queues["a" if r is a2 else "b"],
                            head + [7] * 3 + rest, PublishedPrefixes(), 4.0,
                            0.5)[0][0].name == "a"
