"""Autoscaling signals from samples over a sliding window that empties when the replica idles.

Replicas record samples (decode rounds, per-request TPOT, drafts per position, prefill times);
`record_autoscaling_stats()` reports window aggregates as a flat dict of numbers. A window with
no samples reports no value (never a stale EMA), so an idle cluster gives the policy nothing to
scale up on and the policy is free to scale down.

Report keys (all floats; absent when the window has no samples of that kind):
- decode: `rounds` (always; 0 when idle), `batch` (mean running batch per round; `batch_recent`
  over the last RECENT_S seconds), `round_s`
  (mean round seconds), `k` (mean drafts per request per round), `tpot_s` (mean decode-only TPOT
  of requests finished in the window) and `tpot_n`, `alpha_{i}` (conditional acceptance of draft
  position i), `kv_usage`, `running`, `waiting`, `k_max` (always), and the performance
  model's coefficients `pm_{j}` (workers.perf_model).
- prefill: `prefills` (always), `prefill_s` (mean compute seconds of a prompt), `ttft_s` (mean
  time in the replica: queue + compute), `queue` (always, instantaneous).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

Clock = Callable[[], float]
RECENT_S = 3.0


class SampleWindow:
    """Timestamped scalar samples of the last `horizon_s` seconds."""

    def __init__(self, horizon_s: float = 30.0, clock: Clock = time.monotonic) -> None:
        self.horizon_s, self.clock = horizon_s, clock
        self._items: deque[tuple[float, float]] = deque()

    def add(self, value: float) -> None:
        self._items.append((self.clock(), float(value)))

    def values(self) -> list[float]:
        cutoff = self.clock() - self.horizon_s
        while self._items and self._items[0][0] < cutoff:
            self._items.popleft()
        return [v for _, v in self._items]

    def mean(self) -> float | None:
        vals = self.values()
        return sum(vals) / len(vals) if vals else None

    def __len__(self) -> int:
        return len(self.values())


class CounterWindow:
    """Sums of a fixed-width count vector over the last `horizon_s` seconds, kept in buckets of
    `bucket_s` so a hot path (one call per request per round) stays O(width)."""

    def __init__(self, width: int, horizon_s: float = 30.0, bucket_s: float = 1.0,
                 clock: Clock = time.monotonic) -> None:
        self.width, self.horizon_s, self.bucket_s, self.clock = width, horizon_s, bucket_s, clock
        self._buckets: deque[tuple[float, list[float]]] = deque()

    def add(self, counts: list[float]) -> None:
        now = self.clock()
        start = now - now % self.bucket_s
        if not self._buckets or self._buckets[-1][0] != start:
            self._buckets.append((start, [0.0] * self.width))
        row = self._buckets[-1][1]
        for i, c in enumerate(counts[: self.width]):
            row[i] += c

    def totals(self) -> list[float]:
        cutoff = self.clock() - self.horizon_s
        while self._buckets and self._buckets[0][0] + self.bucket_s <= cutoff:
            self._buckets.popleft()
        out = [0.0] * self.width
        for _, row in self._buckets:
            for i, c in enumerate(row):
                out[i] += c
        return out


class DecodeWindows:
    """What a decode replica records: rounds (batch, k, seconds), drafts per position and
    per-request decode-only TPOT. Mutated from the engine thread (rounds, drafts) and the
    replica's event loop (TPOT); each call is a single deque append, safe under the GIL."""

    def __init__(self, k_max: int, horizon_s: float = 30.0, clock: Clock = time.monotonic
                 ) -> None:
        self.k_max = k_max
        # [rounds, sum batch, sum seconds, sum k * batch]
        self.rounds = CounterWindow(4, horizon_s, clock=clock)
        # [drafted_0..drafted_{K-1}, accepted_0..accepted_{K-1}]
        self.drafts = CounterWindow(2 * max(k_max, 1), horizon_s, clock=clock)
        self.tpot_s = SampleWindow(horizon_s, clock)
        # The load the policy sizes for: mean batch of the last few seconds (fast enough for a
        # burst, smoother than the instantaneous running count of a closed-loop load).
        self.recent = CounterWindow(2, min(RECENT_S, horizon_s), bucket_s=0.5, clock=clock)

    def observe_round(self, batch: int, mean_k: float, seconds: float) -> None:
        self.rounds.add([1.0, float(batch), seconds, mean_k * batch])
        self.recent.add([1.0, float(batch)])

    def observe_drafts(self, num_drafts: int, num_accepted: int) -> None:
        """One request's round: positions < num_drafts were drafted, < num_accepted accepted."""
        if num_drafts <= 0:
            return
        k = max(self.k_max, 1)
        row = [0.0] * (2 * k)
        for i in range(min(num_drafts, k)):
            row[i] = 1.0
            row[k + i] = float(i < num_accepted)
        self.drafts.add(row)

    def alphas(self) -> list[float | None]:
        """Conditional acceptance per position: accepted_i / accepted_{i-1} (drafted_0 for
        i = 0); None where the window has nothing tested at that position."""
        k = max(self.k_max, 1)
        t = self.drafts.totals()
        drafted, accepted = t[:k], t[k:]
        out: list[float | None] = []
        for i in range(self.k_max):
            # Position i is only tested when drafts < i were all accepted and i was drafted.
            tested = min(drafted[i], accepted[i - 1]) if i else drafted[i]
            out.append(accepted[i] / tested if tested > 0 else None)
        return out

    def report(self, kv_usage: float, running: int, waiting: int) -> dict[str, float]:
        n, sum_b, sum_s, sum_kb = self.rounds.totals()
        out = {"rounds": n, "kv_usage": float(kv_usage), "running": float(running),
               "waiting": float(waiting), "k_max": float(self.k_max)}
        if n > 0:
            out |= {"batch": sum_b / n, "round_s": sum_s / n,
                    "k": sum_kb / sum_b if sum_b else 0.0}
        n_recent, b_recent = self.recent.totals()
        if n_recent > 0:
            out["batch_recent"] = b_recent / n_recent
        tpots = self.tpot_s.values()
        if tpots:
            out |= {"tpot_s": sum(tpots) / len(tpots), "tpot_n": float(len(tpots))}
        for i, a in enumerate(self.alphas()):
            if a is not None:
                out[f"alpha_{i}"] = a
        return out


class PrefillWindows:
    """What a prefill replica records: compute seconds and time in the replica per prompt."""

    def __init__(self, horizon_s: float = 30.0, clock: Clock = time.monotonic) -> None:
        self.compute_s = SampleWindow(horizon_s, clock)
        self.ttft_s = SampleWindow(horizon_s, clock)

    def observe(self, compute_s: float, ttft_s: float) -> None:
        self.compute_s.add(compute_s)
        self.ttft_s.add(ttft_s)

    def report(self, queue: int) -> dict[str, float]:
        compute = self.compute_s.values()
        out = {"prefills": float(len(compute)), "queue": float(queue)}
        if compute:
            out["prefill_s"] = sum(compute) / len(compute)
        ttft = self.ttft_s.mean()
        if ttft is not None:
            out["ttft_s"] = ttft
        return out
