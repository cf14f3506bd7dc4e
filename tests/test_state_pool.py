"""The hybrid state pool's verify buffers (workers/state_pool.py, issue 41 item 7): one formula
(`verify_state_bytes`) for what `StateCache` allocates, what KV sizing reserves and what the
memory plan counts; a verify forward writes its per-position states into those buffers and
allocates no more state memory for a longer row; `keep_states` restores from them and refuses
a position the last forward did not keep; the engine gives its runner its k. Greedy / sampled
exactness with drafts: tests/test_qwen3_next.py, tests/test_hybrid_qwen3_5_moe.py; the KV
budget: tests/test_gpu_path_by_construction.py."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest
import torch
from test_qwen3_next import make_qwen3_next_checkpoint
from tiny_tokenizer import VOCAB_SIZE
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from mtpserve.workers import memory_plan
from mtpserve.workers.engine import Engine, EngineConfig, EngineError
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.parallel import construction_tp
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
from mtpserve.workers.state_pool import StateCache, verify_state_bytes

# The tiny Qwen3-Next of tests/test_qwen3_next.py: linear heads Hk 2, Hv 4, Dk = Dv = 8, conv
# kernel 4 (conv_dim = 2 * 2 * 8 + 4 * 8), layers 0-2 linear, 3 full attention.
HV, DK, DV, CONV_DIM, K1, LINEAR_LAYERS = 4, 8, 8, 64, 3, 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("state_pool") / "ckpt")


def test_verify_buffers_are_the_one_formula(ckpt) -> None:
    """The pool's verify buffers == the hand-computed bytes == `verify_state_bytes` == the
    memory plan's, per TP rank: rows x k recurrent states (the state after the last position
    is the slot's own) and rows x (K - 1 + k) conv inputs per linear layer."""
    cfg = ModelConfig.from_pretrained(ckpt)
    assert len(cfg.linear_layers) == LINEAR_LAYERS
    seqs, k = 5, 3
    for tp in (1, 2):
        hand = LINEAR_LAYERS * (seqs * k * (HV // tp) * DK * DV * 4  # fp32 states
                                + seqs * (CONV_DIM // tp) * (K1 + k) * 2)  # bf16 conv inputs
        with construction_tp(0, tp):
            pool = StateCache(cfg, seqs, torch.bfloat16, torch.device("meta"), k)
            assert pool.verify_bytes == hand == verify_state_bytes(cfg, seqs, k, torch.bfloat16)
            assert pool.nbytes == pool.slot_bytes + hand
            assert StateCache(cfg, seqs, torch.bfloat16, torch.device("meta")).verify_bytes == 0
        assert memory_plan.verify_state_bytes(cfg, tp, seqs, k, torch.bfloat16) == hand
        plan = memory_plan.plan_memory(ckpt, memory_plan.PlanSettings(
            tp_size=tp, max_num_seqs=seqs, num_speculative_tokens=k), cfg).per_rank
        assert plan.verify_state_bytes == hand
    assert verify_state_bytes(cfg, seqs, 0, torch.bfloat16) == 0  # one-token rows keep nothing


class _LiveStates(TorchDispatchMode):
    """Bytes of state-shaped tensors ([..., Hv, Dk, Dv]) the ops allocate, live at once: each
    new output (not a view or an in-place result) counts until its tensor is freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(r.alias_info is not None for r in func._schema.returns):
            return out  # a view of, or a write into, an existing tensor
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and tuple(t.shape[-3:]) == (HV, DK, DV):
                n = t.numel() * t.element_size()
                self.live += n
                self.peak = max(self.peak, self.live)
                self.largest = max(self.largest, t.numel() // (HV * DK * DV))
                weakref.finalize(t, self._free, n)
        return out

    def _free(self, n: int) -> None:
        self.live -= n


def _tokens(rows: int, n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB_SIZE, (rows, n), generator=g).tolist()


def test_verify_forward_writes_into_the_buffers_and_allocates_no_more_for_longer_rows(
        ckpt) -> None:
    """Three requests prefilled, then verify forwards of 2 and 7 tokens (k = 6): both write
    into the pool's buffers (the same tensors before and after), no op allocates more than one
    state per row, and the state memory live at once is the same for the 7-token row as for
    the 2-token one (nothing per position beyond the preallocated buffers)."""
    k, rows, pre = 6, 3, 20
    runner = ModelRunner(ckpt, num_blocks=64, block_size=8, num_state_slots=4,
                         num_speculative_tokens=k)
    pool = runner.state_cache
    assert pool.verify_bytes == verify_state_bytes(runner.config, 4, k, torch.float32)
    buffers = {i: (t, t.data_ptr()) for i, t in (*pool.keep_rec.items(),
                                                 *((-1 - j, c) for j, c in pool.keep_conv.items()))}
    toks = _tokens(rows, pre + k + 1)
    tables = [list(range(4 * b, 4 * b + 4)) for b in range(rows)]
    slots = [2, 0, 3]
    runner.execute(ForwardBatch("main", [t[:pre] for t in toks], [0] * rows, tables,
                                [pre - 1], state_slots=slots))
    before = {i: (pool.conv[i].clone(), pool.recurrent[i].clone()) for i in pool.layers}
    peaks = {}
    for S in (2, k + 1):
        for i in pool.layers:  # every verify row starts from the prefilled state
            pool.conv[i].copy_(before[i][0])
            pool.recurrent[i].copy_(before[i][1])
        mode = _LiveStates()
        with mode:
            runner.execute(ForwardBatch("main", [t[pre:pre + S] for t in toks], [pre] * rows,
                                        tables, [0], state_slots=slots))
        assert mode.largest <= rows, f"an op allocated {mode.largest} states for {rows} rows"
        peaks[S] = mode.peak
        for st in runner._linear_states.values():
            assert st.kept == S - 1
            assert any(st.keep_rec is t for t, _ in buffers.values())
    assert peaks[2] == peaks[k + 1] > 0, peaks
    for t, ptr in buffers.values():  # reused, never reallocated
        assert t.data_ptr() == ptr


def test_keep_states_restores_the_state_of_a_shorter_row(ckpt) -> None:
    """After a 4-token verify row per request, keeping position p gives the slot the state
    (conv window and recurrent state) that a forward of only the first p + 1 tokens leaves,
    each row its own p; a position the forward did not keep is refused."""
    runner = ModelRunner(ckpt, num_blocks=64, block_size=8, num_state_slots=4,
                         num_speculative_tokens=3)
    pool = runner.state_cache
    rows, pre, positions = 3, 12, [0, 2, 1]
    toks = _tokens(rows, pre + 4)
    tables = [list(range(4 * b, 4 * b + 4)) for b in range(rows)]
    slots = [1, 3, 0]
    runner.execute(ForwardBatch("main", [t[:pre] for t in toks], [0] * rows, tables,
                                [pre - 1], state_slots=slots))
    before = {i: (pool.conv[i].clone(), pool.recurrent[i].clone()) for i in pool.layers}
    runner.execute(ForwardBatch("main", [t[pre:pre + 4] for t in toks], [pre] * rows, tables,
                                [0], state_slots=slots))
    runner.keep_states(list(range(rows)), positions)
    kept = {i: (pool.conv[i][slots].clone(), pool.recurrent[i][slots].clone())
            for i in pool.layers}
    for b in range(rows):  # the reference: row b alone, only its first p + 1 tokens
        for i in pool.layers:
            pool.conv[i].copy_(before[i][0])
            pool.recurrent[i].copy_(before[i][1])
        p = positions[b]
        runner.execute(ForwardBatch("main", [toks[b][pre:pre + p + 1]], [pre], [tables[b]],
                                    [0], state_slots=[slots[b]]))
        for i in pool.layers:
            assert (kept[i][0][b] - pool.conv[i][slots[b]]).abs().max() <= 1e-5
            assert (kept[i][1][b] - pool.recurrent[i][slots[b]]).abs().max() <= 1e-5
    # The last forward was a 2-token row: it kept position 0 only.
    runner.execute(ForwardBatch("main", [toks[0][:2]], [0], [tables[0]], [0], state_slots=[1]))
    with pytest.raises(RuntimeError, match="kept 1 positions"):
        runner.keep_states([0], [1])
    runner.execute(ForwardBatch("main", [toks[0][:pre]], [0], [tables[0]], [0],
                                state_slots=[1]))  # longer than k + 1: keeps nothing
    with pytest.raises(RuntimeError, match="kept 0 positions"):
        runner.keep_states([0], [0])


def test_engine_gives_its_runner_its_k(ckpt) -> None:
    """The engine builds its runner's verify buffers for max_num_seqs rows of its k, and
    refuses a runner whose buffers hold fewer drafts."""
    cfg = EngineConfig(model=str(ckpt), num_speculative_tokens=2, max_num_seqs=3,
                       num_kv_blocks=64, block_size=8)
    engine = Engine(cfg)
    pool = engine.runner.state_cache
    assert pool.num_speculative_tokens == 2
    assert pool.verify_bytes == verify_state_bytes(engine.model_config, 3, 2, torch.float32)
    small = ModelRunner(ckpt, num_blocks=64, block_size=8, num_state_slots=3,
                        num_speculative_tokens=1)
    with pytest.raises(EngineError, match="verify states for k = 1"):
        Engine(cfg, runner=small)
