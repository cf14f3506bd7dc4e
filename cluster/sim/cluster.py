"""The disaggregated cluster as a discrete-event simulation (Ray-free, deterministic for a seed).

A request arrives at the ingress, is routed to a prefill replica (least ongoing requests, as
router/routing.py ranks them; Serve's handle queues it while every replica is at
`max_ongoing_requests`, and refuses it with a 429 past `max_queued_requests` per ingress
replica), is prefilled in chunks (TTFT: its first token streams at once), routed to a decode
replica (least expected tokens from the routing stats refreshed every second plus requests sent
since), pulls its KV there and decodes in speculative rounds until its last token.

Serve's side: replicas report `record_autoscaling_stats()` every `metrics_interval_s`; every
`control_interval_s` the deployment's policy is called with an AutoscalingContext built from
them and Serve's wrapper applies delays and bounds (sim/policies.py, sim/serve_port.py). A new
replica costs its start delay (weights load + warm-up) before it serves; a removed one stops
taking requests and drains for at most `graceful_shutdown_timeout_s`, after which its requests
migrate (decode resumes them elsewhere by recomputing their context). GPU-seconds count every
replica from the moment it is asked for until it stops, starting and draining included.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Callable

from mtpserve.cluster.serve_options import autoscaling_config, max_ongoing
from mtpserve.cluster.sim.config import SimConfig, cluster_config, serve_default_config
from mtpserve.cluster.sim.cpu import SharedCpu
from mtpserve.cluster.sim.decode_replica import DecodeReplica
from mtpserve.cluster.sim.events import EventQueue
from mtpserve.cluster.sim.hardware import load_hardware
from mtpserve.cluster.sim.lifecycle import DRAINING, RUNNING, STARTING, STOPPED
from mtpserve.cluster.sim.metrics_store import MetricsStore
from mtpserve.cluster.sim.model_arch import load_arch
from mtpserve.cluster.sim.policies import (
    DeploymentView,
    mtpserve_autoscalers,
    profiled_serve_targets,
    serve_default_autoscalers,
)
from mtpserve.cluster.sim.prefill_replica import PrefillReplica
from mtpserve.cluster.sim.replica_models import (
    FittedReplicaModel,
    ReplicaModel,
    RooflineReplicaModel,
)
from mtpserve.cluster.sim.requests import OK, REJECTED, SimRequest
from mtpserve.cluster.sim.results import summarize, timeline_sample
from mtpserve.cluster.sim.slo_planner import FrontendWindow, SloPlanner
from mtpserve.cluster.sim.workloads import (
    ACCEPTANCE,
    CLASSES,
    OUTPUT_MEAN,
    PROMPT_MEAN,
    SCENARIOS,
    Workload,
    generate,
)
from mtpserve.workers.perf_model import expected_tokens

ROLES = ("prefill", "decode")
ROUTING_STATS_PERIOD_S = 1.0  # = router.routing.ROUTING_STATS_PERIOD_S


def build_models(sim: SimConfig) -> tuple[ReplicaModel, ReplicaModel]:
    """(prefill model, decode model) from a profile JSON or the roofline."""
    if sim.profile:
        m = FittedReplicaModel.from_profile(sim.profile)
        if sim.max_num_seqs:
            m.max_num_seqs = sim.max_num_seqs
        return m, m
    arch = load_arch(sim.model_config)
    hw = load_hardware(sim.hardware)
    if sim.load_gbs:
        hw = load_hardware(sim.hardware, load_bw=sim.load_gbs * 1e9)
    tp = sim.tp or int(arch.setting("tp", 1))
    k = sim.mtp_depth if sim.mtp_depth is not None else int(arch.setting("mtp_depth", 1))
    seqs = sim.max_num_seqs or int(arch.setting("max_num_seqs", 128))
    if not arch.mtp_layers:
        k = 0
    prefill = RooflineReplicaModel(hw, arch, tp, k, seqs, sim.max_num_batched_tokens,
                                   "prefill", sim.cold_start)
    decode = RooflineReplicaModel(hw, arch, tp, k, seqs, sim.max_num_batched_tokens,
                                  "decode", sim.cold_start)
    return prefill, decode


class Simulator:
    """`class_alphas`: per-position conditional acceptance of each acceptance class, indexed by
    `workload.cls` (default: workloads.ACCEPTANCE of `code` and `chat`); a replay of a
    recorded load gives each request its own measured acceptance this way."""

    def __init__(self, sim: SimConfig, workload: Workload | None = None,
                 models: tuple[ReplicaModel, ReplicaModel] | None = None,
                 class_alphas: list[tuple[float, ...]] | None = None) -> None:
        self.sim = sim
        self.models = dict(zip(ROLES, models or build_models(sim), strict=True))
        dm = self.models["decode"]
        self.k_max = dm.k_max
        self.cfg = cluster_config(sim, dm.tp, dm.k_max, dm.max_num_seqs,
                                  self.models["prefill"].prefill_kv_tokens, dm.decode_kv_tokens)
        scenario = SCENARIOS.get(sim.scenario)
        if workload is None:
            if scenario is None:
                raise ValueError(f"unknown scenario {sim.scenario!r}; known: "
                                 f"{', '.join(SCENARIOS)}")
            workload = generate(scenario, sim.seed, sim.rate_scale, sim.duration_s)
        self.workload = workload
        self.duration = workload.duration_s
        if class_alphas is None:
            class_alphas = [ACCEPTANCE[c] for c in CLASSES]
        self.class_alphas = [tuple(a[: max(self.k_max, 1)]) for a in class_alphas]
        if len(workload) and int(workload.cls.max()) >= len(self.class_alphas):
            raise ValueError("workload.cls names an acceptance class that class_alphas lacks")
        # E(k) of each class: tokens a request emits per round with k drafts.
        self.tokens_per_round = [[expected_tokens(a, k) for k in range(self.k_max + 1)]
                                 for a in self.class_alphas]
        self.requests = [
            SimRequest(i, float(workload.arrival[i]), int(workload.cls[i]),
                       int(workload.prompt[i]), int(workload.output[i]),
                       self.class_alphas[int(workload.cls[i])])
            for i in range(len(workload))]
        self.events = EventQueue()
        self.now = 0.0
        # Co-located replicas share the host's cores (sim/cpu.py); None: separate machines.
        self.cpu = SharedCpu(self, sim.cpu) if sim.cpu is not None else None
        self._seq = 0
        self.done = 0
        self.replicas: dict[str, list] = {r: [] for r in ROLES}
        self.handle: dict[str, deque[SimRequest]] = {r: deque() for r in ROLES}
        self.queue_cap = self.cfg.limits.max_queued_requests * self.cfg.ingress.replicas
        self.max_ongoing = {r: max_ongoing(self.cfg, r) for r in ROLES}
        self.tp = {r: self.models[r].tp for r in ROLES}
        self.target = {"prefill": self.cfg.prefill.replicas, "decode": self.cfg.decode.replicas}
        self.last_up: dict[str, float | None] = {r: None for r in ROLES}
        self.last_down: dict[str, float | None] = {r: None for r in ROLES}
        self.replica_log: list[list] = []
        self.samples: list[dict] = []
        self.starts = {r: 0 for r in ROLES}
        # Frontend observations (time-ordered): arrivals (isl), first tokens (ttft),
        # finishes (tpot, osl).
        self.fe_arrival: list[tuple[float, float, int]] = []
        self.fe_first: list[tuple[float, float]] = []
        self.fe_done: list[tuple[float, float | None, int]] = []
        self._build_policy()

    # Host interface for replicas ----------------------------------------------------------------
    def clock(self) -> float:
        return self.now

    def schedule(self, t: float, fn: Callable, *args) -> None:
        self.events.push(t, fn, *args)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # Policies -----------------------------------------------------------------------------------
    def _build_policy(self) -> None:
        sim, cfg = self.sim, self.cfg
        self.planner: SloPlanner | None = None
        self.autoscalers: dict = {}
        self.serve_targets: tuple[float, float] | None = None
        self.look_back = 5 * cfg.decode.autoscaling.metrics_interval_s
        if sim.policy == "mtpserve":
            self.autoscaling_configs = {r: autoscaling_config(cfg, r) for r in ROLES}
            self.autoscalers = mtpserve_autoscalers(self.autoscaling_configs, self.clock)
        elif sim.policy == "serve-default":
            pair = sim.serve_target_ongoing or profiled_serve_targets(
                self.models["decode"], self.profile_alphas(), sim.tpot_slo_ms / 1000,
                PROMPT_MEAN + OUTPUT_MEAN / 2)
            self.serve_targets = pair
            targets = dict(zip(("decode", "prefill"), pair, strict=True))
            self.autoscaling_configs = {r: serve_default_config(cfg, r, targets[r])
                                        for r in ROLES}
            self.autoscalers = serve_default_autoscalers(self.autoscaling_configs, self.clock)
        elif sim.policy == "slo-planner":
            self.autoscaling_configs = {}
            mix = self.profile_alphas()
            bounds = {"prefill": (cfg.prefill.autoscaling.min_replicas,
                                  cfg.prefill.autoscaling.max_replicas),
                      "decode": (cfg.decode.autoscaling.min_replicas,
                                 cfg.decode.autoscaling.max_replicas)}
            self.planner = SloPlanner(self.models["prefill"], self.models["decode"],
                                      sim.ttft_slo_ms / 1000, sim.tpot_slo_ms / 1000, bounds,
                                      dict(self.target), mix, sim.planner_interval_s,
                                      sim.planner_reactive_s)
        else:
            raise ValueError(f"unknown policy {sim.policy!r}")
        self.stores = {r: MetricsStore(self.look_back) for r in ROLES}

    def profile_alphas(self) -> list[float]:
        """The acceptance offline profiles are taken at: the mean of the classes."""
        return [sum(col) / len(col) for col in zip(*self.class_alphas, strict=True)]

    # Run ----------------------------------------------------------------------------------------
    def run(self) -> dict:
        for role in ROLES:
            for _ in range(self.target[role]):
                self._new_replica(role, ready=True)
        for req in self.requests:
            if self.cpu is not None and self.sim.ingress_overhead_s > 0:
                self.schedule(req.arrival, self._ingress, req)
            else:
                self.schedule(req.arrival + self.sim.ingress_overhead_s, self._arrive, req)
        interval = self.cfg.decode.autoscaling.metrics_interval_s
        self.schedule(interval, self._metrics_tick, interval)
        self.schedule(0.0, self._routing_tick)
        if self.planner is not None:
            self.schedule(self.planner.interval_s, self._planner_tick)
        else:
            self.schedule(self.sim.control_interval_s, self._control_tick)
        self.schedule(self.sim.timeline_interval_s, self._timeline_tick)
        self._sample_t = 0.0
        end_by = self.duration + self.sim.max_drain_s
        while len(self.events) and self.active():
            t, fn, args = self.events.pop()
            if t > end_by:
                break
            self.now = t
            fn(*args)
        if self.done < len(self.requests):  # stopped at end_by: the rest is unfinished
            self.t_end = max(self.duration, self.now)
        else:
            self.t_end = max([self.duration] + [r.t_end for r in self.requests])
        for role in ROLES:
            for rep in self.replicas[role]:
                if rep.state != STOPPED:
                    rep.state, rep.t_stopped = STOPPED, self.t_end
        self._log_replicas(self.t_end)
        return summarize(self)

    def active(self) -> bool:
        return self.now < self.duration or self.done < len(self.requests)

    # Requests -----------------------------------------------------------------------------------
    def _ingress(self, req: SimRequest) -> None:
        """Shared CPU: the work outside the engines is a job on the host's cores."""
        self.cpu.start(self.sim.ingress_overhead_s, self._arrive, req, kind="ingress")

    def _arrive(self, req: SimRequest) -> None:
        self.fe_arrival.append((self.now, float(req.prompt), req.cls))
        if self.handle["prefill"] or not self._route("prefill", req):
            if len(self.handle["prefill"]) >= self.queue_cap:  # BackPressureError -> 429
                req.status, req.t_end = REJECTED, self.now
                self.done += 1
                return
            self.handle["prefill"].append(req)

    def _route(self, role: str, req: SimRequest) -> bool:
        best, best_score = None, 0.0
        cap = self.max_ongoing[role]
        for rep in self.replicas[role]:
            if rep.state != RUNNING or rep.ongoing >= cap:
                continue
            if role == "decode":  # router.routing.load_score
                tokens, reported, per_request = rep.snapshot
                score = tokens + max(rep.ongoing - reported, 0) * per_request
            else:
                score = rep.ongoing
            if best is None or score < best_score:
                best, best_score = rep, score
        if best is None:
            return False
        best.submit(req)
        return True

    def _dispatch(self, role: str) -> None:
        q = self.handle[role]
        while q and self._route(role, q[0]):
            q.popleft()

    def prefill_done(self, req: SimRequest) -> None:
        if req.t_first is None:
            req.t_first = self.now
            self.fe_first.append((self.now, req.t_first - req.arrival))
        if self.handle["prefill"]:
            self._dispatch("prefill")
        if req.output <= 1:  # the first token ended it: release the hold
            self.release_hold(req)
            self.request_done(req, self.now)
            return
        if self.handle["decode"] or not self._route("decode", req):
            self.handle["decode"].append(req)

    def release_hold(self, req: SimRequest) -> None:
        if req.prefill_replica is not None:
            holder, req.prefill_replica = req.prefill_replica, None
            holder.release(req)

    def request_done(self, req: SimRequest, now: float) -> None:
        req.status, req.t_end = OK, now
        self.done += 1
        self.fe_done.append((now, req.tpot, req.output))
        if self.handle["decode"]:
            self._dispatch("decode")

    # Replicas -----------------------------------------------------------------------------------
    def _new_replica(self, role: str, ready: bool = False) -> None:
        self.starts[role] += 1
        rid = f"{role}-{self.starts[role]}"
        window = (self.cfg.decode if role == "decode" else self.cfg.prefill).autoscaling.window_s
        if role == "decode":
            rep = DecodeReplica(rid, self.models[role], self, self.k_max,
                                self.cfg.speculation.adaptive, window,
                                len(self.class_alphas))
        else:
            rep = PrefillReplica(rid, self.models[role], self, self.k_max, window)
        self.replicas[role].append(rep)
        if ready:
            rep.state = RUNNING
        else:
            self.schedule(self.now + self.models[role].start_s, self._ready, rep)
        self._log_replicas(self.now)

    def _ready(self, rep) -> None:
        if rep.state == STARTING:
            rep.state = RUNNING
            rep.refresh_snapshot()
            self._log_replicas(self.now)
            self._dispatch(rep.role)

    def _set_target(self, role: str, n: int) -> None:
        old = self.target[role]
        if n == old:
            return
        self.target[role] = n
        if n > old:
            self.last_up[role] = self.now
        else:
            self.last_down[role] = self.now
        active = [r for r in self.replicas[role] if r.state in (STARTING, RUNNING)]
        if n > len(active):
            for _ in range(n - len(active)):
                self._new_replica(role)
        elif n < len(active):
            # Serve stops replicas that are still starting first, then the least busy.
            order = sorted(active, key=lambda r: (r.state != STARTING, r.ongoing,
                                                  -r.t_created))
            for rep in order[: len(active) - n]:
                self._stop(rep)
        self._log_replicas(self.now)

    def _stop(self, rep) -> None:
        if rep.state == STARTING:
            self._stopped(rep)
            return
        rep.state = DRAINING
        if rep.ongoing == 0:
            self._stopped(rep)
            return
        rep.drain_deadline = self.now + self.cfg.graceful_shutdown_timeout_s
        self.schedule(rep.drain_deadline, self._drain_timeout, rep)

    def replica_drained(self, rep) -> None:
        if rep.state == DRAINING:
            self._stopped(rep)

    def _drain_timeout(self, rep) -> None:
        if rep.state != DRAINING:
            return
        evicted = rep.evict_all()
        self._stopped(rep)
        for req in evicted:
            req.migrations += 1
            if rep.role == "decode":
                # The orchestrator resumes the stream elsewhere: decode recomputes the context.
                self.release_hold(req)
                req.kv_lost = True
            self.handle[rep.role].appendleft(req)
        self._dispatch(rep.role)

    def _stopped(self, rep) -> None:
        rep.state, rep.t_stopped = STOPPED, self.now
        if rep.role == "prefill":
            rep.drop_holds()
        self.stores[rep.role].drop(rep.id)
        self._log_replicas(self.now)

    def _log_replicas(self, t: float) -> None:
        row = [t]
        for role in ROLES:
            states = [r.state for r in self.replicas[role]]
            row += [states.count(STARTING), states.count(RUNNING), states.count(DRAINING)]
        row += [self.target["prefill"], self.target["decode"]]
        if self.replica_log and self.replica_log[-1][0] == t:
            self.replica_log[-1] = row
        elif not self.replica_log or self.replica_log[-1][1:] != row[1:]:
            self.replica_log.append(row)

    # Periodic -----------------------------------------------------------------------------------
    def _metrics_tick(self, interval: float) -> None:
        """Every running replica records and pushes record_autoscaling_stats()."""
        for role in ROLES:
            store = self.stores[role]
            for rep in self.replicas[role]:
                if rep.state == RUNNING:
                    store.record(rep.id, self.now, rep.report(), rep.ongoing)
            store.record_queued(self.now, len(self.handle[role]))
        if self.active():
            self.schedule(self.now + interval, self._metrics_tick, interval)

    def _routing_tick(self) -> None:
        for rep in self.replicas["decode"]:
            if rep.state == RUNNING:
                rep.refresh_snapshot()
        if self.active():
            self.schedule(self.now + ROUTING_STATS_PERIOD_S, self._routing_tick)

    def view(self, role: str) -> DeploymentView:
        running = [r.id for r in self.replicas[role] if r.state == RUNNING]
        store = self.stores[role]
        return DeploymentView(
            role=role, target=self.target[role], running_ids=running,
            raw_metrics=lambda: store.raw(running),
            aggregated_metrics=lambda: store.aggregated(running),
            total_num_requests=lambda: store.total_requests(running),
            total_queued_requests=store.total_queued,
            last_scale_up_time=self.last_up[role], last_scale_down_time=self.last_down[role])

    def _control_tick(self) -> None:
        for role in ROLES:
            self._set_target(role, self.autoscalers[role].decide(self.now, self.view(role)))
        if self.active():
            self.schedule(self.now + self.sim.control_interval_s, self._control_tick)

    def frontend_window(self, t0: float, t1: float) -> FrontendWindow:
        def span(series: list) -> list:
            lo = bisect.bisect_left(series, (t0,))
            hi = bisect.bisect_left(series, (t1,))
            return series[lo:hi]

        arr = span(self.fe_arrival)
        first = span(self.fe_first)
        done = [d for d in span(self.fe_done) if d[1] is not None]
        running = [r for r in self.replicas["decode"] if r.state == RUNNING]
        conc = (sum(r.ongoing for r in running) + len(self.handle["decode"])) / max(
            len(running), 1)
        return FrontendWindow(
            requests=len(arr), isl=sum(a[1] for a in arr) / len(arr) if arr else None,
            osl=sum(d[2] for d in done) / len(done) if done else None,
            ttft_s=sum(f[1] for f in first) / len(first) if first else None,
            itl_s=sum(d[1] for d in done) / len(done) if done else None,
            decode_concurrency=conc)

    def _planner_tick(self) -> None:
        p = self.planner
        adjustment = None
        if self.now >= p.next_adjust - 1e-9:
            adjustment = self.frontend_window(self.now - p.adjustment_interval_s, self.now)
            p.next_adjust += p.adjustment_interval_s
        starting = {r: sum(x.state == STARTING for x in self.replicas[r]) for r in ROLES}
        out = p.decide(self.now, self.frontend_window(self.now - p.interval_s, self.now),
                       adjustment, starting)
        for role in ROLES:
            self._set_target(role, out[role])
        if self.active():
            self.schedule(self.now + p.interval_s, self._planner_tick)

    def _timeline_tick(self) -> None:
        self.samples.append(timeline_sample(self, self._sample_t, self.now))
        self._sample_t = self.now
        if self.active():
            self.schedule(self.now + self.sim.timeline_interval_s, self._timeline_tick)


def run(sim: SimConfig, workload: Workload | None = None,
        models: tuple[ReplicaModel, ReplicaModel] | None = None,
        class_alphas: list[tuple[float, ...]] | None = None) -> dict:
    return Simulator(sim, workload, models, class_alphas).run()
