"""The engine: scheduler + model runner + MTP proposer + rejection sampler.

`step()` runs one prefill step or one speculative decode round for all running requests (or,
with mixed batches, both in one forward) and returns what each request emitted. Roles: "both"
(offline / single process), "prefill" (stop after the first token and the first k drafts, keep
the KV for transfer) and "decode"
(requests arrive with their KV already in place).

Randomness: every draw is keyed by (request seed, position of the token it decides, slot)
(workers.spec.keyed_random), so a seeded request's output depends only on its prompt, seed and
k: not on the batch, TP, prefill->decode, preemption or resumption elsewhere. A resumed or
preempted request recomputes all tokens but the last emitted one and goes straight to a
verify round, which keeps its round structure (and so its draws) unchanged.
"""

from __future__ import annotations

import dataclasses
import time

import torch
from mtpserve.workers.adaptive_k import AdaptiveK
from mtpserve.workers.block_manager import BlockManager, blocks_for
from mtpserve.workers.engine_config import DTYPES, EngineConfig, EngineError
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
from mtpserve.workers.outputs import RequestOutput, append_tokens, request_output, token_logprobs
from mtpserve.workers.request import Request, RequestStatus
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.scheduler import PrefillChunk, Scheduler, draft_slots
from mtpserve.workers.spec.keyed_random import SLOT_FINAL, uniforms_for
from mtpserve.workers.spec.mtp_proposer import MTPExtend, MTPProposer
from mtpserve.workers.spec.rejection_sampler import RejectionSampler
from mtpserve.workers.spec.sampling import processed_probs, sample_with_uniforms, suppress_tokens

__all__ = ["DTYPES", "Engine", "EngineConfig", "EngineError", "RequestOutput"]


