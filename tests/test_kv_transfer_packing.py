"""Pure-function tests of KV packing and head re-sharding (no processes, no network)."""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.kv_transfer.packing import (
    extras_nbytes,
    gather_blocks,
    pack_extras,
    pack_payload,
    payload_layout,
    scatter_blocks,
    unpack_extras,
    unpack_payload,
)
from mtpserve.workers.kv_transfer.resharding import (
    HeadPull,
    head_range,
    pull_plan,
    unpulled_sources,
)


def _cache(num_layers: int = 3, heads: int = 4, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # each [2, num_blocks=6, block_size=4, heads, head_dim=8]
    return [torch.randn(2, 6, 4, heads, 8, generator=g).to(dtype) for _ in range(num_layers)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gather_then_scatter_moves_blocks_and_heads(dtype):
    src = _cache(dtype=dtype)
    payload = gather_blocks(src, [4, 1], slice(1, 3))  # [L, 2, 2, 4, 2, 8]
    assert payload.shape == (3, 2, 2, 4, 2, 8) and payload.is_contiguous()
    for layer, got in zip(src, payload, strict=True):
        assert torch.equal(got, layer[:, [4, 1], :, 1:3])

    dst = [torch.zeros(2, 5, 4, 2, 8, dtype=dtype) for _ in range(3)]
    scatter_blocks(dst, [0, 3], payload)  # the decode rank's own, different block ids
    for layer, s in zip(dst, src, strict=True):
        assert torch.equal(layer[:, [0, 3]], s[:, [4, 1], :, 1:3])
        assert not layer[:, [1, 2, 4]].any(), "scatter touched blocks it does not own"


def test_gather_from_cache_views_that_leave_out_a_scratch_block():
    # The engine's layers are views of one buffer with a trailing scratch block per half
    # (non-contiguous over K/V); the gather must read them as they are, into `out`.
    g = torch.Generator().manual_seed(1)
    buffer = torch.randn(3, 2, 7, 4, 4, 8, generator=g)  # [L, 2, num_blocks + 1, bs, H, D]
    layers = list(buffer[:, :, :6].unbind(0))
    assert not layers[0].is_contiguous()
    out = torch.full((3, 2, 3, 4, 3, 8), float("nan"))
    got = gather_blocks(layers, [5, 0, 2], slice(1, 4), out=out)
    assert got is out
    for layer, part in zip(layers, got, strict=True):
        assert torch.equal(part, layer[:, [5, 0, 2], :, 1:4])


def test_scatter_rejects_mismatched_payload():
    dst = [torch.zeros(2, 5, 4, 2, 8) for _ in range(3)]
    with pytest.raises(ValueError, match="blocks"):
        scatter_blocks(dst, [0], torch.zeros(3, 2, 2, 4, 2, 8))
    with pytest.raises(ValueError, match="do not fit"):
        scatter_blocks(dst, [0, 1], torch.zeros(3, 2, 2, 4, 3, 8))


def test_scatter_into_a_head_range_leaves_other_heads_alone():
    dst = [torch.zeros(2, 5, 4, 4, 8) for _ in range(3)]
    payload = torch.randn(3, 2, 2, 4, 2, 8)
    scatter_blocks(dst, [3, 1], payload, slice(2, 4))  # heads 2-3 from one prefill rank
    for layer, want in zip(dst, payload, strict=True):
        assert torch.equal(layer[:, [3, 1], :, 2:4], want)
        assert not layer[:, :, :, :2].any() and not layer[:, [0, 2, 4]].any()


def test_extras_round_trip_mixed_dtypes():
    extras = {
        "draft_token_ids": torch.tensor([[5, 7, 9]]),
        "draft_probs": torch.rand(1, 3, 11),
        "hidden": torch.randn(1, 16).to(torch.bfloat16),
        "scalar": torch.tensor(3.5),
    }
    meta, blob = pack_extras(extras)
    assert blob.dtype == torch.uint8
    out = unpack_extras(meta, blob.clone())
    assert list(out) == list(extras)
    for name, t in extras.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t)


@pytest.mark.parametrize("with_extras", [True, False])
def test_payload_carries_kv_and_extras_in_one_buffer(with_extras):
    cache = _cache(dtype=torch.bfloat16)  # 3 layers x 2 x 3 blocks x 4 x 2 heads x 8: 2304 B
    extras = {"ids": torch.tensor([[5, 7, 9]]), "hidden": torch.randn(1, 5).to(torch.bfloat16)}
    payload, kv, meta = pack_payload(cache, [4, 0, 2], slice(1, 3), extras if with_extras else None)
    want = gather_blocks(cache, [4, 0, 2], slice(1, 3))
    assert torch.equal(kv, want) and kv.data_ptr() == payload.data_ptr()
    kv_nbytes, offset = payload_layout(list(kv.shape), kv.dtype, meta)
    assert kv_nbytes == want.numel() * 2
    assert payload.numel() == offset + extras_nbytes(meta) and offset % 64 == 0
    assert not payload[kv_nbytes:offset].any()  # padding is zeroed, never stale memory

    got_kv, got_extras = unpack_payload(payload.clone(), list(kv.shape), kv.dtype, meta)
    assert torch.equal(got_kv, want)
    assert list(got_extras) == (list(extras) if with_extras else [])
    assert all(torch.equal(got_extras[k], extras[k]) for k in got_extras)


def test_head_range_and_invalid_tp():
    assert [head_range(8, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    # tp > heads: replicated, rank r holds head r*H//tp (MLA's one-"head" latent)
    assert [head_range(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    with pytest.raises(ValueError, match="must be a multiple"):
        head_range(2, 3, 0)
    with pytest.raises(ValueError, match="must divide"):
        head_range(6, 4, 0)
    with pytest.raises(ValueError, match="not in a TP group"):
        head_range(8, 2, 2)


@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "dst_rank", "plan"),
    [
        (1, 2, 1, [HeadPull(0, 4, 8)]),  # src < dst: a sub-range of the one prefill rank
        (2, 2, 1, [HeadPull(1, 4, 8)]),  # equal: the matching rank, whole range
        (4, 2, 0, [HeadPull(0, 0, 2), HeadPull(1, 2, 4)]),  # src > dst: several ranks
        (2, 4, 3, [HeadPull(1, 6, 8)]),
        (4, 1, 0, [HeadPull(r, 2 * r, 2 * r + 2) for r in range(4)]),
    ],
)
def test_pull_plan(src_tp, dst_tp, dst_rank, plan):
    assert pull_plan(8, src_tp, dst_tp, dst_rank) == plan


def test_pull_plans_cover_every_head_exactly_once():
    for src_tp in (1, 2, 4, 8):
        for dst_tp in (1, 2, 4, 8):
            heads = [
                h
                for r in range(dst_tp)
                for p in pull_plan(8, src_tp, dst_tp, r)
                for h in range(p.head_start, p.head_end)
            ]
            assert heads == list(range(8)), (src_tp, dst_tp)
    with pytest.raises(ValueError):
        pull_plan(4, 1, 6, 0)


# GQA heads replicated (TP above the KV heads: workers/model/config.py kv_head_split) --------

@pytest.mark.parametrize(
    ("src_tp", "dst_tp", "plans", "dropped"),
    [
        # 1 -> 4: decode rank r pulls head r // 2 from the one prefill rank, 2 ranks per head.
        (1, 4, [[HeadPull(0, r // 2, r // 2 + 1, 2)] for r in range(4)], [[]] * 4),
        # 4 -> 1: each head from its first prefill replica; the other replicas are dropped.
        (4, 1, [[HeadPull(0, 0, 1), HeadPull(2, 1, 2)]], [[1, 3]]),
        # 2 -> 8: prefill rank h holds head h, pulled by the 4 decode ranks replicating it.
        (2, 8, [[HeadPull(r // 4, r // 4, r // 4 + 1, 4)] for r in range(8)], [[]] * 8),
    ],
)
def test_pull_plan_of_replicated_gqa_heads(src_tp, dst_tp, plans, dropped):
    assert [pull_plan(2, src_tp, dst_tp, r) for r in range(dst_tp)] == plans
    assert [unpulled_sources(2, src_tp, dst_tp, r) for r in range(dst_tp)] == dropped


def _fraction_covered(plan, src_tp, dst_tp, rank) -> bool:
    """install_states' rule: the plan's prefill ranks are consecutive and their rank shares
    cover the decode rank's share."""
    ranks = sorted({p.src_rank for p in plan})
    return ranks == list(range(ranks[0], ranks[-1] + 1)) and (
        ranks[0] * dst_tp <= rank * src_tp and (rank + 1) * src_tp <= (ranks[-1] + 1) * dst_tp)


@pytest.mark.parametrize("states", [False, True], ids=["kv-only", "hybrid-states"])
def test_replicated_gqa_plans_are_consistent(states):
    """Every TP pair over 2 KV heads: each decode rank pulls exactly its heads; each
    (prefill rank, head) is told the number of decode ranks that pull it from there (the
    sender's hold waits for that many acks); every prefill rank is pulled or dropped by
    exactly one decode rank. With `states` (a hybrid model, whose recurrent state is sharded
    by rank, not by KV head) the pulled prefill ranks also cover the decode rank's state
    share, and none is dropped."""

    for src_tp in (1, 2, 4, 8):
        for dst_tp in (1, 2, 4, 8):
            pulls: dict[tuple[int, int], list[int]] = {}
            dropped: list[int] = []
            for r in range(dst_tp):
                plan = pull_plan(2, src_tp, dst_tp, r, states)
                heads = {h for p in plan for h in range(p.head_start, p.head_end)}
                assert heads == set(range(*head_range(2, dst_tp, r))), (src_tp, dst_tp, r)
                for p in plan:
                    assert head_range(2, src_tp, p.src_rank)[0] <= p.head_start
                    assert p.head_end <= head_range(2, src_tp, p.src_rank)[1]
                    for h in range(p.head_start, p.head_end):
                        pulls.setdefault((p.src_rank, h), []).append(p.copies)
                if states:
                    assert _fraction_covered(plan, src_tp, dst_tp, r), (src_tp, dst_tp, r)
                dropped += unpulled_sources(2, src_tp, dst_tp, r, states)
            for key, copies in pulls.items():
                assert copies == [len(copies)] * len(copies), (src_tp, dst_tp, key)
            pulled = {s for s, _ in pulls}
            assert sorted(pulled | set(dropped)) == list(range(src_tp))
            assert not pulled & set(dropped) and len(dropped) == len(set(dropped))
            if states:
                assert dropped == []
