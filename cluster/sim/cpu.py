"""CPU sharing between replicas co-located on one host (used only when `SimConfig.cpu` is set:
GPU-scale runs, whose replicas have their own accelerators, never build one).

On a CPU-only host every replica, the ingress, the proxy and the client are processes on the
same cores. `SharedCpu` runs their work as jobs under processor sharing, as Linux's fair
scheduler shares cores among runnable threads: while n of our jobs are busy, each progresses at

    rate(n) = min(1, cores / (n + other_threads))

(one job is one thread: it never runs faster than one core), where `other_threads` are runnable
threads of other jobs on the host (e.g. a training job busy on one core: 1). Work is given in
seconds *as measured with the job alone on this host* (the idle probes of
benchmarks/sim_calibration.py), so a job's speed is `rate(n) / rate(1)` of that: alone it takes
exactly its measured time, and the measurement's own sharing with other jobs is not counted
twice. `pinned=True` instead gives our jobs `cores - other_threads` cores of their own
(the other jobs pinned to the rest): rate(n) = min(1, free / n).

Jobs: a prefill step, a stretch of decode rounds, a KV pull, a request's work outside the
engines (`SimConfig.ingress_overhead_s`: HTTP, ingress, tokenization, Serve calls) and, if
`stream_s_per_chunk` > 0, the streaming of decode's output chunks (one per running request and
round) through ingress, proxy and client: one backlog job that grows at every stretch's end.

`contended` gives, per job kind, how many times slower a job runs than its processor share
while the other engine works: a decode stretch slows the other kinds (prefill steps, the work
outside the engines, ...), a prefill step slows decode stretches (`CONTENDED_BY`). These are
co-location costs that processor sharing alone does not show (on this host one decoding
stream slowed a lone prompt's prefill by ~1.25x with a core free). They are measured, not
fitted: benchmarks/sim_calibration.py's contended probes time the idle probes' prompts again
while one stream decodes, and its decode-contended probe times a stream's rounds while
prompts prefill.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EPS = 1e-12


@dataclass(frozen=True)
class CpuSharing:
    """The host the replicas share (all of it known before any load: the core count, the other
    jobs' load and, optionally, a streaming cost per chunk)."""

    cores: float
    other_threads: float = 0.0
    pinned: bool = False
    stream_s_per_chunk: float = 0.0
    # (job kind, slowdown while a job of kind CONTENDED_BY.get(kind, DECODE) runs)
    contended: tuple[tuple[str, float], ...] = ()

    def rate(self, n: int) -> float:
        """Speed of each of n busy jobs relative to the speed of one job alone."""
        if n <= 0:
            return 1.0
        if self.pinned:
            free = max(self.cores - self.other_threads, EPS)
            return min(1.0, free / n) / min(1.0, free)
        return min(1.0, self.cores / (n + self.other_threads)) / min(
            1.0, self.cores / (1 + self.other_threads))


DECODE = "decode"
PREFILL = "prefill"
# The job kind whose presence slows a `contended` kind: prefill slows decode, decode the rest.
CONTENDED_BY = {DECODE: PREFILL}


class Job:
    __slots__ = ("remaining", "work", "fn", "args", "active", "kind")

    def __init__(self, work: float, fn: Callable[..., Any], args: tuple, kind: str) -> None:
        self.work = self.remaining = max(float(work), 0.0)
        self.fn, self.args, self.active, self.kind = fn, args, True, kind


class SharedCpu:
    """Egalitarian processor sharing of the host's cores among active jobs, on the simulator's
    clock: one pending completion event at a time (stale ones carry an old version)."""

    def __init__(self, host, sharing: CpuSharing) -> None:
        self.host, self.sharing = host, sharing
        self.jobs: list[Job] = []
        self._t = 0.0
        self._version = 0
        self.busy_s = 0.0  # work done by all jobs, in alone-seconds (diagnostic)
        self._contended = dict(sharing.contended)

    # Public ---------------------------------------------------------------------------------
    def start(self, work: float, fn: Callable[..., Any], *args: Any, kind: str = "") -> Job:
        self._advance()
        job = Job(work, fn, args, kind)
        self.jobs.append(job)
        self._reschedule()
        return job

    def done_work(self, job: Job) -> float:
        """Work (alone-seconds) the job has completed by now."""
        if job.active:
            self._advance()
        return job.work - job.remaining

    def set_work(self, job: Job, work: float) -> None:
        """Change a running job's total work (not below what it has done)."""
        self._advance()
        done = job.work - job.remaining
        job.work = max(float(work), done)
        job.remaining = job.work - done
        self._reschedule()

    def cancel(self, job: Job) -> None:
        if job.active:
            self._advance()
            job.active = False
            self.jobs.remove(job)
            self._reschedule()

    def rate(self) -> float:
        return self.sharing.rate(len(self.jobs))

    def job_rate(self, job: Job, base: float | None = None) -> float:
        """The job's speed now: its processor share, divided by its kind's slowdown while a
        job of the kind that contends with it (`CONTENDED_BY`) runs."""
        r = self.rate() if base is None else base
        slow = self._contended.get(job.kind)
        if slow:
            by = CONTENDED_BY.get(job.kind, DECODE)
            if by != job.kind and any(j.kind == by for j in self.jobs):
                r /= slow
        return r

    # Internals ------------------------------------------------------------------------------
    def _advance(self) -> None:
        now = self.host.now
        dt = now - self._t
        self._t = now
        if dt <= 0 or not self.jobs:
            return
        r = self.rate()
        for j in self.jobs:
            rj = self.job_rate(j, r)
            self.busy_s += dt * rj
            j.remaining = max(j.remaining - dt * rj, 0.0)

    def _reschedule(self) -> None:
        self._version += 1
        if not self.jobs:
            return
        r = self.rate()
        t = self.host.now + min(j.remaining / self.job_rate(j, r) for j in self.jobs)
        self.host.schedule(t, self._complete, self._version)

    def _complete(self, version: int) -> None:
        if version != self._version:
            return
        self._advance()
        # The job the event was timed for has reached zero up to rounding: take every job
        # within rounding of zero.
        tol = EPS * max(1.0, self.host.now)
        finished = [j for j in self.jobs if j.remaining <= tol]
        if not finished:  # rounding left a sliver: finish the smallest
            finished = [min(self.jobs, key=lambda j: j.remaining)]
        for j in finished:
            j.active = False
            j.remaining = 0.0
            self.jobs.remove(j)
        self._reschedule()
        for j in finished:
            j.fn(*j.args)
