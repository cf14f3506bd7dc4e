"""Choosing the speculation depth k: per batch-size band for the replica, per request within it.

With conditional acceptance alpha_i of draft i (given drafts < i accepted), a round with k
drafts emits E(k) = 1 + a1 + a1*a2 + ... tokens per request and takes T(B, k) seconds at batch
B (workers.perf_model). The replica's k for a band of batch sizes maximises E(k) / T(B, k); it
may be 0 where speculation does not pay (acceptance collapse, large compute-bound batches).
Without a fitted model T is approximated as 1 + c*k main-forward equivalents and k stays >= 1.

Each request then picks its own k from its own acceptance counts (smoothed towards the
replica's), capped by the replica's band k. One engine round in `explore_every` runs every
request at a neighbouring k of its own (one more or one less, alternating, up to the
request's own k): the perf model keeps measured round times per (batch band, k), and a k that
traffic never runs would otherwise keep the cost the start-up profile gave it (greedy, short
random prompts), which is not what sampled traffic costs. Exploring costs one round in 16 at
a k next to the best, and it also measures acceptance at a depth not in use, so k can come
back after it dropped to 0. The MTP cache is extended every round whatever k is, so k can
grow back. Exactness: greedy output does not depend on k and sampled output is
identically distributed for any k; a *seeded* request keeps its k (randomness is keyed by
position, so its output depends only on its own k and must not depend on the load).
"""

from __future__ import annotations

from collections.abc import Callable

from mtpserve.workers.perf_model import BANDS, PerfModel, band_of, expected_tokens
from mtpserve.workers.request import Request

PRIOR_ROUNDS = 4.0  # pseudo-rounds of the replica's acceptance in a request's estimate
EXPLORE_EVERY = 16  # one round in this many per request runs at a neighbouring k


def best_k(alphas: list[float], cost_per_draft: float) -> int:
    """Heuristic without a perf model: k >= 1 maximising E(k) / (1 + c*k)."""
    best, best_rate = 1, 0.0
    for k in range(1, len(alphas) + 1):
        rate = expected_tokens(alphas, k) / (1 + cost_per_draft * k)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


class AdaptiveK:
    """The engine's k controller (`engine.adaptive`).

    `observe` is called by the engine for every request of every round (drafts, accepted);
    `k_for` gives the drafts a request makes for its next round. With `enabled=False` it only
    observes and every request keeps its own k. `forced_k` pins k (profiling). Observers
    (`on_drafts`) receive each (num_drafts, num_accepted) too: windows and metrics hook here.
    Mutated only on the engine thread.
    """

    def __init__(self, k_max: int, cost_per_draft: float = 0.35, decay: float = 0.98,
                 update_every: int = 16, enabled: bool = True,
                 model: PerfModel | None = None, explore_every: int = EXPLORE_EVERY) -> None:
        self.k_max = k_max
        self.enabled = enabled
        self.explore_every = explore_every  # 0: never explore
        self.cost_per_draft = cost_per_draft
        self.decay = decay
        self.update_every = update_every
        self.model = model
        self.forced_k: int | None = None
        self.round_index = 0  # the engine's step count: exploring rounds are whole rounds
        self.batch = 1  # running batch of the latest round
        self.band_k = [k_max] * len(BANDS)
        # Exponentially decayed counts: accepted[i] / drafted[i] give alpha_i.
        self.drafted = [0.0] * k_max
        self.accepted = [0.0] * k_max
        self.on_drafts: list[Callable[[int, int], None]] = []
        self._rounds = 0

    @property
    def k(self) -> int:
        """The replica's k at the current batch."""
        if self.forced_k is not None:
            return self.forced_k
        return self.band_k[band_of(self.batch)] if self.enabled else self.k_max

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        for fn in self.on_drafts:
            fn(num_drafts, num_accepted)
        for i in range(min(num_drafts, num_accepted + 1)):  # positions actually tested
            self.drafted[i] = self.drafted[i] * self.decay + 1
            self.accepted[i] = self.accepted[i] * self.decay + (i < num_accepted)
        self._rounds += 1
        if self._rounds % self.update_every == 0 and self.k_max > 0:
            self.update()

    def update(self) -> None:
        """Recompute k for every batch band from the model and the replica's acceptance."""
        alphas = self.alphas()
        if self.model is not None and self.model.fitted:
            self.band_k = [self.model.best_k(edge, alphas, self.k_max) for edge in BANDS]
        else:
            self.band_k = [best_k(alphas, self.cost_per_draft)] * len(BANDS)

    def alphas(self) -> list[float]:
        # Untested positions are assumed as good as the last tested one (optimistic), so k
        # can grow back after a dip.
        out, last = [], 0.7
        for d, a in zip(self.drafted, self.accepted, strict=True):
            last = a / d if d > 0.5 else last
            out.append(last)
        return out

    def k_for(self, req: Request, batch: int) -> int:
        """Drafts for `req`'s next round at running batch `batch`."""
        k = req.num_speculative_tokens
        if self.forced_k is not None:
            return min(k, self.forced_k)
        if not self.enabled or not k or req.reproducible:
            return k  # a user-seeded request's k never changes: its output depends on its k
        self.batch = max(batch, 1)
        cap = min(k, self.k)
        if req.num_rounds < 4:
            return cap
        chosen = min(cap, self._request_k(req, cap)) if cap else 0
        return self._explore(chosen, k)

    def _explore(self, k: int, k_req: int) -> int:
        """`k`, or a neighbour of it on an exploring round (see the module docstring);
        within [0, k_req]."""
        n = self.round_index
        if not self.explore_every or n % self.explore_every != self.explore_every - 1:
            return k
        step = 1 if (n // self.explore_every) % 2 else -1
        for alt in (k + step, k - step):  # the other side when one is out of range
            if 0 <= alt <= k_req:
                return alt
        return k

    def _request_k(self, req: Request, cap: int) -> int:
        # The request's own conditional acceptance with the replica's as a prior, so a few
        # rounds do not swing it; positions it never reached keep the replica's value.
        prior = self.alphas()
        alphas = []
        for i in range(cap):
            tested = (min(req.drafted_per_position[i], req.accepted_per_position[i - 1])
                      if i else req.drafted_per_position[i])
            alphas.append((req.accepted_per_position[i] + PRIOR_ROUNDS * prior[i])
                          / (tested + PRIOR_ROUNDS))
        if self.model is not None and self.model.fitted:
            return self.model.best_k(self.batch, alphas, cap)
        return best_k(alphas, self.cost_per_draft)
