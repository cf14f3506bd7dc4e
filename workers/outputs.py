"""What a step emits per request: stop conditions, logprobs and the RequestOutput."""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import torch

from mtpserve.workers.messages import TokenLogprobs
from mtpserve.workers.request import Request, RequestStatus


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_drafted: int
    num_accepted: int
    num_rounds: int = 0
    num_cached_tokens: int = 0  # prompt tokens a prefix-cache hit spared
    arrival: float | None = None  # time.monotonic() the engine took the request
    # One entry per new token when the request asked for logprobs (SamplingParams.logprobs).
    logprobs: list[TokenLogprobs] | None = None
    # With finish_reason "error": the request failed on its own inputs (it alone).
    error: str | None = None


def append_tokens(req: Request, tokens: list[int], eos_ids: set[int], max_model_len: int
                  ) -> list[int]:
    """Append emitted tokens up to a stop condition (EOS, a stop id, max_tokens, the
    context window); returns those kept and marks the request finished if one hit."""
    p = req.params
    kept = []
    if not req.output_token_ids:
        req.first_token_time = time.monotonic()
    for t in tokens:
        req.output_token_ids.append(t)
        kept.append(t)
        if t in p.stop_token_ids or (not p.ignore_eos and t in eos_ids):
            req.status = RequestStatus.FINISHED_STOPPED
            break
        if req.num_output_tokens >= p.max_tokens or req.num_tokens >= max_model_len:
            req.status = RequestStatus.FINISHED_LENGTH
            break
    return kept


def logprob_rows(raw: torch.Tensor, tokens: torch.Tensor, num_top: int) -> torch.Tensor:
    """On the logits' device: log_softmax of the raw target logits (raw [N, V]; row i decided
    tokens[i], a device tensor [N]) -> [N, 1 + 2 * num_top] int64 holding the float64 bits of
    each row's chosen log probability, its `num_top` best values and their ids. Integer bits,
    so the rows ride the step's one counted host copy (`host_sync.to_host`) with its ids:
    a GPU step that returns logprobs adds no sync. Under speculation the rows come from the
    verify forward, i.e. they are the plain forward's."""
    lp = torch.log_softmax(raw.float(), dim=-1)  # [N, V]
    chosen = lp.gather(1, tokens.reshape(-1, 1))  # [N, 1]
    top_v, top_i = lp.topk(num_top, dim=-1)  # [N, num_top]; num_top may be 0
    # float64 holds the float32 values and the ids exactly.
    return torch.cat([chosen.double(), top_v.double(), top_i.double()], dim=1).view(torch.long)


def logprobs_from_rows(rows: list[list[int]], token_ids: list[int], num_top: int
                       ) -> list[TokenLogprobs]:
    """`logprob_rows`' host values (one row per emitted token, in order) -> TokenLogprobs
    with the request's own `num_top` (<= the rows' width: top-k rows are sorted)."""
    out = []
    for t, row in zip(token_ids, rows, strict=False):
        v = struct.unpack(f"<{len(row)}d", struct.pack(f"<{len(row)}q", *row))
        n = (len(row) - 1) // 2
        out.append(TokenLogprobs(t, v[0], [(int(i), x) for i, x in zip(
            v[1 + n: 1 + n + num_top], v[1: 1 + num_top], strict=True)]))
    return out


def request_output(req: Request, emitted: list[int],
                   logprobs: list[TokenLogprobs] | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=req.request_id, new_token_ids=emitted, finished=req.finished,
        finish_reason=req.status.value if req.finished else None,
        num_prompt_tokens=len(req.prompt_token_ids),
        num_output_tokens=req.num_output_tokens,
        num_drafted=req.num_drafted, num_accepted=req.num_accepted,
        num_rounds=req.num_rounds, num_cached_tokens=req.num_cached_tokens,
        arrival=req.arrival, logprobs=logprobs,
    )


def failed_output(req: Request, error: str) -> RequestOutput:
    """The last output of a request that failed on its own inputs (finish_reason "error")."""
    out = request_output(req, [])
    out.finished, out.finish_reason, out.error = True, "error", error
    return out
