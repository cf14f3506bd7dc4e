"""KV-head re-sharding between prefill and decode tensor-parallel groups.

With TP size `tp` over a cache of H heads, rank r holds the global KV heads
[r*H/tp, (r+1)*H/tp). A cache with fewer heads than ranks is replicated: rank r holds head
r*H//tp, the same head as the tp/H - 1 ranks next to it. MLA's latent is such a cache (one
"head", `ModelConfig.num_cache_heads` == 1): every rank holds the whole latent, as vLLM and
SGLang shard MLA (heads split in the projections, the compressed cache replicated). So is GQA
under a TP size above its KV heads (`workers/model/config.py` `kv_head_split`, as vLLM
replicates them): Qwen3-Next's 2 KV heads at TP 8 are each held by 4 ranks.

A decode rank pulls exactly its own heads. Each head range comes from one of the prefill ranks
holding it: the j-th decode replica of a head pulls from the (j mod n)-th of the n prefill
replicas, so the prefill side's load is spread and every byte travels once per decode rank
that needs it. A pull tells its sender how many decode ranks pull those heads from it
(`HeadPull.copies`): the sender keeps the hold until that many acks came. Prefill replicas
that no decode rank pulls from (prefill TP > decode TP over a replicated cache) are told to
drop their holds once the pull succeeded (`unpulled_sources`).

A hybrid model's recurrent state (`kv_transfer/states.py`) is sharded by rank, not by KV head:
prefill replicas of one KV head hold different state shards. With `states`, a decode rank
pulls its replicated head from every prefill replica whose rank share overlaps its own (the
state shards it needs; the KV bytes of such a head then travel once per replica: identical,
scattered over each other), not round-robin.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mtpserve.workers.kv_transfer.receiver import KVReceiver

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeadPull:
    """Pull global KV heads [head_start, head_end) from prefill rank `src_rank`; `copies`
    decode ranks pull the same heads from it (1 unless the cache is replicated)."""

    src_rank: int
    head_start: int
    head_end: int
    copies: int = 1


def head_range(num_kv_heads: int, tp_size: int, rank: int) -> tuple[int, int]:
    """Global KV heads [start, end) held by `rank` of a TP group of `tp_size` (one head,
    replicated, when the group has more ranks than the cache has heads)."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in a TP group of size {tp_size}")
    if tp_size > num_kv_heads:
        if tp_size % num_kv_heads:
            raise ValueError(f"TP size {tp_size} must be a multiple of the {num_kv_heads} "
                             "KV heads it replicates")
        head = rank * num_kv_heads // tp_size
        return head, head + 1
    if num_kv_heads % tp_size:
        raise ValueError(f"TP size {tp_size} must divide the {num_kv_heads} KV heads")
    per_rank = num_kv_heads // tp_size
    return rank * per_rank, (rank + 1) * per_rank


def holders(num_kv_heads: int, tp_size: int, head: int) -> list[int]:
    """Ranks of a TP group of `tp_size` that hold global KV head `head`, in rank order."""
    return [r for r in range(tp_size)
            if head_range(num_kv_heads, tp_size, r)[0] <= head < head_range(
                num_kv_heads, tp_size, r)[1]]


def _sources(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int, head: int,
             states: bool) -> list[int]:
    """Prefill ranks that decode rank `dst_rank` pulls `head` from: one of its holders,
    round-robin; with `states` and a head replicated on the prefill side, every holder whose
    rank share [s/src_tp, (s+1)/src_tp) overlaps the decode rank's [r/dst_tp, (r+1)/dst_tp)."""
    src = holders(num_kv_heads, src_tp, head)
    if states and len(src) > 1:
        return [s for s in src
                if s * dst_tp < (dst_rank + 1) * src_tp and dst_rank * src_tp < (s + 1) * dst_tp]
    dst = holders(num_kv_heads, dst_tp, head)
    return [src[dst.index(dst_rank) % len(src)]]


