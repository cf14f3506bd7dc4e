"""The GPU hot path (issue 33 item 7), checked on CPU wherever its control flow runs there:
`auto` never gives CUDA the padded gather; host inputs reach the device through one staged
copy (same values); the draft chain leaves its tokens on the device (one host sync per round:
tests/test_host_syncs.py); KV pool sizing arithmetic and its profiling control flow; the
gpu_check comparison of compiled graphs against eager logits. What needs a GPU (syncs counted
by CUDA sync debug mode, graph replays, the sizing on a real device) is measured by
`benchmarks/gpu_check.py`'s hot-path part."""

from __future__ import annotations

import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mtpserve.workers.engine_config import (
    DEFAULT_NUM_KV_BLOCKS,
    EngineConfig,
    KVMemoryBudget,
    kv_blocks_for_memory,
    resolve_attention_backend,
)
from mtpserve.workers.kv_cache import KVCache
from mtpserve.workers.model.attention_metadata import AttentionMetadata, stage, stage_lists
from mtpserve.workers.model.decode_graph import GraphKey
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner, kv_bytes_per_block
from mtpserve.workers.request import Request
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.spec_decode.mtp_proposer import MTPExtend, MTPProposer

GiB = 1 << 30


def test_auto_never_gives_cuda_the_padded_gather() -> None:
    assert resolve_attention_backend("auto", "cuda") == "flex"
    assert resolve_attention_backend("auto", "cuda:1") == "flex"
    assert resolve_attention_backend("auto", "cpu") == "gather"
    assert resolve_attention_backend("gather", "cuda") == "gather"  # explicit: measured
    with pytest.raises(ValueError):
        resolve_attention_backend("paged", "cuda")


