"""CUDA-graph capture of the decode buckets: what can be checked without a GPU is the
bookkeeping (static buffers keep their storage and take each batch's values; capture order;
CPU runners never build the wrapper). The replay itself is checked by the `gpu` test."""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.model.cuda_graphs import (
    CUDAGraphs,
    StaticInputs,
    capture_order,
    example_inputs,
)
from mtpserve.workers.model.decode_graph import GraphKey
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner


@pytest.fixture(scope="module")
def graph_runner(tiny_qwen3) -> ModelRunner:
    # Building the graphs object compiles nothing; only `run` / `warmup` would. Static
    # buckets, as CUDA graphs use them (dynamic packages are CPU ahead-of-time only).
    return ModelRunner(tiny_qwen3, num_blocks=32, block_size=4, decode_graphs=True,
                       dynamic_graphs=False)


def test_cpu_runner_has_no_cuda_graphs(graph_runner) -> None:
    assert graph_runner.graphs is not None and graph_runner.cuda_graphs is None
    with pytest.raises(ValueError, match="CUDA"):
        CUDAGraphs(graph_runner.graphs)


def test_static_inputs_are_overwritten_in_place(graph_runner) -> None:
    g = graph_runner.graphs
    key = g.key_for("mtp", 0, [1, 3], [[1, 2], [3, 4, 5]])
    assert key is not None and (key.batch, key.query_len) == (2, 4)
    static = StaticInputs.like(*example_inputs(g, key))
    ptrs = [t.data_ptr() for t in (static.ids, static.positions, static.slots, static.tables,
                                   static.logit_rows, static.prev)]
    inp = g.prepare(key, [[7], [8, 9, 10]], [5, 9], [[1, 2], [3, 4, 5]], [0, 4, 5, 6])
    prev = torch.randn(2, 4, graph_runner.config.hidden_size)
    static.copy_from(inp, prev)
    assert ptrs == [t.data_ptr() for t in (static.ids, static.positions, static.slots,
                                           static.tables, static.logit_rows, static.prev)]
    for mine, theirs in ((static.ids, inp.ids), (static.positions, inp.positions),
                         (static.slots, inp.slots), (static.tables, inp.tables),
                         (static.logit_rows, inp.logit_rows), (static.prev, prev)):
        assert torch.equal(mine, theirs)
    other = g.key_for("mtp", 0, [1], [[1]])
    with pytest.raises(AssertionError, match="inputs of"):
        static.copy_from(g.prepare(other, [[1]], [0], [[1]], [0]), prev[:1])


def test_capture_inputs_write_only_the_scratch_block(graph_runner) -> None:
    g = graph_runner.graphs
    key = GraphKey("main", 0, 4, 4, g.min_blocks)
    inp, prev = example_inputs(g, key)
    scratch = g.kv.scratch_block
    assert prev is None
    assert bool((inp.slots // g.block_size == scratch).all())
    assert bool((inp.tables == scratch).all())


def test_capture_order_is_largest_batch_first(graph_runner) -> None:
    keys = graph_runner.graphs.warmup_keys([1, 8, 32], [1, 2, 3], 300, 1)
    order = capture_order(set(keys))
    assert sorted(order, key=lambda k: k.batch, reverse=True) == order
    assert set(order) == set(keys) and order[0].batch == 32


@pytest.mark.gpu
def test_replay_equals_the_compiled_call(tiny_qwen3) -> None:
    """On CUDA: a captured bucket replays the compiled forward's logits, and the KV writes
    land where the call's did."""
    runners = [ModelRunner(tiny_qwen3, num_blocks=32, block_size=4, device="cuda",
                           dtype=torch.float32, decode_graphs=True, cuda_graphs=cg,
                           compile_cache_dir="") for cg in (False, True)]
    for r in runners:
        r.warmup_graphs([2], [1, 3], 40)
    assert runners[1].cuda_graphs is not None and runners[1].cuda_graphs.captured
    outs = []
    for r in runners:
        batch = ForwardBatch("main", [[3, 4, 5], [6]], [0, 7], [[1, 2, 3], [4, 5]],
                             [0, 1, 2, 3])
        outs.append(r.execute(batch).clone())
    assert (outs[0] - outs[1]).abs().max().item() < 1e-5
    for a, b in zip(runners[0].kv_cache.layers, runners[1].kv_cache.layers, strict=True):
        assert (a - b).abs().max().item() < 1e-5
