"""A simulated prefill replica: chunked prefill as workers/scheduler.py schedules it for
`Engine(role="prefill")`, with the real `PrefillWindows` (workers/replica/signals.py) on the
simulated
clock, so `report()` is what the replica's `record_autoscaling_stats()` returns.

Each step takes the prompts being prefilled, then admits waiting prompts FIFO while the token
budget (`max_num_batched_tokens`), a sequence slot and KV blocks for the prompt plus one round
last; its time is the replica model's step time for the chunks' tokens and attended positions.
A finished prompt's KV is held until the decode side has pulled it (or this replica stops:
then decode recomputes the prompt, as `kv_transfer.failure_policy: recompute` does).
"""

from __future__ import annotations

from collections import deque

from mtpserve.cluster.sim.lifecycle import DRAINING, STARTING, STOPPED
from mtpserve.cluster.sim.replica_models import ReplicaModel, attended
from mtpserve.cluster.sim.requests import SimRequest
from mtpserve.workers.replica.signals import PrefillWindows

PREFILL_MAX_NUM_SEQS = 64  # EngineReplica passes 64 when the role has no max_num_seqs


class PrefillReplica:
    role = "prefill"

    def __init__(self, rid: str, model: ReplicaModel, host, k_max: int, window_s: float
                 ) -> None:
        self.id, self.model, self.host, self.k_max = rid, model, host, k_max
        self.capacity = model.prefill_kv_tokens
        self.state = STARTING
        self.t_created = host.now
        self.t_stopped: float | None = None
        self.drain_deadline: float | None = None
        self.windows = PrefillWindows(window_s, clock=host.clock)
        self.queue: deque[SimRequest] = deque()
        self.prefilling: list[list] = []  # [request, computed tokens, reserved slots]
        self.held: dict[int, tuple[SimRequest, int]] = {}  # rid -> (request, slots)
        self.kv = 0  # slots reserved by prefilling + held requests
        self.enqueued: dict[int, float] = {}
        self.busy = False
        self.busy_s = 0.0  # EngineRecorder._prefill_busy_s
        self.cpu = getattr(host, "cpu", None)  # co-located replicas share cores (sim/cpu.py)

    @property
    def ongoing(self) -> int:
        """Requests inside PrefillServer.prefill (Serve's ongoing count; holds are not)."""
        return len(self.queue) + len(self.prefilling)

    def report(self) -> dict[str, float]:
        """= EngineRecorder.autoscaling_stats for a prefill replica."""
        return self.windows.report(self.ongoing) | {"kv_usage": min(self.kv / self.capacity,
                                                                    1.0)}

    def refresh_snapshot(self) -> None:
        pass

    def submit(self, req: SimRequest) -> None:
        self.queue.append(req)
        self.enqueued[req.rid] = self.host.now
        if not self.busy:
            self._start_step()

    def release(self, req: SimRequest) -> None:
        """Decode pulled the KV (or the request ended at its first token)."""
        item = self.held.pop(req.rid, None)
        if item is not None:
            self.kv -= item[1]
            if not self.busy and self.queue:
                self._start_step()
            self._maybe_drained()

    def _start_step(self) -> None:
        if self.state == STOPPED:
            return
        budget = self.model.max_num_batched_tokens
        chunks = []
        for item in self.prefilling:
            if budget <= 0:
                break
            req, done, _ = item
            end = min(req.prompt, done + budget)
            chunks.append((item, done, end))
            budget -= end - done
        k = self.k_max
        while self.queue and budget > 0 and len(self.prefilling) < PREFILL_MAX_NUM_SEQS:
            req = self.queue[0]
            # Admit when the prompt plus one round fits; reserve the prompt + k-1 MTP slots.
            if self.kv + req.prompt + 2 * k + 1 > self.capacity and (self.kv or
                                                                     self.prefilling):
                break
            self.queue.popleft()
            item = [req, 0, req.prompt + max(k - 1, 0)]
            self.kv += item[2]
            self.prefilling.append(item)
            end = min(req.prompt, budget)
            chunks.append((item, 0, end))
            budget -= end
        if not chunks:
            self.busy = False
            return
        tokens = sum(e - s for _, s, e in chunks)
        att = sum(attended(s, e) for _, s, e in chunks)
        dt = self.model.prefill_step_s(tokens, att)
        self.busy = True
        if self.cpu is not None:  # the step is work on the shared cores: its wall time varies
            self.cpu.start(dt, self._shared_step_end, chunks, self.host.now,
                           kind="prefill")
        else:
            self.host.schedule(self.host.now + dt, self._step_end, chunks, dt)

    def _shared_step_end(self, chunks: list, t0: float) -> None:
        self._step_end(chunks, self.host.now - t0)  # the engine times steps by wall clock

    def _step_end(self, chunks: list, dt: float) -> None:
        if self.state == STOPPED:
            return
        now = self.host.now
        self.busy_s += dt
        finished = []
        for item, _, end in chunks:
            item[1] = end
            if end >= item[0].prompt:
                finished.append(item)
        if finished:
            compute_s, self.busy_s = self.busy_s / len(finished), 0.0
            for item in finished:
                req = item[0]
                self.prefilling.remove(item)
                self.held[req.rid] = (req, item[2])
                req.prefill_replica = self
                self.windows.observe(compute_s, now - self.enqueued.pop(req.rid))
                self.host.prefill_done(req)
        self.busy = False
        self._start_step()
        self._maybe_drained()

    def _maybe_drained(self) -> None:
        if self.state == DRAINING and self.ongoing == 0:
            self.host.replica_drained(self)

    def evict_all(self) -> list[SimRequest]:
        """Graceful shutdown ran out: prompts not yet prefilled go back to the router."""
        out = list(self.queue) + [item[0] for item in self.prefilling]
        for item in self.prefilling:
            self.kv -= item[2]
        self.queue.clear()
        self.prefilling.clear()
        self.enqueued.clear()
        return out

    def drop_holds(self) -> None:
        """The replica stopped: KV it still held is gone; decode recomputes those prompts."""
        for req, _ in self.held.values():
            req.kv_lost = True
            req.prefill_replica = None
        self.held.clear()
        self.kv = 0
