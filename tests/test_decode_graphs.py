"""Fixed-shape compiled decode graphs give the eager forward's logits and KV, write nothing
outside the batch's own slots, and a position outside a block table fails instead of being
clamped into another block."""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model.attention_metadata import AttentionMetadata
from mtpserve.workers.model.decode_graph import GraphKey, bucket, query_bucket
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
from mtpserve.workers.sampling_params import SamplingParams


def test_buckets() -> None:
    assert [bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert bucket(3, 32) == 32
    assert [query_bucket(n) for n in (1, 2, 4, 5)] == [1, 4, 4, 8]


def test_warmup_compiles_what_traffic_hits_first(tiny_qwen3, tmp_path) -> None:
    """Warm-up and the background compiler (same keys, same order) build batch 1 at the
    shortest contexts first, every batch bucket before the next larger one and every
    shorter table before a longer one; within a batch bucket the forwards of a speculative
    round (verify row, MTP extend, draft step) come before the rare 1-token main forward."""
    runner = ModelRunner(tiny_qwen3, num_blocks=32, block_size=4, decode_graphs=True,
                         compile_cache_dir=tmp_path, dynamic_graphs=False)
    g = runner.graphs
    keys = g.warmup_keys(list(range(1, 5)), [1, 2, 3], 4 * g.min_blocks * 2, 1)
    names = [k.name for k in keys]
    nb = g.min_blocks
    assert names[:3] == [f"main0-b1-s4-nb{nb}", f"mtp0-b1-s4-nb{nb}", f"mtp0-b1-s1-nb{nb}"]
    tables = [k.num_blocks for k in keys]
    assert tables == sorted(tables) and set(tables) == {nb, 2 * nb}
    for table in (nb, 2 * nb):
        row = [k for k in keys if k.num_blocks == table]
        spec = [k for k in row if not (k.kind == "main" and k.query_len == 1)]
        assert row[:len(spec)] == spec  # the 1-token main forwards last
        assert [k.batch for k in spec] == sorted(k.batch for k in spec)
        assert [k.batch for k in row[len(spec):]] == [1, 2, 4]
    assert len(set(keys)) == len(keys) == 2 * 3 * 4


def test_dynamic_packages_cover_every_shape(tiny_qwen3, tmp_path) -> None:
    """One dynamic package per kind covers every batch, query length and table width, main
    first; a forward runs at its exact shape (no power-of-two padding)."""
    runner = ModelRunner(tiny_qwen3, num_blocks=32, block_size=4, decode_graphs=True,
                         compile_cache_dir=tmp_path)
    g = runner.graphs
    keys = g.warmup_keys(list(range(1, 33)), [1, 2, 3], 4 * g.min_blocks * 8, 2)
    assert [k.name for k in keys] == ["main0-dynamic", "mtp0-dynamic", "mtp1-dynamic"]
    key = g.key_for("main", 0, [1, 3, 2], [[1], [2, 3, 4], [5, 6]])
    assert (key.batch, key.query_len, key.num_blocks) == (3, 3, 3)
    assert key.package == keys[0]


def test_a_failed_dynamic_export_falls_back_to_static_buckets(tiny_qwen3, tmp_path) -> None:
    """A model whose dynamic export fails: that forward runs eagerly with the eager logits,
    and from then on the forwards map to static buckets (nothing compiled here: the export
    is made to fail before it starts)."""
    eager = ModelRunner(tiny_qwen3, num_blocks=16, block_size=4, decode_graphs=False)
    runner = ModelRunner(tiny_qwen3, num_blocks=16, block_size=4, decode_graphs=True,
                         compile_cache_dir=tmp_path)
    g = runner.graphs
    assert g.dynamic

    def refuse(*a, **kw):
        raise RuntimeError("export refused")

    g.aot.get = refuse
    batch = ForwardBatch("main", [[3, 4, 5], [6, 7]], [0, 0], [[1, 2], [3]], [2, 3])
    want = eager.execute(batch)
    got = runner.execute(batch)
    assert (want - got).abs().max().item() <= 1e-5
    assert not g.dynamic and not g.compiled
    key = g.key_for("main", 0, [1, 1], [[1, 2], [3]])
    assert not key.dynamic and (key.batch, key.num_blocks) == (2, g.min_blocks)


def test_position_outside_block_table_fails() -> None:
    positions = torch.tensor([[0, 1], [4, 5]])  # row 1 position 5 needs block 1 of 1
    with pytest.raises(IndexError, match="row 1"):
        AttentionMetadata.build(positions, [2, 2], [[3], [7]], block_size=4)


def test_graph_path_rejects_position_outside_block_table(tiny_qwen3) -> None:
    runner = ModelRunner(tiny_qwen3, num_blocks=16, block_size=4, decode_graphs=True)
    with pytest.raises(IndexError, match="row 0"):
        runner.execute(ForwardBatch("main", [[5]], [4], [[1]], [0]))


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [True, False])
def test_graph_forwards_match_eager(tiny_qwen3, dynamic: bool) -> None:
    """Ragged batch (static buckets: B=3 -> 4, S=1..3 -> 4; dynamic: exact shapes), then an
    MTP forward over its rows, then single-token steps: same logits and the same KV in every
    real block; the padding's KV lands only in the scratch block."""
    runners = [ModelRunner(tiny_qwen3, num_blocks=32, block_size=4, decode_graphs=g,
                           dynamic_graphs=dynamic) for g in (False, True)]
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 2)]
    tables = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    outs: list[list[torch.Tensor]] = [[], []]
    for runner, out in zip(runners, outs, strict=True):
        S = max(map(len, prompts))
        out.append(runner.execute(ForwardBatch(
            "main", prompts, [0, 0, 0], tables, [b * S + len(p) - 1 for b, p in
                                                 enumerate(prompts)])))
        news = [[7], [8, 9], [10, 11, 12]]
        starts = [len(p) for p in prompts]
        out.append(runner.execute(ForwardBatch("main", news, starts, tables, [0, 3, 4, 6, 7, 8])))
        out.append(runner.execute(ForwardBatch(
            "mtp", news, starts, tables, [0, 4, 8], hidden_from="main",
            hidden_rows=[[0], [3, 4], [6, 7, 8]])))
        out.append(runner.execute(ForwardBatch(
            "mtp", [[1], [2]], [6, 11], tables[:2], [0, 1], hidden_from="mtp",
            hidden_rows=[[0], [4]])))
    assert runners[1].graphs is not None
    assert len(runners[1].graphs.compiled) == (2 if dynamic else 4)
    for eager, graph in zip(*outs, strict=True):
        assert eager.shape == graph.shape
        assert (eager - graph).abs().max().item() <= 1e-4
    for a, b in zip(runners[0].kv_cache.layers, runners[1].kv_cache.layers, strict=True):
        assert (a - b).abs().max().item() <= 1e-4
        used = {blk for t in tables for blk in t}
        for blk in range(32):
            if blk not in used:
                assert b[:, blk].abs().sum() == 0, f"block {blk} written by padding"


