"""Adapting the speculation depth k to the measured acceptance.

With conditional acceptance alpha_i of draft i (given drafts < i accepted), a round with k
drafts emits E(k) = 1 + a1 + a1*a2 + ... tokens and costs about 1 + c*k main-forward
equivalents (c: the extra verify width plus one MTP step per draft). k is the depth in
[1, k_max] that maximises E(k) / (1 + c*k); it never drops to 0 so the MTP KV stays filled.
"""

from __future__ import annotations


def best_k(alphas: list[float], cost_per_draft: float) -> int:
    best, best_rate, expected, chain = 1, 0.0, 1.0, 1.0
    for k, a in enumerate(alphas, start=1):
        chain *= a
        expected += chain
        rate = expected / (1 + cost_per_draft * k)
        if rate > best_rate + 1e-9:
            best, best_rate = k, rate
    return best


class AdaptiveK:
    def __init__(self, k_max: int, cost_per_draft: float = 0.35, decay: float = 0.98,
                 update_every: int = 16) -> None:
        self.k_max = k_max
        self.k = k_max
        self.cost_per_draft = cost_per_draft
        self.decay = decay
        self.update_every = update_every
        # Exponentially decayed counts: drafted[i] / accepted[i] give alpha_i.
        self.drafted = [0.0] * k_max
        self.accepted = [0.0] * k_max
        self._rounds = 0

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        for i in range(min(num_drafts, num_accepted + 1)):  # positions actually tested
            self.drafted[i] = self.drafted[i] * self.decay + 1
            self.accepted[i] = self.accepted[i] * self.decay + (i < num_accepted)
        self._rounds += 1
        if self._rounds % self.update_every == 0 and self.k_max > 0:
            self.k = best_k(self.alphas(), self.cost_per_draft)

    def alphas(self) -> list[float]:
        # Untested positions are assumed as good as the last tested one (optimistic), so k
        # can grow back after a dip.
        out, last = [], 0.7
        for d, a in zip(self.drafted, self.accepted, strict=True):
            last = a / d if d > 0.5 else last
            out.append(last)
        return out
