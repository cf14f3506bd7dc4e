"""The flex attention backend (FlexAttention over the block table, no per-layer gather) gives
the gather backend's outputs: both block masks against a dense reference on a shuffled paged
cache, then the model's prefill, verify, decode and MTP forwards, eager and (slow) compiled."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model.flex_paged_attention import (
    FlexPagedMask,
    eager_block_mask,
    graph_block_mask,
)
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
from mtpserve.workers.sampling_params import SamplingParams


def _dense(q, cache, positions, tables):
    """Gather + SDPA, the reference: [B, Hq, S, D]."""
    B = positions.shape[0]
    _, _, _, hk, d = cache.shape
    ctx = cache.index_select(1, tables.reshape(-1)).view(2, B, -1, hk, d)
    L = ctx.shape[2]
    mask = (torch.arange(L).view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)
    return F.scaled_dot_product_attention(q, ctx[0].transpose(1, 2), ctx[1].transpose(1, 2),
                                          attn_mask=mask, scale=0.125, enable_gqa=True)


def _case(bs: int, S: int, starts: list[int], num_cache_blocks: int = 40):
    g = torch.Generator().manual_seed(bs * 100 + S)
    B = len(starts)
    nb = (max(starts) + S - 1) // bs + 2  # one spare table entry past the last position
    tables = torch.randperm(num_cache_blocks, generator=g)[: B * nb].view(B, nb)
    positions = torch.tensor(starts).view(B, 1) + torch.arange(S).view(1, S)
    cache = torch.randn(2, num_cache_blocks, bs, 2, 64, generator=g)
    q = torch.randn(B, 4, S, 64, generator=g)
    return q, cache, positions, tables


@pytest.mark.parametrize("bs,S,starts", [(16, 1, [20, 3, 47]), (16, 4, [13, 14, 30]),
                                         (4, 4, [0, 5, 22]), (4, 37, [0, 9, 2])])
def test_eager_mask_is_exact_under_flex_reference(bs: int, S: int, starts: list[int]) -> None:
    """The eager mask's mask_mod alone is the causal paged mask: flex's unfused reference
    (which ignores block sparsity) matches gather + SDPA, decode to prefill shapes."""
    q, cache, positions, tables = _case(bs, S, starts)
    nbc, hk = cache.shape[1], cache.shape[3]
    mask = eager_block_mask(positions, tables, bs, nbc)
    k = cache[0].view(1, nbc * bs, hk, 64).transpose(1, 2)
    v = cache[1].view(1, nbc * bs, hk, 64).transpose(1, 2)
    with warnings.catch_warnings():  # "called without torch.compile": that is the point
        warnings.simplefilter("ignore")
        out = flex_attention(q, k, v, block_mask=mask, scale=0.125, enable_gqa=True)
    assert (out - _dense(q, cache, positions, tables)).abs().max().item() < 1e-5


@pytest.mark.parametrize("B,S", [(1, 1), (3, 4)])
def test_eager_mask_compiled_matches_gather(B: int, S: int) -> None:
    """The eager mask as a compiled kernel sees it (how CUDA's eager forwards run it): one
    decode row alone (the CPU template's split-KV path) and a verify batch."""
    q, cache, positions, tables = _case(16, S, [20, 3, 47][:B])
    nbc, hk = cache.shape[1], cache.shape[3]
    mask = eager_block_mask(positions, tables, 16, nbc)
    k = cache[0].view(1, nbc * 16, hk, 64).transpose(1, 2)
    v = cache[1].view(1, nbc * 16, hk, 64).transpose(1, 2)
    fn = torch.compile(flex_attention, fullgraph=True, dynamic=False)
    out = fn(q, k, v, block_mask=mask, scale=0.125, enable_gqa=True)
    assert (out - _dense(q, cache, positions, tables)).abs().max().item() < 1e-5


def test_graph_mask_compiled_matches_gather() -> None:
    """The in-graph mask (full blocks + a window of partial ones, reading only the graph's
    inputs) inside a compiled function, on a verify shape that straddles a block boundary."""
    q, cache, positions, tables = _case(4, 4, [2, 14, 7])

    @torch.compile(fullgraph=True, dynamic=False)
    def attend(q, cache, positions, tables):
        return FlexPagedMask(positions, tables, 4).attend(q, cache, 0.125)

    out = attend(q, cache, positions, tables)
    assert (out - _dense(q, cache, positions, tables)).abs().max().item() < 1e-5
    mask = graph_block_mask(positions, tables, 4, cache.shape[1])
    assert mask.full_kv_num_blocks is not None  # the full blocks skip the mask_mod


def _forwards(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill (ragged), a ragged verify, an MTP extend over its rows, single-token decode of
    three rows and of one, on shuffled block tables."""
    g = torch.Generator().manual_seed(0)
    vocab = runner.config.vocab_size
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (37, 21, 50)]
    tables = [[5, 9, 2, 7], [1, 3, 4, 6], [10, 11, 12, 13]]
    S = max(map(len, prompts))
    out = [runner.execute(ForwardBatch("main", prompts, [0, 0, 0], tables,
                                       [b * S + len(p) - 1 for b, p in enumerate(prompts)]))]
    news, starts = [[7], [8, 9], [10, 11, 12]], [len(p) for p in prompts]
    out.append(runner.execute(ForwardBatch("main", news, starts, tables, [0, 3, 4, 6, 7, 8])))
    out.append(runner.execute(ForwardBatch("mtp", news, starts, tables, [0, 4, 8],
                                           hidden_from="main", hidden_rows=[[0], [3, 4],
                                                                            [6, 7, 8]])))
    nxt = [s + len(x) for s, x in zip(starts, news, strict=True)]
    out.append(runner.execute(ForwardBatch("main", [[5], [6], [7]], nxt, tables, [0, 1, 2])))
    # One row alone (the CPU template's split-KV decode path).
    out.append(runner.execute(ForwardBatch("main", [[9]], [nxt[1] + 1], tables[1:2], [0])))
    return out


def _assert_same(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.shape == y.shape
        assert (x - y).abs().max().item() < 1e-4
        assert torch.equal(x.argmax(-1), y.argmax(-1))


def test_eager_runner_flex_equals_gather(default_model) -> None:
    runners = [ModelRunner(default_model, num_blocks=64, block_size=16, decode_graphs=False,
                           attention_backend=b) for b in ("gather", "flex")]
    assert runners[1].attention_backend == "flex"
    outs = [_forwards(r) for r in runners]
    _assert_same(*outs)
    for a, b in zip(runners[0].kv_cache.layers, runners[1].kv_cache.layers, strict=True):
        assert (a - b).abs().max().item() < 1e-4  # the same slots written (rounding apart)


@pytest.mark.slow
def test_compiled_graphs_flex_equal_gather(default_model) -> None:
    """Decode graphs compiled with the flex backend (verify, MTP and decode buckets)."""
    ref = _forwards(ModelRunner(default_model, num_blocks=64, block_size=16,
                                decode_graphs=False))
    flex = ModelRunner(default_model, num_blocks=64, block_size=16, decode_graphs=True,
                       attention_backend="flex", compile_cache_dir="")
    _assert_same(ref, _forwards(flex))
    # verify, MTP extend, decode B=4 and B=1 (flex keeps static buckets)
    assert not flex.graphs.dynamic and len(flex.graphs.compiled) == 4


@pytest.mark.slow
def test_engine_greedy_flex_equals_gather(default_model) -> None:
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 4000, (n,), generator=g).tolist() for n in (6, 19, 33)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    got = []
    for backend in ("gather", "flex"):
        eng = Engine(EngineConfig(model=str(default_model), num_speculative_tokens=2,
                                  num_kv_blocks=64, attention_backend=backend))
        reqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        got.append([r.output_token_ids for r in reqs])
    assert got[0] == got[1]
