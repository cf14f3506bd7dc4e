"""A simulated decode replica: continuous batching of speculative rounds, as workers/engine.py
and workers/scheduler.py run them, at the cost the replica model gives.

Faithful to the engine: admission of transferred requests FIFO by a sequence slot
(`max_num_seqs` counts running + receiving) and KV blocks (prompt + one round's slots), KV
pulled on one serial transfer lane per replica while rounds go on, joining at the next round
boundary, per-request k capped by the replica's k for the batch band (workers/adaptive_k.py,
the real `AdaptiveK` fed with this replica's acceptance), the replica's own online
`PerfModel` seeded by the start profile, and the real `DecodeWindows`
(workers/replica/signals.py) on
the simulated clock, so `report()` is what `record_autoscaling_stats()` would return.

Simplified ("fluid" rounds): every request of an acceptance class emits the class's expected
tokens per round E(k) = 1 + a1 + a1 a2 + ... each round instead of a random draw, so all
requests of a class advance together and a stretch of identical rounds is one event (cost per
request, not per round). A stretch ends at the next finish, KV arrival, KV overflow or after
`STEP_CAP_S`; the round time is evaluated at the stretch's start (context grows inside it).
KV growth past the cache preempts the newest request, which recomputes its context here.
"""

from __future__ import annotations

import heapq
import math
from collections import deque

from mtpserve.cluster.sim.lifecycle import DRAINING, STARTING, STOPPED
from mtpserve.cluster.sim.replica_models import ReplicaModel, prefill_alone_s, profile_samples
from mtpserve.cluster.sim.requests import SimRequest
from mtpserve.workers.adaptive_k import AdaptiveK
from mtpserve.workers.perf_model import PerfModel, features
from mtpserve.workers.replica.signals import DecodeWindows

STEP_CAP_S = 0.5  # longest stretch of identical rounds (= the recent-batch window's bucket)
# Refit the online model and re-band k at most this often (the engine: every 8 / 16 rounds);
# replicas report once a second, so finer refits would not reach the policy anyway.
SOLVE_EVERY_S = 1.0
DEFAULT_EXPECTED_TOKENS = 256  # = workers.replica.decode_server.DEFAULT_EXPECTED_TOKENS


def lookahead(k: int) -> int:
    """KV slots one round may touch beyond the committed tokens (scheduler.decode_slots)."""
    return max(k + 1, 2 * k)


