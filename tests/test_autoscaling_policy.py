"""Autoscaling decisions (pure functions) and the class policies over a Serve-like context."""

from __future__ import annotations

from types import SimpleNamespace

from cluster.autoscaling_policy import (
    DecodePolicy,
    DecodeSignals,
    PrefillPolicy,
    decide_decode,
    decide_prefill,
)


def test_decode_holds_without_metrics() -> None:
    assert decide_decode(3, DecodeSignals(None, None, None), 50, 0.3) == 3


def test_decode_scales_up_on_slow_tpot_or_full_kv() -> None:
    assert decide_decode(2, DecodeSignals(60, 0.7, 0.2), 50, 0.3) == 3
    assert decide_decode(2, DecodeSignals(20, 0.7, 0.9), 50, 0.3) == 3


def test_low_acceptance_brings_scale_up_forward() -> None:
    s = DecodeSignals(45, 0.1, 0.3)  # within the SLO but above 80% of it
    assert decide_decode(2, s, 50, 0.3) == 3
    assert decide_decode(2, DecodeSignals(45, 0.7, 0.3), 50, 0.3) == 2


def test_decode_scales_down_only_on_real_slack() -> None:
    assert decide_decode(3, DecodeSignals(10, 0.7, 0.2), 50, 0.3) == 2
    assert decide_decode(3, DecodeSignals(10, 0.7, 0.6), 50, 0.3) == 3  # KV still busy
    assert decide_decode(1, DecodeSignals(10, 0.7, 0.2), 50, 0.3) == 1


def test_prefill_policy() -> None:
    assert decide_prefill(1, None, None, 1000) == 1
    assert decide_prefill(1, 1500, 0, 1000) == 2
    assert decide_prefill(1, 100, 5, 1000) == 2
    assert decide_prefill(2, 100, 0, 1000) == 1


def ctx(metrics: dict, target: int = 2):
    return SimpleNamespace(aggregated_metrics=metrics, target_num_replicas=target,
                           policy_state={"x": 1})


def test_class_policies_read_aggregated_metrics() -> None:
    pol = DecodePolicy(target_tpot_ms=50, min_acceptance_rate=0.3)
    up, state = pol(ctx({"tpot_ms": {"a": 80.0, "b": 60.0}, "kv_usage": {"a": 0.1}}))
    assert up == 3 and state == {"x": 1}
    assert pol(ctx({}))[0] == 2
    assert PrefillPolicy(target_ttft_ms=100)(ctx({"ttft_ms": {"a": 500.0}}))[0] == 3
