"""Automatic prefix caching in the engine: outputs with the cache on equal those with it off
(greedy and seeded, batched, chunked, under preemption); shared blocks are freed exactly once,
eviction never touches a referenced block, a flush empties the pool; concurrent requests with
one prompt (n > 1) share one prefill."""

from __future__ import annotations

import dataclasses

import torch
from helpers import drain, greedy, make_engine

from mtpserve.workers.block_manager import BlockManager
from mtpserve.workers.engine import Engine
from mtpserve.workers.prefix_cache import block_hashes
from mtpserve.workers.request import Request
from mtpserve.workers.sampling_params import SamplingParams

GREEDY = greedy(24)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)


def shared_prefix_prompts(n: int, prefix_len: int = 45, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 256, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 256, (3 + 2 * i,), generator=g).tolist()
            for i in range(n)]


def engine(path, caching: bool, blocks: int = 128, budget: int = 512, **kw) -> Engine:
    return make_engine(path, 2, block_size=4, num_kv_blocks=blocks,
                       max_num_batched_tokens=budget, prefix_caching=caching, **kw)


def run(eng: Engine, ps: list[list[int]], params: SamplingParams = GREEDY,
        one_by_one: bool = False) -> list[list[int]]:
    """Outputs of `ps`, submitted together (or each after the previous finished); checks
    block accounting after every step."""
    out = []
    batches = [[p] for p in ps] if one_by_one else [ps]
    for batch in batches:
        # Ids continue across calls: an engine may run several of them.
        reqs = [eng.add_request(f"r{len(out) + i}", p, params) for i, p in enumerate(batch)]
        drain(eng, check_blocks=True)
        out += [r.output_token_ids for r in reqs]
    return out


def test_cache_on_equals_off_greedy_and_seeded(tiny_qwen3) -> None:
    ps = shared_prefix_prompts(5)
    for params in (GREEDY, SEEDED):
        want = run(engine(tiny_qwen3, False), ps, params, one_by_one=True)
        eng = engine(tiny_qwen3, True)
        assert run(eng, ps, params, one_by_one=True) == want
        # Every request after the first found the 44-token (11-block) shared prefix.
        bm = eng.block_manager
        assert bm.cache_hits == 4 * 44, bm.stats()
        assert bm.cache_queries == sum(len(p) for p in ps)
        # Only cached, unreferenced blocks remain; the pool is whole.
        assert bm.num_free_blocks == 128 and bm.num_cached_blocks > 11
        bm.check_integrity([])
        # Outputs are cached too (multi-turn): a prompt that is a whole earlier request hits
        # past its prompt.
        again = run(eng, [ps[0] + want[0]], params)
        assert bm.cache_hits > 4 * 44 + len(ps[0])
        assert again == run(engine(tiny_qwen3, False), [ps[0] + want[0]], params)


def test_cache_hits_with_chunked_prefill_and_batches(tiny_qwen3) -> None:
    ps = shared_prefix_prompts(6, prefix_len=61, seed=3)
    want = run(engine(tiny_qwen3, False, budget=7), ps)
    eng = engine(tiny_qwen3, True, budget=7)
    run(eng, ps[:1])
    assert run(eng, ps, one_by_one=False) == want
    assert eng.block_manager.cache_hits >= 6 * 60


def test_concurrent_same_prompt_shares_one_prefill(tiny_qwen3) -> None:
    """n > 1 choices (same prompt, submitted together) compute its blocks once: the siblings
    wait for the first one's blocks instead of recomputing them, with the same outputs."""
    p = shared_prefix_prompts(1, prefix_len=50, seed=4)[0]
    eng = engine(tiny_qwen3, True, budget=16)
    together = run(eng, [p] * 3, SEEDED)
    alone = run(engine(tiny_qwen3, False, budget=16), [p], SEEDED)
    assert together == alone * 3
    full = (len(p) - 1) // 4 * 4
    assert eng.block_manager.cache_hits == 2 * full


def test_preemption_with_shared_blocks_keeps_outputs(tiny_qwen3) -> None:
    ps = shared_prefix_prompts(6, prefix_len=40, seed=5)
    params = greedy(40)
    want = run(engine(tiny_qwen3, False, blocks=256), ps, params)
    tight = engine(tiny_qwen3, True, blocks=48)
    reqs = [tight.add_request(f"r{i}", q, params) for i, q in enumerate(ps)]
    drain(tight, check_blocks=True)
    assert [r.output_token_ids for r in reqs] == want
    assert sum(r.num_preemptions for r in reqs) > 0
    assert tight.block_manager.num_free_blocks == 48