class Engine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.runner = runner or ModelRunner(
            config.model, config.num_kv_blocks, config.block_size,
            DTYPES[config.dtype], config.device, draft_vocab_size=config.draft_vocab_size,
        )
        mcfg = self.runner.config
        self.model_config = mcfg
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings)
        if config.num_speculative_tokens > 0 and mcfg.num_mtp_modules == 0:
            raise EngineError("num_speculative_tokens > 0 needs a model with an MTP module")
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.mixed_prefill_tokens if config.mixed_batches else 0)
        self.proposer = MTPProposer(self.runner.execute, mcfg.num_mtp_modules, self._banned)
        self.sampler = RejectionSampler()
        # Always present: it observes every round (windows, metrics hook into it); it only
        # changes k when adaptive_k is on.
        self.adaptive = AdaptiveK(config.num_speculative_tokens, enabled=config.adaptive_k)
        self.requests: dict[str, Request] = {}
        self.prefilled: dict[str, Request] = {}  # role "prefill": KV held for transfer
        self.eos_ids = set(mcfg.eos_token_ids)  # config.json + generation_config.json
        self.totals = {"rounds": 0, "drafted": 0, "accepted": 0, "emitted": 0}

    # Requests ------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, resume_token_ids: list[int] | None = None
                     ) -> Request:
        """Validate and build a request. `resume_token_ids`: tokens already emitted elsewhere
        (migration); they count towards max_tokens and the request continues after them
        exactly as it would have where it started (same seed, same k)."""
        resume = list(resume_token_ids or [])
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
        if resume and (n + len(resume) >= self.max_model_len
                       or len(resume) >= params.max_tokens):
            raise EngineError(f"nothing left to generate after {len(resume)} resumed tokens")
        vocab = self.model_config.vocab_size
        if min(prompt_token_ids + resume) < 0 or max(prompt_token_ids + resume) >= vocab:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        k = self.config.num_speculative_tokens
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        # A prefill-only engine holds the prompt (+ resumed tokens) and the drafts' MTP
        # entries, never the output: its admission ignores max_tokens.
        out_len = 0 if self.config.role == "prefill" else params.max_tokens
        worst = min(n + out_len, self.max_model_len) + 2 * k + 1
        if blocks_for(worst, self.config.block_size) > self.config.num_kv_blocks:
            raise EngineError(
                f"request needs up to {blocks_for(worst, self.config.block_size)} KV blocks; "
                f"the cache has {self.config.num_kv_blocks}"
            )
        return Request(request_id, list(prompt_token_ids), params, arrival=time.monotonic(),
                       num_speculative_tokens=k, output_token_ids=resume)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, resume_token_ids: list[int] | None = None
                    ) -> Request:
        req = self.make_request(request_id, prompt_token_ids, params, resume_token_ids)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def add_resumed(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, resume_token_ids: list[int]) -> Request:
        """A request resumed after `resume_token_ids` were already sent (migration), with
        `max_tokens` / `min_tokens` counting what is left (the orchestrator's convention).
        It continues with the same round structure, so a seeded request's tokens are those
        it would have produced where it started. A prefill-only engine must emit a first
        token, so there the resumed tokens simply extend the prompt."""
        if not resume_token_ids or self.config.role == "prefill":
            return self.add_request(request_id, prompt_token_ids + resume_token_ids, params)
        n = len(resume_token_ids)
        total = dataclasses.replace(params, max_tokens=params.max_tokens + n,
                                    min_tokens=params.min_tokens + n)
        return self.add_request(request_id, prompt_token_ids, total, resume_token_ids)

    def add_transferred(self, req: Request, num_slots: int) -> None:
        """Park a request whose KV (main + MTP), first token and drafts come from a prefill
        replica as waiting-for-KV: the scheduler gives it `num_slots` slots of blocks when a
        sequence slot and blocks are free (`admit_transferred`); transfer threads fill them;
        `activate_transferred` schedules it once every rank has its KV."""
        assert req.num_computed_tokens == req.num_tokens - 1, "decode invariant"
        self.requests[req.request_id] = req
        self.scheduler.add_transferred(req, num_slots)

    def activate_transferred(self, req: Request) -> None:
        """Every TP rank has received the request's KV: it joins the decode rounds (or, if
        it was aborted meanwhile, its blocks are freed now)."""
        if req.request_id in self.scheduler.cancelled:
            self.scheduler.drop_transfer(req)
            return
        req.first_token_time = time.monotonic()
        self.scheduler.finish_transfer(req)

    def drop_transferred(self, req: Request) -> None:
        """A waiting-for-KV request whose pull failed on some rank (every rank is done with
        its blocks): free them and forget it."""
        self.requests.pop(req.request_id, None)
        self.scheduler.drop_transfer(req)
        req.status = RequestStatus.FINISHED_ABORTED

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
        if out.prefill or out.decode:
            return self._step(out.decode, out.prefill)
        return []

    def _step(self, reqs: list[Request], chunks: list[PrefillChunk]) -> list[RequestOutput]:
        """One main forward holding a speculative verify round for `reqs` (rows [last,
        d1..dk]) and/or prefill `chunks`, then one MTP extend for both (mixed batches when
        both are given). Rows are padded to a common width W; a chunk longer than W is split
        into several rows of the same request (each row attends to the KV the rows before it
        wrote in the same forward), so a chunk riding along a decode round pads the verify
        rows only to W, not to the chunk's length."""
        for r in reqs:  # drafting is capped the same way; this only guards transferred drafts
            room = max(self._room(r), 0)
            if len(r.draft_token_ids) > room:
                r.draft_token_ids = r.draft_token_ids[:room]
                if r.draft_probs is not None:
                    r.draft_probs = r.draft_probs[:room]
        if not chunks and reqs:
            fused = self._greedy_round(reqs)
            if fused is not None:
                return fused
        S = max((len(r.draft_token_ids) for r in reqs), default=-1) + 1  # verify row length
        lens = [c.end - c.start for c in chunks]
        if not reqs:
            W = max(lens)  # pure prefill: one row per chunk, as before
        else:
            # Enough prefill rows to match the decode rows: padding stays ~ the chunk tokens.
            W = max(S, -(-sum(lens) // len(reqs))) if chunks else S
            # The runner pads to the longest row: W must be one (flat rows are b * W + s).
            W = min(W, max([S, *lens]))
        input_ids = [[r.output_token_ids[-1]] + r.draft_token_ids for r in reqs]
        starts = [r.num_computed_tokens for r in reqs]
        tables = [r.block_ids for r in reqs]
        chunk_rows: list[list[int]] = []  # flat main rows of each chunk token
        for c in chunks:
            rows = []
            for p in range(c.start, c.end, W):
                q = min(p + W, c.end)
                b = len(input_ids)
                input_ids.append(c.request.all_token_ids[p:q])
                starts.append(p)
                tables.append(c.request.block_ids)
                rows += [b * W + i for i in range(q - p)]
            chunk_rows.append(rows)
        assert max(len(x) for x in input_ids) == W, "flat rows assume the runner's width"
        last = [j for j, c in enumerate(chunks) if c.is_last]
        logit_rows = [b * W + s for b in range(len(reqs)) for s in range(S)]
        raw = self.runner.execute(ForwardBatch(
            kind="main", input_ids=input_ids, start_positions=starts, block_tables=tables,
            logit_rows=logit_rows + [chunk_rows[j][-1] for j in last],
        ))  # [R * S + len(last), V]
        n_verify = len(logit_rows)
        outputs, extends, done = [], [], []
        if reqs:
            outputs, extends, done = self._verify(reqs, raw[:n_verify], S, W)
        if chunks:
            p_out, p_ext = self._prefilled_chunks(chunks, raw[n_verify:], last, chunk_rows, W)
            outputs += p_out
            extends += p_ext
        for r in done:
            self._finish(r)
        self.proposer.extend(extends)
        for c in chunks:
            if c.is_last:
                self._after_prefill(c.request)
        return outputs

    def _greedy_round(self, reqs: list[Request]) -> list[RequestOutput] | None:
        """The round as one compiled graph (ModelRunner.greedy_round) when every row is greedy
        with the same k and nothing per-token applies (logprobs, a min_tokens mask, adaptive
        k); None otherwise, or when no graph fits. Same tokens and drafts as step by step."""
        K = len(reqs[0].draft_token_ids)
        if (not getattr(self.runner, "fuses_greedy_rounds", False) or K == 0
                or self.adaptive.enabled
                or self.model_config.num_mtp_modules != 1
                or any(len(r.draft_token_ids) != K or self._k(r) != K or not r.params.greedy
                       or r.params.logprobs is not None
                       or r.num_output_tokens < r.params.min_tokens for r in reqs)):
            return None
        # Drafts the next round may make if this one accepts nothing (it emits one token).
        room = [self._room(r) - 1 for r in reqs]
        res = self.runner.greedy_round(
            [[r.output_token_ids[-1]] + r.draft_token_ids for r in reqs],
            [r.num_computed_tokens for r in reqs], [r.block_ids for r in reqs], room)
        if res is None:
            return None
        outputs = []
        for r, acc, bonus, drafts in zip(reqs, *res, strict=True):
            n = r.num_computed_tokens
            emitted = self._append(r, r.draft_token_ids[:acc] + [bonus])
            self._count_round(r, K, min(acc, len(emitted)), emitted)
            r.draft_token_ids, r.draft_probs = [], None
            if not r.finished:
                r.num_computed_tokens = n + acc + 1
                self.block_manager.truncate(r, draft_slots(r))
                r.draft_token_ids = drafts[: self._num_drafts(r)]
            outputs.append(request_output(r, emitted))
        for r in reqs:
            if r.finished:
                self._finish(r)
        return outputs

    def _count_round(self, r: Request, k_used: int, a: int, emitted: list[int]) -> None:
        """Per-position and engine counters of one verified round (a: accepted drafts that
        were emitted; drafts cut off by a stop condition never were)."""
        for i in range(k_used):
            r.drafted_per_position[i] += 1
            r.accepted_per_position[i] += i < a
        r.num_rounds += 1
        self.totals["rounds"] += 1
        self.totals["drafted"] += k_used
        self.totals["accepted"] += a
        self.totals["emitted"] += len(emitted)
        self.adaptive.observe(k_used, a)

    def _prefilled_chunks(self, chunks: list[PrefillChunk], logits: torch.Tensor,
                          last: list[int], chunk_rows: list[list[int]], W: int
                          ) -> tuple[list[RequestOutput], list[MTPExtend]]:
        """Bookkeeping after the forward that computed `chunks` (logits [len(last), V]: the
        rows of the chunks that complete a prompt): first tokens and MTP extends."""
        # A recompute (preempted / resumed request) stops one token short of the end and
        # samples nothing: its last emitted token is verified next round with fresh drafts.
        fresh = [i for i, j in enumerate(last) if not chunks[j].request.output_token_ids]
        first = dict(zip(fresh, self._sample(logits[fresh], [chunks[last[i]].request
                                                             for i in fresh]), strict=True))
        for c in chunks:
            c.request.num_computed_tokens = c.end
        outputs: list[RequestOutput] = []
        extends = []
        for j, c in enumerate(chunks):
            req = c.request
            if c.is_last and last.index(j) in fresh:
                i = last.index(j)
                emitted = self._append(req, [first[i]])
                self.totals["emitted"] += len(emitted)
                lp = token_logprobs(logits[i : i + 1], emitted, req.params.logprobs)
                outputs.append(request_output(req, emitted, lp))
            if req.num_speculative_tokens == 0 or req.finished:
                continue
            tokens = req.all_token_ids[c.start + 1 : c.end + 1]
            # One MTP entry row per main row (same split), drafts from the last one.
            for p in range(0, len(tokens), W):
                q = min(p + W, len(tokens))
                drafts = self._num_drafts(req) if c.is_last and q == len(tokens) else 0
                extends.append(MTPExtend(req, c.start + p, tokens[p:q], chunk_rows[j][p:q],
                                         drafts))
        return outputs, extends

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

    def _verify(self, reqs: list[Request], raw: torch.Tensor, S: int, W: int
                ) -> tuple[list[RequestOutput], list[MTPExtend], list[Request]]:
        """Rejection-sample a round (raw [R * S, V]: row b * S + s; main rows b * W + s) and
        update the requests. Returns outputs, MTP extends and the requests that finished."""
        # Row (b, s) decides the token at position n_b + 1 + s; min_tokens masks it like q.
        first_pos = [r.num_computed_tokens + 1 for r in reqs]
        logits = suppress_tokens(raw, [self._banned(r, first_pos[b] + s)
                                       for b, r in enumerate(reqs) for s in range(S)])
        result = self.sampler(logits.view(len(reqs), S, -1), [r.draft_token_ids for r in reqs],
                              [r.draft_probs for r in reqs], [r.params for r in reqs],
                              [r.seed for r in reqs], first_pos)
        outputs, extends = [], []
        emitted_rows: list[list[int]] = []
        for b, r in enumerate(reqs):
            k_used = len(r.draft_token_ids)
            n = r.num_computed_tokens
            emitted = self._append(r, result.output_token_ids[b])
            emitted_rows.append(emitted)
            # Drafts cut off by EOS / a stop token / the length limit were never emitted.
            a = min(result.num_accepted[b], len(emitted))
            self._count_round(r, k_used, a, emitted)
            r.draft_token_ids, r.draft_probs = [], None
            if r.finished:
                continue
            r.num_computed_tokens = n + a + 1  # main KV: last token + accepted drafts
            self.block_manager.truncate(r, draft_slots(r))  # roll back rejected slots
            if r.num_speculative_tokens:
                extends.append(MTPExtend(r, n, emitted, [b * W + i for i in range(a + 1)],
                                         self._num_drafts(r)))
        for b, r in enumerate(reqs):
            # Row (b, s) of the verify forward is the plain forward's row for emitted token s.
            lp = token_logprobs(raw[b * S : b * S + len(emitted_rows[b])], emitted_rows[b],
                                r.params.logprobs)
            outputs.append(request_output(r, emitted_rows[b], lp))
        return outputs, extends, [r for r in reqs if r.finished]

    # Helpers -----------------------------------------------------------------------------
    def _k(self, req: Request) -> int:
        k = req.num_speculative_tokens
        return self.adaptive.k_for(req, len(self.scheduler.running)) if k else k

    def _room(self, req: Request) -> int:
        """Drafts the next round may verify: the round writes main KV up to position n + k
        and emits up to k + 1 tokens, within the window and the token budget. Drafting
        writes MTP entries up to n + k - 2, so the same cap keeps it inside the window."""
        return min(self.max_model_len - 2 - req.num_computed_tokens,
                   req.params.max_tokens - req.num_output_tokens - 1)

    def _num_drafts(self, req: Request) -> int:
        return max(0, min(self._k(req), self._room(req)))

    def _banned(self, req: Request, position: int) -> list[int]:
        """Token ids the token at `position` may not be: EOS / stop ids before min_tokens."""
        p = req.params
        if position - len(req.prompt_token_ids) >= p.min_tokens:
            return []
        return list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(self.eos_ids))

    def _sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """The first token of each request (logits [R, V]), keyed at its position."""
        if not reqs:
            return []
        pos = [r.num_tokens for r in reqs]
        logits = suppress_tokens(logits, [self._banned(r, p) for r, p in zip(reqs, pos,
                                                                             strict=True)])
        tokens = logits.argmax(dim=-1)
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if rows:
            p = processed_probs(logits[rows], [reqs[i].params for i in rows])
            u = uniforms_for([reqs[i].seed for i in rows], [pos[i] for i in rows], SLOT_FINAL,
                             logits.device)
            tokens[torch.tensor(rows, device=tokens.device)] = sample_with_uniforms(p, u)
        return tokens.tolist()

    def _append(self, req: Request, tokens: list[int]) -> list[int]:
        return append_tokens(req, tokens, self.eos_ids, self.max_model_len)

    def _finish(self, req: Request) -> None:
        req.finish_time = time.monotonic()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)

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