@pytest.mark.slow
def test_in_process_compile_matches_eager(default_model) -> None:
    """`ahead_of_time=False` (torch.compile in the process, as on GPUs): its graphs trace the
    C++ attention op's availability check as a constant (dynamo cannot trace the CPU
    capability query inside) and give eager's logits."""
    outs: list[list[torch.Tensor]] = [[], []]
    for graphs, out in zip((False, True), outs, strict=True):
        runner = ModelRunner(default_model, num_blocks=32, block_size=16, decode_graphs=graphs,
                             dynamic_graphs=False, compile_ahead_of_time=False)
        out.append(runner.execute(ForwardBatch("main", [[5, 6, 7]], [0], [[1, 2]], [2])))
        out.append(runner.execute(ForwardBatch("main", [[9]], [3], [[1, 2]], [0])))
    assert runner.graphs is not None and runner.graphs.aot is None
    assert len(runner.graphs.compiled) == 2
    for eager, graph in zip(*outs, strict=True):
        assert (eager - graph).abs().max().item() <= 1e-4


@pytest.mark.slow
def test_engine_greedy_same_with_graphs(tiny_qwen3) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 13, 20)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    got = []
    for graphs in (False, True):
        runner = ModelRunner(tiny_qwen3, num_blocks=64, block_size=4, decode_graphs=graphs)
        eng = Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=2,
                                  num_kv_blocks=64, block_size=4), runner=runner)
        reqs = [eng.add_request(str(i), p, params) for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        got.append([r.output_token_ids for r in reqs])
    assert got[0] == got[1]


@pytest.mark.slow
@pytest.mark.parametrize("k", [1, 2])
def test_greedy_round_graph_is_the_step_by_step_round(default_model, k: int) -> None:
    """A whole greedy round as one graph (k = 1) emits the tokens plain decoding emits and
    drafts what the step-by-step round drafts (same acceptance per position), with rows of
    different lengths and token budgets (the room masks at the end); k = 2 is not fused and
    runs step by step."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (9, 30, 55)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True) for m in (40, 33, 21)]
    runs = {}
    for name, kk, rounds in (("plain", 0, False), ("steps", k, False), ("fused", k, True)):
        runner = ModelRunner(default_model, num_blocks=128, block_size=16, decode_graphs=True,
                             greedy_rounds=rounds)
        runner.warmup_graphs([1, 2, 4], list(range(1, k + 2)), 512)
        eng = Engine(EngineConfig(model=str(default_model), num_speculative_tokens=kk,
                                  num_kv_blocks=128), runner=runner)
        calls = []
        if rounds:
            def counted(*a, _inner=runner.greedy_round, _calls=calls):
                out = _inner(*a)
                _calls.append(out is not None)
                return out

            runner.greedy_round = counted
        reqs = [eng.add_request(str(i), p, sp) for i, (p, sp) in
                enumerate(zip(prompts, params, strict=True))]
        while eng.has_unfinished():
            eng.step()
        assert eng.block_manager.num_free_blocks == 128
        runs[name] = ([r.output_token_ids for r in reqs],
                      [r.accepted_per_position for r in reqs], eng.totals["rounds"])
        if rounds:
            assert sum(calls) > 5 if k == 1 else not any(calls)
            # one dynamic package runs every batch (3, 2, 1) and table width
            assert {key for key in runner.graphs.compiled if key.kind == "round"} == {
                GraphKey.dynamic_package("round", 0)}
    assert runs["steps"][0] == runs["plain"][0]
    assert runs["fused"][0] == runs["plain"][0]
    assert runs["fused"][1:] == runs["steps"][1:]  # same drafts, so same acceptance