def test_abort_of_a_sharing_request_frees_only_its_reference(tiny_qwen3) -> None:
    ps = shared_prefix_prompts(3, prefix_len=40, seed=6)
    eng = engine(tiny_qwen3, True)
    run(eng, ps[:1])
    a = eng.add_request("a", ps[1], GREEDY)
    b = eng.add_request("b", ps[2], GREEDY)
    eng.step()
    shared = [x for x in a.block_ids if x in b.block_ids]
    assert len(shared) == 9  # 36 of the 40 shared tokens; the rest differ by lookahead
    assert all(eng.block_manager.ref_counts[x] == 2 for x in shared)
    assert eng.abort("a")
    assert all(eng.block_manager.ref_counts[x] == 1 for x in shared)
    drain(eng)
    assert b.output_token_ids == run(engine(tiny_qwen3, False), [ps[2]])[0]
    eng.block_manager.check_integrity([])
    assert eng.block_manager.num_free_blocks == 128


def test_block_manager_eviction_lru_and_flush() -> None:
    bm = BlockManager(6, 2, prefix_caching=True, salt=b"s")
    a = Request("a", [1, 2, 3, 4, 5, 6, 7], GREEDY, num_speculative_tokens=1)
    assert bm.ensure_capacity(a, 7)
    bm.register(a, 6)  # blocks 0-2 hold positions < 6: named
    assert bm.num_cached_blocks == 3
    assert bm.cached_prefix(Request("x", [1, 2, 3, 4, 9], GREEDY), 4) == a.block_ids[:1]
    b = Request("b", [1, 2, 3, 4, 5, 9], GREEDY, num_speculative_tokens=1)
    hit = bm.cached_prefix(b, 5)
    assert hit == a.block_ids[:2]  # block 1's lookahead (5) matches; block 2's would not
    bm.reuse(b, hit)
    bm.free(a)  # a's unshared named block becomes evictable, its shared ones stay held
    assert bm.num_free_blocks == 4 and len(bm.cache.evictable) == 1
    # Running out of free blocks evicts the unreferenced cached block, never b's.
    c = Request("c", [8] * 8, GREEDY)
    assert bm.ensure_capacity(c, 8)
    assert bm.num_free_blocks == 0 and not set(c.block_ids) & set(b.block_ids)
    assert bm.num_cached_blocks == 2
    bm.check_integrity([b, c])
    assert not bm.can_allocate(1)
    bm.free(b)
    bm.free(c)
    assert bm.num_free_blocks == 6 and len(bm.cache.evictable) == 2
    assert bm.flush() == 2
    assert bm.num_cached_blocks == 0 and len(bm.free_ids) == 6
    bm.check_integrity([])


def test_block_hashes_chain_and_lookahead() -> None:
    h = block_hashes([1, 2, 3, 4, 5], 2, b"s")
    assert len(h) == 2  # block 2 ([5]) has no lookahead token yet
    assert block_hashes([1, 2, 3, 4, 6], 2, b"s")[0] == h[0]
    assert block_hashes([1, 2, 3, 4, 6], 2, b"s")[1] != h[1]  # lookahead differs
    assert block_hashes([9, 2, 3, 4, 5], 2, b"s")[1] != h[1]  # the chain carries the parent
    assert block_hashes([1, 2, 3, 4, 5], 2, b"t") != h  # the salt names the model


def test_k0_requests_cache_main_kv_apart_from_whole_blocks(tiny_qwen3) -> None:
    """A request at k = 0 writes no MTP entries: its blocks are cached in a chain of their own
    that k = 0 requests hit and k > 0 requests never see; k = 0 requests also hit blocks a
    k > 0 request made whole. Outputs equal those without the cache throughout."""
    k0 = dataclasses.replace(GREEDY, num_speculative_tokens=0)
    ps = shared_prefix_prompts(2, prefix_len=45, seed=6)
    want = [run(engine(tiny_qwen3, False), ps[:2], params) for params in (k0, GREEDY)]
    eng = engine(tiny_qwen3, True)
    bm = eng.block_manager
    assert run(eng, ps[:2], k0, one_by_one=True) == want[0]
    assert bm.cache_hits == 44  # the second k = 0 request found the first one's prefix
    assert run(eng, ps[:1], GREEDY) == want[1][:1]
    assert bm.cache_hits == 44  # main KV without MTP entries is not a k > 0 hit
    assert run(eng, ps[1:2], k0) == want[0][1:]
    assert bm.cache_hits == 44 + (len(ps[1]) - 1) // 4 * 4  # its own whole prompt
    assert bm.num_free_blocks == 128
    bm.check_integrity([])
    # A k = 0 request finds the blocks a k > 0 request made whole.
    eng = engine(tiny_qwen3, True)
    assert run(eng, ps[:1], GREEDY) == want[1][:1]
    assert run(eng, ps[1:2], k0) == want[0][1:]
    assert eng.block_manager.cache_hits == 44
