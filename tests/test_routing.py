"""Least-loaded replica choice: routing stats (expected tokens) combined with live queues."""

from __future__ import annotations

from types import SimpleNamespace

from router.routing import load_score, rank_by_load


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
