"""Recurrent-state slots of hybrid (linear-attention) models, beside the paged KV cache.

Each running request of a hybrid model (Qwen3-Next) holds one state slot: for every Gated
DeltaNet layer, its conv window and its recurrent state (`workers/model/gated_deltanet.py`).
The engine side (`HybridBlockManager`) hands a slot out with a request's first KV blocks and
takes it back whenever its blocks are freed (finish, abort, preemption, migration), so a slot
lives exactly as long as the KV it goes with; the runner side (`StateCache`) holds the
tensors, indexed by slot, and the verify buffers (per layer, the states a verify forward of
max_num_seqs rows x k drafts keeps for `keep_states`), allocated once, so that KV sizing
counts them. `max_num_seqs` bounds the scheduler's requests (running,
prefilling, receiving), so a pool of that many slots never runs out there. A prefill engine's
held requests (KV kept for transfer) have left the scheduler but keep their slots until
released, so admission also asks for a free slot (`can_admit`) and waits for a release when
none is left; running out anyway is a bug that fails loudly. A slot is not cleared when
handed out: a row starting at position 0 starts from zeros (the layer ignores what the slot
held).

Prefix caching is off for hybrid models: a cached block restores KV but not the recurrent
state at the block's end (no state checkpoints are kept), so a hit would be silently wrong.
"""

from __future__ import annotations

import logging
import math

import torch

from mtpserve.workers.block_manager import BlockManager
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.gated_deltanet import LinearState, linear_attention_backend
from mtpserve.workers.model.parallel import get_tp
from mtpserve.workers.request import Request

logger = logging.getLogger(__name__)


def verify_state_shapes(cfg: ModelConfig, rows: int, k: int) -> tuple[tuple[int, ...],
                                                                       tuple[int, ...]]:
    """This rank's (`get_tp()`) verify buffers of one linear layer for `rows` verify rows of
    k drafts: the recurrent states [rows, k, Hv / tp, Dk, Dv] (fp32) after each position
    but the last of a [last, d1..dk] row, and the conv inputs [rows, conv_dim / tp, K - 1 + k]
    (model dtype) up to the last position's window. The state after the last position is
    the slot's own, so a row keeps k states, not k + 1 (`LinearState`)."""
    lin = cfg.linear
    assert lin is not None
    tp = get_tp().size
    return ((rows, k, lin.num_value_heads // tp, lin.key_head_dim, lin.value_head_dim),
            (rows, lin.conv_dim // tp, lin.conv_kernel - 1 + k))


def verify_state_bytes(cfg: ModelConfig, rows: int, k: int, dtype: torch.dtype) -> int:
    """Bytes of this rank's verify buffers over every linear layer (`verify_state_shapes`):
    what `StateCache` allocates for max_num_seqs rows, KV sizing reserves
    (`ModelRunner.size_kv_pool`) and the memory plan counts (workers/memory_plan.py). 0 for
    a model without linear layers or k = 0 (a one-token row keeps nothing)."""
    if cfg.linear is None or k <= 0 or rows <= 0:
        return 0
    rec, conv = verify_state_shapes(cfg, rows, k)
    elem = torch.empty((), dtype=dtype).element_size()
    return (math.prod(rec) * 4 + math.prod(conv) * elem) * len(cfg.linear_layers)


class StateCache:
    """The state tensors of one rank: per linear layer, conv [slots + 1, conv_dim / tp, K - 1]
    in the model dtype and recurrent [slots + 1, Hv / tp, Dk, Dv] in fp32 (this rank's heads,
    workers/model/gated_deltanet.py); slot `scratch_slot` (the
    last) serves rows that name none (a runner driven without an engine, memory profiling).

    Verify buffers (`verify_state_shapes`, `num_speculative_tokens` = k): per linear layer,
    the states a verify forward of up to `num_slots` rows of k + 1 tokens keeps so that each
    row can keep the state at its last accepted token (`LinearState.keep`). Allocated once
    here, beside the slots, and rewritten by every verify forward: their memory is fixed
    (`verify_bytes`) and counted by KV sizing, never allocated per forward."""

    def __init__(self, cfg: ModelConfig, num_slots: int, dtype: torch.dtype,
                 device: torch.device, num_speculative_tokens: int = 0) -> None:
        lin = cfg.linear
        assert lin is not None
        self.linear = lin
        self.layers = cfg.linear_layers
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.num_speculative_tokens = k = max(0, num_speculative_tokens)
        n = num_slots + 1
        tp = get_tp().size  # this rank's heads: conv channels and value heads split by rank
        self.conv = {i: torch.zeros(n, lin.conv_dim // tp, lin.conv_kernel - 1, dtype=dtype,
                                    device=device) for i in self.layers}
        self.recurrent = {i: torch.zeros(n, lin.num_value_heads // tp, lin.key_head_dim,
                                         lin.value_head_dim, dtype=torch.float32,
                                         device=device) for i in self.layers}
        self.keep_rec: dict[int, torch.Tensor] = {}
        self.keep_conv: dict[int, torch.Tensor] = {}
        if k:
            rec, conv = verify_state_shapes(cfg, num_slots, k)
            self.keep_rec = {i: torch.empty(rec, dtype=torch.float32, device=device)
                             for i in self.layers}
            self.keep_conv = {i: torch.empty(conv, dtype=dtype, device=device)
                              for i in self.layers}

    @property
    def slot_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.conv.values(), *self.recurrent.values()))

    @property
    def verify_bytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for t in (*self.keep_rec.values(), *self.keep_conv.values()))

    @property
    def nbytes(self) -> int:
        return self.slot_bytes + self.verify_bytes

    def views(self, slots: torch.Tensor, fresh: torch.Tensor, lens: torch.Tensor
              ) -> dict[int, LinearState]:
        """One `LinearState` per linear layer for a forward with these rows."""
        return {i: LinearState(self.conv[i], self.recurrent[i], slots, fresh, lens,
                               self.keep_rec.get(i), self.keep_conv.get(i))
                for i in self.layers}


