"""Model-based Ray Serve autoscaling policies for the decode and prefill deployments.

Replicas report window aggregates from `record_autoscaling_stats()`
(workers/replica/signals.py); these
class policies run every control-loop tick inside the Serve controller, so they are cheap and
pure apart from publishing the decision (workers/replica/metrics.py) and the demand board
(cluster/demand_board.py).

Decode: the latest fresh report of every replica gives its load (requests running + waiting),
per-position acceptance, performance model T(B, k, context) (workers.perf_model) and the mean
context of its requests; requests queued at Serve's handles are load too. For each candidate
count n the per-replica batch is load / n, the replica would pick its best k there, and the
predicted TPOT is T(B, k, B x context) / E(k), calibrated by measured / predicted TPOT at the
current count. It is predicted twice: for the mean replica (averaged models and acceptance)
and for every busy replica with its own model, acceptance, context and share of the load (a
hot replica: more requests, longer contexts, worse acceptance or a slower device); the worse
of the two decides. The decision is the smallest n whose prediction meets `headroom * target`
(and whose KV usage fits), reached in ONE decision. Scaling down needs the smaller count to
hold for `downscale_hold_s` with a stricter headroom (hysteresis: up and down thresholds
differ, so a steady load never flaps). Prefill sizes from prompt compute time, arrivals and
queue the same way, keeping a utilisation reserve (PREFILL_MAX_UTIL), and posts the growth
of its arrivals (arrival rate / rate it serves) on a `DemandBoard` (cluster/demand_board.py);
the decode policy of the same application multiplies its load by it, so decode replicas start
while prefill is still catching up with a burst instead of one start delay later. Idle
windows (no rounds, nothing running) ask for `min_replicas` after the hold; stale or missing
reports hold the current count (never a scale-up on old data).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mtpserve.cluster.demand_board import BOARD, DemandBoard, arrival_growth
from mtpserve.workers.perf_model import PerfModel

UP_HEADROOM = 0.8  # scale up to keep predicted TPOT under 80% of the SLO
DOWN_HEADROOM = 0.65  # scale down only where the smaller count stays under 65%
KV_HIGH = 0.85
# A hot replica's share of the load (its requests / the busy replicas' mean) is believed up to
# this: routing (least expected tokens) evens batches out, so a larger share is a transient
# that must not buy replicas for the whole deployment.
MAX_SHARE = 2.0
# The hottest replica keeps HOT_HEADROOM below the SLO like the mean replica (scaled likewise
# for scale-down). Simulator, seed 0: 0.8 costs ~20% more GPU-seconds than the mean alone at a
# steady load for +1.6% attainment, but 0.9 or 1.0 let the burst fall under 0.9 attainment.
HOT_HEADROOM = 0.8
# Prefill keeps its predicted utilisation (arrivals x prompt time / replicas) under this while
# scaling up (scaled by the headroom ratio for scale-down): a reserve that absorbs a 2x step of
# arrivals while new replicas start. Simulator, seed 0, realistic start delay (attainment /
# GPU-seconds, acceptance-shift, burst, diurnal): none 0.972/23,160, 0.959/24,188,
# 0.981/23,990; 0.5 0.995/24,493, 0.974/26,575, 0.992/26,852 (kept); 0.65 burst 0.971/26,590.
PREFILL_MAX_UTIL = 0.5


@dataclass(frozen=True)
class ReplicaLoad:
    """One decode replica's fresh report, as the policy needs it."""

    requests: float  # running (recent mean batch) + waiting
    alphas: list[float] = field(default_factory=list)
    model: PerfModel | None = None
    measured_tpot_s: float | None = None
    kv_usage: float = 0.0


@dataclass(frozen=True)
class DecodeLoad:
    """Decode signals summed / averaged over the replicas with fresh reports, and the replicas
    themselves (`replicas`) for the hot-replica prediction."""

    num_replicas: int  # replicas with a fresh report
    num_requests: float  # running + waiting, summed (+ handle queue, see DecodePolicy)
    rounds: float  # rounds in the window, summed (0: idle)
    alphas: list[float] = field(default_factory=list)
    k_max: int = 0
    model: PerfModel | None = None
    measured_tpot_s: float | None = None
    kv_usage: float = 0.0  # summed over replicas (1.0 = one replica full)
    replicas: tuple[ReplicaLoad, ...] = ()

    @property
    def idle(self) -> bool:
        return self.rounds == 0 and self.num_requests == 0


def _tpot(model: PerfModel, batch: float, alphas: list[float], k_max: int) -> float:
    k = model.best_k(batch, alphas, min(k_max, len(alphas)))
    return model.tpot_s(batch, k, alphas)  # context: batch x the model's mean per request


