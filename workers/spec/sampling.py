"""Turning logits into probabilities (temperature, top-k, top-p) and sampling from them.

Randomness enters only as uniforms drawn per request (from the request's own generator when
it has a seed), so a seeded request is reproducible whatever it is batched with.
"""

from __future__ import annotations

import torch

from workers.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax(filter(logits / T)) per row. logits [N, V] float32 -> probs [N, V]."""
    temps = torch.tensor([max(p.temperature, 1e-5) for p in params], dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(tp < 1.0 for tp in top_ps):
        logits = _filter_top_k_top_p(logits, top_ks, top_ps)
    return torch.softmax(logits, dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]):
    V = logits.shape[-1]
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V).unsqueeze(0)
    k = torch.tensor([k if k > 0 else V for k in top_ks]).unsqueeze(1)
    remove = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always survives).
    cum_before = probs.cumsum(dim=-1) - probs
    remove |= cum_before >= torch.tensor(top_ps).unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def draw_uniforms(generators: list[torch.Generator | None], n: int) -> torch.Tensor:
    """[len(generators), n] uniforms, one row per request (its own generator if seeded)."""
    if all(g is None for g in generators):
        return torch.rand(len(generators), n)
    return torch.stack([torch.rand(n, generator=g) for g in generators])


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (need not be normalised), u [N] -> token ids [N]."""
    cdf = probs.cumsum(dim=-1)
    target = (u * cdf[:, -1]).unsqueeze(1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return ids.clamp_(max=probs.shape[-1] - 1)
