"""Workload scenarios: arrival rate over time, acceptance mix over time, length distributions.

Every request belongs to an acceptance class, `code` or `chat`, whose per-position conditional
acceptance alpha_i (draft i accepted given drafts < i were) is fixed. A class is a property of
the request's text, so a scenario shifts acceptance by shifting the mix, as a real service
does when its traffic changes. The class numbers are assumptions in the range MTP reports give
(first MTP draft ~0.9 on code/math for MiMo-7B and DeepSeek-V3; chat text lower; deeper drafts
decay): replace them with `mtpserve eval-mtp` measurements of the served model.

Lengths (all scenarios, both classes, so acceptance is the only thing the mix changes):
prompt tokens ~ lognormal(median 1024, sigma 1.0) clipped to [32, 8192]; output tokens ~
lognormal(median 1000, sigma 0.8) clipped to [16, 8192] (reasoning-style answers; means ~1607
and ~1364); max_tokens 8192.

| scenario | rate (x --rate-scale) | code share |
|---|---|---|
| acceptance-shift | 20 req/s, constant | 1 (0-15 min), to 0 (15-20), 0 (20-40), to 1 (40-45), 1 |
| burst | 16 req/s; 48 req/s from minute 20 to 30 | 0.5 |
| diurnal | 40 req/s x (0.2 + 0.8 sin^2(pi t / 1 h)): a day in an hour | 0.5 |

The rates are sized for one H200 per replica serving the MiMo-7B-like model at an 8 ms TPOT
SLO (a decode replica then carries ~10 req/s of chat or ~20 of code): peak load needs several
prefill and decode replicas. Scale them to other hardware and models with --rate-scale.

Arrivals are a non-homogeneous Poisson process (thinning); everything is drawn from one
numpy Generator seeded with `seed`, so a seed fixes the workload exactly.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

ACCEPTANCE = {
    "code": (0.90, 0.82, 0.75, 0.70, 0.66, 0.62, 0.60, 0.58),
    "chat": (0.62, 0.48, 0.40, 0.35, 0.32, 0.30, 0.28, 0.27),
}
CLASSES = ("code", "chat")
MAX_TOKENS = 8192


@dataclass(frozen=True)
class LengthDist:
    median: float
    sigma: float
    lo: int
    hi: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.exp(np.log(self.median) + self.sigma * rng.standard_normal(n))
        return np.clip(np.round(x), self.lo, self.hi).astype(np.int64)


PROMPT = LengthDist(1024, 1.0, 32, 8192)
OUTPUT = LengthDist(1000, 0.8, 16, 8192)
# Means of the clipped distributions (Monte Carlo, 2e6 draws): what offline
# profiles size for.
PROMPT_MEAN = 1607.0
OUTPUT_MEAN = 1364.0


@dataclass(frozen=True)
class Scenario:
    name: str
    duration_s: float
    base_rps: float
    rate: Callable[[float], float]  # multiple of base_rps at time t
    code_share: Callable[[float], float]
    description: str


def _shift(t: float) -> float:
    m = t / 60
    if m < 15:
        return 1.0
    if m < 20:
        return 1 - (m - 15) / 5
    if m < 40:
        return 0.0
    if m < 45:
        return (m - 40) / 5
    return 1.0


SCENARIOS: dict[str, Scenario] = {
    "acceptance-shift": Scenario(
        "acceptance-shift", 3600.0, 20.0, lambda t: 1.0, _shift,
        "steady load; the mix goes code -> chat -> code (acceptance falls and recovers)"),
    "burst": Scenario(
        "burst", 3600.0, 16.0, lambda t: 3.0 if 1200 <= t < 1800 else 1.0, lambda t: 0.5,
        "arrival rate steps up 3x for 10 minutes, then back"),
    "diurnal": Scenario(
        "diurnal", 3600.0, 40.0, lambda t: 0.2 + 0.8 * math.sin(math.pi * t / 3600) ** 2,
        lambda t: 0.5, "a day compressed into an hour: 0.2x at night, 1x at noon"),
}


@dataclass(frozen=True)
class Workload:
    """Arrays of one generated workload, in arrival order."""

    arrival: np.ndarray  # seconds
    cls: np.ndarray  # index into CLASSES
    prompt: np.ndarray
    output: np.ndarray
    duration_s: float

    def __len__(self) -> int:
        return len(self.arrival)


def generate(scenario: Scenario, seed: int, rate_scale: float = 1.0,
             duration_s: float | None = None) -> Workload:
    rng = np.random.default_rng(seed)
    dur = scenario.duration_s if duration_s is None else duration_s
    peak = scenario.base_rps * rate_scale * max(scenario.rate(t) for t in np.linspace(0, dur, 721))
    times: list[float] = []
    t = 0.0
    if peak > 0:
        while True:  # thinning: candidates at the peak rate, kept with rate(t) / peak
            t += rng.exponential(1 / peak)
            if t >= dur:
                break
            if rng.random() * peak < scenario.base_rps * rate_scale * scenario.rate(t):
                times.append(t)
    n = len(times)
    arrival = np.array(times, dtype=float)
    share = np.array([scenario.code_share(x) for x in times], dtype=float)
    cls = (rng.random(n) >= share).astype(np.int64)  # 0 = code, 1 = chat
    return Workload(arrival, cls, PROMPT.draw(rng, n), OUTPUT.draw(rng, n), dur)


def single_request(prompt: int, output: int, cls: int = 0, at: float = 0.0) -> Workload:
    """One request (tests: a lone request must see exactly the model's TTFT and TPOT)."""
    return Workload(np.array([at]), np.array([cls]), np.array([prompt]), np.array([output]),
                    at + 1.0)
