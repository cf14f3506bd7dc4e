"""The C++ decode attention of compiled CPU graphs (workers/model/cpu_paged_attention.py)
computes what the inductor formulation it replaces computes (`inline_paged_attention`:
causal, sliding window, sinks), a query's result does not depend on the other queries and
rows of its batch, and a slot outside the cache is an error, not a wild read."""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.model import cpu_paged_attention as cpa
from mtpserve.workers.model.attention_metadata import causal_mask
from mtpserve.workers.model.layers import inline_paged_attention

pytestmark = pytest.mark.skipif(not cpa.available(), reason="no AVX-512 or no C++ compiler")

B, S, HQ, HK, D, BS, NB = 3, 3, 4, 2, 64, 16, 12


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slots = (NB * B + 1) * BS
    kv = torch.randn(2, slots, HK, D, generator=g)
    tables = torch.randperm(NB * B, generator=g).view(B, NB)
    L = NB * BS
    token_index = (tables.unsqueeze(-1) * BS + torch.arange(BS)).view(B, L)
    positions = torch.tensor([[5, 6, 7], [100, 101, 102], [0, 150, 191]])
    q = torch.randn(B, S, HQ, D, generator=g)
    return q, kv, token_index, positions, L


@pytest.mark.parametrize("window,sinks", [(None, False), (20, False), (None, True), (7, True)])
def test_matches_the_inductor_formulation(window, sinks) -> None:
    q, kv, ti, pos, L = _case()
    mask = causal_mask(pos, L)
    if window is not None:
        mask = mask & (torch.arange(L).view(1, 1, -1) > pos.unsqueeze(-1) - window).unsqueeze(1)
    s = torch.randn(HQ) if sinks else None
    want = inline_paged_attention(q, kv, ti, mask, 0.125, s)
    got = cpa.paged(q, kv, ti, pos, 0.125, window, s)
    assert got.shape == (B, S, HQ * D)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_query_does_not_depend_on_its_batch() -> None:
    q, kv, ti, pos, _ = _case(1)
    full = cpa.paged(q, kv, ti, pos, 0.125)
    for b in range(B):
        for s in range(S):
            alone = cpa.paged(q[b:b + 1, s:s + 1], kv, ti[b:b + 1], pos[b:b + 1, s:s + 1], 0.125)
            assert torch.equal(alone[0, 0], full[b, s])


def test_a_slot_outside_the_cache_is_an_error() -> None:
    q, kv, ti, pos, _ = _case()
    bad = ti.clone()
    bad[1, 3] = kv.shape[1]
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpa.paged(q, kv, bad, pos, 0.125)
