"""Per-request sampling settings."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from mtpserve.workers.structured.spec import StructuredSpec

_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# top_p below this keeps only the most likely token anyway; a smaller value underflows to 0
# in float32 and would filter out every token (then the last vocabulary id is always drawn).
MIN_TOP_P = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    """OpenAI-style sampling; `temperature == 0` is greedy.

    `num_speculative_tokens` caps this request's drafts per round (0 disables speculation);
    None uses the engine's k. `seed` keys every random number the request uses (see
    `workers.spec_decode.keyed_random`); None: the engine draws one at admission. `user_seed` says
    whether the seed was the user's choice (a reproducible request, whose k adaptive
    speculation must not change) or drawn for the user upstream (the router does that so the
    seed travels with the request). `min_tokens`: EOS and stop tokens cannot be generated
    before this many output tokens. `logprobs`: None for none; N >= 0 returns the log
    probability of each emitted token plus the N most likely alternatives. `structured`: the
    output must match this grammar / schema / choice / tool-call format, or begin with a
    healed prompt tail (token healing); every token, drafts included, is masked by it (from the
    end of `structured_after` on, when given: a reasoning block stays free).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k filtering
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    num_speculative_tokens: int | None = None
    min_tokens: int = 0
    logprobs: int | None = None
    user_seed: bool = True
    structured: StructuredSpec | None = None
    # The constraint applies from the end of this marker on (a reasoning model's `</think>`):
    # what comes before it is unconstrained. None: from the first output token.
    structured_after: str | None = None
    # With `structured_after`: the output may open the block with this marker (a single token:
    # Qwen3's `<think>`); if its first token is anything else, the constraint applies from it.
    structured_opener: str | None = None

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens < 0:
            raise ValueError("num_speculative_tokens must be >= 0")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    def for_vocab(self, vocab_size: int) -> SamplingParams:
        """These settings normalised for a model, so nothing a client sends can raise (or
        silently misbehave) inside a batched sampling step: a top_k at or above the vocabulary
        is no filter (0), a vanishing top_p keeps the top token, and min_tokens / the draft
        cap are clamped to what can take effect. Same sampling distribution as before."""
        changes: dict = {}
        if self.top_k >= vocab_size or self.top_k < 0:
            changes["top_k"] = 0
        if self.top_p < MIN_TOP_P:
            changes["top_p"] = MIN_TOP_P
        if self.min_tokens > self.max_tokens:
            changes["min_tokens"] = self.max_tokens
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > 64:
            changes["num_speculative_tokens"] = 64  # engines cap k far below this
        return dataclasses.replace(self, **changes) if changes else self

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def reproducible(self) -> bool:
        """The user fixed the seed: the output must be a function of (prompt, seed, k)."""
        return self.seed is not None and self.user_seed
