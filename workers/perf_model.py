"""Decode performance model of one replica: round time as a function of (batch size B, k) and
the context the batch attends.

A speculative round is one verify forward over B x (k+1) tokens, one MTP forward over the
accepted tokens, and k-1 serial one-token MTP steps. Each forward has a fixed launch cost and a
per-token cost, and attention reads every running request's KV once per forward, so

    T(B, k, C) = c0 + c1 * B + c2 * k + c3 * B * k + c4 * C / 1000        (seconds)

with C the context tokens of the batch (sum over its requests), is linear in its coefficients.
They are fitted by exponentially weighted least squares over the replica's own rounds,
regularised towards the coefficients of a short profile run at start (so batch sizes not seen
lately are predicted from the profile, not extrapolated from noise). The profile's prompts are
short, so its fit has c4 = 0 and the context term is learnt online; c4 is kept >= 0 (more
context is never faster: a fit that says so is confusing context with batch). The model also
keeps the recent mean context per request (`ctx_per_seq`), the context a prediction assumes when
none is given. With per-position acceptance alpha_i (draft i accepted given drafts < i were), a
round emits E(k) = 1 + a1 + a1*a2 + ... tokens per request, so predicted
TPOT(B, k) = T(B, k, B * ctx_per_seq) / E(k).

The fit alone does not choose k: a k that traffic rarely runs is predicted from few rounds
and the start-up profile (greedy, short random prompts), and sampled traffic costs more per
draft than that (rejection sampling). So the model also keeps the *measured* mean round time
per (batch band, k) (`cells`, an average over each cell's own recent rounds), fed by the rounds
traffic runs and by adaptive k's exploring rounds; `best_k` compares measured cells where it
has them and corrects the fit to their level where it has not.

Ray-free: the replica feeds it from the engine thread; the autoscaling policy rebuilds it from
the coefficients the replica reports (`pm_0..pm_4`, `pm_ctx`; a report with only `pm_0..pm_3`,
from an older replica, means c4 = 0).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence

import numpy as np

NUM_FEATURES = 5
BANDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # upper edges of the batch-size bands
CELL_ALPHA = 0.1  # weight of a round in its (band, k) cell's mean round time
CELL_MIN_ROUNDS = 4  # rounds before a cell's measured time is trusted
CELL_K_SLACK = 0.2  # a round counts for cell k when its mean k is within this of k


def band_of(batch: float) -> int:
    for i, edge in enumerate(BANDS):
        if batch <= edge:
            return i
    return len(BANDS) - 1
CTX = 4  # index of the context coefficient
CTX_UNIT = 1000.0  # c4 is seconds per thousand context tokens (keeps the normal equations sane)


def features(batch: float, k: float, ctx_tokens: float = 0.0) -> np.ndarray:
    return np.array([1.0, batch, k, batch * k, ctx_tokens / CTX_UNIT])  # [5]


def _coef5(coef: Sequence[float]) -> np.ndarray:
    c = np.zeros(NUM_FEATURES)
    c[: len(coef)] = np.asarray(coef, float)[:NUM_FEATURES]
    return c


def expected_tokens(alphas: Sequence[float], k: int) -> float:
    """Tokens one request emits per round with k drafts: accepted prefix + 1."""
    total, chain = 1.0, 1.0
    for a in list(alphas)[:k]:
        chain *= a
        total += chain
    return total


class PerfModel:
    """Round seconds vs (batch, k, context); `observe` is O(25), `predict` O(5). `coef` may
    have 4 entries (no context term) or 5."""

    def __init__(self, coef: Sequence[float] | None = None, decay: float = 0.995,
                 prior_weight: float = 8.0, ctx_per_seq: float = 0.0) -> None:
        self.prior = _coef5(coef if coef is not None else [])
        self.coef = self.prior.copy()  # [5]
        self.decay = decay
        self.prior_weight = prior_weight
        self._xtx = np.zeros((NUM_FEATURES, NUM_FEATURES))  # [5, 5] decayed sum of x x^T
        self._xty = np.zeros(NUM_FEATURES)  # [5]
        self._n = 0
        # Per-feature scale of the ridge: mean x_j^2 of the profile, so `prior_weight` counts
        # pseudo-rounds like the profile's.
        self._prior_scale = np.ones(NUM_FEATURES)
        # Decayed sums of context tokens and of requests over the observed rounds.
        self._ctx_sum, self._seq_sum = ctx_per_seq, 1.0 if ctx_per_seq else 0.0
        # (band, k) -> [mean round seconds, rounds seen]: measured, not fitted.
        self.cells: dict[tuple[int, int], list[float]] = {}

    @property
    def ctx_per_seq(self) -> float:
        """Mean context tokens per running request over the recent rounds (0: never said)."""
        return self._ctx_sum / self._seq_sum if self._seq_sum else 0.0

    @property
    def fitted(self) -> bool:
        return bool(self.prior.any() or self._n)

    def observe(self, batch: int, k: float, seconds: float, ctx_tokens: float = 0.0) -> None:
        """One round of `batch` requests attending `ctx_tokens` context tokens in total."""
        x = features(batch, k, ctx_tokens)
        self._xtx = self.decay * self._xtx + np.outer(x, x)
        self._xty = self.decay * self._xty + x * seconds
        self._ctx_sum = self.decay * self._ctx_sum + ctx_tokens
        self._seq_sum = self.decay * self._seq_sum + batch
        self._n += 1
        if self._n % 8 == 0 or self._n < 8:
            self._solve()
        near = round(k)
        if abs(k - near) <= CELL_K_SLACK:  # rows of mixed k between two cells count for none
            cell = self.cells.setdefault((band_of(batch), near), [seconds, 0.0])
            cell[0] += CELL_ALPHA * (seconds - cell[0])
            cell[1] += 1

    def measured_s(self, batch: float, k: int) -> float | None:
        """Mean recent round seconds at k in `batch`'s band, once enough rounds ran there."""
        cell = self.cells.get((band_of(batch), k))
        return cell[0] if cell is not None and cell[1] >= CELL_MIN_ROUNDS else None

    def round_costs(self, batch: float, k_max: int, ctx_tokens: float | None = None
                    ) -> list[float]:
        """Round seconds for k = 0..k_max at `batch`: measured where the band's cells have
        enough rounds; elsewhere the fit, scaled by the mean measured / fitted ratio of the
        measured cells (the fit's slope in k, the measurements' level)."""
        fitted = [self.round_s(batch, k, ctx_tokens) for k in range(k_max + 1)]
        measured = [self.measured_s(batch, k) for k in range(k_max + 1)]
        ratios = [m / f for m, f in zip(measured, fitted, strict=True) if m is not None]
        scale = sum(ratios) / len(ratios) if ratios else 1.0
        return [m if m is not None else f * scale
                for m, f in zip(measured, fitted, strict=True)]

    def _solve(self) -> None:
        # Ridge towards the prior: (X^T X + R) c = X^T y + R c_prior, R = r diag(scale). With
        # no prior (all zero) a tiny ridge only keeps the system well posed.
        r = self.prior_weight if self.prior.any() else 1e-6
        ridge = r * np.diag(self._prior_scale)  # [5, 5]
        a, b = self._xtx + ridge, self._xty + ridge @ self.prior
        coef = np.linalg.solve(a, b)
        if coef[CTX] < 0:
            # Context and batch move together in steady traffic; a negative context cost is
            # that confusion, not physics: refit the rest with c4 = 0.
            keep = [j for j in range(NUM_FEATURES) if j != CTX]
            coef = np.zeros(NUM_FEATURES)
            coef[keep] = np.linalg.solve(a[np.ix_(keep, keep)], b[keep])
        self.coef = coef

    def fit(self, samples: Iterable[tuple]) -> PerfModel:
        """Least-squares fit of (batch, k, seconds) or (batch, k, seconds, context tokens)
        samples (median per cell); becomes the prior. Without contexts c4 = 0."""
        cells: dict[tuple[int, float, float], list[float]] = {}
        for b, k, s, *c in samples:
            cells.setdefault((b, k, float(c[0]) if c else 0.0), []).append(s)
        assert cells, "no samples to fit"
        # One median per cell: a round that lost the CPU to a neighbour must not bend the fit.
        rows = [(b, k, c, float(np.median(v))) for (b, k, c), v in cells.items()]
        x = np.stack([features(b, k, c) for b, k, c, _ in rows])  # [N, 5]
        y = np.array([s for *_, s in rows])  # [N]
        # Relative error matters (TPOT SLO), so weight each sample by 1 / seconds.
        w = 1.0 / np.maximum(y, 1e-6)
        cols = list(range(NUM_FEATURES)) if x[:, CTX].any() else list(range(CTX))
        coef = np.zeros(NUM_FEATURES)
        coef[cols] = np.linalg.lstsq(x[:, cols] * w[:, None], y * w, rcond=None)[0]
        coef[CTX] = max(coef[CTX], 0.0)
        self._prior_scale = np.maximum((x * x).mean(axis=0), 1e-3)
        self.prior = coef
        self.coef = coef.copy()
        return self

    def round_s(self, batch: float, k: float, ctx_tokens: float | None = None) -> float:
        """Round seconds; `ctx_tokens` defaults to `batch` requests of the recent mean
        context."""
        if ctx_tokens is None:
            ctx_tokens = batch * self.ctx_per_seq
        # Never below the fixed cost: a bad fit must not predict free rounds.
        return max(float(features(batch, k, ctx_tokens) @ self.coef), 1e-6,
                   float(self.coef[0]) * 0.5)

    def tpot_s(self, batch: float, k: int, alphas: Sequence[float],
               ctx_tokens: float | None = None) -> float:
        return self.round_s(batch, k, ctx_tokens) / expected_tokens(alphas, k)

    def best_k(self, batch: float, alphas: Sequence[float], k_max: int,
               ctx_tokens: float | None = None) -> int:
        """k in [0, k_max] with the most tokens per second per request at this batch
        (measured round times where there are some: `round_costs`)."""
        best, best_rate = 0, 0.0
        for k, seconds in enumerate(self.round_costs(batch, k_max, ctx_tokens)):
            rate = expected_tokens(alphas, k) / seconds
            if rate > best_rate * (1 + 1e-3):  # ties go to the smaller k
                best, best_rate = k, rate
        return best

    def report(self) -> dict[str, float]:
        return {f"pm_{j}": float(c) for j, c in enumerate(self.coef)} | {
            "pm_ctx": self.ctx_per_seq}

    @classmethod
    def from_report(cls, stats: dict[str, float]) -> PerfModel | None:
        if not all(f"pm_{j}" in stats for j in range(CTX)):
            return None
        return cls([stats.get(f"pm_{j}", 0.0) for j in range(NUM_FEATURES)],
                   ctx_per_seq=stats.get("pm_ctx", 0.0))


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