def predicted_tpot_s(load: DecodeLoad, n: int) -> float | None:
    """Predicted TPOT of the mean replica with `n` replicas sharing the load (uncalibrated)."""
    if load.model is None:
        return None
    return _tpot(load.model, max(math.ceil(load.num_requests / n), 1), load.alphas, load.k_max)


def _calibration(measured: float | None, predicted: float | None) -> float:
    # The model times engine rounds; measured TPOT adds queueing and scheduling gaps.
    if measured and predicted:
        return min(max(measured / predicted, 0.67), 2.0)
    return 1.0


def hot_tpot_s(load: DecodeLoad, n: int) -> float | None:
    """Worst calibrated TPOT over the busy replicas with `n` replicas: each keeps its share of
    the load (capped at MAX_SHARE x the mean), its own model, acceptance and context."""
    busy = [r for r in load.replicas if r.requests > 0 and r.model is not None and r.alphas]
    if not busy:
        return None
    mean = sum(r.requests for r in busy) / len(busy)
    worst = None
    for r in busy:
        now = _tpot(r.model, max(r.requests, 1.0), r.alphas, load.k_max)
        share = min(r.requests / mean, MAX_SHARE)
        batch = max(math.ceil(load.num_requests / n * share), 1)
        pred = _calibration(r.measured_tpot_s, now) * _tpot(r.model, batch, r.alphas,
                                                            load.k_max)
        worst = pred if worst is None else max(worst, pred)
    return worst


def decode_replicas(load: DecodeLoad, target_tpot_s: float, lo: int, hi: int,
                    headroom: float = UP_HEADROOM) -> int:
    """Smallest count in [lo, hi] whose predicted TPOT (the mean replica's and the hottest
    replica's) meets headroom * target and whose KV usage (mean and fullest replica) stays
    under KV_HIGH; `hi` if none does."""
    if load.idle:
        return lo
    current = max(load.num_replicas, 1)
    calib = _calibration(load.measured_tpot_s, predicted_tpot_s(load, current))
    kv_mean = load.kv_usage / current
    kv_share = min(max((r.kv_usage for r in load.replicas), default=0.0) / kv_mean, MAX_SHARE
                   ) if kv_mean > 0 else 1.0
    for n in range(max(lo, 1), hi + 1):
        if load.kv_usage / n * max(kv_share, 1.0) > KV_HIGH:  # the fullest replica's KV
            continue
        pred = predicted_tpot_s(load, n)
        if pred is None:  # no model: scale measured TPOT with the per-replica load
            if load.measured_tpot_s is None:
                return max(lo, load.num_replicas)
            pred = load.measured_tpot_s * current / n
        else:
            pred *= calib
            hot = hot_tpot_s(load, n)
            if hot is not None and hot > headroom / UP_HEADROOM * HOT_HEADROOM * target_tpot_s:
                continue
        if pred <= headroom * target_tpot_s:
            return n
    return hi


def prefill_replicas(arrivals_per_s: float, prefill_s: float | None, queue: float,
                     target_ttft_s: float, lo: int, hi: int, headroom: float = UP_HEADROOM
                     ) -> int:
    """Smallest count whose predicted TTFT (M/M/1-like wait + backlog drain) meets the SLO
    and whose utilisation stays under PREFILL_MAX_UTIL (the reserve for a step of arrivals)."""
    if arrivals_per_s == 0 and queue == 0:
        return lo
    if prefill_s is None:
        return lo if queue == 0 else hi
    for n in range(max(lo, 1), hi + 1):
        rho = arrivals_per_s * prefill_s / n
        if rho >= min(1.0, PREFILL_MAX_UTIL * headroom / UP_HEADROOM):
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


def _app(ctx) -> str:
    return str(getattr(ctx, "app_name", None) or "")


def _replica_alphas(r: dict, k_max: int) -> list[float]:
    out = []
    for i in range(k_max):
        if f"alpha_{i}" not in r:
            break
        out.append(r[f"alpha_{i}"])
    return out


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
    fitted = [m for m in models if m is not None]
    model = None
    if fitted:  # the mean replica: average coefficients and context
        model = PerfModel([sum(m.coef[j] for m in fitted) / len(fitted)
                           for j in range(len(fitted[0].coef))],
                          ctx_per_seq=sum(m.ctx_per_seq for m in fitted) / len(fitted))
    tpots = [(r["tpot_s"], r.get("tpot_n", 1.0)) for r in reps if "tpot_s" in r]
    measured = sum(t * n for t, n in tpots) / sum(n for _, n in tpots) if tpots else None
    # Recent mean batch (smoother than the instantaneous count) plus the queue.
    loads = [r.get("batch_recent", r.get("running", 0.0)) + r.get("waiting", 0.0) for r in reps]
    replicas = tuple(
        ReplicaLoad(requests=q, alphas=_replica_alphas(r, k_max), model=m,
                    measured_tpot_s=r.get("tpot_s"), kv_usage=r.get("kv_usage", 0.0))
        for r, q, m in zip(reps, loads, models, strict=True))
    return DecodeLoad(
        num_replicas=len(reps), num_requests=sum(loads),
        rounds=sum(r["rounds"] for r in reps), alphas=alphas, k_max=k_max, model=model,
        measured_tpot_s=measured, kv_usage=sum(r.get("kv_usage", 0.0) for r in reps),
        replicas=replicas)


