"""Decode performance model of one replica: round time as a function of (batch size B, k).

A speculative round is one verify forward over B x (k+1) tokens, one MTP forward over the
accepted tokens, and k-1 serial one-token MTP steps. Each forward has a fixed launch cost and a
per-token cost, so

    T(B, k) = c0 + c1 * B + c2 * k + c3 * B * k        (seconds)

is linear in its coefficients. They are fitted by exponentially weighted least squares over
the replica's own rounds, regularised towards the coefficients of a short profile run at start
(so batch sizes not seen lately are predicted from the profile, not extrapolated from noise).
With per-position acceptance alpha_i (draft i accepted given drafts < i were), a round emits
E(k) = 1 + a1 + a1*a2 + ... tokens per request, so predicted TPOT(B, k) = T(B, k) / E(k).

Ray-free: the replica feeds it from the engine thread; the autoscaling policy rebuilds it from
the coefficients the replica reports (`pm_0..pm_3`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

NUM_FEATURES = 4


def features(batch: float, k: float) -> np.ndarray:
    return np.array([1.0, batch, k, batch * k])  # [4]


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """Tokens one request emits per round with k drafts: accepted prefix + 1."""
    total, chain = 1.0, 1.0
    for a in list(alphas)[:k]:
        chain *= a
        total += chain
    return total


class PerfModel:
    """Round seconds vs (batch, k); `observe` is O(16), `predict` O(4)."""

    def __init__(self, coef: Sequence[float] | None = None, decay: float = 0.995,
                 prior_weight: float = 8.0) -> None:
        self.prior = np.asarray(coef if coef is not None else [0.0] * NUM_FEATURES, float)
        self.coef = self.prior.copy()  # [4]
        self.decay = decay
        self.prior_weight = prior_weight
        self._xtx = np.zeros((NUM_FEATURES, NUM_FEATURES))  # [4, 4] decayed sum of x x^T
        self._xty = np.zeros(NUM_FEATURES)  # [4]
        self._n = 0
        # Per-feature scale of the ridge: mean x_j^2 of the profile, so `prior_weight` counts
        # pseudo-rounds like the profile's.
        self._prior_scale = np.ones(NUM_FEATURES)

    @property
    def fitted(self) -> bool:
        return bool(self.prior.any() or self._n)

    def observe(self, batch: int, k: float, seconds: float) -> None:
        x = features(batch, k)
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self._n += 1
        if self._n % 8 == 0 or self._n < 8:
            self._solve()

    def _solve(self) -> None:
        # Ridge towards the prior: (X^T X + R) c = X^T y + R c_prior, R = r diag(scale). With
        # no prior (all zero) a tiny ridge only keeps the system well posed.
        r = self.prior_weight if self.prior.any() else 1e-6
        ridge = r * np.diag(self._prior_scale)  # [4, 4]
        self.coef = np.linalg.solve(self._xtx + ridge, self._xty + ridge @ self.prior)

    def fit(self, samples: Iterable[tuple[int, float, float]]) -> PerfModel:
        """Least-squares fit of (batch, k, seconds) samples (median per cell); becomes the
        prior."""
        cells: dict[tuple[int, float], list[float]] = {}
        for b, k, s in samples:
            cells.setdefault((b, k), []).append(s)
        assert cells, "no samples to fit"
        # One median per (batch, k) cell: a round that lost the CPU to a neighbour must not
        # bend the fit.
        rows = [(b, k, float(np.median(v))) for (b, k), v in cells.items()]
        x = np.stack([features(b, k) for b, k, _ in rows])  # [N, 4]
        y = np.array([s for _, _, s in rows])  # [N]
        # Relative error matters (TPOT SLO), so weight each sample by 1 / seconds.
        w = 1.0 / np.maximum(y, 1e-6)
        coef, *_ = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)
        self._prior_scale = np.maximum((x * x).mean(axis=0), 1e-3)
        self.prior = coef
        self.coef = coef.copy()
        return self

    def round_s(self, batch: float, k: float) -> float:
        # Never below the fixed cost: a bad fit must not predict free rounds.
        return max(float(features(batch, k) @ self.coef), 1e-6, float(self.coef[0]) * 0.5)

    def tpot_s(self, batch: float, k: int, alphas: Sequence[float]) -> float:
        return self.round_s(batch, k) / expected_tokens(alphas, k)

    def best_k(self, batch: float, alphas: Sequence[float], k_max: int) -> int:
        """k in [0, k_max] with the most tokens per second per request at this batch."""
        best, best_rate = 0, 0.0
        for k in range(k_max + 1):
            rate = expected_tokens(alphas, k) / self.round_s(batch, k)
            if rate > best_rate * (1 + 1e-3):  # ties go to the smaller k
                best, best_rate = k, rate
        return best

    def report(self) -> dict[str, float]:
        return {f"pm_{j}": float(c) for j, c in enumerate(self.coef)}

    @classmethod
    def from_report(cls, stats: dict[str, float]) -> PerfModel | None:
        if not all(f"pm_{j}" in stats for j in range(NUM_FEATURES)):
            return None
        return cls([stats[f"pm_{j}"] for j in range(NUM_FEATURES)])


def profile_rounds(engine, batch_sizes: Sequence[int], ks: Sequence[int],
                   rounds_per_cell: int = 6, prompt_len: int = 16, seed: int = 0,
                   clock: Callable[[], float] = time.perf_counter
                   ) -> list[tuple[int, float, float]]:
    """Time decode rounds of synthetic greedy requests on an idle `workers.engine.Engine`, for
    every (batch, k) cell. The engine's `adaptive` controller is pinned to each k (`forced_k`)
    so rounds use exactly that k; requests are aborted afterwards. Returns (batch, k, seconds).
    `clock`: wall time by default; `time.thread_time` measures only this thread's CPU (a
    single-threaded CPU engine on a shared machine, where wall time measures the neighbours).
    """
    from mtpserve.workers.sampling_params import SamplingParams

    assert not engine.has_unfinished(), "profile needs an idle engine"
    gen = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    samples: list[tuple[int, float, float]] = []
    controller = engine.adaptive
    try:
        for k in ks:
            controller.forced_k = k
            for b in batch_sizes:
                ids = [f"__profile-{k}-{b}-{i}" for i in range(b)]
                params = SamplingParams(max_tokens=(k + 1) * (rounds_per_cell + 2) + 8,
                                        temperature=0.0, ignore_eos=True)
                for rid in ids:
                    prompt = gen.integers(3, vocab, prompt_len).tolist()
                    engine.add_request(rid, prompt, params)
                timed = 0
                while timed < rounds_per_cell and engine.has_unfinished():
                    before = engine.totals["rounds"]
                    t0 = clock()
                    engine.step()
                    dt = clock() - t0
                    n = engine.totals["rounds"] - before
                    if n == b:  # a full decode round (prefill steps add no rounds)
                        samples.append((b, float(k), dt))
                        timed += 1
                for rid in ids:
                    engine.abort(rid)
    finally:
        controller.forced_k = None
    return samples
