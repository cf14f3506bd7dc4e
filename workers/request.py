"""Per-request state: token ids, computed tokens, block table, drafts, counters."""

from __future__ import annotations

import enum
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch

from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.spec_decode.keyed_random import fold_seed


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and waiting to be recomputed
    PREFILLING = "prefilling"  # chunked prefill under way
    RUNNING = "running"  # decoding (speculative rounds)
    PREFILLED = "prefilled"  # prefill-only engine: done, KV held for transfer
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass
class Request:
    """Invariant while decoding: the main KV holds positions [0, num_computed_tokens) and
    `num_computed_tokens == num_tokens - 1` (the last token is verified next round together
    with `draft_token_ids`). MTP entry t (token t+1) is exact for t < num_computed_tokens."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    # Prefix caching: hashes of the full blocks known so far, how many of the table's head
    # blocks are named in the cache (shared or registered), and the prompt tokens that a
    # prefix hit spared (OpenAI's usage.prompt_tokens_details.cached_tokens).
    block_hashes: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    num_speculative_tokens: int = 0  # k for this request (engine k capped by params)
    # The drafts on the host (`draft_token_ids`), or still on the device where the draft
    # chain left them (`device_drafts`, a workers.spec_decode.device_drafts.DraftRow): the
    # next round reads them there and learns their values with its accepted ids.
    _draft_token_ids: list[int] = field(default_factory=list, repr=False)
    device_drafts: Any = field(default=None, repr=False)
    draft_probs: torch.Tensor | None = None  # [k, V] q of each draft (sampling only)
    num_rounds: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    # Keys every random number of this request (workers.spec_decode.keyed_random): the user's seed,
    # or one drawn at admission when the request has none.
    seed: int | None = None
    num_preemptions: int = 0
    # Prefill chunks run over `prefill_token_ids` (prompt, plus outputs after a preemption).
    prefill_target: int = 0
    first_token_time: float | None = None
    finish_time: float | None = None
    # Structured outputs: the matcher of `params.structured` (workers.structured.guide keeps it
    # in step with output_token_ids); None when unconstrained.
    constraint: Any = None
    grammar: Any = None  # its grammar's compile in flight (a Future), until installed

    def __post_init__(self) -> None:
        if self.seed is None:
            seed = self.params.seed
            self.seed = fold_seed(seed) if seed is not None else secrets.randbits(63)
        k = self.num_speculative_tokens
        self.drafted_per_position = self.drafted_per_position or [0] * k
        self.accepted_per_position = self.accepted_per_position or [0] * k

    @property
    def draft_token_ids(self) -> list[int]:
        """The drafts on the host. Drafts still on the device are copied first, with every
        request of the chain that drafted them (one host sync): readers off the hot path (a
        prefill replica shipping them, grammar matchers, a TP group's host batches)."""
        if self.device_drafts is not None:
            self.device_drafts.resolve()
        return self._draft_token_ids

    @draft_token_ids.setter
    def draft_token_ids(self, ids: list[int]) -> None:
        self._draft_token_ids = ids
        self.device_drafts = None

    @property
    def num_drafts(self) -> int:
        """How many drafts the next round verifies (known on the host wherever they are)."""
        d = self.device_drafts
        return d.count if d is not None else len(self._draft_token_ids)

    @property
    def reproducible(self) -> bool:
        """The user fixed the seed, so the output must depend only on (prompt, seed, k):
        adaptive speculation must leave this request's k alone."""
        return self.params.reproducible

    @property
    def k_from_user(self) -> bool:
        """The user capped k for this request (`num_speculative_tokens` / `mtp` option)."""
        return self.params.num_speculative_tokens is not None

    @property
    def recompute_target(self) -> int:
        """Tokens a (re)prefill computes: the prompt, or after a preemption / resume every
        token but the last emitted one, which the next round verifies together with fresh
        drafts. The round structure then stays what it would have been without the
        recompute, and so (keyed randomness) does a seeded request's output."""
        return self.num_tokens - 1 if self.output_token_ids else self.num_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def num_drafted(self) -> int:
        return sum(self.drafted_per_position)

    @property
    def num_accepted(self) -> int:
        return sum(self.accepted_per_position)
