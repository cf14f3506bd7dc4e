"""What a run reports: SLO attainment, goodput, GPU-seconds, latency percentiles, the replica
timeline (every change of replica states and targets) and a sampled timeline (load,
acceptance, replicas, TTFT/TPOT per interval). Everything is a plain JSON-able dict."""

from __future__ import annotations

import bisect
from dataclasses import asdict
from typing import Any

import numpy as np

from mtpserve.cluster.sim.lifecycle import RUNNING
from mtpserve.cluster.sim.requests import OK, REJECTED

REPLICA_COLUMNS = ["t", "prefill_starting", "prefill_running", "prefill_draining",
                   "decode_starting", "decode_running", "decode_draining", "target_prefill",
                   "target_decode"]


def _r(x: float | None, nd: int = 6) -> float | None:
    return None if x is None else round(float(x), nd)


def _pct(values: list[float], q: float, scale: float = 1000.0) -> float | None:
    return _r(float(np.percentile(values, q)) * scale, 3) if values else None


def gpu_seconds(sim) -> float:
    return sum(sim.tp[role] * (rep.t_stopped - rep.t_created)
               for role in sim.replicas for rep in sim.replicas[role])


def timeline_gpu_seconds(rows: list[list], tp: dict[str, int]) -> float:
    """The integral of the replica timeline: alive replicas x TP over time."""
    total = 0.0
    for a, b in zip(rows, rows[1:], strict=False):
        alive_p, alive_d = sum(a[1:4]), sum(a[4:7])
        total += (b[0] - a[0]) * (alive_p * tp["prefill"] + alive_d * tp["decode"])
    return total


def _span(series: list, t0: float, t1: float) -> list:
    return series[bisect.bisect_left(series, (t0,)):bisect.bisect_left(series, (t1,))]


def timeline_sample(sim, t0: float, t1: float) -> dict[str, Any]:
    arr = _span(sim.fe_arrival, t0, t1)
    first = [f[1] for f in _span(sim.fe_first, t0, t1)]
    tpots = [d[1] for d in _span(sim.fe_done, t0, t1) if d[1] is not None]
    dt = max(t1 - t0, 1e-9)
    out: dict[str, Any] = {"t": _r(t1, 3), "arrivals_rps": _r(len(arr) / dt, 3)}
    if arr:
        out["code_share"] = _r(sum(a[2] == 0 for a in arr) / len(arr), 4)
        out["alpha0_workload"] = _r(sum(sim.class_alphas[a[2]][0] for a in arr) / len(arr), 4)
    decode = [r for r in sim.replicas["decode"] if r.state == RUNNING]
    alphas = [a[0] for a in (r.windows.alphas() for r in decode) if a and a[0] is not None]
    if alphas:
        out["alpha0_measured"] = _r(sum(alphas) / len(alphas), 4)
    if decode:
        out["decode_batch"] = _r(sum(r.batch for r in decode) / len(decode), 2)
        ks = []
        for r in decode:
            r.adaptive.batch = max(r.batch, 1)
            ks.append(r.adaptive.k)
        out["decode_k"] = _r(sum(ks) / len(ks), 2)
    for role in ("prefill", "decode"):
        states = [r.state for r in sim.replicas[role]]
        out[f"{role}_alive"] = sum(s != "stopped" for s in states)
        out[f"{role}_running"] = states.count(RUNNING)
        out[f"{role}_target"] = sim.target[role]
        out[f"{role}_queued"] = len(sim.handle[role])
    out["ttft_ms_p50"], out["ttft_ms_p99"] = _pct(first, 50), _pct(first, 99)
    out["tpot_ms_p50"], out["tpot_ms_p99"] = _pct(tpots, 50), _pct(tpots, 99)
    return out


def summarize(sim) -> dict[str, Any]:
    s = sim.sim
    ttft_slo, tpot_slo = s.ttft_slo_ms / 1000, s.tpot_slo_ms / 1000
    reqs = sim.requests
    ok = [r for r in reqs if r.status == OK]
    ttft_ok = [r.ttft <= ttft_slo for r in ok]
    tpot_ok = [r.tpot is None or r.tpot <= tpot_slo for r in ok]
    met = sum(a and b for a, b in zip(ttft_ok, tpot_ok, strict=True))
    n = max(len(reqs), 1)
    ttfts = [r.ttft for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    dm, pm = sim.models["decode"], sim.models["prefill"]
    gs = gpu_seconds(sim)
    summary = {
        "requests": len(reqs), "finished": len(ok),
        "rejected": sum(r.status == REJECTED for r in reqs),
        "unfinished": len(reqs) - len(ok) - sum(r.status == REJECTED for r in reqs),
        "slo_attainment": _r(met / n, 6),
        "ttft_attainment": _r(sum(ttft_ok) / n, 6),
        "tpot_attainment": _r(sum(tpot_ok) / n, 6),
        "goodput_rps": _r(met / sim.duration, 4),
        "gpu_seconds": _r(gs, 3), "gpu_hours": _r(gs / 3600, 4),
        "ttft_ms_p50": _pct(ttfts, 50), "ttft_ms_p99": _pct(ttfts, 99),
        "tpot_ms_p50": _pct(tpots, 50), "tpot_ms_p99": _pct(tpots, 99),
        "migrations": sum(r.migrations for r in reqs),
        "preemptions": sum(r.preemptions for r in reqs),
        "replica_starts": {role: sim.starts[role] for role in sim.starts},
        "decode_rounds": sum(r.rounds_total for r in sim.replicas["decode"]),
        "sim_end_s": _r(sim.t_end, 3),
    }
    config = {
        "scenario": s.scenario, "policy": s.policy, "seed": s.seed, "rate_scale": s.rate_scale,
        "duration_s": sim.duration, "hardware": None if s.profile else s.hardware,
        "model": s.profile or s.model_config, "tp": dm.tp, "k_max": dm.k_max,
        "max_num_seqs": dm.max_num_seqs, "ttft_slo_ms": s.ttft_slo_ms,
        "tpot_slo_ms": s.tpot_slo_ms, "replica_start_s": _r(dm.start_s, 3),
        "prefill_replica_start_s": _r(pm.start_s, 3), "cold_start": s.cold_start,
        "replica_start_parts": {
            role: {k: _r(v, 3) for k, v in getattr(m, "start_parts", {}).items()}
            for role, m in (("prefill", pm), ("decode", dm))},
        "decode_kv_tokens": dm.decode_kv_tokens, "prefill_kv_tokens": pm.prefill_kv_tokens,
        "autoscaling_configs": sim.autoscaling_configs,
        "serve_target_ongoing": sim.serve_targets,
    }
    if s.cpu is not None:  # only co-located replicas (GPU-scale JSON unchanged)
        config["cpu_sharing"] = asdict(s.cpu)
    return {"config": config, "summary": summary,
            "replica_timeline": {"columns": REPLICA_COLUMNS,
                                 "rows": [[_r(x, 6) for x in row] for row in sim.replica_log]},
            "timeline": sim.samples}
