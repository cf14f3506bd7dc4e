"""How far a runner's decode graphs are: the buckets its warm-ups cover, how many are built,
which one the background compiler is building, and when it should be done.

Plain data (`progress`) for the replica's stats (`Engine.stats()["compile"]`, the ingress's
`/v1/mtpserve/stats`), the per-replica gauges of /metrics (`mtpserve:compile_buckets_total`,
`mtpserve:compile_buckets_done`, `mtpserve:compile_eta_seconds`) and the progress lines
`mtpserve up` prints. A bucket is done once its graph is built in this process or the
background compiler's package for it is in the compile cache (the engine adopts it at its
next step), so the count moves while the replica is idle. The ETA is the buckets left times
the seconds per bucket measured so far: between the background compiler's packages, else
this process's own warm-up compiles. Read on the engine thread (the `stats` command).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mtpserve.workers.model.background_compile import BackgroundCompile
    from mtpserve.workers.model.decode_graph import DecodeGraphs


def seconds_per_bucket(finished: list[float], started_at: float | None) -> float | None:
    """Mean seconds per bucket of buckets compiled one after another, from their finish times
    (wall clock) and when the compiler started (its first bucket's time includes the
    compiler's own start); None before the first finishes."""
    finished = sorted(finished)
    if len(finished) >= 2:
        return (finished[-1] - finished[0]) / (len(finished) - 1)
    if finished and started_at is not None:
        return max(0.0, finished[0] - started_at)
    return None


def eta_s(remaining: int, per_bucket: float | None, since: float | None,
          now: float) -> float | None:
    """Seconds until `remaining` buckets are built at `per_bucket` seconds each, the one in
    progress having started at `since` (the last finish); never less than the buckets after
    the current one (a slow bucket does not count as done). None: not measured yet."""
    if remaining <= 0:
        return 0.0
    if per_bucket is None:
        return None
    into = 0.0 if since is None else max(0.0, now - since)
    return max(remaining * per_bucket - into, (remaining - 1) * per_bucket)


def progress(graphs: DecodeGraphs, background: BackgroundCompile | None,
             now: float | None = None) -> dict:
    """The progress report of `graphs` (and of `background`, while one is compiling for them):

    - `total`: buckets the warm-ups cover (the configuration's batch sizes, query lengths and
      contexts); `done`: built or finished by the background compiler (<= total);
      `adopted`: built in this process (the engine runs them now; <= done)
    - `compiling`: names of the buckets being compiled now (the background compiler's)
    - `state`: `done` (every bucket built), `compiling`, or `stopped` (the rest run
      eagerly: the warm-up budget ran out without a background compiler, or it failed)
    - `seconds_per_bucket`, `eta_s` (0 when done; None until measured or when stopped),
      `elapsed_s` (from the first warm-up to now, or to the last bucket once done)
    - `compiled`: buckets compiled (not loaded from the compile cache) since this start
    """
    now = time.time() if now is None else now
    if background is not None:
        background.probe()
    planned = graphs.planned
    total = len(planned)
    # A bucket built before its warm-up planned it (a lazy compile) counts from the start.
    done_at = [graphs.ready_at.get(k, graphs.started_at or now) for k in planned
               if k in graphs.ready_at or k in graphs.compiled]
    done = len(done_at)
    adopted = sum(k in graphs.compiled for k in planned)
    running = background is not None and background.running
    if background is not None and graphs.background_finished:
        per = seconds_per_bucket(graphs.background_finished, background.started_at)
    elif graphs.compile_seconds:
        per = sum(graphs.compile_seconds) / len(graphs.compile_seconds)
    else:
        per = None
    if done == total:
        state, eta = "done", 0.0
    elif running:
        since = max(graphs.background_finished, default=background.started_at)
        state, eta = "compiling", eta_s(total - done, per, since, now)
    else:
        state, eta = "stopped", None
    end = max(done_at, default=now) if state == "done" else now
    return {
        "total": total, "done": done, "adopted": adopted,
        "compiling": [k.name for k in background.compiling()] if running else [],
        "state": state,
        "seconds_per_bucket": None if per is None else round(per, 2),
        "eta_s": None if eta is None else round(eta, 1),
        "elapsed_s": None if graphs.started_at is None
        else round(max(0.0, end - graphs.started_at), 1),
        "compiled": len(graphs.compile_seconds) + len(graphs.background_finished),
    }