def test_kv_blocks_for_memory_arithmetic() -> None:
    budget = KVMemoryBudget(total=140 * GiB, weights=15 * GiB, activations=2 * GiB,
                            graphs=1 * GiB, staging=GiB // 2)
    per_block = 2 * 16 * 8 * 128 * 2 * 28  # 7B-like: 16 tokens, 8 KV heads, bf16, 28 layers
    room = int(0.9 * 140 * GiB) - (15 * GiB + 3 * GiB + GiB // 2)
    assert kv_blocks_for_memory(budget, 0.9, per_block) == room // per_block - 1
    assert kv_blocks_for_memory(budget, 0.9, per_block, extra_blocks=0) == room // per_block
    # A larger fraction gives more blocks; what is accounted is never handed to the KV pool.
    assert kv_blocks_for_memory(budget, 0.95, per_block) > kv_blocks_for_memory(
        budget, 0.9, per_block)
    # A GPU shared with another process: never more than is free beside what comes later.
    shared = KVMemoryBudget(total=140 * GiB, weights=15 * GiB, activations=2 * GiB,
                            graphs=1 * GiB, staging=GiB // 2, free=40 * GiB)
    free_room = 40 * GiB - (3 * GiB + GiB // 2)
    assert kv_blocks_for_memory(shared, 0.9, per_block) == free_room // per_block - 1
    assert kv_blocks_for_memory(shared, 0.2, per_block) == (
        int(0.2 * 140 * GiB) - 18 * GiB - GiB // 2) // per_block - 1  # own share binds
    with pytest.raises(ValueError, match="fewer than 8"):
        kv_blocks_for_memory(budget, 0.13, per_block)  # 18.2 GiB < 18.5 GiB used
    with pytest.raises(ValueError, match="expected"):
        kv_blocks_for_memory(budget, 1.5, per_block)


def test_engine_config_kv_defaults() -> None:
    assert EngineConfig(model="m").num_kv_blocks == DEFAULT_NUM_KV_BLOCKS
    assert EngineConfig(model="m", num_kv_blocks=64).num_kv_blocks == 64
    # On CUDA an unset pool is sized from kv_cache_memory_fraction once weights are loaded.
    assert EngineConfig(model="m", device="cuda").num_kv_blocks is None
    assert EngineConfig(model="m", device="cuda", num_kv_blocks=64).num_kv_blocks == 64
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        EngineConfig(model="m", kv_cache_memory_fraction=0.0)


def test_kv_bytes_per_block_is_what_the_cache_allocates(tiny_qwen3) -> None:
    runner = ModelRunner(tiny_qwen3, 10, 4, decode_graphs=False)
    cache = KVCache(runner.config, 10, 4, torch.bfloat16, torch.device("cpu"))
    allocated = sum(b.numel() * b.element_size() for b in cache.buffers)
    assert allocated == 11 * kv_bytes_per_block(runner.config, 4, torch.bfloat16)  # + scratch


class _FixedMemory:
    """A device whose allocator reports given numbers (the sizing's inputs); the profiled
    forward itself really runs, on CPU."""

    def __init__(self, total: int, free: int, peak_over: int) -> None:
        self.total, self.free, self.peak_over = total, free, peak_over
        self.calls: list[str] = []

    def info(self) -> tuple[int, int]:
        return self.free, self.total

    def allocated(self) -> int:
        return 1000

    def reset_peak(self) -> None:
        self.calls.append("reset_peak")

    def peak(self) -> int:
        self.calls.append("peak")
        return 1000 + self.peak_over

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")


def test_size_kv_pool_profiles_then_accounts(tiny_qwen3) -> None:
    runner = ModelRunner(tiny_qwen3, 8, 4, decode_graphs=False)
    mem = _FixedMemory(total=4 * GiB, free=3 * GiB, peak_over=300 << 20)
    blocks = runner.size_kv_pool(0.5, torch.float32, profile_tokens=64,
                                 graph_reserve_bytes=100 << 20, staging_bytes=50 << 20,
                                 memory=mem)
    weights = sum(t.numel() * t.element_size()
                  for t in (*runner.model.parameters(), *runner.model.buffers()))
    want = KVMemoryBudget(total=4 * GiB, weights=weights, activations=300 << 20,
                          graphs=100 << 20, staging=50 << 20, free=3 * GiB)
    assert runner.kv_budget == want
    assert blocks == kv_blocks_for_memory(want, 0.5, kv_bytes_per_block(runner.config, 4,
                                                                        torch.float32))
    assert mem.calls == ["empty_cache", "reset_peak", "peak", "empty_cache"]
    assert not runner._hidden  # the profile's hidden states are not left behind


def test_kv_blocks_for_memory_counts_states_once() -> None:
    # A hybrid's state pool is allocated before sizing: it comes out of the process's share
    # but is already outside `free` (not subtracted twice there).
    per_block = 1 << 20
    base = dict(total=100 * GiB, weights=10 * GiB, activations=GiB, graphs=0, staging=0)
    own = KVMemoryBudget(**base, states=20 * GiB)
    assert kv_blocks_for_memory(own, 0.9, per_block) == (
        int(0.9 * 100 * GiB) - 31 * GiB) // per_block - 1
    shared = KVMemoryBudget(**base, states=20 * GiB, free=30 * GiB)  # after weights + states
    assert kv_blocks_for_memory(shared, 0.9, per_block) == 29 * GiB // per_block - 1


@pytest.fixture(scope="module")
def tiny_hybrid(tmp_path_factory):
    from test_qwen3_next import make_qwen3_next_checkpoint

    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("hybrid") / "ckpt")


def test_size_kv_pool_reserves_the_hybrid_verify_states(tiny_hybrid) -> None:
    # The profile is one long row (no per-position states): the budget reserves the pool's
    # verify buffers for max_num_seqs rows x k drafts by their formula, beside the slots, and
    # the KV pool is smaller by them than a runner's for k = 0 (plain decoding).
    from mtpserve.workers.state_pool import verify_state_bytes

    seqs = 6
    budgets, blocks = {}, {}
    for k in (0, 3):
        runner = ModelRunner(tiny_hybrid, 8, 4, num_state_slots=seqs, num_speculative_tokens=k)
        mem = _FixedMemory(total=GiB, free=GiB // 2, peak_over=100 << 20)
        blocks[k] = runner.size_kv_pool(0.5, torch.float32, profile_tokens=64,
                                        graph_reserve_bytes=0, staging_bytes=10 << 20,
                                        memory=mem)
        pool = runner.state_cache
        verify = verify_state_bytes(runner.config, seqs, k, torch.float32)
        assert pool.verify_bytes == verify and (verify > 0) == (k > 0)
        weights = sum(t.numel() * t.element_size()
                      for t in (*runner.model.parameters(), *runner.model.buffers()))
        budgets[k] = want = KVMemoryBudget(
            total=GiB, weights=weights, activations=100 << 20, graphs=0, staging=10 << 20,
            free=GiB // 2, states=pool.slot_bytes + verify)
        assert runner.kv_budget == want
        per_block = kv_bytes_per_block(runner.config, 4, torch.float32)
        assert blocks[k] == kv_blocks_for_memory(want, 0.5, per_block)
    verify = budgets[3].states - budgets[0].states
    assert verify == verify_state_bytes(runner.config, seqs, 3, torch.float32)
    assert blocks[0] - blocks[3] in (verify // per_block, verify // per_block + 1)


def test_stage_is_one_aligned_buffer_with_the_same_values() -> None:
    host = [torch.arange(5), torch.arange(12).view(3, 4) * 7, torch.tensor([-3])]
    dev = stage(host, "cpu")
    for h, d in zip(host, dev, strict=True):
        assert torch.equal(h, d) and d.shape == h.shape
        assert d.data_ptr() % 64 == 0
    # One buffer: every view shares the storage the single copy wrote.
    assert len({d.untyped_storage().data_ptr() for d in dev}) == 1
    a, b = stage_lists([[1, 2, 3], [], [9]], "cpu")[::2]
    assert a.tolist() == [1, 2, 3] and b.tolist() == [9]
    mask = torch.rand(2, 1, 3, 5) > 0.5
    assert torch.equal(stage([mask], "cpu")[0], mask)


def test_metadata_staging_keeps_the_old_values(tiny_qwen3) -> None:
    positions = torch.tensor([[4, 5, 5], [9, 10, 11]])
    ids = torch.tensor([[1, 2, 0], [3, 4, 5]])
    for backend in ("gather", "flex"):
        m = AttentionMetadata.build(positions, [2, 3], [[3, 1], [0, 2, 5]], 4, "cpu",
                                    backend, ride_along=[ids, positions])
        # slot = table[p // 4] * 4 + p % 4 for the real query slots
        assert m.write_slots.tolist() == [1 * 4 + 0, 1 * 4 + 1, 5 * 4 + 1, 5 * 4 + 2,
                                          5 * 4 + 3]
        assert m.write_rows.tolist() == [0, 1, 3, 4, 5]
        assert m.block_index.tolist() == [3, 1, 0, 0, 2, 5]  # rows 0-padded to 3 blocks
        assert torch.equal(m.staged[0], ids) and torch.equal(m.staged[1], positions)
        if backend == "flex":
            assert torch.equal(m.flex.positions, positions)


def test_device_ids_give_the_same_forward(tiny_qwen3) -> None:
    """A draft step's ids fed from a device tensor == the same ids from the host lists, eager
    and through a graph bucket's inputs."""
    runner = ModelRunner(tiny_qwen3, 16, 4, decode_graphs=False)
    tables, starts = [[1, 2, 3], [4, 5, 6]], [5, 7]
    runner.execute(ForwardBatch("main", [[3] * 9, [4] * 9], [0, 0], tables, [0]))
    hidden = ForwardBatch("main", [[11], [12]], starts, tables, [0, 1])
    runner.execute(hidden)
    host = runner.execute(ForwardBatch("mtp", [[11], [12]], starts, tables, [0, 1],
                                       hidden_from="main", hidden_rows=[[0], [1]])).clone()
    runner.execute(hidden)
    dev = runner.execute(ForwardBatch("mtp", [[0], [0]], starts, tables, [0, 1],
                                      hidden_from="main", hidden_rows=[[0], [1]],
                                      device_ids=torch.tensor([[11], [12]])))
    assert torch.equal(host, dev)
    graphs = ModelRunner(tiny_qwen3, 16, 4, decode_graphs=True).graphs  # compiles nothing
    key = GraphKey("mtp", 0, 2, 1, graphs.min_blocks)
    a = graphs.prepare(key, [[11], [12]], starts, tables, [0, 1])
    b = graphs.prepare(key, [[0], [0]], starts, tables, [0, 1],
                       device_ids=torch.tensor([[11], [12]]))
    for x, y in ((a.ids, b.ids), (a.positions, b.positions), (a.slots, b.slots),
                 (a.tables, b.tables), (a.logit_rows, b.logit_rows)):
        assert torch.equal(x, y)


class _HostReads(TorchFunctionMode):
    """Counts reads of tensor values into Python made from one source file (on CUDA each is
    a device -> host sync)."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "numpy"}

    def __init__(self, filename: str) -> None:
        super().__init__()
        self.filename, self.count = filename, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS and sys._getframe(1).f_code.co_filename == self.filename:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_chain_leaves_its_tokens_on_the_device(tiny_qwen3, temperature) -> None:
    """k = 3 drafts for two requests: with the device feed the chain reads nothing on the
    host (its drafts stay on the device for the next round, tests/test_host_syncs.py); read
    afterwards they come back in one copy, the same drafts and q rows as the per-step host
    feed, which copies every step's tokens."""
    import mtpserve.workers.spec_decode.mtp_proposer as mp
    from mtpserve.workers.host_sync import HOST_SYNCS

    results = []
    for feed in (True, False):
        runner = ModelRunner(tiny_qwen3, 32, 4, decode_graphs=False)
        prop = MTPProposer(runner.execute, runner.config.num_mtp_modules, device_feed=feed)
        assert MTPProposer(runner.execute, 1).device_feed  # a ModelRunner takes device ids
        reqs, items = [], []
        for i, n in enumerate((9, 6)):
            r = Request(f"r{i}", list(range(3 + i, 3 + i + n)),
                        SamplingParams(temperature=temperature, seed=i, max_tokens=8))
            r.block_ids = [4 * i + j for j in range(4)]
            r.num_computed_tokens = n
            reqs.append(r)
        prompts = [r.prompt_token_ids for r in reqs]
        runner.execute(ForwardBatch("main", prompts, [0, 0], [r.block_ids for r in reqs],
                                    [8, 9 + 5]))
        for b, r in enumerate(reqs):
            n = len(r.prompt_token_ids)
            items.append(MTPExtend(r, 0, r.prompt_token_ids[1:] + [7],
                                   [b * 9 + s for s in range(n)], num_drafts=3 - b))
        reads = _HostReads(mp.__file__)
        before = HOST_SYNCS.snapshot()
        with reads:
            prop.extend(items)
        chain = HOST_SYNCS.snapshot() - before
        assert reads.count == 0  # every read goes through workers/host_sync.py
        assert [r.num_drafts for r in reqs] == [3, 2]
        drafts = [r.draft_token_ids for r in reqs]
        read = HOST_SYNCS.snapshot() - before - chain
        results.append((drafts, [r.draft_probs for r in reqs], dict(chain), dict(read)))
    (drafts, probs, chain_dev, read_dev), (drafts_host, probs_host, chain_host, _) = results
    assert drafts == drafts_host and [len(d) for d in drafts] == [3, 2]
    for a, b in zip(probs, probs_host, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)
    assert chain_dev == {} and read_dev == {"drafts": 1}  # both requests in one copy
    # The host feed: steps 2 and 3 read their inputs, then the chain's drafts.
    assert chain_host == {"draft step (host feed)": 2, "drafts": 1}


@pytest.mark.slow
def test_gpu_check_graph_vs_eager_on_cpu(tiny_qwen3) -> None:
    """gpu_check's per-bucket comparison, run where it can be: compiled (CPU) graphs against
    eager logits at each compiled bucket, two different batches per bucket."""
    from mtpserve.benchmarks.gpu_check import graph_vs_eager

    runner = ModelRunner(tiny_qwen3, 128, 4, decode_graphs=True, compile_cache_dir="")
    runner.warmup_graphs([2], [1, 2], 64, mtp_modules=1)
    rows = graph_vs_eager(runner, tolerance=1e-4)
    checked = [r for r in rows if "ok" in r]
    assert checked and all(r["ok"] for r in checked), rows


def test_graph_memory_record_reserves_what_was_measured(tmp_path) -> None:
    """The first start reserves the default guess; a capture's measurement (the largest kept)
    is what later starts reserve, plus the margin; no folder, or a torn file: the default."""
    from mtpserve.workers.graph_memory import (
        DEFAULT_GRAPH_RESERVE,
        MARGIN,
        GraphMemoryRecord,
        record_key,
    )

    key = record_key(tmp_path / "no-model", "bfloat16", 16, "flex", 1, 0, "H200", "2.x")
    assert key != record_key(tmp_path / "no-model", "float32", 16, "flex", 1, 0, "H200", "2.x")
    rec = GraphMemoryRecord(tmp_path / "cache")
    assert rec.reserve(key) == DEFAULT_GRAPH_RESERVE
    rec.store(key, 300 << 20)
    rec.store(key, 200 << 20)  # a smaller capture does not lower the record
    assert GraphMemoryRecord(tmp_path / "cache").reserve(key) == int((300 << 20) * MARGIN)
    assert GraphMemoryRecord(None).reserve(key) == DEFAULT_GRAPH_RESERVE
    (tmp_path / "cache" / "graph-memory.json").write_text("{torn")
    assert rec.reserve(key) == DEFAULT_GRAPH_RESERVE


def test_replica_ranks_profile_their_largest_forward() -> None:
    # The KV pool is sized after a profile forward of this many tokens (on CUDA): a prefill
    # chunk, or a decode round verifying k drafts for a full batch.
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers.replica.engine_core import rank_spec

    cfg = ClusterConfig.model_validate({
        "model": "m", "prefill": {"max_num_batched_tokens": 2048},
        "decode": {"max_num_seqs": 256}, "speculation": {"num_speculative_tokens": 3}})
    assert rank_spec(cfg, "prefill").profile_tokens == 2048
    assert rank_spec(cfg, "decode").profile_tokens == 256 * 4
    # Hybrid models: the ranks' verify buffers (and so their KV sizing) use the same k.
    assert rank_spec(cfg, "decode").num_speculative_tokens == 3
