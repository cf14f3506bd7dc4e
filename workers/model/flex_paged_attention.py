"""Paged attention with FlexAttention: the block table is the block mask.

The gather backend (`layers.Attention`) copies each row's context out of the paged cache into
a dense [B, L] buffer in every layer, then runs SDPA with a dense mask. Here K and V stay where
they are: the whole cache is one long KV sequence ([1, Hk, num_blocks * block_size, D],
broadcast over the batch), and each query row's `BlockMask` lists only the physical blocks of
its block table, so the kernel reads exactly those blocks once (vLLM's FLEX_ATTENTION backend
works the same way). KV block size = the cache's block size; queries in tiles of `Q_BLOCK`.

Two masks, one meaning (a query at position p sees its own row's logical positions <= p):

- **eager** (built outside any compiled region): an inverse block table `p2l` [B, num_blocks]
  (physical block -> logical index in that row, -1 if absent) makes the mask_mod exact on its
  own, so it is right under every kernel, including flex's unfused eager reference (which
  ignores block sparsity and applies the mask_mod everywhere). Costs B * num_blocks int32s.
- **in a compiled graph** (the decode buckets): blocks wholly before the q-tile's first
  position are *full* blocks (no mask_mod); the rest are a window of at most W partial blocks
  after them, which the mask_mod identifies by comparing with W table entries. This form
  captures only the graph's inputs (positions, tables): inductor's CPU flex template misreads
  a mask buffer computed inside the graph (an in-graph `p2l` gave wrong outputs, measured on
  torch 2.13), and it needs no [B, num_blocks] tensor per forward.

Rows must hold consecutive positions, padding slots repeating the last one (what
`ModelRunner` and `DecodeGraphs.prepare` build). `auto` picks this backend on CUDA, so CUDA
never runs the padded gather (`engine_config.resolve_attention_backend`); written by
construction and exact against gather on CPU, measured by `benchmarks/gpu_check.py`
(hot-path and fast-path parts) on the first GPU run.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

Q_BLOCK = 16  # query tile of the block mask (flex's triton kernel needs BLOCK_M | Q_BLOCK)

# Outside a compiled region, CUDA calls a compiled flex_attention (recompiled per shape, then
# dynamic, as vLLM calls it). CPU calls flex's eager reference, which materialises
# [B, H, S, num_blocks * block_size] scores: correct with the exact eager mask, and only used
# by tests and an explicit `flex` on CPU (auto is gather there). A compiled CPU flex recompiles
# for every new table width (a decode step at 0.9 tok/s measured) and its C++ failed to build
# once dynamo made a shape dynamic (torch 2.13).
_compiled_flex = torch.compile(flex_attention, fullgraph=True)


def _kernel_options(device: torch.device, block_size: int) -> dict | None:
    """Triton tiles that divide the mask's blocks (BLOCK_M | Q_BLOCK, BLOCK_N | block_size);
    the main kernel rather than flex-decoding, whose tiling assumes larger KV blocks (the
    choice vLLM's FLEX_ATTENTION backend makes). None on CPU (its own template)."""
    if device.type != "cuda":
        return None
    return {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": Q_BLOCK,
            "BLOCK_N": min(block_size, 64)}


def _tile_positions(positions: torch.Tensor) -> torch.Tensor:
    """[B, nq, Q_BLOCK]: positions padded to whole q-tiles (repeating the last)."""
    B, S = positions.shape
    nq = -(-S // Q_BLOCK)
    pad = nq * Q_BLOCK - S
    if pad:
        positions = torch.cat([positions, positions[:, -1:].expand(B, pad)], dim=1)
    return positions.view(B, nq, Q_BLOCK)


def _columns(idx: torch.Tensor, num_cache_blocks: int) -> torch.Tensor:
    """kv-index rows [..., n] as int32, padded with block 0 past what any count reaches. The
    CPU template wants the mask to span the whole KV length (it asserts so), CUDA does not."""
    if idx.device.type == "cpu" and idx.shape[-1] < num_cache_blocks:
        idx = F.pad(idx, (0, num_cache_blocks - idx.shape[-1]))
    return idx.to(torch.int32).contiguous()


def eager_block_mask(positions: torch.Tensor, tables: torch.Tensor, block_size: int,
                     num_cache_blocks: int) -> BlockMask:
    """positions [B, S], tables [B, NB] (entries past a row's own blocks: any valid block, they
    are never listed): the exact mask, built by eager ops (see the module docstring)."""
    B, S = positions.shape
    NB = tables.shape[1]
    dev = positions.device
    tiles = _tile_positions(positions)  # [B, nq, Q]
    nq = tiles.shape[1]
    needed = tiles.amax(-1) // block_size + 1  # [B, nq] blocks up to the tile's last position
    # Inverse block table; entries past a row's last needed block (the eager path pads tables
    # with block 0, another request's) land in an extra column that nothing reads.
    logical = torch.arange(NB, device=dev).expand(B, NB)
    live = logical < needed.amax(1, keepdim=True)
    p2l = torch.full((B, num_cache_blocks + 1), -1, dtype=torch.int32, device=dev)
    p2l.scatter_(1, torch.where(live, tables, num_cache_blocks),
                 logical.to(torch.int32).contiguous())
    kv_indices = _columns(tables.view(B, 1, 1, NB).expand(B, 1, nq, NB), num_cache_blocks)

    def mask_mod(b, h, q, kv):
        lb = p2l[b, kv // block_size]
        return (lb >= 0) & (lb * block_size + kv % block_size <= positions[b, q])

    # No full blocks (the mask_mod is exact everywhere), but passed as an empty list: the CPU
    # template's split-KV decode path (one short query row) does not compile without them.
    no_full = torch.zeros_like(needed, dtype=torch.int32).unsqueeze(1)
    return BlockMask.from_kv_blocks(
        needed.to(torch.int32).unsqueeze(1), kv_indices, no_full, torch.zeros_like(kv_indices),
        BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(S, num_cache_blocks * block_size), compute_q_blocks=False)


def graph_block_mask(positions: torch.Tensor, tables: torch.Tensor, block_size: int,
                     num_cache_blocks: int) -> BlockMask:
    """The same mask for a compiled graph: full blocks + a window of partial blocks whose
    mask_mod reads only `positions` and `tables` (which must be the graph's inputs)."""
    B, S = positions.shape
    NB = tables.shape[1]
    dev = positions.device
    tiles = _tile_positions(positions)  # [B, nq, Q]
    nq = tiles.shape[1]
    n_full = ((tiles[..., 0] + 1) // block_size).clamp(max=NB)  # [B, nq] wholly visible
    n_part = (tiles.amax(-1) // block_size + 1 - n_full).clamp(min=0)
    W = (min(S, Q_BLOCK) - 1) // block_size + 2  # partial blocks a tile can touch
    j = (n_full.unsqueeze(-1) + torch.arange(W, device=dev)).clamp(max=NB - 1)  # [B, nq, W]
    partial = tables.gather(1, j.view(B, -1)).view(B, 1, nq, W)
    full = tables.view(B, 1, 1, NB).expand(B, 1, nq, NB)

    def mask_mod(b, h, q, kv):
        q = q.clamp(max=S - 1)  # the kernel may evaluate padding rows of the last tile
        j0 = (positions[b, (q // Q_BLOCK) * Q_BLOCK] + 1) // block_size
        blk = kv // block_size
        lb = torch.full_like(blk, -1)
        for t in range(W):  # which of the window's table entries holds this block
            jt = j0 + t
            hit = (tables[b, jt.clamp(max=NB - 1)] == blk) & (jt < NB)
            lb = torch.where(hit, jt, lb)
        return (lb >= 0) & (lb * block_size + kv % block_size <= positions[b, q])

    return BlockMask.from_kv_blocks(
        n_part.to(torch.int32).unsqueeze(1), _columns(partial, num_cache_blocks),
        n_full.to(torch.int32).unsqueeze(1), _columns(full, num_cache_blocks),
        BLOCK_SIZE=(Q_BLOCK, block_size), mask_mod=mask_mod,
        seq_lengths=(S, num_cache_blocks * block_size), compute_q_blocks=False)


@dataclass
class FlexPagedMask:
    """What a forward's flex attention needs; shared by every layer (one mask per forward).

    `positions` [B, S] and `tables` [B, NB] (long) on the model's device."""

    positions: torch.Tensor
    tables: torch.Tensor
    block_size: int
    _mask: BlockMask | None = None

    def block_mask(self, num_cache_blocks: int) -> BlockMask:
        if self._mask is None:
            build = (graph_block_mask if torch.compiler.is_compiling() else eager_block_mask)
            self._mask = build(self.positions, self.tables, self.block_size, num_cache_blocks)
        return self._mask

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, scale: float) -> torch.Tensor:
        """q [B, Hq, S, D]; kv_cache [2, num_blocks, block_size, Hk, D] (read in place)
        -> [B, Hq, S, D]."""
        _, nb, bs, hk, d = kv_cache.shape
        k = kv_cache[0].view(1, nb * bs, hk, d).transpose(1, 2)  # [1, Hk, nb * bs, D]
        v = kv_cache[1].view(1, nb * bs, hk, d).transpose(1, 2)
        mask = self.block_mask(nb)
        opts = _kernel_options(q.device, bs)
        if torch.compiler.is_compiling():
            return flex_attention(q, k.to(q.dtype), v.to(q.dtype), block_mask=mask,
                                  scale=scale, enable_gqa=True, kernel_options=opts)
        fn = _compiled_flex if q.device.type == "cuda" else flex_attention
        with warnings.catch_warnings():  # recompile notes; "called without torch.compile"
            warnings.simplefilter("ignore")
            return fn(q, k.to(q.dtype), v.to(q.dtype), block_mask=mask, scale=scale,
                      enable_gqa=True, kernel_options=opts)