class HybridBlockManager(BlockManager):
    """The block manager of a hybrid model: KV blocks plus one state slot per request holding
    blocks (module docstring). Prefix caching is always off here."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int,
                 has_mtp: bool = True, salt: bytes = b"") -> None:
        super().__init__(num_blocks, block_size, prefix_caching=False, salt=salt,
                         has_mtp=has_mtp)
        self.num_state_slots = num_state_slots
        self.free_slots = list(range(num_state_slots - 1, -1, -1))
        self.slot_of: dict[str, int] = {}

    def state_slot(self, req: Request) -> int:
        return self.slot_of[req.request_id]

    def can_admit(self) -> bool:
        # A prefill engine's held requests keep their slots outside max_num_seqs: with every
        # slot held, admission waits for a release, as it waits for blocks.
        return bool(self.free_slots)

    def _take_slot(self, req: Request) -> None:
        if req.request_id in self.slot_of:
            return
        if not self.free_slots:  # max_num_seqs bounds holders: a bookkeeping bug
            raise RuntimeError(f"no free state slot for {req.request_id} "
                               f"({self.num_state_slots} held)")
        self.slot_of[req.request_id] = self.free_slots.pop()

    def ensure_capacity(self, req: Request, num_slots: int) -> bool:
        had = req.request_id in self.slot_of
        self._take_slot(req)
        if super().ensure_capacity(req, num_slots):
            return True
        if not had:  # nothing taken on failure
            self.free_slots.append(self.slot_of.pop(req.request_id))
        return False

    def reuse(self, req: Request, blocks: list[int]) -> None:
        assert not blocks, "prefix caching is off for hybrid models"
        super().reuse(req, blocks)

    def free(self, req: Request) -> None:
        super().free(req)
        slot = self.slot_of.pop(req.request_id, None)
        if slot is not None:
            self.free_slots.append(slot)

    def check_integrity(self, live: list[Request]) -> None:
        super().check_integrity(live)
        held = set(self.slot_of)
        assert held <= {r.request_id for r in live}, f"state slots of dead requests: " \
            f"{sorted(held - {r.request_id for r in live})}"
        assert len(set(self.slot_of.values())) == len(self.slot_of), "a slot held twice"
        assert len(self.free_slots) + len(self.slot_of) == self.num_state_slots

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "state_slots_total": self.num_state_slots,
                "state_slots_used": len(self.slot_of), "prefix_caching_refused": 1,
                # 1: the delta rule runs in flash-linear-attention's kernels, 0: plain torch
                "linear_attention_fla": int(linear_attention_backend() == "fla")}