def _publish(deployment: str, desired: int, extra: dict[str, float]) -> None:
    try:
        from mtpserve.workers.replica.metrics import publish_policy

        publish_policy(deployment, desired, extra)
    except Exception:  # metrics must never break scaling
        pass


class DecodePolicy:
    """`policy_function` of the DecodeServer deployment (class policy with kwargs).
    `board`: where the prefill policy posts arrival growth (default: the process's BOARD)."""

    def __init__(self, target_tpot_ms: float = 50.0, downscale_hold_s: float = 30.0,
                 max_age_s: float = 10.0, publish: bool = True,
                 board: DemandBoard | None = None, **_: float) -> None:
        self.target_tpot_s = target_tpot_ms / 1000
        self.downscale_hold_s = downscale_hold_s
        self.max_age_s = max_age_s
        self.publish = publish
        self.board = BOARD if board is None else board

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
        demand = load.num_requests + handle_queue(ctx)
        # Demand still upstream: prefill arrivals outgrowing what prefill serves reach decode
        # once prefill has scaled (Little's law: the load grows with the arrival rate).
        growth = self.board.growth(_app(ctx), ctx.current_time, self.max_age_s)
        up_load = dataclasses.replace(load, num_requests=demand * growth)
        load = dataclasses.replace(load, num_requests=demand)
        up = decode_replicas(up_load, self.target_tpot_s, lo, hi, UP_HEADROOM)
        down = decode_replicas(load, self.target_tpot_s, lo, hi, DOWN_HEADROOM)
        now = ctx.current_time
        desired, state = with_hysteresis(current, up, down, now, state, self.downscale_hold_s)
        if self.publish:
            pred = predicted_tpot_s(load, max(load.num_replicas, 1))
            _publish(ctx.deployment_name, desired,
                     {"predicted_tpot_s": pred or 0.0, "target_tpot_s": self.target_tpot_s,
                      "load": load.num_requests, "growth": growth})
        return desired, state


class PrefillPolicy:
    """`policy_function` of the PrefillServer deployment; posts arrival growth to `board`."""

    def __init__(self, target_ttft_ms: float = 1000.0, window_s: float = 30.0,
                 downscale_hold_s: float = 30.0, max_age_s: float = 10.0,
                 publish: bool = True, board: DemandBoard | None = None, **_: float) -> None:
        self.target_ttft_s = target_ttft_ms / 1000
        self.window_s = window_s
        self.downscale_hold_s = downscale_hold_s
        self.max_age_s = max_age_s
        self.publish = publish
        self.board = BOARD if board is None else board

    def __call__(self, ctx) -> tuple[int, dict]:
        current = ctx.target_num_replicas
        lo, hi = ctx.capacity_adjusted_min_replicas, ctx.capacity_adjusted_max_replicas
        reps = [r for r in latest_reports(ctx, self.max_age_s).values() if "prefills" in r]
        state = dict(ctx.policy_state or {})
        if not reps:
            return current, state
        served = sum(r["prefills"] for r in reps) / self.window_s
        times = [r["prefill_s"] for r in reps if "prefill_s" in r]
        prefill_s = sum(times) / len(times) if times else None
        queue = sum(r.get("queue", 0.0) for r in reps) + handle_queue(ctx)
        up = prefill_replicas(served, prefill_s, queue, self.target_ttft_s, lo, hi,
                              UP_HEADROOM)
        growth = arrival_growth(state, ctx.current_time, served, queue, up > current)
        self.board.post(_app(ctx), ctx.current_time, growth)
        down = prefill_replicas(served, prefill_s, queue, self.target_ttft_s, lo, hi,
                                DOWN_HEADROOM)
        desired, state = with_hysteresis(current, up, down, ctx.current_time, state,
                                         self.downscale_hold_s)
        if self.publish:
            _publish(ctx.deployment_name, desired, {"load": served, "growth": growth})
        return desired, state
