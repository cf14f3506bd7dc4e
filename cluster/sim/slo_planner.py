"""`slo-planner`: a baseline in the style of NVIDIA Dynamo's SLA planner, written from its
published description (Dynamo docs, "SLA-based Planner" / "Planner Design"):

- Throughput-based (predictive), every `adjustment_interval` (Dynamo's default 180 s): from
  the frontend's request count, mean ISL and OSL over the last interval (the constant load
  predictor: next = last) and correction factors actual / expected TTFT and ITL,
  prefill replicas = ceil(requests x ISL / interval x min(1, prefill_correction) /
  prefill throughput per replica at that ISL) and decode replicas = ceil(requests x OSL /
  interval / decode throughput per replica at the corrected ITL target ITL_slo /
  decode_correction and context ISL + OSL / 2).
- Load-based (reactive), every 10 s (Dynamo's metric pulling interval): +1 replica of a role
  whose mean TTFT / ITL over the last 10 s breached its SLO, -1 where it stayed under
  `DOWN_FRACTION` of it; a role with a replica still starting is left alone (the previous
  scaling has not landed). The throughput-based count is the lower bound.

"Profiled" throughput is the replica model itself (as Dynamo's pre-deployment profiling
measures the real engine), profiled once at a fixed acceptance (the mean of the workload's
classes, with the best k per batch): the planner has no live acceptance signal. It sets replica
counts directly (Dynamo's connector), not through Serve's autoscaler.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from mtpserve.cluster.sim.replica_models import ReplicaModel, prefill_alone_s
from mtpserve.workers.perf_model import expected_tokens

DOWN_FRACTION = 0.6


@dataclass
class FrontendWindow:
    """What the frontend's Prometheus metrics give over one interval."""

    requests: int
    isl: float | None
    osl: float | None
    ttft_s: float | None
    itl_s: float | None
    decode_concurrency: float  # running + queued decode requests per decode replica


class SloPlanner:
    def __init__(self, prefill_model: ReplicaModel, decode_model: ReplicaModel,
                 ttft_slo_s: float, tpot_slo_s: float, bounds: dict[str, tuple[int, int]],
                 initial: dict[str, int], profile_alphas: Sequence[float],
                 adjustment_interval_s: float = 180.0, reactive_interval_s: float = 10.0
                 ) -> None:
        self.prefill_model, self.decode_model = prefill_model, decode_model
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.bounds = bounds
        self.alphas = list(profile_alphas)
        self.interval_s = reactive_interval_s
        self.adjustment_interval_s = adjustment_interval_s
        self.next_adjust = adjustment_interval_s
        self.floor = {r: bounds[r][0] for r in bounds}
        self.target = dict(initial)
        self._itl_cache: dict[tuple[int, int], float] = {}

    # Profiles --------------------------------------------------------------------------------
    def itl_s(self, batch: int, context: float) -> float:
        """Profiled ITL at a batch and context per request (best k at the profile's
        acceptance, as the engine's adaptive k would pick)."""
        key = (batch, int(context) // 64)
        v = self._itl_cache.get(key)
        if v is None:
            m = self.decode_model
            v = min(m.round_s(batch, k, batch * context) / expected_tokens(self.alphas, k)
                    for k in range(m.k_max + 1))
            self._itl_cache[key] = v
        return v

    def decode_throughput(self, itl_target_s: float, context: float) -> float:
        """Tokens/s of one decode replica at the largest batch meeting the ITL target (batch 1
        if none does)."""
        best = 1
        for b in range(1, self.decode_model.max_num_seqs + 1):
            if self.itl_s(b, context) <= itl_target_s:
                best = b
            else:
                break
        return best / self.itl_s(best, context)

    def prefill_throughput(self, isl: float) -> float:
        return isl / prefill_alone_s(self.prefill_model, max(int(isl), 1))

    # Decisions -------------------------------------------------------------------------------
    def predictive(self, w: FrontendWindow) -> dict[str, int]:
        if w.requests == 0 or w.isl is None:
            return {r: self.bounds[r][0] for r in self.bounds}
        isl, osl = w.isl, w.osl or 1.0
        rate = w.requests / self.adjustment_interval_s
        p_corr = 1.0
        if w.ttft_s is not None:
            p_corr = w.ttft_s / prefill_alone_s(self.prefill_model, max(int(isl), 1))
        d_corr = 1.0
        context = isl + osl / 2
        if w.itl_s is not None:
            b = max(1, min(self.decode_model.max_num_seqs, round(w.decode_concurrency)))
            d_corr = w.itl_s / self.itl_s(b, context)
        n_p = math.ceil(rate * isl * min(1.0, p_corr) / self.prefill_throughput(isl))
        n_d = math.ceil(rate * osl / self.decode_throughput(self.tpot_slo_s / d_corr, context))
        return {"prefill": n_p, "decode": n_d}

    def decide(self, now: float, reactive: FrontendWindow, adjustment: FrontendWindow | None,
               starting: dict[str, int]) -> dict[str, int]:
        """`reactive`: the last reactive interval; `adjustment`: the last adjustment interval
        when one has just ended (else None)."""
        if adjustment is not None:
            self.floor = self.predictive(adjustment)
        observed = {"prefill": (reactive.ttft_s, self.ttft_slo_s),
                    "decode": (reactive.itl_s, self.tpot_slo_s)}
        for role, (value, slo) in observed.items():
            if starting.get(role, 0) or value is None:
                continue
            if value > slo:
                self.target[role] += 1
            elif value < DOWN_FRACTION * slo:
                self.target[role] -= 1
        out = {}
        for role, (lo, hi) in self.bounds.items():
            self.target[role] = min(max(self.target[role], self.floor.get(role, lo), lo), hi)
            out[role] = self.target[role]
        return out
