"""Hybrid models' recurrent state on the KV wire: the prefill rank's state slot travels as
extras with the request's KV; the decode rank writes it into the slot its engine gave the
request.

A hybrid model (Qwen3-Next, Qwen3.5) keeps, per request and per Gated DeltaNet layer, a conv
window and a recurrent state in a state slot (`workers/state_pool.py`), not in KV blocks. The
state is fixed-size per request, so it rides in the pull payload's extras blob
(`packing.pack_payload`) beside the full-attention layers' KV, over the same pair channel:
`state.conv.<layer>` [conv_dim_local, K - 1] (the model dtype) and `state.rec.<layer>`
[Hv_local, Dk, Dv] (fp32), as the prefill rank holds them.

Under TP the states are sharded like the DeltaNet's heads (`workers/model/gated_deltanet.py`):
rank r of `tp` holds key heads [r Hk/tp, (r+1) Hk/tp) and the value heads they serve, its
conv channels laid out [q_r | k_r | v_r]. Each prefill rank ships its whole shard with every
pull step; a decode rank rebuilds the span of the prefill ranks it pulled from (in rank order,
as `resharding.pull_plan` lists them) and keeps its own share (`install_states`), so prefill
and decode TP sizes may differ (1 -> 2, 2 -> 1). The decode rank installs the state on its
transfer thread, before it reports the pull done: like the request's blocks, the slot is the
request's alone until the engine activates it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mtpserve.workers.state_pool import StateCache

CONV, REC = "state.conv.", "state.rec."


def is_state_key(name: str) -> bool:
    return name.startswith((CONV, REC))


def state_extras(cache: StateCache, slot: int) -> dict[str, torch.Tensor]:
    """Copies of `slot`'s conv and recurrent state of every linear layer (the prefill rank's
    shard), keyed for the extras blob; copies, so the hold never aliases a live slot."""
    out: dict[str, torch.Tensor] = {}
    for i in cache.layers:
        out[f"{CONV}{i}"] = cache.conv[i][slot].clone()
        out[f"{REC}{i}"] = cache.recurrent[i][slot].clone()
    return out


def split_states(extras: dict[str, torch.Tensor]
                 ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(state entries, the rest) of one pull step's extras."""
    states = {k: v for k, v in extras.items() if is_state_key(k)}
    return states, {k: v for k, v in extras.items() if not is_state_key(k)}


def install_states(
    cache: StateCache,
    slot: int,
    parts: Sequence[tuple[int, dict[str, torch.Tensor]]],  # (prefill rank, its state entries)
    src_tp: int,
    dst_tp: int,
    dst_rank: int,
) -> None:
    """Write this decode rank's share of the pulled states into `slot`.

    `parts` are the shards of consecutive prefill ranks, in rank order (the ranks
    `resharding.pull_plan` pulls from). Together they cover the fraction
    [first / src_tp, (last + 1) / src_tp) of every linear layer's heads; this rank keeps
    [dst_rank / dst_tp, (dst_rank + 1) / dst_tp) of them, per component (the q, k and v
    channels of the conv window; the value heads of the recurrent state)."""
    ranks = [r for r, _ in parts]
    first = ranks[0] if ranks else 0
    if ranks != list(range(first, first + len(ranks))) or not (
            first * dst_tp <= dst_rank * src_tp
            and (dst_rank + 1) * src_tp <= (first + len(ranks)) * dst_tp):
        raise ValueError(f"state shards of prefill ranks {ranks} (of {src_tp}) do not cover "
                         f"decode rank {dst_rank} of {dst_tp}")
    for i in cache.layers:
        conv_dst, rec_dst = cache.conv[i][slot], cache.recurrent[i][slot]
        recs = [p[f"{REC}{i}"] for _, p in parts]
        rec = _share(torch.cat(recs, dim=0), len(parts), src_tp, dst_tp, dst_rank, first)
        comps = zip(*(_conv_components(p[f"{CONV}{i}"], cache) for _, p in parts), strict=True)
        conv = torch.cat([_share(torch.cat(c, dim=0), len(parts), src_tp, dst_tp, dst_rank,
                                 first) for c in comps], dim=0)
        if conv.shape != conv_dst.shape or rec.shape != rec_dst.shape:
            raise ValueError(f"layer {i}: pulled state conv {tuple(conv.shape)}, rec "
                             f"{tuple(rec.shape)} does not fit the slot's "
                             f"{tuple(conv_dst.shape)}, {tuple(rec_dst.shape)}")
        conv_dst.copy_(conv)
        rec_dst.copy_(rec)


def _conv_components(conv: torch.Tensor, cache: StateCache) -> list[torch.Tensor]:
    """A prefill rank's conv window [q | k | v channels, K - 1] split into its components;
    its shard's sizes follow from its channel count (q, k and v shrink alike under TP)."""
    lin = cache.linear
    key = conv.shape[0] * lin.num_key_heads * lin.key_head_dim // lin.conv_dim
    return list(torch.split(conv, [key, key, conv.shape[0] - 2 * key], dim=0))


def _share(whole: torch.Tensor, span: int, src_tp: int, dst_tp: int, dst_rank: int,
           first: int) -> torch.Tensor:
    """Rows of `whole` (prefill ranks first .. first + span - 1, concatenated) that decode
    rank `dst_rank` holds."""
    per_src = whole.shape[0] // span
    total = per_src * src_tp  # rows of the whole model
    lo, hi = dst_rank * total // dst_tp, (dst_rank + 1) * total // dst_tp
    base = first * per_src
    return whole[lo - base:hi - base]
