"""MLA's latent cache across prefill and decode TP groups of different sizes.

The latent has no head axis: the paged cache holds it as one "head" that every TP rank holds
whole (`ModelConfig.num_cache_heads` == 1). Re-sharding then means replication: each decode
rank pulls the whole latent from one prefill rank; a prefill rank keeps its hold until every
decode rank that pulls from it has acked, and prefill ranks nobody pulls from are told to drop
theirs. Plans are checked for every TP pair up to 8; the protocol on real gloo pairs between
processes (the prefill ranks of test_kv_transfer)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest
import torch
from test_kv_transfer import Peer, expected_kv, seed_extras

from mtpserve.workers.kv_transfer import KVReceiver, pull_resharded
from mtpserve.workers.kv_transfer.resharding import (
    HeadPull,
    head_range,
    pull_plan,
    unpulled_sources,
)

LATENT = (0, 1)  # the one cache "head" of an MLA model


@pytest.mark.parametrize(("src_tp", "dst_tp", "dst_rank", "plan"), [
    (1, 2, 1, [HeadPull(0, 0, 1, copies=2)]),  # both decode ranks from the one prefill rank
    (2, 1, 0, [HeadPull(0, 0, 1)]),  # one of the two replicas; rank 1 is dropped
    (2, 4, 3, [HeadPull(1, 0, 1, copies=2)]),  # decode 1, 3 from prefill 1; 0, 2 from 0
    (4, 2, 1, [HeadPull(1, 0, 1)]),
])
def test_replicated_latent_plan(src_tp, dst_tp, dst_rank, plan) -> None:
    assert pull_plan(1, src_tp, dst_tp, dst_rank) == plan


def test_every_decode_rank_gets_the_latent_and_every_prefill_hold_ends_once() -> None:
    """For every (prefill TP, decode TP) up to 8: each decode rank pulls the whole latent
    once; each prefill rank is either pulled from, by exactly the `copies` it is told, or
    dropped by exactly one decode rank; the load spreads over the prefill replicas."""
    for src_tp in (1, 2, 4, 8):
        for dst_tp in (1, 2, 4, 8):
            pulls = Counter()
            told: dict[int, set[int]] = {}
            dropped = Counter()
            for r in range(dst_tp):
                plan = pull_plan(1, src_tp, dst_tp, r)
                assert [(p.head_start, p.head_end) for p in plan] == [LATENT]
                pulls[plan[0].src_rank] += 1
                told.setdefault(plan[0].src_rank, set()).add(plan[0].copies)
                dropped.update(unpulled_sources(1, src_tp, dst_tp, r))
            assert all(told[s] == {n} for s, n in pulls.items()), (src_tp, dst_tp)
            assert not set(pulls) & set(dropped) and set(pulls) | set(dropped) == set(
                range(src_tp)) and set(dropped.values()) <= {1}, (src_tp, dst_tp)
            assert max(pulls.values()) == max(1, dst_tp // src_tp), (src_tp, dst_tp)


def test_sharded_caches_never_drop_a_rank() -> None:
    """GQA (heads split, not replicated): the plans are unchanged and nothing is dropped."""
    for src_tp in (1, 2, 4, 8):
        for dst_tp in (1, 2, 4, 8):
            for r in range(dst_tp):
                assert unpulled_sources(8, src_tp, dst_tp, r) == []
                assert all(p.copies == 1 for p in pull_plan(8, src_tp, dst_tp, r))
    assert head_range(1, 4, 3) == LATENT


# -- the protocol between processes -------------------------------------------------------------


@pytest.fixture(scope="module")
def prefill() -> Iterator[list[tuple[Peer, str]]]:
    """Two prefill ranks, each a KVSender in its own process, holding the latent whole."""
    peers = [Peer(), Peer()]
    try:
        for p in peers:
            p.start("start_sender", 30.0, 5.0)
        yield [(p, p.result(60)) for p in peers]
    finally:
        for p in peers:
            p.stop()


def test_prefill_tp1_to_decode_tp2_holds_until_both_ranks_acked(prefill) -> None:
    peer, address = prefill[0]
    peer.call("hold", "mla-1to2", 41, "bfloat16", LATENT)
    decode = [KVReceiver(name=f"decode{r}") for r in range(2)]
    try:
        want = expected_kv(41, torch.bfloat16, LATENT)
        kv0, extras0 = pull_resharded(decode[0], [address], "mla-1to2", 1, 2, 0)
        assert torch.equal(kv0, want)
        assert torch.equal(extras0["draft_token_ids"], seed_extras(41)["draft_token_ids"])
        # One of the two decode ranks acked: the other still needs the whole latent.
        assert peer.call("wait_release", "mla-1to2", 0.3) is None
        kv1, extras1 = pull_resharded(decode[1], [address], "mla-1to2", 1, 2, 1)
        assert torch.equal(kv1, want)
        assert torch.equal(extras1["draft_probs"], seed_extras(41)["draft_probs"])
        assert peer.call("wait_release", "mla-1to2", 10.0) == "acked"
    finally:
        for r in decode:
            r.close()


def test_prefill_tp2_to_decode_tp1_pulls_one_replica_and_drops_the_other(prefill) -> None:
    addresses = [address for _, address in prefill]
    for peer, _ in prefill:
        peer.call("hold", "mla-2to1", 43, "float32", LATENT)
    receiver = KVReceiver(name="decode")
    try:
        kv, extras = pull_resharded(receiver, addresses, "mla-2to1", 1, 1, 0)
        assert torch.equal(kv, expected_kv(43, torch.float32, LATENT))
        assert torch.equal(extras["draft_probs"], seed_extras(43)["draft_probs"])
        assert [peer.call("wait_release", "mla-2to1", 10.0) for peer, _ in prefill] == [
            "acked", "released"]
        assert receiver.stats()["pulls"] == 1  # the latent travelled once
    finally:
        receiver.close()
