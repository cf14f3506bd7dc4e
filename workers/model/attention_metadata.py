"""Per-forward attention inputs for a padded batch over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mtpserve.workers.model.flex_paged_attention import FlexPagedMask

# Attention backends over the paged cache: "gather" copies each row's context into a dense
# buffer per layer and runs SDPA; "flex" reads the cache in place (flex_paged_attention.py).
ATTENTION_BACKENDS = ("gather", "flex")


@dataclass
class AttentionMetadata:
    """Built once per forward and shared by every layer (main and MTP use the same tables).

    Row b of the batch holds `query_lens[b]` new tokens at consecutive positions; padded query
    slots neither write KV nor matter (their outputs are ignored).
    """

    write_slots: torch.Tensor  # [N] flat KV slot of each real (non-padding) query token
    write_rows: torch.Tensor | None  # [N] their rows in the flattened [B*S] batch; None: all
    block_index: torch.Tensor  # [B * max_blocks] block tables, flattened (0-padded)
    mask: torch.Tensor | None  # [B, 1, S, L] bool, True = may attend; None: attend to all
    max_context_len: int  # L
    flex: FlexPagedMask | None = None  # set: the flex backend (block_index / mask unused)

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,  # [B, S] (padding: any valid position)
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        backend: str = "gather",
    ) -> AttentionMetadata:
        B, S = positions.shape
        lens = torch.tensor(query_lens, dtype=torch.long)
        write = (torch.arange(S).unsqueeze(0) < lens.unsqueeze(1)).reshape(-1)
        max_blocks = max(len(t) for t in block_tables)
        tables = torch.zeros(B, max_blocks, dtype=torch.long)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        pos = positions.cpu()
        flat_pos = pos.reshape(-1)
        rows = torch.arange(B).repeat_interleave(S)
        block_idx = flat_pos // block_size
        # A position past its row's block table is a scheduling bug: fail loudly instead of
        # writing into (and attending to) another request's block.
        table_lens = torch.tensor([len(t) for t in block_tables], dtype=torch.long)
        outside = block_idx >= table_lens[rows]
        if bool(outside.any()):
            b = int(rows[outside][0])
            raise IndexError(
                f"row {b}: position {int(flat_pos[outside][0])} needs block "
                f"{int(block_idx[outside][0])} but its table has {len(block_tables[b])} blocks"
            )
        slots = tables[rows, block_idx] * block_size + flat_pos % block_size
        padded = not bool(write.all())
        rows = write.nonzero().squeeze(1) if padded else None
        ctx_len = int((pos.masked_fill(~write.view(B, S), -1).max(dim=1).values + 1).max())
        ctx = torch.arange(ctx_len)
        # Query at position p attends context positions <= p; padded queries attend position 0
        # so no row is fully masked (that would make NaNs).
        if backend == "flex":
            flex = FlexPagedMask(pos.to(device), tables.to(device), block_size)
            return cls((slots[rows] if padded else slots).to(device),
                       rows.to(device) if padded else None, tables.view(-1).to(device), None,
                       ctx_len, flex)
        qpos = pos.masked_fill(~write.view(B, S), 0)
        mask = (ctx.view(1, 1, -1) <= qpos.unsqueeze(-1)).unsqueeze(1)
        return cls(
            write_slots=(slots[rows] if padded else slots).to(device),
            write_rows=rows.to(device) if padded else None,
            block_index=tables.view(-1).to(device),
            # A single decode token sees its whole context: no mask, SDPA's fastest path.
            mask=None if bool(mask.all()) else mask.to(device),
            max_context_len=ctx_len,
        )


def graph_metadata(positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                   block_size: int, backend: str = "gather") -> AttentionMetadata:
    """The metadata of a bucket-padded compiled forward (workers/model/decode_graph.py):
    positions [B, S] and tables [B, NB] are graph inputs, slots [B * S] the KV written (padding
    into the scratch block). Nothing depends on the data: the gather backend's causal mask is
    built from the positions, the flex backend's block mask too."""
    L = tables.shape[1] * block_size
    if backend == "flex":
        return AttentionMetadata(slots, None, tables.reshape(-1), None, L,
                                 FlexPagedMask(positions, tables, block_size))
    return AttentionMetadata(slots, None, tables.reshape(-1), causal_mask(positions, L), L)


def causal_mask(positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """[B, 1, S, L] bool: a query at position p sees context positions <= p (the compiled
    decode graphs build it in-graph from the positions, so it never depends on the data)."""
    ctx = torch.arange(context_len, device=positions.device)
    return (ctx.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)
