"""What bounds a request's next round: its k, the drafts the window and token budget leave
room for, the tokens it may not emit yet, and appending emitted tokens up to a stop condition.

Shared by the engine (scheduling a round), the MTP proposer (masking drafts) and the round
outcomes (verifying one), so all three read the same limits."""

from __future__ import annotations

from mtpserve.workers.adaptive_k import AdaptiveK
from mtpserve.workers.outputs import append_tokens
from mtpserve.workers.request import Request
from mtpserve.workers.scheduler import Scheduler


class RoundLimits:
    def __init__(self, adaptive: AdaptiveK, scheduler: Scheduler, eos_ids: set[int],
                 max_model_len: int) -> None:
        self.adaptive = adaptive
        self.scheduler = scheduler
        self.eos_ids = eos_ids  # config.json + generation_config.json
        self.max_model_len = max_model_len

    def k(self, req: Request) -> int:
        """The request's k this round (adaptive speculation may lower it under load)."""
        k = req.num_speculative_tokens
        return self.adaptive.k_for(req, len(self.scheduler.running)) if k else k

    def room(self, req: Request) -> int:
        """Drafts the next round may verify: the round writes main KV up to position n + k
        and emits up to k + 1 tokens, within the window and the token budget. Drafting
        writes MTP entries up to n + k - 2, so the same cap keeps it inside the window."""
        return min(self.max_model_len - 2 - req.num_computed_tokens,
                   req.params.max_tokens - req.num_output_tokens - 1)

    def num_drafts(self, req: Request) -> int:
        return max(0, min(self.k(req), self.room(req)))

    def banned(self, req: Request, position: int) -> list[int]:
        """Token ids the token at `position` may not be: EOS / stop ids before min_tokens."""
        p = req.params
        if position - len(req.prompt_token_ids) >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids))

    def append(self, req: Request, tokens: list[int]) -> list[int]:
        """Append emitted tokens up to a stop condition; returns those kept."""
        return append_tokens(req, tokens, self.eos_ids, self.max_model_len)