class DecodeReplica:
    role = "decode"

    def __init__(self, rid: str, model: ReplicaModel, host, k_max: int, adaptive: bool,
                 window_s: float, num_classes: int) -> None:
        self.id, self.model, self.host = rid, model, host
        self.k_max, self.max_num_seqs = k_max, model.max_num_seqs
        self.capacity = model.decode_kv_tokens
        self.state = STARTING
        self.t_created = host.now
        self.t_stopped: float | None = None
        self.drain_deadline: float | None = None
        self.windows = DecodeWindows(k_max, window_s, clock=host.clock)
        # The replica's online model, seeded by the start profile (EngineRecorder.profile).
        self.perf = PerfModel()
        self.perf.fit(profile_samples(model))
        self.adaptive = AdaptiveK(k_max, enabled=adaptive, model=self.perf)
        self.adaptive.update()
        self._k_cache: dict[tuple[int, int, int], int] = {}
        self._last_solve = host.now
        # Requests.
        self.awaiting: deque[SimRequest] = deque()  # waiting for a slot + blocks (FIFO)
        self.receiving: dict[int, tuple[SimRequest, int]] = {}  # rid -> (request, KV slots)
        self.ready: list[SimRequest] = []  # KV landed, joins at the next round boundary
        self.running: dict[int, SimRequest] = {}  # insertion order: newest last
        self.reserved = 0  # KV slots of receiving + ready requests
        self.lane_free = 0.0
        c = num_classes
        self.progress = [0.0] * c  # tokens each running request of a class has emitted
        self.heaps: list[list] = [[] for _ in range(c)]  # (threshold, seq, request)
        self.count = [0] * c
        self.base = [0.0] * c  # sum of (context at join - progress at join)
        # The current stretch of rounds.
        self.busy = False
        self.step_seq = 0
        self.step_start = 0.0
        self.step_T = 0.0
        self.step_rounds = 0
        self.step_k: list[int] = [0] * c
        self.step_E: list[float] = [1.0] * c
        self.step_B = 0
        self.step_ctx = 0.0
        # Routing hints (DecodeServer.record_routing_stats, refreshed every period).
        self.output_ema: float | None = None
        self.snapshot = (0.0, 0, DEFAULT_EXPECTED_TOKENS)
        # Counters.
        self.rounds_total = 0
        self.preemptions = 0
        # Co-located replicas share the host's cores (sim/cpu.py): the stretch of rounds, the
        # KV lane's pulls and the streaming of output chunks are jobs on them.
        self.cpu = getattr(host, "cpu", None)
        self.job = None  # the stretch in progress
        self.lane: deque[tuple[SimRequest, float]] = deque()  # pulls waiting for the lane
        self.lane_busy = False
        self.stream_job = None

    # Load --------------------------------------------------------------------------------------
    @property
    def batch(self) -> int:
        return len(self.running)

    @property
    def num_seqs(self) -> int:
        return len(self.running) + len(self.receiving) + len(self.ready)

    @property
    def ongoing(self) -> int:
        """Requests inside DecodeServer.generate (Serve's ongoing count)."""
        return self.num_seqs + len(self.awaiting)

    def context_sum(self) -> float:
        return sum(self.base[c] + self.count[c] * self.progress[c]
                   for c in range(len(self.count)))

    def kv_used(self) -> float:
        return self.context_sum() + self.batch * lookahead(self.k_max) + self.reserved

    def report(self) -> dict[str, float]:
        """= EngineRecorder.autoscaling_stats for a decode replica: waiting counts queued
        recomputes, requests queued for KV blocks and those pulling their KV."""
        waiting = len(self.awaiting) + len(self.receiving)
        out = self.windows.report(min(self.kv_used() / self.capacity, 1.0), self.batch, waiting)
        self.adaptive.batch = max(self.batch, 1)
        return out | self.perf.report() | {"k_replica": float(self.adaptive.k)}

    def refresh_snapshot(self) -> None:
        """DecodeServer.record_routing_stats: expected tokens still to generate."""
        typical = int(self.output_ema or DEFAULT_EXPECTED_TOKENS)
        total = 0.0
        for r in self._ongoing_requests():
            expected = min(r.max_tokens, typical)
            total += max(expected - self._produced(r), 1)
        self.snapshot = (total, self.ongoing, typical)

    def _ongoing_requests(self):
        yield from self.awaiting
        for r, _ in self.receiving.values():
            yield r
        yield from self.ready
        yield from self.running.values()

    def _produced(self, r: SimRequest) -> int:
        if r.rid in self.running:
            return r.produced + int(self.progress[r.cls] - r.join_progress)
        return r.produced

    # Arrivals and admission ---------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.awaiting.append(req)
        self._admit()

    def _slots(self, req: SimRequest) -> int:
        return req.prompt + req.produced + lookahead(self.k_max)

    def _admit(self) -> None:
        """Scheduler.admit_transferred: FIFO while a slot and the blocks are free; the pull
        (or, without a KV holder, a recompute here) runs on the replica's serial lane."""
        now = self.host.now
        while self.awaiting and self.num_seqs < self.max_num_seqs:
            req = self.awaiting[0]
            slots = self._slots(req)
            if self.kv_used() + slots > self.capacity and self.num_seqs > 0:
                break
            self.awaiting.popleft()
            dur = (prefill_alone_s(self.model, req.context) if req.kv_lost
                   else self.model.kv_transfer_s(req.prompt + max(self.k_max - 1, 0)))
            self.receiving[req.rid] = (req, slots)
            self.reserved += slots
            if self.cpu is not None:
                self.lane.append((req, dur))
                self._next_pull()
                continue
            start = max(now, self.lane_free)
            self.lane_free = start + dur
            self.host.schedule(start + dur, self._kv_landed, req)

    def _next_pull(self) -> None:
        """Shared CPU: the serial lane's next pull is a job on the host's cores."""
        if not self.lane_busy and self.lane:
            req, dur = self.lane.popleft()
            self.lane_busy = True
            self.cpu.start(dur, self._pulled, req, kind="pull")

    def _pulled(self, req: SimRequest) -> None:
        self.lane_busy = False
        self._next_pull()
        self._kv_landed(req)

    def _kv_landed(self, req: SimRequest) -> None:
        item = self.receiving.pop(req.rid, None)
        if item is None or self.state == STOPPED:
            return  # migrated away meanwhile
        self.host.release_hold(req)
        self.ready.append(req)
        if not self.busy:
            self._join_ready()
            self._start_step()
        elif self.cpu is not None:  # join at the end of the round in progress
            done = max(1, math.ceil(self.cpu.done_work(self.job) / self.step_T - 1e-9))
            if done < self.step_rounds:
                self.step_rounds = done
                self.cpu.set_work(self.job, done * self.step_T)
        else:  # join at the end of the round in progress
            now = self.host.now
            done = max(1, math.ceil((now - self.step_start) / self.step_T - 1e-9))
            if done < self.step_rounds:
                self.step_rounds = done
                self.step_seq += 1
                self.host.schedule(self.step_start + done * self.step_T, self._step_end,
                                   self.step_seq)

    def _join_ready(self) -> None:
        now = self.host.now
        for req in self.ready:
            self.reserved -= self._slots(req)  # its KV is counted by context from now on
            c = req.cls
            req.join_progress = self.progress[c]
            req.threshold = self.progress[c] + (req.output - req.produced)
            req.t_join = now
            req.removed = False
            req.seq = self.host.next_seq()
            heapq.heappush(self.heaps[c], (req.threshold, req.seq, req))
            self.count[c] += 1
            self.base[c] += req.prompt + req.produced - self.progress[c]
            self.running[req.rid] = req
        self.ready.clear()

    # Rounds -------------------------------------------------------------------------------------
    def _class_k(self, batch: int, c: int, cap: int) -> int:
        if cap == 0 or not self.adaptive.enabled:
            return cap
        key = (batch, cap, c)
        k = self._k_cache.get(key)
        if k is None:
            # AdaptiveK._request_k: the request's own acceptance (here its class's), capped by
            # the replica's k for the batch band.
            alphas = self.host.class_alphas[c]
            k = self._k_cache[key] = min(cap, self.perf.best_k(batch, alphas, cap))
        return k

    def _start_step(self) -> None:
        if not self.running or self.state == STOPPED:
            self.busy = False
            return
        now = self.host.now
        B = self.batch
        self.adaptive.batch = B
        cap = self.adaptive.k
        ks = [self._class_k(B, c, cap) for c in range(len(self.count))]
        E = [self.host.tokens_per_round[c][ks[c]] for c in range(len(ks))]
        k_mean = sum(ks[c] * self.count[c] for c in range(len(ks))) / B
        ctx = self.context_sum()
        T = self.model.round_s(B, k_mean, ctx)
        rounds = max(1, int(STEP_CAP_S / T))
        for c, heap in enumerate(self.heaps):
            while heap and heap[0][2].removed:
                heapq.heappop(heap)
            if heap:
                need = heap[0][0] - self.progress[c]
                rounds = min(rounds, max(1, math.ceil(need / E[c] - 1e-9)))
        used = ctx + B * lookahead(self.k_max) + self.reserved
        growth = sum(self.count[c] * E[c] for c in range(len(E)))
        if used + growth * rounds > self.capacity:
            rounds = max(1, int((self.capacity - used) / growth))
        self.busy = True
        self.step_seq += 1
        self.step_start, self.step_T, self.step_rounds = now, T, rounds
        self.step_k, self.step_E, self.step_B, self.step_ctx = ks, E, B, ctx
        if self.cpu is not None:
            self.job = self.cpu.start(rounds * T, self._step_end, self.step_seq, kind="decode")
        else:
            self.host.schedule(now + rounds * T, self._step_end, self.step_seq)

    def _step_end(self, seq: int) -> None:
        if seq != self.step_seq or self.state == STOPPED:
            return
        now = self.host.now
        m, B, T, ks, E = self.step_rounds, self.step_B, self.step_T, self.step_k, self.step_E
        if self.cpu is not None:
            self.job = None
            T = (now - self.step_start) / m  # the engine times rounds by wall clock
            self._stream(m * B)
        self._account(m, B, T, ks, self.step_ctx)
        for c in range(len(E)):
            self.progress[c] += m * E[c]
        self.rounds_total += m
        for c, heap in enumerate(self.heaps):
            while heap and (heap[0][2].removed or heap[0][0] <= self.progress[c] + 1e-6):
                _, _, req = heapq.heappop(heap)
                if not req.removed:
                    self._finish(req, now)
        if self.kv_used() > self.capacity and len(self.running) > 1:
            self._preempt_newest()
        self.busy = False
        self._admit()
        self._join_ready()
        if self.state == DRAINING and self.ongoing == 0:
            self.host.replica_drained(self)
            return
        self._start_step()

    def _stream(self, chunks: int) -> None:
        """Shared CPU: `chunks` output chunks to stream through ingress, proxy and client, on
        one backlog job."""
        work = chunks * self.cpu.sharing.stream_s_per_chunk
        if work <= 0:
            return
        if self.stream_job is not None and self.stream_job.active:
            self.cpu.set_work(self.stream_job, self.stream_job.work + work)
        else:
            self.stream_job = self.cpu.start(work, lambda: None, kind="stream")

    def _account(self, m: int, B: int, T: float, ks: list[int], ctx: float) -> None:
        """What m identical rounds feed the windows, the online model and the k controller
        (the sums m rounds of per-round and per-request observations would add)."""
        k_mean = sum(ks[c] * self.count[c] for c in range(len(ks))) / B
        self.windows.rounds.add([m, m * B, m * T, m * k_mean * B])
        self.windows.recent.add([m, m * B])
        observe_rounds(self.perf, B, k_mean, T, m, ctx)
        kw = max(self.k_max, 1)
        row = [0.0] * (2 * kw)
        tested = [0.0] * kw  # AdaptiveK counts positions actually tested
        n_obs = 0
        for c, k in enumerate(ks):
            n = self.count[c] * m
            if n == 0 or k == 0:
                continue
            n_obs += n
            chain = 1.0
            for i, a in enumerate(self.host.class_alphas[c][:k]):
                row[i] += n
                tested[i] += n * chain
                chain *= a
                row[kw + i] += n * chain
        if n_obs:
            self.windows.drafts.add(row)
            observe_drafts(self.adaptive, tested, row[kw:])
        if self.host.now - self._last_solve >= SOLVE_EVERY_S or self.perf._n < 8:
            self.perf._solve()
            self.adaptive.update()
            self._k_cache.clear()
            self._last_solve = self.host.now

    def _remove_running(self, req: SimRequest) -> None:
        c = req.cls
        req.removed = True
        self.count[c] -= 1
        self.base[c] -= req.prompt + req.produced - req.join_progress
        del self.running[req.rid]

    def _finish(self, req: SimRequest, now: float) -> None:
        need = req.output - req.produced
        self._remove_running(req)
        req.produced = req.output
        if need > 0 and now > req.t_join:
            self.windows.tpot_s.add((now - req.t_join) / need)  # decode-only TPOT
        self.output_ema = (req.output if self.output_ema is None
                           else 0.9 * self.output_ema + 0.1 * req.output)
        self.host.request_done(req, now)

    def _preempt_newest(self) -> None:
        """Out of KV blocks: the newest running request is recomputed later (vLLM's policy,
        Scheduler._schedule_decode)."""
        rid = next(reversed(self.running))
        req = self.running[rid]
        done = int(self.progress[req.cls] - req.join_progress)
        self._remove_running(req)
        req.produced = min(req.output - 1, req.produced + done)
        req.kv_lost = True
        req.preemptions += 1
        self.preemptions += 1
        self.awaiting.appendleft(req)

    # Lifecycle ----------------------------------------------------------------------------------
    def evict_all(self) -> list[SimRequest]:
        """Graceful shutdown ran out: every request still here leaves (the orchestrator
        resumes it on another replica with the tokens it already streamed)."""
        if self.busy:  # rounds completed up to now count
            now = self.host.now
            if self.cpu is not None and self.job is not None:
                done = int(self.cpu.done_work(self.job) / self.step_T + 1e-9)
                self.cpu.cancel(self.job)
                self.job = None
            else:
                done = int((now - self.step_start) / self.step_T + 1e-9)
            if done > 0:
                self._account(done, self.step_B, self.step_T, self.step_k, self.step_ctx)
                for c in range(len(self.step_E)):
                    self.progress[c] += done * self.step_E[c]
        out = list(self.awaiting) + [r for r, _ in self.receiving.values()] + list(self.ready)
        for req in list(self.running.values()):
            done = int(self.progress[req.cls] - req.join_progress)
            self._remove_running(req)
            req.produced = min(req.output - 1, req.produced + done)
            out.append(req)
        self.awaiting.clear()
        self.receiving.clear()
        self.ready.clear()
        self.reserved = 0
        self.busy = False
        self.step_seq += 1
        return out