def pull_plan(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int,
              states: bool = False) -> list[HeadPull]:
    """What decode rank `dst_rank` (of `dst_tp`) pulls from a prefill group of `src_tp`.

    Ordered by head (then prefill rank), so concatenating the pulled slices along the head
    axis gives the decode rank's local KV. src_tp < dst_tp: one pull of a sub-range; == : one
    full pull; > : several. A replicated cache: one pull of the rank's head from one of its
    prefill replicas; with `states` (a hybrid model), from each replica whose state shard the
    rank needs (module docstring), the same head once per such replica.
    """
    plan: list[HeadPull] = []
    for head in range(*head_range(num_kv_heads, dst_tp, dst_rank)):
        for src in _sources(num_kv_heads, src_tp, dst_tp, dst_rank, head, states):
            # Decode ranks that pull `head` from `src`: the sender keeps its hold for them.
            copies = sum(1 for d in holders(num_kv_heads, dst_tp, head)
                         if src in _sources(num_kv_heads, src_tp, dst_tp, d, head, states))
            last = plan[-1] if plan else None
            if last and last.src_rank == src and last.head_end == head and last.copies == copies:
                plan[-1] = HeadPull(src, last.head_start, head + 1, copies)
            else:
                plan.append(HeadPull(src, head, head + 1, copies))
    return plan


def unpulled_sources(num_kv_heads: int, src_tp: int, dst_tp: int, dst_rank: int,
                     states: bool = False) -> list[int]:
    """Prefill ranks that no decode rank pulls from and whose holds decode rank `dst_rank`
    drops (each such rank is assigned to one decode rank that needs its head). Empty unless
    the cache is replicated, src_tp > dst_tp and not `states` (where every prefill rank's
    state shard is pulled)."""
    pulled = {p.src_rank for r in range(dst_tp)
              for p in pull_plan(num_kv_heads, src_tp, dst_tp, r, states)}
    mine = []
    for s in range(src_tp):
        if s in pulled:
            continue
        head = head_range(num_kv_heads, src_tp, s)[0]
        src, dst = holders(num_kv_heads, src_tp, head), holders(num_kv_heads, dst_tp, head)
        if dst[src.index(s) % len(dst)] == dst_rank:
            mine.append(s)
    return mine


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
    extras_every_step: bool = False,
) -> Iterator[tuple[HeadPull, torch.Tensor, dict[str, torch.Tensor]]]:
    """Pull this decode rank's KV heads of a request, one `pull_plan` step at a time.

    Yields (step, kv [n_layers, 2, n_blocks, block_size, h, head_dim], extras) in head order.
    Extras are replicated across prefill ranks, so only the first step fetches them (later
    steps yield {}) unless `extras_every_step` (hybrid models: each prefill rank's extras
    hold its own shard of the recurrent state, kv_transfer/states.py; the plan is then
    `pull_plan`'s `states` one, where a replicated head may come in several steps). Pulls run
    one after another under one deadline; `buffer()` is read before each pull (see
    `KVReceiver.pull`), so a consumer may swap it between steps.
    """
    deadline = time.monotonic() + timeout_s
    src_tp = len(sender_addresses)
    plan = pull_plan(num_kv_heads, src_tp, dst_tp, dst_rank, states=extras_every_step)
    for i, step in enumerate(plan):
        kv, extras = receiver.pull(
            sender_addresses[step.src_rank],
            request_id,
            step.head_start,
            step.head_end,
            timeout_s=max(deadline - time.monotonic(), 1e-3),
            with_extras=i == 0 or extras_every_step,
            buffer=buffer(),
            skip_blocks=skip_blocks,
            copies=step.copies,
        )
        yield step, kv, extras
    # A replicated cache's prefill replicas that nobody pulls from (best effort: their TTL
    # frees them otherwise).
    for src in unpulled_sources(num_kv_heads, src_tp, dst_tp, dst_rank, extras_every_step):
        if not receiver.drop(sender_addresses[src], request_id,
                             max(deadline - time.monotonic(), 1.0)):
            logger.warning("could not drop the unpulled hold of %r on prefill rank %d; its "
                           "TTL frees it", request_id, src)


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
