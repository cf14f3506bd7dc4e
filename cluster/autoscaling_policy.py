"""Custom Ray Serve autoscaling policies keyed on decode latency, acceptance and KV usage.

Replicas report numbers from `record_autoscaling_stats()`; Serve aggregates them per replica
and calls these policies every control-loop tick inside the controller (so they must be cheap
and pure). They hold steady when metrics are missing and scale down only on real slack.
Serve applies min/max bounds and up/down-scale delays on top.
"""

from __future__ import annotations

from dataclasses import dataclass


def _mean(values: dict | None) -> float | None:
    if not values:
        return None
    vals = list(values.values())
    return sum(vals) / len(vals)


@dataclass(frozen=True)
class DecodeSignals:
    tpot_ms: float | None
    acceptance_rate: float | None
    kv_usage: float | None


def decide_decode(current: int, s: DecodeSignals, target_tpot_ms: float,
                  min_acceptance_rate: float, kv_high: float = 0.85) -> int:
    """Desired decode replicas.

    Up: TPOT over the SLO, or KV nearly full (preemptions next). Low acceptance makes each
    round emit fewer tokens, so it brings the scale-up threshold forward to 80% of the SLO.
    Down: TPOT under half the SLO with KV at most half used and acceptance not degraded.
    """
    if s.tpot_ms is None and s.kv_usage is None:
        return current
    low_acc = s.acceptance_rate is not None and s.acceptance_rate < min_acceptance_rate
    threshold = target_tpot_ms * (0.8 if low_acc else 1.0)
    if (s.tpot_ms is not None and s.tpot_ms > threshold) or (
        s.kv_usage is not None and s.kv_usage > kv_high
    ):
        return current + 1
    if (s.tpot_ms is not None and s.tpot_ms < 0.5 * target_tpot_ms
            and (s.kv_usage is None or s.kv_usage < 0.5) and not low_acc):
        return max(current - 1, 1)
    return current


def decide_prefill(current: int, ttft_ms: float | None, queue: float | None,
                   target_ttft_ms: float) -> int:
    """Up when prefill latency exceeds its SLO or more than 2 prompts wait per replica;
    down when latency is under a quarter of the SLO and nothing waits."""
    if ttft_ms is None and queue is None:
        return current
    if (ttft_ms is not None and ttft_ms > target_ttft_ms) or (
        queue is not None and queue > 2.0
    ):
        return current + 1
    if ttft_ms is not None and ttft_ms < 0.25 * target_ttft_ms and not queue:
        return max(current - 1, 1)
    return current


class DecodePolicy:
    """`policy_function` for the DecodeServer deployment (class policy with kwargs)."""

    def __init__(self, target_tpot_ms: float = 50.0, min_acceptance_rate: float = 0.3) -> None:
        self.target_tpot_ms = target_tpot_ms
        self.min_acceptance_rate = min_acceptance_rate

    def __call__(self, ctx) -> tuple[int, dict]:
        agg = ctx.aggregated_metrics or {}
        s = DecodeSignals(_mean(agg.get("tpot_ms")), _mean(agg.get("acceptance_rate")),
                          _mean(agg.get("kv_usage")))
        current = ctx.target_num_replicas
        return decide_decode(current, s, self.target_tpot_ms, self.min_acceptance_rate), \
            dict(ctx.policy_state or {})


class PrefillPolicy:
    def __init__(self, target_ttft_ms: float = 1000.0) -> None:
        self.target_ttft_ms = target_ttft_ms

    def __call__(self, ctx) -> tuple[int, dict]:
        agg = ctx.aggregated_metrics or {}
        current = ctx.target_num_replicas
        return decide_prefill(current, _mean(agg.get("ttft_ms")), _mean(agg.get("queue")),
                              self.target_ttft_ms), dict(ctx.policy_state or {})
