"""Serving metrics of one replica (counters and histograms of real samples, vLLM's names) and
the autoscaling signals, fed from the engine thread.

`EngineRecorder` attaches to an `AsyncEngine`: every step (timed by the loop) and every
request's round (through `engine.adaptive.on_drafts`) lands in cumulative counters, histograms,
the sliding windows of workers/replica/signals.py and the online performance model. A snapshot
(plain
dict) goes to the `/metrics` endpoint: in-process for the local orchestrator, or pushed once a
second to the `MetricsHub` actor that the ingress reads in a Ray cluster. Prometheus rendering
lives in router.metrics_api.
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
from collections.abc import Callable

from mtpserve.workers.perf_model import PerfModel, profile_rounds
from mtpserve.workers.replica.signals import DecodeWindows, PrefillWindows

logger = logging.getLogger(__name__)

# vLLM's buckets, extended below 10 ms for small models on CPUs.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0]
ITL_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
HUB_NAME, HUB_NAMESPACE = "mtpserve-metrics", "mtpserve"


class Histogram:
    """Cumulative bucket counts of observed samples (Prometheus semantics, `+Inf` implied)."""

    def __init__(self, bounds: list[float]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last: above every bound
        self.sum, self.count = 0.0, 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def snapshot(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum,
                "count": self.count}


class EngineRecorder:
    """Metrics and autoscaling signals of one engine. Engine-thread callbacks append to
    counters and deques only; `snapshot` / `autoscaling_stats` read them from other threads
    (single appends and integer adds, consistent enough for monitoring under the GIL)."""

    def __init__(self, async_engine, role: str, window_s: float = 30.0,
                 kv_stats: Callable[[], dict] | None = None) -> None:
        self.async_engine, self.role, self.kv_stats = async_engine, role, kv_stats
        engine = async_engine.engine
        self.k_max = engine.config.num_speculative_tokens
        self.decode = DecodeWindows(self.k_max, window_s)
        self.prefill = PrefillWindows(window_s)
        self.model = PerfModel()
        engine.adaptive.model = self.model  # k per batch band follows this replica's model
        self.counters = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                         "spec_decode_num_accepted_tokens": 0, "generation_tokens": 0,
                         "num_preemptions": 0}
        self.per_pos = [0] * self.k_max
        self.hists = {"time_to_first_token_seconds": Histogram(TTFT_BUCKETS),
                      "inter_token_latency_seconds": Histogram(ITL_BUCKETS),
                      "request_time_per_output_token_seconds": Histogram(ITL_BUCKETS)}
        self._last_emit: dict[str, float] = {}  # request id -> time of its latest tokens
        self._decode_start: dict[str, tuple[float, int]] = {}  # id -> (t, tokens before)
        self._totals = dict(engine.totals)
        self._prefill_busy_s = 0.0
        self._steps = 0
        self.recording = True
        engine.adaptive.on_drafts.append(self._on_drafts)
        async_engine.step_observers.append(self._on_step)

    # Engine thread ---------------------------------------------------------------------------
    def _on_drafts(self, num_drafts: int, num_accepted: int) -> None:
        if not self.recording or num_drafts <= 0:
            return
        self.counters["spec_decode_num_drafts"] += 1
        self.counters["spec_decode_num_draft_tokens"] += num_drafts
        self.counters["spec_decode_num_accepted_tokens"] += num_accepted
        for i in range(min(num_accepted, self.k_max)):
            self.per_pos[i] += 1
        self.decode.observe_drafts(num_drafts, num_accepted)

    def _on_step(self, engine, outputs: list, seconds: float) -> None:
        if not self.recording:
            self._totals = dict(engine.totals)
            return
        t, now = engine.totals, time.monotonic()
        rounds = t["rounds"] - self._totals["rounds"]
        drafted = t["drafted"] - self._totals["drafted"]
        self._totals = dict(t)
        compute_s = 0.0
        if rounds > 0:  # a decode round of `rounds` requests
            mean_k = drafted / rounds
            # Context the round attended (requests that finished in it have left `running`:
            # a slight undercount, O(batch) ints per round).
            ctx = sum(r.num_computed_tokens for r in engine.scheduler.running)
            self.model.observe(rounds, mean_k, seconds, ctx)
            self.decode.observe_round(rounds, mean_k, seconds)
        else:  # a prefill step: prompts finishing now share the prefill time since the last
            self._prefill_busy_s += seconds
            firsts = sum(len(o.new_token_ids) == o.num_output_tokens for o in outputs)
            if firsts:
                compute_s, self._prefill_busy_s = self._prefill_busy_s / firsts, 0.0
        for out in outputs:
            self._on_output(engine, out, now, compute_s)
        self._steps += 1
        if self._steps % 256 == 0:  # aborted requests never finish: forget them
            for rid in [r for r in self._last_emit if r not in engine.requests]:
                self._last_emit.pop(rid, None)
                self._decode_start.pop(rid, None)

    def _on_output(self, engine, out, now: float, compute_s: float) -> None:
        n_new = len(out.new_token_ids)
        self.counters["generation_tokens"] += n_new
        rid = out.request_id
        last = self._last_emit.get(rid)
        if last is None:
            req = engine.requests.get(rid) or engine.prefilled.get(rid)
            # A request that ended at its first token is already gone from the engine.
            arrival = req.arrival if req is not None else out.arrival
            if out.num_output_tokens == n_new and arrival is not None:
                # This engine produced the request's first token: TTFT inside the engine.
                self.hists["time_to_first_token_seconds"].observe(now - arrival)
                self.prefill.observe(compute_s, now - arrival)
                if self.role == "prefill":  # its tokens after the first are decode's
                    return
                last = now
            elif req is not None and req.first_token_time is not None:
                # Decode replica: the request started decoding when its KV arrived.
                last = req.first_token_time
            self._decode_start[rid] = (last if last is not None else now,
                                       out.num_output_tokens - n_new)
        elif n_new:
            gap = (now - last) / n_new
            for _ in range(n_new):
                self.hists["inter_token_latency_seconds"].observe(gap)
        self._last_emit[rid] = now
        if out.finished:
            self._last_emit.pop(rid, None)
            start, before = self._decode_start.pop(rid, (now, out.num_output_tokens))
            n = out.num_output_tokens - max(before, 1)
            if n > 0 and now > start:
                tpot = (now - start) / n  # decode-only: from the first decode round
                self.hists["request_time_per_output_token_seconds"].observe(tpot)
                self.decode.tpot_s.add(tpot)

    # Other threads ---------------------------------------------------------------------------
    def profile(self, batch_sizes: tuple[int, ...] = (1, 2, 4, 8), rounds_per_cell: int = 4
                ) -> None:
        """Seed the performance model with a short profile (engine thread, before serving)."""
        if self.k_max == 0 and self.role == "prefill":
            return

        def run(engine) -> None:
            self.recording = False
            try:
                bs = [b for b in batch_sizes if b <= engine.config.max_num_seqs]
                samples = profile_rounds(engine, bs, range(self.k_max + 1), rounds_per_cell)
                if samples:
                    self.model.fit(samples)
                    engine.adaptive.update()
            finally:
                self.recording = True

        self.async_engine.call(run).result()

    def autoscaling_stats(self, stats: dict) -> dict[str, float]:
        """`record_autoscaling_stats` of the replica; `stats` is `Engine.stats()`."""
        kv = stats["used_blocks"] / max(stats["num_blocks"], 1)
        if self.role == "prefill":
            queue = stats["num_waiting"] + stats.get("num_prefilling", 0)
            return self.prefill.report(queue) | {"kv_usage": kv}
        # Requests waiting for their KV are demand too (the autoscaler missed them before).
        out = self.decode.report(kv, stats["num_running"], _waiting(stats))
        return out | self.model.report() | {"k_replica": float(stats["num_speculative_tokens"])}

    def predicted_tpot_s(self, report: dict[str, float]) -> float | None:
        if "batch" not in report or not self.model.fitted:
            return None
        alphas = [report.get(f"alpha_{i}", 0.0) for i in range(self.k_max)]
        k = round(report.get("k", 0.0))
        return self.model.tpot_s(report["batch"], k, alphas)

    def snapshot(self, key: str, stats: dict) -> dict:
        """Everything /metrics needs from this replica (JSON-able)."""
        report = self.autoscaling_stats(stats)
        gauges = {"num_requests_running": stats["num_running"],
                  "num_requests_waiting": _waiting(stats),
                  "kv_cache_usage_perc": report["kv_usage"],
                  "num_speculative_tokens": stats["num_speculative_tokens"],
                  "prefix_cache_blocks": stats.get("cached_blocks", 0)}
        if self.role != "prefill":
            gauges["measured_tpot_seconds"] = report.get("tpot_s")
            gauges["predicted_tpot_seconds"] = self.predicted_tpot_s(report)
        compile_ = stats.get("compile")  # decode graphs (workers/model/compile_progress.py)
        if compile_:
            gauges["compile_buckets_total"] = compile_["total"]
            gauges["compile_buckets_done"] = compile_["done"]
            gauges["compile_eta_seconds"] = compile_["eta_s"]
        counters = dict(self.counters)
        kv = self.kv_stats() if self.kv_stats else {}
        counters["kv_transfer_bytes"] = kv.get("bytes_received", kv.get("bytes_sent", 0))
        counters["kv_transfer_seconds"] = kv.get("pull_seconds", 0.0)
        counters["kv_transfer_bytes_saved"] = kv.get("bytes_saved", 0)
        counters["prefix_cache_queries"] = stats.get("prefix_cache_queries", 0)
        counters["prefix_cache_hits"] = stats.get("prefix_cache_hits", 0)
        return {"replica": key, "role": self.role, "time": time.time(),
                "counters": counters, "per_pos": list(self.per_pos),
                "hists": {n: h.snapshot() for n, h in self.hists.items()},
                "gauges": {n: v for n, v in gauges.items() if v is not None},
                "compile": compile_}


# Aggregation across replicas (Ray) ---------------------------------------------------------------
class MetricsHub:
    """Named actor holding the latest snapshot of every replica and the policies' decisions.
    Snapshots of replicas that went away are kept: their counters must not go backwards."""

    def __init__(self) -> None:
        self.snapshots: dict[str, dict] = {}
        self.policy: dict[str, dict] = {}

    def push(self, snapshot: dict) -> None:
        self.snapshots[snapshot["replica"]] = snapshot

    def push_policy(self, deployment: str, decision: dict) -> None:
        self.policy[deployment] = decision

    def collect(self) -> dict:
        return {"snapshots": list(self.snapshots.values()), "policy": dict(self.policy)}


_hub = None
_last_policy_push: dict[str, tuple[float, int]] = {}


def hub():
    """The hub actor (created on first use, detached so it outlives any one replica). It
    lives on the head node, as Serve's controller does: a lost worker node must not take
    /metrics and the stats endpoint down with it."""
    global _hub
    if _hub is None:
        import ray
        from ray._common.constants import HEAD_NODE_RESOURCE_NAME

        _hub = ray.remote(MetricsHub).options(
            name=HUB_NAME, namespace=HUB_NAMESPACE, get_if_exists=True, lifetime="detached",
            num_cpus=0, resources={HEAD_NODE_RESOURCE_NAME: 0.001}).remote()
    return _hub


def publish_policy(deployment: str, desired: int, extra: dict[str, float]) -> None:
    """From a policy in the Serve controller: fire-and-forget, at most once a second unless the
    decision changed."""
    now = time.monotonic()
    last = _last_policy_push.get(deployment)
    if last is not None and now - last[0] < 1.0 and last[1] == desired:
        return
    _last_policy_push[deployment] = (now, desired)
    hub().push_policy.remote(deployment, {"desired_replicas": desired, "time": time.time(),
                                          **extra})


def start_pusher(recorder: EngineRecorder, key: str, interval_s: float = 1.0
                 ) -> threading.Event:
    """Push the recorder's snapshot to the hub every `interval_s` from a daemon thread; set
    the returned event to stop."""
    stop = threading.Event()

    def loop() -> None:
        import ray

        while not stop.wait(interval_s):
            if not ray.is_initialized():  # a replica built outside Ray (tests): keep local
                continue
            try:
                stats = recorder.async_engine.call(lambda e: e.stats()).result(timeout=5)
                hub().push.remote(recorder.snapshot(key, stats))
            except Exception:  # monitoring must never take the replica down
                logger.debug("metrics push failed", exc_info=True)

    threading.Thread(target=loop, name="metrics-push", daemon=True).start()
    return stop



def replica_key(role: str) -> str:
    try:
        from ray import serve

        return f"{role}:{serve.get_replica_context().replica_id.unique_id}"
    except Exception:  # outside a Serve replica (tests)
        return f"{role}:{id(object()):x}"


def attach_replica_metrics(replica, role: str) -> EngineRecorder:
    """Wire metrics and autoscaling signals into a prefill or decode Serve replica: the
    recorder, a short profile that seeds the decode performance model, and the push to the
    hub that /metrics reads."""
    a = (replica.cfg.decode if role == "decode" else replica.cfg.prefill).autoscaling
    kv_stats = None
    if role == "decode":
        def kv_stats() -> dict:
            return replica.driver.core.receiver.stats()
    recorder = EngineRecorder(replica.engine, role, a.window_s if a else 30.0, kv_stats)
    if role == "decode":
        t0 = time.perf_counter()
        recorder.profile()
        logger.info("decode profile took %.2fs; round time model %s", time.perf_counter() - t0,
                    recorder.model.coef.tolist())
    recorder.pusher = start_pusher(recorder, replica_key(role))
    return recorder


# Routing hints -----------------------------------------------------------------------------------
class EMA:
    """Exponential moving average that knows whether it has seen anything (routing hints;
    never an autoscaling signal: it does not decay when idle)."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha, self.value = alpha, None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


def _waiting(stats: dict) -> int:
    """Requests admitted but not running: queued (recompute), queued for KV blocks, and
    pulling their KV (as vLLM counts requests waiting for remote KV as waiting)."""
    return (stats["num_waiting"] + stats.get("num_awaiting_kv", 0)
            + stats.get("num_receiving", 0))
