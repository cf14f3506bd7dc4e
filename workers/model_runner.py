"""Runs forwards of the main model and the MTP modules over the paged KV cache.

The engine (TP rank 0) describes each forward as a `ForwardBatch` of plain lists; every TP
rank executes the same batch, so in a TP group rank 0 only broadcasts the batch. Hidden states
that the next forward consumes (main hidden -> MTP, MTP hidden -> next draft step) stay on each
rank and are selected by row indices, never shipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from workers.kv_cache import KVCache
from workers.model.attention_metadata import AttentionMetadata
from workers.model.loader import load_model


@dataclass
class ForwardBatch:
    """One padded forward. Row b holds `input_ids[b]` at positions start_positions[b]...

    `hidden_rows[b][s]` (MTP only) indexes the flattened [B_prev * S_prev] hidden states of
    the previous forward of kind `hidden_from`. `logit_rows` lists the flat (b * S + s) rows
    whose logits are returned.
    """

    kind: str  # "main" | "mtp"
    input_ids: list[list[int]]
    start_positions: list[int]
    block_tables: list[list[int]]
    logit_rows: list[int]
    module: int = 0
    hidden_from: str | None = None  # "main" | "mtp"
    hidden_rows: list[list[int]] = field(default_factory=list)


def pad_rows(rows: list[list[int]], width: int, value: int = 0) -> list[list[int]]:
    """Right-pad ragged rows so the batch becomes one tensor in one allocation."""
    return [r + [value] * (width - len(r)) for r in rows]


def column_major_linears(model: torch.nn.Module) -> None:
    """Store every linear weight [out, in] column-major (same values and shape).

    `F.linear` computes x @ W.T; with W.T contiguous, the CPU GEMV streams the weight in
    order, which is ~20% faster for the memory-bound single-token decode. Embeddings keep
    row-major storage (their lookups read rows)."""
    from workers.model.parallel import (
        ColumnParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )

    for mod in model.modules():
        if isinstance(mod, ColumnParallelLinear | RowParallelLinear | ReplicatedLinear):
            mod.weight.data = mod.weight.data.t().contiguous().t()


class ModelRunner:
    def __init__(
        self,
        model_path: str | Path,
        num_blocks: int,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.model = load_model(model_path, dtype=dtype, device=self.device)
        if self.device.type == "cpu":
            column_major_linears(self.model)
        self.config = self.model.config
        self.block_size = block_size
        self.kv_cache = KVCache(self.config, num_blocks, block_size, dtype, self.device)
        self._hidden: dict[str, torch.Tensor] = {}

    @torch.inference_mode()
    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        """Run one forward; returns float32 logits [len(logit_rows), V]."""
        lens = [len(x) for x in batch.input_ids]
        B, S = len(lens), max(lens)
        ids = torch.tensor(pad_rows(batch.input_ids, S), dtype=torch.long)  # [B, S]
        starts = torch.tensor(batch.start_positions, dtype=torch.long).unsqueeze(1)
        positions = starts + torch.arange(S).unsqueeze(0)  # padding runs past; masked out
        positions = torch.minimum(positions, starts + torch.tensor(lens).unsqueeze(1) - 1)
        attn = AttentionMetadata.build(positions, lens, batch.block_tables, self.block_size,
                                       self.device)
        ids, positions = ids.to(self.device), positions.to(self.device)
        caches = self.kv_cache.layers
        if batch.kind == "main":
            hidden = self.model(ids, positions, attn, caches)
        else:
            src = self._hidden[batch.hidden_from or "main"]
            rows = torch.tensor(pad_rows(batch.hidden_rows, S), dtype=torch.long)
            prev = src[rows.to(self.device)]  # [B, S, hidden]
            hidden = self.model.forward_mtp(batch.module, ids, prev, positions, attn, caches)
        flat = hidden.reshape(B * S, -1)
        self._hidden[batch.kind] = flat
        sel = flat[torch.tensor(batch.logit_rows, dtype=torch.long, device=self.device)]
        if batch.kind == "main":
            logits = self.model.compute_logits(sel)
        else:
            logits = self.model.compute_mtp_logits(batch.module, sel)
        # Sampling and verification run on the host (rank 0); only the few selected rows move.
        return logits if logits.device.type == "cpu" else logits.cpu()
