"""Turning logits into probabilities (temperature, top-k, top-p) and sampling from them.

Randomness enters only as uniforms from `keyed_random` (a function of the request's seed, the
token position and the draw slot), so a seeded request is reproducible whatever it is batched
with. Everything here runs on the logits' device.
"""

from __future__ import annotations

import torch

from mtpserve.workers.model.attention_metadata import stage, stage_lists
from mtpserve.workers.sampling_params import SamplingParams


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """softmax(filter(logits / T)) per row. logits [N, V] float32 -> probs [N, V]. Per-row
    settings reach the device in staged non-blocking copies (a pageable copy would sync)."""
    dev = logits.device
    temps = [max(p.temperature, 1e-5) for p in params]
    if any(t != 1.0 for t in temps):  # x / 1.0 == x: the usual T = 1 batch skips a pass
        (t_dev,) = stage([torch.tensor(temps, dtype=logits.dtype)], dev)
        logits = logits / t_dev.unsqueeze(1)
    top_ks = [p.top_k if p.top_k > 0 else 0 for p in params]
    top_ps = [p.top_p for p in params]
    if any(top_ks) or any(tp < 1.0 for tp in top_ps):
        logits = _filter_top_k_top_p(logits, top_ks, top_ps)
    return torch.softmax(logits, dim=-1)


def _filter_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]):
    V, dev = logits.shape[-1], logits.device
    sorted_logits, idx = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(V, device=dev).unsqueeze(0)
    (k,) = stage_lists([[k if k > 0 else V for k in top_ks]], dev)
    k = k.unsqueeze(1)
    remove = ranks >= k
    probs = torch.softmax(sorted_logits.masked_fill(remove, float("-inf")), dim=-1)
    # Keep the smallest prefix whose mass reaches top_p (the top token always survives). Only
    # rows with top_p < 1: a float32 cumsum reaches 1.0 before the tail, and `>= 1.0` would
    # drop that tail from rows that asked for no top-p (and make them depend on the batch).
    cum_before = probs.cumsum(dim=-1) - probs
    (tp,) = stage([torch.tensor(top_ps, dtype=probs.dtype)], dev)
    tp = tp.unsqueeze(1)  # [N, 1]
    remove |= (cum_before >= tp) & (tp < 1.0)
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, idx, sorted_logits)


def suppress_tokens(logits: torch.Tensor, banned: list[list[int]]) -> torch.Tensor:
    """logits [N, V] with banned[i] set to -inf in row i (a copy when anything is banned).

    Used for `min_tokens`: EOS / stop tokens are impossible until enough tokens exist. The
    engine applies the same mask to the target rows (p) and to the MTP rows that give q, so
    rejection sampling still reproduces the masked target exactly."""
    rows = [i for i, b in enumerate(banned) for _ in b]
    if not rows:
        return logits
    cols = [t for b in banned for t in b]
    out = logits.clone()
    d_rows, d_cols = stage_lists([rows, cols], logits.device)
    out[d_rows, d_cols] = float("-inf")
    return out


def sample_with_uniforms(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] (need not be normalised), u [N] in (0, 1) -> ids [N].

    The CDF is accumulated in float64 so rounding does not shift mass between tokens."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    target = (u.to(torch.float64) * cdf[:, -1]).unsqueeze(1)
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1)
    return ids.clamp_(max=probs.shape[-1] - 1)


def sampling_fault(params: SamplingParams, vocab_size: int) -> str | None:
    """Why `params` cannot be sampled with, or None: the request's own sampling path (filter,
    softmax, inverse CDF) run alone on a uniform row. After a batched step raised, the engine
    asks this of each request in the batch to find the one whose inputs caused it."""
    if params.greedy:
        return None
    try:
        probs = processed_probs(torch.zeros(1, vocab_size), [params])
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0:
            return "sampling settings leave no token with a finite probability"
        sample_with_uniforms(probs, torch.full((1,), 0.5, dtype=torch.float64))
    except Exception as e:  # noqa: BLE001 - any failure is this request's
        return f"invalid sampling settings ({type(e).__name__}: {e})"
    return None
