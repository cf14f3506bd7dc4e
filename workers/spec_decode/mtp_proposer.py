"""Drafting with the MTP module(s).

`extend` runs module 0 over new entries whose main hidden states the previous main forward
produced (prefill chunks, or the accepted tokens + the recovered/bonus token of a round),
which also fills the MTP KV cache. For requests that want drafts, the output at their last
entry gives draft 1; drafts 2..k are serial one-token steps that feed back the MTP's own
output: step s uses module min(s-1, N-1), so depth-specific modules (DeepSeek-V3) or one module
reused k times (Qwen3.5 style). Depth modules m >= 1 have no exact history (their catch-up
would need every shallower module's outputs at lagging entries), so they attend only to the
entries they wrote in the current draft chain: those run at chain-relative positions 0, 1, ...
(RoPE scores depend only on relative positions), which never reads a slot left over from
another round or another request. Their drafts are approximate, which costs acceptance, never
exactness; and drafts are a function of the request's tokens alone, so a migrated or
preempted request drafts the same.

Sampled drafts use the uniform keyed (seed, position of the drafted token, SLOT_DRAFT + depth).
With a draft vocabulary (workers.spec_decode.draft_vocab) the MTP head scores only the most frequent
tokens; q is then that subset's softmax, which is the distribution the rejection sampler uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtpserve.workers.model_runner import ForwardBatch
from mtpserve.workers.request import Request
from mtpserve.workers.spec_decode.keyed_random import SLOT_DRAFT, keyed_uniforms
from mtpserve.workers.spec_decode.sampling import (
    processed_probs,
    sample_with_uniforms,
    suppress_tokens,
)

# (request, position of the token being decided) -> token ids it may not be (min_tokens)
BannedFn = Callable[[Request, int], list[int]]


@dataclass
class MTPExtend:
    """New MTP entries [start, start + len(token_ids)) of one request."""

    request: Request
    start: int
    token_ids: list[int]  # token t+1 for each entry t
    main_rows: list[int]  # flat rows of the main forward's hidden states for those entries
    num_drafts: int  # 0: only fill the cache


class MTPProposer:
    def __init__(self, execute: Callable[[ForwardBatch], torch.Tensor], num_modules: int,
                 banned: BannedFn | None = None):
        self.execute = execute
        self.num_modules = num_modules
        self.banned = banned

    def extend(self, items: list[MTPExtend]) -> None:
        if not items:
            return
        S = max(len(it.token_ids) for it in items)
        drafting = [b for b, it in enumerate(items) if it.num_drafts > 0]
        logits = self.execute(ForwardBatch(
            kind="mtp", module=0,
            input_ids=[it.token_ids for it in items],
            start_positions=[it.start for it in items],
            block_tables=[it.request.block_ids for it in items],
            logit_rows=[b * S + len(items[b].token_ids) - 1 for b in drafting],
            hidden_from="main",
            hidden_rows=[it.main_rows for it in items],
        ))
        reqs = [items[b].request for b in drafting]
        for r in reqs:
            r.draft_token_ids = []
            r.draft_probs = None
        counts = [items[b].num_drafts for b in drafting]
        prev_rows = [b * S + len(items[b].token_ids) - 1 for b in drafting]
        self._draft_loop(reqs, counts, logits, prev_rows)

    def _draft_loop(self, reqs: list[Request], counts: list[int], logits: torch.Tensor,
                    prev_rows: list[int]) -> None:
        active = list(range(len(reqs)))
        # q rows ([V] each) per request, stacked once at the end: growing draft_probs with a
        # cat per step would copy O(k^2 V) floats per request per round.
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        step = 1
        while True:
            for i, qi in zip(active, self._take_drafts([reqs[i] for i in active], logits),
                             strict=True):
                if qi is not None:
                    qs[i].append(qi)
            step += 1
            nxt = [j for j, i in enumerate(active) if counts[i] >= step]
            if not nxt:
                break
            rows = [[prev_rows[j]] for j in nxt]
            active = [active[j] for j in nxt]
            batch_reqs = [reqs[i] for i in active]
            module = min(step - 1, self.num_modules - 1)
            # A reused module 0 appends entries after its exact ones (n, n+1, ...); depth
            # module m takes the DeepSeek-V3 entry n-1 (previous depth's output there, token
            # n+m) at chain-relative position 0 (then 1, ... when it is reused past depth N).
            offset = step - 1 - module
            logits = self.execute(ForwardBatch(
                kind="mtp", module=module,
                input_ids=[[r.draft_token_ids[-1]] for r in batch_reqs],
                start_positions=[(r.num_computed_tokens - 1 if module == 0 else 0) + offset
                                 for r in batch_reqs],
                block_tables=[r.block_ids for r in batch_reqs],
                logit_rows=list(range(len(batch_reqs))),
                hidden_from="mtp", hidden_rows=rows,
            ))
            prev_rows = list(range(len(batch_reqs)))
        for r, q in zip(reqs, qs, strict=True):
            if q:
                r.draft_probs = torch.stack(q)  # [k, V]

    def _take_drafts(self, reqs: list[Request], logits: torch.Tensor
                     ) -> list[torch.Tensor | None]:
        """Append one draft per request: argmax (greedy) or a sample from q. Returns each
        request's q row ([V], the distribution its draft was drawn from) or None (greedy).

        logits [len(reqs), V]: the MTP head's rows. The draft decides the token at position
        num_computed_tokens + depth."""
        depth = [len(r.draft_token_ids) + 1 for r in reqs]
        pos = [r.num_computed_tokens + d for r, d in zip(reqs, depth, strict=True)]
        if self.banned is not None:  # min_tokens: the same mask as on the target side
            logits = suppress_tokens(logits, [self.banned(r, p) for r, p in zip(reqs, pos,
                                                                               strict=True)])
        greedy = [r.params.greedy for r in reqs]
        tokens = logits.argmax(dim=-1)
        q_rows: list[torch.Tensor | None] = [None] * len(reqs)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            q = processed_probs(logits[rows], [reqs[i].params for i in rows])  # [n, V]
            dev = logits.device
            u = keyed_uniforms(
                torch.tensor([reqs[i].seed for i in rows], device=dev),
                torch.tensor([pos[i] for i in rows], device=dev),
                torch.tensor([SLOT_DRAFT + depth[i] for i in rows], device=dev))
            sampled = sample_with_uniforms(q, u)
            tokens[torch.tensor(rows, device=tokens.device)] = sampled
            for j, i in enumerate(rows):
                q_rows[i] = q[j]
        for r, t in zip(reqs, tokens.tolist(), strict=True):
            r.draft_token_ids.append(t)
        return q_rows
