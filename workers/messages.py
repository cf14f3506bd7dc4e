"""Typed messages that cross layers: ingress -> orchestrator -> prefill/decode servers -> engine.

The engine owns them (the bottom layer), so the engine, the Serve shells and the HTTP layer
share one definition without the engine importing the layers above it.

Everything here is plain data (picklable, no torch tensors) so it crosses Ray handles cheaply.
"""

from __future__ import annotations

import dataclasses
import secrets
from dataclasses import dataclass, field

from mtpserve.workers.sampling_params import SamplingParams


@dataclass
class GenerateRequest:
    """One sequence to generate (an OpenAI request with n > 1 becomes n of these): its prompt
    and the engine's own `SamplingParams`, carried as they are.

    `resume_token_ids` holds tokens already emitted to the client: a request can be resumed on
    another decode replica from `prompt_token_ids + resume_token_ids` alone (recompute), which
    is what failover needs; no KV or engine state is required.

    A request without a seed gets a random one here, at admission, so prefill, decode and any
    replica it is resumed on use the same numbers; `params.user_seed` then says the user did
    not choose it (adaptive speculation may change such a request's k).
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    resume_token_ids: list[int] = field(default_factory=list)
    # Conditional disaggregation override: None lets the orchestrator choose, True always
    # prefills on a prefill replica, False on the decode replica.
    disaggregate: bool | None = None

    def __post_init__(self) -> None:
        if self.params.seed is None:
            self.params = dataclasses.replace(self.params, seed=secrets.randbits(63),
                                              user_seed=False)


@dataclass
class TokenLogprobs:
    """Log probabilities of one emitted token under the target model (raw logits)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (id, logprob), best first


@dataclass
class KVTransferParams:
    """What a decode replica needs to pull a prefilled request's KV (main + MTP layers). The
    prefill answers `(TokenChunk, KVTransferParams | None)`: the first token travels as the
    chunk the client gets; these params only exist while the prefill holds KV for decode.

    `sender_addresses[r]` is prefill TP rank r's KV sender ("host:port"); a decode rank pulls
    its own KV-head slice from the prefill rank(s) that hold it. The MTP seed state (drafts and
    their probabilities) travels with the KV as `extras`.
    """

    request_id: str
    sender_addresses: list[str]
    prefill_tp_size: int
    num_kv_heads: int
    num_tokens: int  # KV slots to pull: prompt (computed) + k-1 speculative MTP entries
    num_computed_tokens: int  # main KV positions [0, n)
    first_token_id: int  # the decode side continues after it (the client has it as a chunk)
    num_drafts: int
    # Serve's unique id of the prefill replica holding the KV: `PrefillServer.release` is
    # routed to exactly that replica (TARGET_REPLICA). None outside Serve.
    prefill_replica: str | None = None


# A keyword argument naming the replica (Serve's unique id) a handle call must reach; the
# request router (mtpserve.router.routing) honours it. The called method accepts and ignores it.
TARGET_REPLICA = "target_replica"


# TokenChunk.error_kind: what failed. The orchestrator applies kv_transfer.failure_policy to
# "kv_transfer" (the request's KV never arrived); anything else is a decode failure (migration).
ERROR_KV_TRANSFER = "kv_transfer"
ERROR_ENGINE = "engine"
# The request failed on its own inputs (it alone): a 400 for its client, never migrated.
ERROR_REQUEST = "request"


@dataclass
class TokenChunk:
    """Tokens emitted since the last chunk of one sequence, plus running counters."""

    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_drafted: int = 0
    num_accepted: int = 0
    num_rounds: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from a prefix cache (usage)
    error: str | None = None  # set with finish_reason "error"
    error_kind: str | None = None  # with "error": ERROR_KV_TRANSFER | ERROR_ENGINE | ERROR_REQUEST
    logprobs: list[TokenLogprobs] | None = None  # one per token id, if requested
    # No tokens: the replica is alive and still working on the request (queued for KV
    # blocks, pulling, prefilling). A stream that goes silent instead is stalled.
    heartbeat: bool = False
    stamps: dict[str, float] | None = None  # hop -> wall time (workers/hop_trace.py, opt-in)
    # Prefill, the first chunk: the KV held for decode, handed to the senders on the engine
    # thread as the step emitted the token (`PrefillCore._annotate`).
    kv_transfer: KVTransferParams | None = None


def merge_chunks(chunks: list[TokenChunk]) -> TokenChunk:
    """Consecutive chunks of one sequence as one: their tokens (and logprobs) in order, the
    last one's counters and finish state (counters are running totals). What a stream sends
    when its consumer fell behind the engine: one message instead of one per round."""
    if len(chunks) == 1:
        return chunks[0]
    last = chunks[-1]
    logprobs = None
    if any(c.logprobs for c in chunks):
        logprobs = [lp for c in chunks for lp in (c.logprobs or [])]
    # Stamps (when traced) stay the first chunk's: the hops of the oldest token in the merge.
    return dataclasses.replace(
        last, token_ids=[t for c in chunks for t in c.token_ids], logprobs=logprobs,
        num_cached_tokens=max(c.num_cached_tokens for c in chunks),
        stamps=next((c.stamps for c in chunks if c.stamps), None),
        kv_transfer=next((c.kv_transfer for c in chunks if c.kv_transfer), None))
