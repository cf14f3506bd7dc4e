"""A whole greedy speculative round as one compiled graph.

For a batch whose rows are all greedy, every decision of a round is an argmax, so the round
needs no host round trip: verify [last, d1..dK] with the main model, accept the longest prefix
where the target's argmax equals the draft, take the target's argmax after it (the bonus or
recovered token), run the MTP catch-up over the accepted entries, draft 1 from its last entry,
then drafts 2..K serially, all in one call. It computes exactly what the step-by-step round
computes (`Engine._step`: verify, `RejectionSampler._greedy`, `MTPProposer.extend` and its draft
loop with one reused MTP module), so outputs and drafts are the same; only the per-forward
Python, dynamo and wrapper overhead of the k + 1 separate calls goes away.

`DecodeGraphs.round_key` fuses only k = 1 for now: the k = 2 / 3 graphs gave the same tokens
and drafts (tested while they were enabled) but ran slower than their separate forwards.

Per-row differences are masks, never branches: entries past a row's accepted prefix and draft
steps past its draft budget write their KV into the scratch slot, and every position is clamped
into the RoPE table and every block index into the table (compiled kernels do not bounds-check).
"""

from __future__ import annotations

import torch

from mtpserve.workers.model.attention_metadata import graph_metadata
from mtpserve.workers.model.transformer import CausalLM


def greedy_round_graph(model: CausalLM, block_size: int, scratch_slot: int,
                       ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                       tables: torch.Tensor, room: torch.Tensor,
                       caches: list[torch.Tensor]
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, K+1] = [last, d1..dK] at positions [B, K+1] (n, n+1, ...), writing main KV at
    `slots` [B*(K+1)]; tables [B, NB]; room [B]: drafts each row may make next round if it
    accepts nothing (its window / token budget; each accepted draft takes one). Returns
    (accepted [B], bonus [B], drafts [B, K]); a row's drafts past its room are junk."""
    B, S = ids.shape
    K = S - 1
    max_pos = model.rotary.cos.shape[0] - 1
    backend = model.attention_backend
    attn = graph_metadata(positions, slots, tables, block_size, backend)
    hidden = model(ids, positions, attn, caches)  # [B, S, h]
    target = model.compute_logits(hidden.reshape(B * S, -1)).argmax(-1).view(B, S)
    match = (target[:, :K] == ids[:, 1:]).long()
    accepted = match.cumprod(dim=1).sum(dim=1)  # [B]
    bonus = target.gather(1, accepted.unsqueeze(1)).squeeze(1)  # [B]

    # MTP catch-up: entry n+i takes token n+i+1 (d_{i+1} if accepted, else the bonus) and the
    # main hidden of n+i; only entries i <= accepted are real.
    i = torch.arange(S, device=ids.device).unsqueeze(0)  # [1, S]
    nxt = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)  # the last column is never used
    tokens = torch.where(i < accepted.unsqueeze(1), nxt, bonus.unsqueeze(1))
    real = (i <= accepted.unsqueeze(1)).reshape(-1)
    mtp_slots = torch.where(real, slots, torch.full_like(slots, scratch_slot))
    attn = graph_metadata(positions, mtp_slots, tables, block_size, backend)
    h = model.forward_mtp(0, tokens, hidden, positions, attn, caches)  # [B, S, h]
    h = h.gather(1, accepted.view(B, 1, 1).expand(B, 1, h.shape[-1]))  # entry n+a
    draft = model.compute_mtp_logits(0, h.reshape(B, -1)).argmax(-1)  # [B]
    drafts = [draft]

    # Draft step s (2..K): entry n+a+s-1, input the previous draft and the MTP's own hidden.
    base = positions[:, 0] + accepted  # n + a
    num_drafts = torch.clamp(torch.minimum(room - accepted, torch.full_like(room, K)), min=0)
    for s in range(2, K + 1):
        pos = torch.clamp(base + (s - 1), max=max_pos)  # [B]
        live = num_drafts >= s
        blk = torch.where(live, pos // block_size, torch.zeros_like(pos))
        slot = tables.gather(1, blk.unsqueeze(1)).squeeze(1) * block_size + pos % block_size
        slot = torch.where(live, slot, torch.full_like(slot, scratch_slot))
        p = pos.unsqueeze(1)  # [B, 1]
        # (flex: `p` is computed in the graph, which inductor's CPU flex template misreads
        # as a mask input; only k = 1 rounds are fused, and they never get here.)
        attn = graph_metadata(p, slot, tables, block_size, backend)
        h = model.forward_mtp(0, draft.unsqueeze(1), h, p, attn, caches)  # [B, 1, h]
        draft = model.compute_mtp_logits(0, h.reshape(B, -1)).argmax(-1)
        drafts.append(draft)
    return accepted, bonus, torch.stack(drafts, dim=1)
