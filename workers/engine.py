"""The engine: scheduler + model runner + MTP proposer + rejection sampler.

`step()` runs one prefill step or one speculative decode round for all running requests and
returns what each request emitted. Roles: "both" (offline / single process), "prefill"
(stop after the first token and the first k drafts, keep the KV for transfer) and "decode"
(requests arrive with their KV already in place).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Literal

import torch

from workers.adaptive_k import AdaptiveK
from workers.block_manager import BlockManager, blocks_for
from workers.model_runner import ForwardBatch, ModelRunner, pad_rows
from workers.request import Request, RequestStatus
from workers.sampling_params import SamplingParams
from workers.scheduler import PrefillChunk, Scheduler, draft_slots
from workers.spec.mtp_proposer import MTPExtend, MTPProposer
from workers.spec.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler
from workers.spec.sampling import draw_uniforms, processed_probs, sample_with_uniforms

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    num_speculative_tokens: int = 2
    adaptive_k: bool = False
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    role: Literal["both", "prefill", "decode"] = "both"


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


class EngineError(ValueError):
    """A request the engine cannot take (too long, bad parameters)."""


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.runner = runner or ModelRunner(
            config.model, config.num_kv_blocks, config.block_size,
            DTYPES[config.dtype], config.device,
        )
        mcfg = self.runner.config
        self.model_config = mcfg
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings)
        if config.num_speculative_tokens > 0 and mcfg.num_mtp_modules == 0:
            raise EngineError("num_speculative_tokens > 0 needs a model with an MTP module")
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.proposer = MTPProposer(self.runner.execute, mcfg.num_mtp_modules)
        self.sampler = RejectionSampler()
        self.adaptive = AdaptiveK(config.num_speculative_tokens) if config.adaptive_k else None
        self.requests: dict[str, Request] = {}
        self.prefilled: dict[str, Request] = {}  # role "prefill": KV held for transfer
        self.eos_ids = set(mcfg.eos_token_ids)
        self.totals = {"rounds": 0, "drafted": 0, "accepted": 0, "emitted": 0}

    # Requests ------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams) -> Request:
        if request_id in self.requests:
            raise EngineError(f"duplicate request id {request_id!r}")
        n = len(prompt_token_ids)
        if n == 0:
            raise EngineError("prompt is empty")
        if n >= self.max_model_len:
            raise EngineError(
                f"prompt has {n} tokens; the context window is {self.max_model_len} tokens "
                "(prompt + at least one generated token must fit)"
            )
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        k = self.config.num_speculative_tokens
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        worst = min(n + params.max_tokens, self.max_model_len) + 2 * k + 1
        if blocks_for(worst, self.config.block_size) > self.config.num_kv_blocks:
            raise EngineError(
                f"request needs up to {blocks_for(worst, self.config.block_size)} KV blocks; "
                f"the cache has {self.config.num_kv_blocks}"
            )
        return Request(request_id, list(prompt_token_ids), params, arrival=time.monotonic(),
                       num_speculative_tokens=k)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams) -> Request:
        req = self.make_request(request_id, prompt_token_ids, params)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def add_transferred(self, req: Request) -> None:
        """A request whose KV (main + MTP), first token and drafts arrived from a prefill
        replica; its blocks are already allocated and filled."""
        assert req.num_computed_tokens == req.num_tokens - 1, "decode invariant"
        self.requests[req.request_id] = req
        req.first_token_time = time.monotonic()
        self.scheduler.add_running(req)

    def release_prefilled(self, request_id: str) -> bool:
        """Free a prefill-only request's KV once the decode side has it (or gave up)."""
        req = self.prefilled.pop(request_id, None)
        if req is None:
            return False
        self.block_manager.free(req)
        req.status = RequestStatus.FINISHED_STOPPED
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if unknown or already finished."""
        req = self.requests.pop(request_id, None) or self.prefilled.pop(request_id, None)
        if req is None:
            return False
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # Steps -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.prefill:
            return self._prefill_step(out.prefill)
        if out.decode:
            return self._decode_step(out.decode)
        return []

    def _prefill_step(self, chunks: list[PrefillChunk]) -> list[RequestOutput]:
        S = max(c.end - c.start for c in chunks)
        last = [b for b, c in enumerate(chunks) if c.is_last]
        logits = self.runner.execute(ForwardBatch(
            kind="main",
            input_ids=[c.request.all_token_ids[c.start : c.end] for c in chunks],
            start_positions=[c.start for c in chunks],
            block_tables=[c.request.block_ids for c in chunks],
            logit_rows=[b * S + chunks[b].end - chunks[b].start - 1 for b in last],
        ))
        outputs: list[RequestOutput] = []
        done = [chunks[b].request for b in last]
        first = self._sample(logits, done) if done else []
        for c in chunks:
            c.request.num_computed_tokens = c.end
        extends = []
        for b, c in enumerate(chunks):
            req = c.request
            if c.is_last:
                emitted = self._append(req, [first[last.index(b)]])
                self.totals["emitted"] += len(emitted)
                outputs.append(self._output(req, emitted))
            if req.num_speculative_tokens == 0 or req.finished:
                continue
            tokens = req.all_token_ids[c.start + 1 : c.end + 1]
            extends.append(MTPExtend(req, c.start, tokens,
                                     [b * S + i for i in range(len(tokens))],
                                     self._k(req) if c.is_last else 0))
        self.proposer.extend(extends)
        for c in chunks:
            if c.is_last:
                self._after_prefill(c.request)
        return outputs

    def _after_prefill(self, req: Request) -> None:
        if req.finished:
            self._finish(req)
            return
        if self.config.role == "prefill":
            self.scheduler.prefilling.remove(req)
            req.status = RequestStatus.PREFILLED
            self.prefilled[req.request_id] = self.requests.pop(req.request_id)
        else:
            self.scheduler.finish_prefill(req)

    def _decode_step(self, reqs: list[Request]) -> list[RequestOutput]:
        for r in reqs:  # never verify past the context window or the token budget
            room = min(self.max_model_len - 1 - r.num_computed_tokens - 1,
                       r.params.max_tokens - r.num_output_tokens - 1)
            if len(r.draft_token_ids) > max(room, 0):
                r.draft_token_ids = r.draft_token_ids[: max(room, 0)]
                if r.draft_probs is not None:
                    r.draft_probs = r.draft_probs[: max(room, 0)]
        K = max(len(r.draft_token_ids) for r in reqs)
        S = K + 1
        logits = self.runner.execute(ForwardBatch(
            kind="main",
            input_ids=[[r.output_token_ids[-1]] + r.draft_token_ids for r in reqs],
            start_positions=[r.num_computed_tokens for r in reqs],
            block_tables=[r.block_ids for r in reqs],
            logit_rows=[b * S + s for b in range(len(reqs)) for s in range(S)],
        )).view(len(reqs), S, -1)
        drafts = torch.tensor(pad_rows([r.draft_token_ids for r in reqs], K, PLACEHOLDER_TOKEN_ID),
                              dtype=torch.long).view(len(reqs), K)  # [R, K]
        q = None
        if K and not all(r.params.greedy for r in reqs):
            q = torch.zeros(len(reqs), K, logits.shape[-1])
            for b, r in enumerate(reqs):
                if r.draft_probs is not None:
                    q[b, : r.draft_probs.shape[0]] = r.draft_probs
        result = self.sampler(logits, drafts, q, [len(r.draft_token_ids) for r in reqs],
                              [r.params for r in reqs], [r.generator for r in reqs])
        outputs, extends = [], []
        rows = result.output_token_ids.tolist()
        for b, r in enumerate(reqs):
            a = result.num_accepted[b]
            k_used = len(r.draft_token_ids)
            for i in range(k_used):
                r.drafted_per_position[i] += 1
                r.accepted_per_position[i] += i < a
            r.num_rounds += 1
            self.totals["rounds"] += 1
            self.totals["drafted"] += k_used
            self.totals["accepted"] += a
            if self.adaptive:
                self.adaptive.observe(k_used, a)
            n = r.num_computed_tokens
            emitted = self._append(r, rows[b][: a + 1])
            self.totals["emitted"] += len(emitted)
            outputs.append(self._output(r, emitted))
            r.draft_token_ids, r.draft_probs = [], None
            if r.finished:
                self._finish(r)
                continue
            r.num_computed_tokens = n + a + 1  # main KV: last token + accepted drafts
            self.block_manager.truncate(r, draft_slots(r))  # roll back rejected slots
            if r.num_speculative_tokens:
                extends.append(MTPExtend(r, n, emitted, [b * S + i for i in range(a + 1)],
                                         self._k(r)))
        self.proposer.extend(extends)
        return outputs

    # Helpers -----------------------------------------------------------------------------
    def _k(self, req: Request) -> int:
        k = req.num_speculative_tokens
        return min(k, self.adaptive.k) if self.adaptive and k else k

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:
            p = processed_probs(logits[rows], [reqs[i].params for i in rows])
            u = draw_uniforms([reqs[i].generator for i in rows], 1).squeeze(1)
            tokens[rows] = sample_with_uniforms(p, u)
        return tokens.tolist()

    def _append(self, req: Request, tokens: list[int]) -> list[int]:
        """Append emitted tokens up to a stop condition; returns those kept."""
        p = req.params
        kept = []
        if not req.output_token_ids:
            req.first_token_time = time.monotonic()
        for t in tokens:
            req.output_token_ids.append(t)
            kept.append(t)
            if t in p.stop_token_ids or (not p.ignore_eos and t in self.eos_ids):
                req.status = RequestStatus.FINISHED_STOPPED
                break
            if req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.max_model_len:
                req.status = RequestStatus.FINISHED_LENGTH
                break
        return kept

    def _finish(self, req: Request) -> None:
        req.finish_time = time.monotonic()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)

    @staticmethod
    def _output(req: Request, emitted: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, new_token_ids=emitted, finished=req.finished,
            finish_reason=req.status.value if req.finished else None,
            num_prompt_tokens=len(req.prompt_token_ids),
            num_output_tokens=req.num_output_tokens,
            num_drafted=req.num_drafted, num_accepted=req.num_accepted,
            num_rounds=req.num_rounds,
        )

    def stats(self) -> dict:
        t = self.totals
        return {
            **self.block_manager.stats(),
            "num_waiting": len(self.scheduler.waiting),
            "num_prefilling": len(self.scheduler.prefilling),
            "num_running": len(self.scheduler.running),
            "num_prefilled_held": len(self.prefilled),
            "num_speculative_tokens": self.adaptive.k if self.adaptive
            else self.config.num_speculative_tokens,
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
            "mean_accepted_length": (t["accepted"] + t["rounds"]) / t["rounds"]
            if t["rounds"] else None,
            **{f"total_{k}": v for k, v in t.items()},
        }
