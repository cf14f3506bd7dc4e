"""Model-based Ray Serve autoscaling policies for the decode and prefill deployments.

Replicas report window aggregates from `record_autoscaling_stats()` (workers/signals.py); these
class policies run every control-loop tick inside the Serve controller, so they are cheap and
pure apart from publishing the decision (workers/metrics.py).

Decode: the latest fresh report of every replica gives the load (requests running + waiting),
the per-position acceptance and the replica's performance model T(B, k) (workers.perf_model).
For each candidate count n the per-replica batch is load / n, the replica would pick its best k
there, and the predicted TPOT is T(B, k) / E(k), calibrated by measured / predicted TPOT at the
current count. The decision is the smallest n whose prediction meets `headroom * target` (and
whose KV usage fits), reached in ONE decision. Scaling down needs the smaller count to hold for
`downscale_hold_s` with a stricter headroom (hysteresis: up and down thresholds differ, so a
steady load never flaps). Prefill sizes from prompt compute time, arrivals and queue the same
way. Idle windows (no rounds, nothing running) ask for `min_replicas` after the hold; stale or
missing reports hold the current count (never a scale-up on old data).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mtpserve.workers.perf_model import PerfModel

UP_HEADROOM = 0.8  # scale up to keep predicted TPOT under 80% of the SLO
DOWN_HEADROOM = 0.65  # scale down only where the smaller count stays under 65%
KV_HIGH = 0.85


@dataclass(frozen=True)
class DecodeLoad:
    """Decode signals summed / averaged over the replicas with fresh reports."""

    num_replicas: int  # replicas with a fresh report
    num_requests: float  # running + waiting, summed
    rounds: float  # rounds in the window, summed (0: idle)
    alphas: list[float] = field(default_factory=list)
    k_max: int = 0
    model: PerfModel | None = None
    measured_tpot_s: float | None = None
    kv_usage: float = 0.0  # summed over replicas (1.0 = one replica full)

    @property
    def idle(self) -> bool:
        return self.rounds == 0 and self.num_requests == 0


def predicted_tpot_s(load: DecodeLoad, n: int) -> float | None:
    """Predicted TPOT with `n` replicas sharing the load (uncalibrated)."""
    if load.model is None:
        return None
    batch = max(math.ceil(load.num_requests / n), 1)
    k = load.model.best_k(batch, load.alphas, min(load.k_max, len(load.alphas)))
    return load.model.tpot_s(batch, k, load.alphas)


def decode_replicas(load: DecodeLoad, target_tpot_s: float, lo: int, hi: int,
                    headroom: float = UP_HEADROOM) -> int:
    """Smallest count in [lo, hi] whose predicted TPOT meets headroom * target and whose KV
    usage stays under KV_HIGH; `hi` if none does."""
    if load.idle:
        return lo
    calib = 1.0
    now = predicted_tpot_s(load, max(load.num_replicas, 1))
    if now and load.measured_tpot_s:
        # The model times engine rounds; measured TPOT adds queueing and scheduling gaps.
        calib = min(max(load.measured_tpot_s / now, 0.67), 2.0)
    for n in range(max(lo, 1), hi + 1):
        if load.kv_usage / n > KV_HIGH:
            continue
        pred = predicted_tpot_s(load, n)
        if pred is None:  # no model: scale measured TPOT with the per-replica load
            if load.measured_tpot_s is None:
                return max(lo, load.num_replicas)
            pred = load.measured_tpot_s * max(load.num_replicas, 1) / n
            calib = 1.0
        if calib * pred <= headroom * target_tpot_s:
            return n
    return hi


def prefill_replicas(arrivals_per_s: float, prefill_s: float | None, queue: float,
                     target_ttft_s: float, lo: int, hi: int, headroom: float = UP_HEADROOM
                     ) -> int:
    """Smallest count whose predicted TTFT (M/M/1-like wait + backlog drain) meets the SLO."""
    if arrivals_per_s == 0 and queue == 0:
        return lo
    if prefill_s is None:
        return lo if queue == 0 else hi
    for n in range(max(lo, 1), hi + 1):
        rho = arrivals_per_s * prefill_s / n
        if rho >= 1:
            continue
        ttft = prefill_s / (1 - rho) + queue / n * prefill_s
        if ttft <= headroom * target_ttft_s:
            return n
    return hi


def with_hysteresis(current: int, up: int, down: int, now: float, state: dict,
                    hold_s: float) -> tuple[int, dict]:
    """`up`: the count the up-headroom asks for; `down`: the count the stricter down-headroom
    allows. Up moves at once; down only after `down` < current held for `hold_s`, to the
    largest `down` seen meanwhile (answered every tick from then until it is applied)."""
    state = dict(state)
    if up > current:
        for key in ("down_since", "down_max", "down_from"):
            state.pop(key, None)
        return up, state
    if down >= current or state.get("down_from", current) != current:
        # No slack, or the count changed since the hold began (the scale-down was applied, or
        # replicas came and went): a new hold starts from the count there is now.
        for key in ("down_since", "down_max", "down_from"):
            state.pop(key, None)
        if down >= current:
            return current, state
    state.setdefault("down_from", current)
    since = state.setdefault("down_since", now)
    state["down_max"] = max(state.get("down_max", down), down)
    if now - since >= hold_s:
        # Keep answering the smaller count every tick until Serve applies it (its own
        # downscale delay counts consecutive decisions).
        return state["down_max"], state
    return current, state


# Reading the Serve context --------------------------------------------------------------------
def latest_reports(ctx, max_age_s: float) -> dict:
    """{replica: {metric: latest value}} of replicas whose reports are fresh."""
    now = ctx.current_time
    raw = ctx.raw_metrics or {}
    out: dict = {}
    if raw:
        for name, per_replica in raw.items():
            for rid, series in per_replica.items():
                if series:
                    last = max(series, key=lambda v: v.timestamp)
                    if now is None or now - last.timestamp <= max_age_s:
                        out.setdefault(rid, {})[name] = float(last.value)
        return out
    for name, per_replica in (ctx.aggregated_metrics or {}).items():
        for rid, value in per_replica.items():
            out.setdefault(rid, {})[name] = float(value)
    return out


def handle_queue(ctx) -> float:
    """Requests queued at the deployment's handles (Serve's `total_queued_requests`), 0 when
    the context does not say (older Serve, tests)."""
    try:
        return max(0.0, float(getattr(ctx, "total_queued_requests", 0.0) or 0.0))
    except (TypeError, ValueError):
        return 0.0


def decode_load(reports: dict) -> DecodeLoad:
    reps = [r for r in reports.values() if "rounds" in r]
    if not reps:
        return DecodeLoad(0, 0.0, 0.0)
    k_max = max(int(r.get("k_max", 0)) for r in reps)
    alphas = []
    for i in range(k_max):
        vals = [r[f"alpha_{i}"] for r in reps if f"alpha_{i}" in r]
        if not vals:
            break
        alphas.append(sum(vals) / len(vals))
    models = [PerfModel.from_report(r) for r in reps]
    models = [m for m in models if m is not None]
    model = None
    if models:  # replicas are alike: average their coefficients
        model = PerfModel([sum(m.coef[j] for m in models) / len(models) for j in range(4)])
    tpots = [(r["tpot_s"], r.get("tpot_n", 1.0)) for r in reps if "tpot_s" in r]
    measured = sum(t * n for t, n in tpots) / sum(n for _, n in tpots) if tpots else None
    return DecodeLoad(
        num_replicas=len(reps),
        # Recent mean batch (smoother than the instantaneous count) plus the queue.
        num_requests=sum(r.get("batch_recent", r.get("running", 0.0)) + r.get("waiting", 0.0)
                         for r in reps),
        rounds=sum(r["rounds"] for r in reps), alphas=alphas, k_max=k_max, model=model,
        measured_tpot_s=measured, kv_usage=sum(r.get("kv_usage", 0.0) for r in reps))


def _publish(deployment: str, desired: int, extra: dict[str, float]) -> None:
    try:
        from mtpserve.workers.metrics import publish_policy

        publish_policy(deployment, desired, extra)
    except Exception:  # metrics must never break scaling
        pass


class DecodePolicy:
    """`policy_function` of the DecodeServer deployment (class policy with kwargs)."""

    def __init__(self, target_tpot_ms: float = 50.0, downscale_hold_s: float = 30.0,
                 max_age_s: float = 10.0, publish: bool = True, **_: float) -> None:
        self.target_tpot_s = target_tpot_ms / 1000
        self.downscale_hold_s = downscale_hold_s
        self.max_age_s = max_age_s
        self.publish = publish

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.target_num_replicas
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        load = decode_load(latest_reports(ctx, self.max_age_s))
        state = dict(ctx.policy_state or {})
        if load.num_replicas == 0:  # nothing fresh: hold, never scale on old data
            return current, state
        # Demand the replicas cannot report: requests queued at the callers' handles (Serve
        # holds them once every replica is at max_ongoing_requests). A saturated deployment
        # otherwise looks like a full batch at an acceptable TPOT while the queue grows.
        queued = handle_queue(ctx)
        if queued:
            load = dataclasses.replace(load, num_requests=load.num_requests + queued)
        up = decode_replicas(load, self.target_tpot_s, lo, hi, UP_HEADROOM)
        down = decode_replicas(load, self.target_tpot_s, lo, hi, DOWN_HEADROOM)
        now = ctx.current_time
        desired, state = with_hysteresis(current, up, down, now, state, self.downscale_hold_s)
        if self.publish:
            pred = predicted_tpot_s(load, max(load.num_replicas, 1))
            _publish(ctx.deployment_name, desired,
                     {"predicted_tpot_s": pred or 0.0, "target_tpot_s": self.target_tpot_s,
                      "load": load.num_requests})
        return desired, state


class PrefillPolicy:
    """`policy_function` of the PrefillServer deployment."""

    def __init__(self, target_ttft_ms: float = 1000.0, window_s: float = 30.0,
                 downscale_hold_s: float = 30.0, max_age_s: float = 10.0,
                 publish: bool = True, **_: float) -> None:
        self.target_ttft_s = target_ttft_ms / 1000
        self.window_s = window_s
        self.downscale_hold_s = downscale_hold_s
        self.max_age_s = max_age_s
        self.publish = publish

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.target_num_replicas
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        reps = [r for r in latest_reports(ctx, self.max_age_s).values() if "prefills" in r]
        state = dict(ctx.policy_state or {})
        if not reps:
            return current, state
        arrivals = sum(r["prefills"] for r in reps) / self.window_s
        times = [r["prefill_s"] for r in reps if "prefill_s" in r]
        prefill_s = sum(times) / len(times) if times else None
        queue = sum(r.get("queue", 0.0) for r in reps)
        up = prefill_replicas(arrivals, prefill_s, queue, self.target_ttft_s, lo, hi,
                              UP_HEADROOM)
        down = prefill_replicas(arrivals, prefill_s, queue, self.target_ttft_s, lo, hi,
                                DOWN_HEADROOM)
        desired, state = with_hysteresis(current, up, down, ctx.current_time, state,
                                         self.downscale_hold_s)
        if self.publish:
            _publish(ctx.deployment_name, desired, {"load": arrivals})
        return desired, state