def observe_rounds(model: PerfModel, batch: int, k: float, seconds: float, m: int,
                   ctx_tokens: float = 0.0) -> None:
    """`m` calls of `PerfModel.observe(batch, k, seconds, ctx_tokens)` in closed form (the
    decayed normal equations and context sums); the solve is left to the caller (the engine
    solves every 8 rounds)."""
    x = features(batch, k, ctx_tokens)
    dm = model.decay ** m
    w = (1 - dm) / (1 - model.decay)
    model._xtx = dm * model._xtx + w * (x[:, None] * x[None, :])
    model._xty = dm * model._xty + w * x * seconds
    model._ctx_sum = dm * model._ctx_sum + w * ctx_tokens
    model._seq_sum = dm * model._seq_sum + w * batch
    model._n += m


def observe_drafts(ctrl: AdaptiveK, tested: list[float], accepted: list[float]) -> None:
    """The `AdaptiveK.observe` calls whose summed per-position counts are `tested` /
    `accepted`, in closed form (a call decays only the positions it tested); `update` is the
    caller's."""
    for i in range(min(ctrl.k_max, len(tested))):
        n = tested[i]
        if n <= 0:
            continue
        dn = ctrl.decay ** n
        w = (1 - dn) / (1 - ctrl.decay) / n
        ctrl.drafted[i] = dn * ctrl.drafted[i] + w * n
        ctrl.accepted[i] = dn * ctrl.accepted[i] + w * accepted[i]
