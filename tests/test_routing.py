"""Least-loaded replica choice from what replicas report in record_routing_stats()."""

from __future__ import annotations

from types import SimpleNamespace

from router.routing import load_score, rank_by_load


def test_load_score_prefers_reported_load_over_queue() -> None:
    assert load_score({"ongoing_tokens": 10}, queue_len=99) == 10
    assert load_score({"inflight": 2}, queue_len=99) == 2
    assert load_score({}, queue_len=3) == 3


def test_rank_by_load_orders_least_loaded_first() -> None:
    a = SimpleNamespace(name="a", routing_stats={"ongoing_tokens": 500})
    b = SimpleNamespace(name="b", routing_stats={"ongoing_tokens": 20})
    c = SimpleNamespace(name="c", routing_stats=None)  # not reported yet: its queue counts
    queues = {"a": 0, "b": 0, "c": 100}
    ranked = rank_by_load([a, b, c], lambda r: queues[r.name])
    assert [group[0].name for group in ranked] == ["b", "c", "a"]
    assert all(len(group) == 1 for group in ranked)
