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
preempted request drafts the same. Those chain entries go to the request's own slots: its block
table from the block holding position n = num_computed_tokens on (`block_size` given), never
written by anyone else, where positions 0.. of the full table may sit in a prefix-cached block
that requests sharing it would write at the same slots in the same forward (drafts then
depended on the batch). The chain needs max(1, k - N + 1) slots; the request holds n + k - 1
(`scheduler.draft_slots`), so the tail from block n // B has them.

Sampled drafts use the uniform keyed (seed, position of the drafted token, SLOT_DRAFT + depth).
With a draft vocabulary (workers.spec_decode.draft_vocab) the MTP head scores only the most frequent
tokens; q is then that subset's softmax, which is the distribution the rejection sampler uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from mtpserve.workers.host_sync import to_host
from mtpserve.workers.model.attention_metadata import stage_lists
from mtpserve.workers.model_runner import ForwardBatch
from mtpserve.workers.request import Request
from mtpserve.workers.spec_decode import device_drafts
from mtpserve.workers.spec_decode.keyed_random import SLOT_DRAFT, uniforms_for
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
                 banned: BannedFn | None = None, device_feed: bool | None = None,
                 block_size: int | None = None):
        self.execute = execute
        # Depth modules' chain entries start at the block holding position
        # num_computed_tokens (module docstring); None: at block 0 (no prefix caching).
        self.block_size = block_size
        # Draft tokens feed the next draft step on the device when the runner takes
        # `ForwardBatch.device_ids` (one process); a TP group gets each batch as data, so
        # there every step's tokens come to the host (None: ask the runner).
        if device_feed is None:
            device_feed = bool(getattr(getattr(execute, "__self__", None),
                                       "accepts_device_ids", False))
        self.device_feed = device_feed
        self.num_modules = num_modules
        self.banned = banned
        # Structured outputs (workers.structured.guide.StructuredGuide, set by the engine):
        # drafts are masked by each request's matcher, advanced along the chain and rolled
        # back after it. Constrained rows cost one host copy per draft step.
        self.guide = None

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
        """Drafts 1..counts[i] of each request. Each step's tokens stay on the device and
        feed the next step (`ForwardBatch.device_ids`), and the chain's drafts stay there
        after it (workers/spec_decode/device_drafts.py): the next round verifies them from
        the device and its one host copy brings their values along with its accepted ids.
        Nothing on the host depends on their values in between (positions, keys and banned
        ids depend on the depth only). A runner without device feed (a TP group, whose
        ranks take host batches) copies each step's tokens to the host."""
        if not reqs:
            return
        active = list(range(len(reqs)))
        # q rows ([V] each) per request, stacked once at the end: growing draft_probs with a
        # cat per step would copy O(k^2 V) floats per request per round.
        qs: list[list[torch.Tensor]] = [[] for _ in reqs]
        steps: list[tuple[list[int], torch.Tensor]] = []  # (requests, their tokens [n])
        step = 1
        while True:
            tokens, q_rows = self._take_drafts([reqs[i] for i in active], logits, step)
            steps.append((active, tokens))
            for i, qi in zip(active, q_rows, strict=True):
                if qi is not None:
                    qs[i].append(qi)
            step += 1
            nxt = [j for j, i in enumerate(active) if counts[i] >= step]
            if not nxt:
                break
            rows = [[prev_rows[j]] for j in nxt]
            if len(nxt) < len(active):
                (keep,) = stage_lists([nxt], tokens.device)
                tokens = tokens[keep]
            host_ids = (None if self.device_feed
                        else [[t] for t in to_host([tokens], "draft step (host feed)")[0]])
            active = [active[j] for j in nxt]
            batch_reqs = [reqs[i] for i in active]
            module = min(step - 1, self.num_modules - 1)
            # A reused module 0 appends entries after its exact ones (n, n+1, ...); depth
            # module m takes the DeepSeek-V3 entry n-1 (previous depth's output there, token
            # n+m) at chain-relative position 0 (then 1, ... when it is reused past depth N).
            offset = step - 1 - module
            logits = self.execute(ForwardBatch(
                kind="mtp", module=module,
                # With device_feed only the row lengths count; the ids are `device_ids`.
                input_ids=host_ids or [[0]] * len(batch_reqs),
                start_positions=[(r.num_computed_tokens - 1 if module == 0 else 0) + offset
                                 for r in batch_reqs],
                block_tables=[self._chain_blocks(r, module) for r in batch_reqs],
                logit_rows=list(range(len(batch_reqs))),
                hidden_from="mtp", hidden_rows=rows,
                device_ids=tokens.view(-1, 1) if self.device_feed else None,
            ))
            prev_rows = list(range(len(batch_reqs)))
        device_drafts.attach(reqs, self._chain_matrix(steps, len(reqs)), counts)
        if not self.device_feed:  # host batches: the drafts are needed there next round
            reqs[0].device_drafts.resolve()
        for r, q in zip(reqs, qs, strict=True):
            if q:
                r.draft_probs = torch.stack(q)  # [k, V]
        if self.guide is not None:
            self.guide.end_drafts(reqs)

    def _chain_blocks(self, r: Request, module: int) -> list[int]:
        """The block table a draft step of `module` writes through: the request's for module
        0 (its entries sit at their real positions); for a depth module the request's own
        tail, from the block holding position num_computed_tokens (module docstring)."""
        if module == 0 or self.block_size is None:
            return r.block_ids
        return r.block_ids[r.num_computed_tokens // self.block_size:]

    @staticmethod
    def _chain_matrix(steps: list[tuple[list[int], torch.Tensor]], n: int) -> torch.Tensor:
        """[n, steps] long on the device: column s holds step s's tokens at the rows of the
        requests that drafted at that step (0 elsewhere), without leaving the device."""
        if all(len(active) == n for active, _ in steps):
            return torch.stack([t for _, t in steps], dim=1)
        dev = steps[0][1].device
        out = torch.zeros(n, len(steps), dtype=torch.long, device=dev)
        idx = stage_lists([active for active, _ in steps], dev)
        for s, ((_, t), rows) in enumerate(zip(steps, idx, strict=True)):
            out[rows, s] = t
        return out

    def _take_drafts(self, reqs: list[Request], logits: torch.Tensor, depth: int
                     ) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """Draft number `depth` of each request: argmax (greedy) or a sample from q. Returns
        the tokens ([len(reqs)], on the logits' device) and each request's q row ([V], the
        distribution its draft was drawn from) or None (greedy).

        logits [len(reqs), V]: the MTP head's rows. The draft decides the token at position
        num_computed_tokens + depth."""
        pos = [r.num_computed_tokens + depth for r in reqs]
        if self.banned is not None:  # min_tokens: the same mask as on the target side
            logits = suppress_tokens(logits, [self.banned(r, p) for r, p in zip(reqs, pos,
                                                                               strict=True)])
        if self.guide is not None:  # structured outputs: q masked like the target's p
            logits = self.guide.mask_drafts(reqs, logits, depth)
        greedy = [r.params.greedy for r in reqs]
        tokens = logits.argmax(dim=-1) if any(greedy) else None
        q_rows: list[torch.Tensor | None] = [None] * len(reqs)
        if not all(greedy):
            rows = [i for i, g in enumerate(greedy) if not g]
            u = uniforms_for([reqs[i].seed for i in rows], [pos[i] for i in rows],
                             SLOT_DRAFT + depth, logits.device)
            if len(rows) == len(reqs):
                q = processed_probs(logits, [r.params for r in reqs])  # [n, V]
                tokens = sample_with_uniforms(q, u)
            else:
                # Rows picked by a staged index: a Python list index is a synchronous copy.
                (idx,) = stage_lists([rows], logits.device)
                q = processed_probs(logits[idx], [reqs[i].params for i in rows])
                tokens[idx] = sample_with_uniforms(q, u)
            for j, i in enumerate(rows):
                q_rows[i] = q[j]
        if self.guide is not None:
            self.guide.advance_drafts(reqs, tokens, logits, depth)
        return tokens, q_rows
