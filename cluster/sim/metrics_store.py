"""What Serve's controller holds about one deployment's replicas: the custom metrics each
replica's `record_autoscaling_stats()` returned (timestamped, pruned to `look_back_period_s`
as the replica's metrics pusher prunes them), ongoing-request samples per replica and the
handles' queued-request samples, from which `raw_metrics`, `aggregated_metrics` and
`total_num_requests` of an `AutoscalingContext` are built."""

from __future__ import annotations

from mtpserve.cluster.sim.serve_port import TimeStampedValue


def _prune(series: list, cutoff: float) -> None:
    i = 0
    while i < len(series) and series[i][0] < cutoff:
        i += 1
    if i:
        del series[:i]


def _mean(series: list) -> float:
    return sum(v for _, v in series) / len(series) if series else 0.0


class MetricsStore:
    def __init__(self, look_back_s: float) -> None:
        self.look_back_s = look_back_s
        self.series: dict[str, dict[str, list[TimeStampedValue]]] = {}
        self.ongoing: dict[str, list[tuple[float, float]]] = {}
        self.queued: list[tuple[float, float]] = []

    def record(self, rid: str, t: float, report: dict[str, float], ongoing: int) -> None:
        cutoff = t - self.look_back_s
        for name, value in report.items():
            s = self.series.setdefault(name, {}).setdefault(rid, [])
            s.append(TimeStampedValue(t, float(value)))
        for per in self.series.values():
            s = per.get(rid)
            if s:
                _prune(s, cutoff)
        o = self.ongoing.setdefault(rid, [])
        o.append((t, float(ongoing)))
        _prune(o, cutoff)

    def record_queued(self, t: float, queued: int) -> None:
        self.queued.append((t, float(queued)))
        _prune(self.queued, t - self.look_back_s)

    def drop(self, rid: str) -> None:
        for per in self.series.values():
            per.pop(rid, None)
        self.ongoing.pop(rid, None)

    def raw(self, running: list[str]) -> dict:
        out: dict = {}
        for name, per in self.series.items():
            got = {rid: per[rid] for rid in running if per.get(rid)}
            if got:
                out[name] = got
        return out

    def aggregated(self, running: list[str]) -> dict:
        return {name: {rid: _mean(s) for rid, s in per.items()}
                for name, per in self.raw(running).items()}

    def total_requests(self, running: list[str]) -> float:
        return sum(_mean(self.ongoing.get(rid, [])) for rid in running) + _mean(self.queued)

    def total_queued(self) -> float:
        return _mean(self.queued)
