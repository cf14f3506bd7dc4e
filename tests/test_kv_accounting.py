"""KV blocks: freed on finish and abort, rollback frees exactly the rejected slots, chunked
prefill == one-shot prefill, preemption under memory pressure keeps outputs exact."""

from __future__ import annotations

import torch
from helpers import GREEDY, drain, make_engine, run_to_completion

from mtpserve.workers.block_manager import BlockManager, blocks_for
from mtpserve.workers.engine import Engine, prefill_width
from mtpserve.workers.model_runner import ForwardBatch
from mtpserve.workers.request import Request
from mtpserve.workers.scheduler import draft_slots


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 256, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n)
    ]


def run(engine: Engine, ps: list[list[int]]) -> list[list[int]]:
    return run_to_completion(engine, ps, GREEDY, check_blocks=True)


def test_block_manager_refcounts_and_integrity() -> None:
    bm = BlockManager(8, 4)
    r = Request("a", [1, 2, 3], GREEDY)
    assert bm.ensure_capacity(r, 9) and len(r.block_ids) == 3
    held = r.block_ids[:1]
    bm.incref(held)  # e.g. also held by a KV transfer
    bm.check_integrity([r])
    assert bm.truncate(r, 4) == 2  # 9 -> 4 slots: two blocks back
    assert len(r.block_ids) == 1 and bm.num_free_blocks == 7
    bm.free(r)
    assert bm.num_free_blocks == 7  # the transfer still holds its block
    bm.check_integrity([])
    bm.release(held)
    assert bm.num_free_blocks == 8
    assert not bm.ensure_capacity(r, 100) and r.block_ids == []


def test_all_blocks_free_after_finish_and_abort(tiny_qwen3) -> None:
    eng = make_engine(tiny_qwen3, 2, num_kv_blocks=128, block_size=4, max_num_batched_tokens=32)
    ps = prompts(6)
    reqs = [eng.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    for _ in range(6):
        eng.step()
    assert eng.block_manager.num_used_blocks > 0
    assert eng.abort("r1") and eng.abort("r4")
    assert not eng.abort("r1") and not eng.abort("nope")
    drain(eng)
    assert eng.block_manager.num_free_blocks == 128
    assert reqs[0].finished and reqs[1].status.value == "abort"
    eng.block_manager.check_integrity([])


def test_rollback_frees_exactly_the_rejected_slots(tiny_qwen3) -> None:
    k = 3
    eng = make_engine(tiny_qwen3, k, num_kv_blocks=64, block_size=2)
    req = eng.add_request("r", prompts(1, seed=5)[0], GREEDY)
    rejected_rounds = 0
    while eng.has_unfinished():
        eng.step()
        if req.finished:
            break
        # Between rounds a request holds exactly the committed tokens + k-1 draft entries.
        assert len(req.block_ids) == blocks_for(draft_slots(req), 2)
        rejected_rounds += req.num_rounds > 0 and req.accepted_per_position[0] < req.num_rounds
    assert rejected_rounds > 0  # random MTP weights: drafts get rejected
    assert eng.block_manager.num_free_blocks == 64


def small_engine(path, num_kv_blocks: int, budget: int) -> Engine:
    return make_engine(path, 2, block_size=4, num_kv_blocks=num_kv_blocks,
                       max_num_batched_tokens=budget)


def test_chunked_prefill_equals_one_shot(tiny_qwen3) -> None:
    ps = prompts(4, seed=1)
    outs = []
    for budget in (7, 512):
        outs.append(run(small_engine(tiny_qwen3, 128, budget), ps))
    assert outs[0] == outs[1]

    def kv_after_prefill(budget: int):
        # Same main and MTP KV contents after prefill, chunked or not.
        eng = small_engine(tiny_qwen3, 32, budget)
        r = eng.add_request("x", ps[1], GREEDY)
        while r.num_output_tokens == 0:
            eng.step()
        n = r.num_computed_tokens
        slots = torch.tensor([r.block_ids[p // 4] * 4 + p % 4 for p in range(n)])
        return [
            layer[:, :, :, :, :].flatten(1, 2)[:, slots] for layer in eng.runner.kv_cache.layers
        ], r.draft_token_ids

    (kv_a, d_a), (kv_b, d_b) = kv_after_prefill(5), kv_after_prefill(512)
    assert d_a == d_b
    assert len(kv_a) == 3  # 2 main layers + 1 MTP layer
    for a, b in zip(kv_a, kv_b, strict=True):
        assert torch.allclose(a, b, atol=1e-5)


def test_preemption_under_memory_pressure_keeps_outputs(tiny_qwen3) -> None:
    ps = prompts(6, seed=2)
    roomy = make_engine(tiny_qwen3, 2, num_kv_blocks=256, block_size=4)
    tight = make_engine(tiny_qwen3, 2, num_kv_blocks=40, block_size=4)
    want = run(roomy, ps)
    reqs = [tight.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(ps)]
    drain(tight)
    assert [r.output_token_ids for r in reqs] == want
    assert sum(r.num_preemptions for r in reqs) > 0
    assert tight.block_manager.num_free_blocks == 40


def test_request_larger_than_cache_is_rejected(tiny_qwen3) -> None:
    eng = make_engine(tiny_qwen3, 2, num_kv_blocks=8, block_size=4)
    import pytest

    from mtpserve.workers.engine import EngineError

    with pytest.raises(EngineError, match="KV blocks"):
        eng.add_request("big", list(range(3, 40)), GREEDY)
    with pytest.raises(EngineError, match="context window"):
        eng.add_request("huge", [5] * 600, GREEDY)
    assert eng.block_manager.num_free_blocks == 8


def test_forward_batch_padding_rows_write_nothing(tiny_qwen3) -> None:
    eng = make_engine(tiny_qwen3, 2, num_kv_blocks=16, block_size=4)
    layers = eng.runner.kv_cache.layers
    eng.runner.execute(ForwardBatch("main", [[5], [6, 7, 8]], [0, 0], [[1], [2]], [0]))
    used = {1, 2}
    for layer in layers[:2]:
        for b in range(16):
            assert (layer[:, b].abs().sum() > 0) == (b in used)


def test_prefill_rows_pad_little_and_new_prompts_start_with_real_chunks(tiny_qwen3) -> None:
    """A prefill forward splits long chunks into rows instead of padding a short chunk to the
    longest (a 1-token tail beside a 127-token chunk); a budget's last few tokens do not start
    a new prompt with a sliver chunk. Outputs equal those of a 512-token budget."""
    assert prefill_width([127, 1]) < 127  # 2 x 127 slots otherwise
    assert prefill_width([128, 128, 128, 128]) == 128  # nothing to save
    assert prefill_width([500]) == 500
    ps = prompts(6, seed=4)
    eng = make_engine(tiny_qwen3, 2, block_size=4, num_kv_blocks=256, mixed_batches=False,
                      max_num_batched_tokens=sum(len(p) for p in ps[:2]) + 3)
    reqs = [eng.add_request(str(i), p, GREEDY) for i, p in enumerate(ps)]
    eng.step()  # the first two prompts; 3 tokens of budget left do not start the third
    assert [r.num_computed_tokens for r in reqs[:3]] == [len(ps[0]), len(ps[1]), 0]
    drain(eng, check_blocks=True)
    want = run(small_engine(tiny_qwen3, 256, 512), ps)
    assert [r.output_token_ids for r in reqs] == want
