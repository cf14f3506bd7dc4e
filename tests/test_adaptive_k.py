"""Speculation depth adapts to measured acceptance: deep when drafts land, shallow when not."""

from __future__ import annotations

from workers.adaptive_k import AdaptiveK, best_k


def test_best_k_follows_acceptance() -> None:
    assert best_k([0.9, 0.9, 0.9], cost_per_draft=0.2) == 3
    assert best_k([0.1, 0.1, 0.1], cost_per_draft=0.3) == 1
    # A good first draft but poor later ones: stop after the first.
    assert best_k([0.9, 0.05, 0.05], cost_per_draft=0.3) == 1


def test_adaptive_k_moves_with_observed_rounds() -> None:
    ak = AdaptiveK(k_max=3, cost_per_draft=0.3, update_every=8)
    assert ak.k == 3
    for _ in range(64):
        ak.observe(num_drafts=ak.k, num_accepted=0)  # every first draft rejected
    assert ak.k == 1
    for _ in range(400):
        ak.observe(num_drafts=ak.k, num_accepted=ak.k)  # everything accepted again
    assert ak.k == 3
