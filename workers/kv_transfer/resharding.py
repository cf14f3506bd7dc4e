"""KV-head re-sharding between prefill and decode tensor-parallel groups.

With TP size `tp`, rank r holds the global KV heads [r*H/tp, (r+1)*H/tp). A decode rank pulls
exactly its own head range, from every prefill rank whose range overlaps it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mtpserve.workers.kv_transfer.receiver import KVReceiver


@dataclass(frozen=True)
class HeadPull:
    """Pull global KV heads [head_start, head_end) from prefill rank `src_rank`."""

    src_rank: int
    head_start: int
    head_end: int


def head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Global KV heads [start, end) held by `rank` of a TP group of `tp_size`."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in a TP group of size {tp_size}")
    if tp_size > num_kv_heads or num_kv_heads % tp_size != 0:
        raise ValueError(
            f"TP size {tp_size} must divide the {num_kv_heads} KV heads "
            "(KV-head replication for TP > num_kv_heads is not supported)"
        )
    per_rank = num_kv_heads // tp_size
    return rank * per_rank, (rank + 1) * per_rank


def pull_plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int) -> list[HeadPull]:
    """What decode rank `dst_rank` (of `dst_tp`) pulls from a prefill group of `src_tp`.

    Ordered by head, so concatenating the pulled slices along the head axis gives the decode
    rank's local KV. src_tp < dst_tp: one pull of a sub-range; == : one full pull; > : several.
    """
    dst_start, dst_end = head_range(num_kv_heads, dst_tp, dst_rank)
    plan = []
    for src_rank in range(src_tp):
        src_start, src_end = head_range(num_kv_heads, src_tp, src_rank)
        start, end = max(dst_start, src_start), min(dst_end, src_end)
        if start < end:
            plan.append(HeadPull(src_rank, start, end))
    return plan


def pull_slices(
    receiver: KVReceiver,
    sender_addresses: Sequence[str],  # by prefill rank
    request_id: str,
    num_kv_heads: int,
    dst_tp: int,
    dst_rank: int,
    timeout_s: float = 30.0,
    buffer: Callable[[], torch.Tensor | None] = lambda: None,
    skip_blocks: int = 0,
) -> Iterator[tuple[HeadPull, torch.Tensor, dict[str, torch.Tensor]]]:
    """Pull this decode rank's KV heads of a request, one `pull_plan` step at a time.

    Yields (step, kv [n_layers, 2, n_blocks, block_size, h, head_dim], extras) in head order.
    Extras are replicated across prefill ranks, so only the first step fetches them (later
    steps yield {}). Pulls run one after another under one deadline; `buffer()` is read
    before each pull (see `KVReceiver.pull`), so a consumer may swap it between steps.
    """
    deadline = time.monotonic() + timeout_s
    plan = pull_plan(num_kv_heads, len(sender_addresses), dst_tp, dst_rank)
    for i, step in enumerate(plan):
        kv, extras = receiver.pull(
            sender_addresses[step.src_rank],
            request_id,
            step.head_start,
            step.head_end,
            timeout_s=max(deadline - time.monotonic(), 1e-3),
            with_extras=i == 0,
            buffer=buffer(),
            skip_blocks=skip_blocks,
        )
        yield step, kv, extras


def pull_resharded(
    receiver: KVReceiver,
    sender_addresses: Sequence[str],  # by prefill rank
    request_id: str,
    num_kv_heads: int,
    dst_tp: int,
    dst_rank: int,
    timeout_s: float = 30.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Pull this decode rank's KV heads of a request from the prefill group.

    Returns (kv [n_layers, 2, n_blocks, block_size, H/dst_tp, head_dim], extras), the slices
    of `pull_slices` concatenated along the head axis.
    """
    parts: list[torch.Tensor] = []
    extras: dict[str, torch.Tensor] = {}
    for _, kv, got in pull_slices(
        receiver, sender_addresses, request_id, num_kv_heads, dst_tp, dst_rank, timeout_s
    ):
        parts.append(kv)  # [L, 2, n_blocks, block_size, h, D]
        extras = extras or got
    kv = parts[0] if len(parts) == 1 else torch.cat(parts, dim=4)
    return kv, extras
