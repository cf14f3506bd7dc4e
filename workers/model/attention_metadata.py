"""Per-forward attention inputs for a padded batch over the paged KV cache, and the host
staging every forward's small int inputs go through (`stage`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mtpserve.workers.model.flex_paged_attention import FlexPagedMask

_ALIGN = 64  # bytes: each staged tensor starts aligned (compiled kernels may assume it)


def _to_device(buf: torch.Tensor, device: torch.device, pinned: bool = False) -> torch.Tensor:
    """A packed host buffer -> the device without blocking the host: pinned then copied with
    `non_blocking=True` on CUDA (a pageable copy is synchronous, which keeps the host from
    running ahead of the GPU); off CUDA the buffer itself (the copy would be a no-op)."""
    if device.type == "cpu":
        return buf
    if device.type == "cuda" and not pinned:
        buf = torch.empty(buf.shape, dtype=buf.dtype, pin_memory=True).copy_(buf)
    return buf.to(device, non_blocking=True)


def stage(host: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host tensors of one dtype -> the device in one copy that never blocks the host.

    They are packed into one buffer (pinned on CUDA) and copied with `non_blocking=True`.
    The buffer is fresh per call; torch's caching host allocator does not hand a pinned block
    out again before the copies recorded on it have run, so the host may build the next
    step's inputs at once. Off CUDA the same packing runs and the views share the packed
    buffer, so CPU runs exercise this path with the same values."""
    device = torch.device(device)
    if not host:
        return []
    dtype = host[0].dtype
    assert all(t.dtype == dtype for t in host), "stage: one dtype per call"
    align = max(1, _ALIGN // host[0].element_size())
    sizes = [t.numel() for t in host]
    offsets, n = [], 0
    for size in sizes:
        offsets.append(n)
        n += -(-size // align) * align
    buf = torch.empty(n, dtype=dtype, pin_memory=device.type == "cuda")
    for off, t in zip(offsets, host, strict=True):
        buf[off: off + t.numel()].copy_(t.reshape(-1))
    dev = _to_device(buf, device, pinned=True)
    return [dev[off: off + t.numel()].view(t.shape)
            for off, t in zip(offsets, host, strict=True)]


def stage_lists(rows: Sequence[Sequence[int]], device: torch.device | str
                ) -> list[torch.Tensor]:
    """Python int lists -> 1-D long tensors on the device: one padded Python list, one host
    tensor, one non-blocking copy (as `stage`). Every forward stages its inputs this way,
    so it is built for few torch calls (~16 us for 5 short lists against ~80 us through
    `stage`, measured here)."""
    align = _ALIGN // 8
    flat: list[int] = []
    offsets = []
    for r in rows:
        offsets.append(len(flat))
        flat.extend(r)
        flat.extend((0,) * (-len(flat) % align))
    dev = _to_device(torch.tensor(flat, dtype=torch.long), torch.device(device))
    return [dev[off: off + len(r)] for off, r in zip(offsets, rows, strict=True)]


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
    # The caller's other long host tensors of this forward (ids, positions, logit rows),
    # moved in the same staged copy as the tables (`build(ride_along=...)`), on the device.
    staged: list[torch.Tensor] = field(default_factory=list)
    # Compiled CPU graphs: [B, L] cache slot of each context position; set, attention reads
    # the cache in place (`layers.inline_paged_attention`) instead of gathering block_index.
    token_index: torch.Tensor | None = None
    # [B, S] each query's position (padding: one its row may attend from); sliding-window
    # layers build their masks from it (`window_mask`).
    positions: torch.Tensor | None = None
    # The smallest real query position (host int; None in compiled graphs): a windowed layer
    # needs no context before min_position - window + 1.
    min_position: int | None = None
    _windows: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _context_slots: torch.Tensor | None = field(default=None, repr=False)

    def context_slots(self, batch: int, block_size: int) -> torch.Tensor:
        """[B, L] cache slot of each context position, from the block tables; built once per
        forward (every DSA layer reads its indexer keys and selected latents through it)."""
        if self._context_slots is None:
            t = torch.arange(self.max_context_len, device=self.block_index.device)
            tables = self.block_index.view(batch, -1)
            self._context_slots = tables[:, t // block_size] * block_size + t % block_size
        return self._context_slots

    def window_mask(self, size: int) -> torch.Tensor:
        """[B, 1, S, L] bool of a sliding-window layer: causal, and a query at p sees only
        (p - size, p]. Built once per forward and window size, shared by its layers."""
        mask = self._windows.get(size)
        if mask is None:
            assert self.positions is not None, "sliding-window attention needs positions"
            ctx = torch.arange(self.max_context_len, device=self.positions.device)
            near = (ctx.view(1, 1, -1) > self.positions.unsqueeze(-1) - size).unsqueeze(1)
            mask = near if self.mask is None else self.mask & near
            self._windows[size] = mask
        return mask

    @classmethod
    def build(
        cls,
        positions: torch.Tensor,  # [B, S] (padding: any valid position)
        query_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
        backend: str = "gather",
        ride_along: Sequence[torch.Tensor] = (),
    ) -> AttentionMetadata:
        """Everything is computed on the host from host tensors (no device round trip) and
        moved in one staged copy with `ride_along` (long host tensors, returned on the device
        in `staged`)."""
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
        write_slots = slots[rows] if padded else slots
        qpos = pos.masked_fill(~write.view(B, S), 0)
        host = [write_slots, tables, pos] + list(ride_along) + [qpos]
        if padded:
            host.append(rows)
        dev = stage(host, device)
        d_slots, d_tables, d_pos = dev[:3]
        staged = dev[3: 3 + len(ride_along)]
        d_qpos = dev[3 + len(ride_along)]
        d_rows = dev[-1] if padded else None
        if backend == "flex":
            return cls(d_slots, d_rows, d_tables.view(-1), None, ctx_len,
                       FlexPagedMask(d_pos, d_tables, block_size), staged)
        mask = (ctx.view(1, 1, -1) <= qpos.unsqueeze(-1)).unsqueeze(1)
        return cls(
            write_slots=d_slots,
            write_rows=d_rows,
            block_index=d_tables.view(-1),
            # A single decode token sees its whole context: no mask, SDPA's fastest path.
            mask=None if bool(mask.all()) else stage([mask], device)[0],
            max_context_len=ctx_len,
            staged=staged,
            positions=d_qpos,
            min_position=int(pos.masked_fill(~write.view(B, S), ctx_len).min()),
        )


def graph_metadata(positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                   block_size: int, backend: str = "gather",
                   inline: bool = True) -> AttentionMetadata:
    """The metadata of a bucket-padded compiled forward (workers/model/decode_graph.py):
    positions [B, S] and tables [B, NB] are graph inputs, slots [B * S] the KV written (padding
    into the scratch block). Nothing depends on the data: the gather backend's causal mask is
    built from the positions, the flex backend's block mask too. `inline` (CPU only): the
    gather backend reads the cache in place (`layers.inline_paged_attention`); off for an
    eager run of the graph's function, where that would materialise its products."""
    L = tables.shape[1] * block_size
    if backend == "flex":
        return AttentionMetadata(slots, None, tables.reshape(-1), None, L,
                                 FlexPagedMask(positions, tables, block_size))
    token_index = None
    if inline and tables.device.type == "cpu":  # inductor's C++ kernels fuse these lookups
        B, NB = tables.shape
        offsets = torch.arange(block_size, device=tables.device)
        token_index = (tables.unsqueeze(-1) * block_size + offsets).view(B, NB * block_size)
    return AttentionMetadata(slots, None, tables.reshape(-1), causal_mask(positions, L), L,
                             token_index=token_index, positions=positions)


def causal_mask(positions: torch.Tensor, context_len: int) -> torch.Tensor:
    """[B, 1, S, L] bool: a query at position p sees context positions <= p (the compiled
    decode graphs build it in-graph from the positions, so it never depends on the data)."""
    ctx = torch.arange(context_len, device=positions.device)
    return (ctx.view(1, 1, -1) <= positions.unsqueeze(-1)).unsqueeze(1)
