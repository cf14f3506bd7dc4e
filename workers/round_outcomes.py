"""What a forward's logits decide: the verify / sampling half of `Engine.step`.

`RoundOutcomes` turns logits into tokens and request state: rejection-sampling a speculative
round (`verify`), the whole greedy round as one compiled graph when it applies
(`greedy_round`), first tokens of finished prompts and the MTP extends they need
(`prefilled_chunks`, `sample`), and the per-position acceptance counters (`totals`). Its inputs
are explicit: the runner (forwards), the block manager (rollback, prefix-cache naming), the
rejection sampler, adaptive k and the round limits. It never removes a request: each call
returns the requests that finished and the engine retires them.

Structured outputs: every row that decides a constrained request's token is masked by its
matcher (`StructuredGuide`: the first token, each of the k + 1 verify rows, advanced along the
drafts), so greedy rows take the masked argmax and sampled rows the masked p; the fused greedy
graph, which cannot mask, is skipped for rounds with a constrained request.
"""

from __future__ import annotations

from typing import Any

import torch

from mtpserve.workers.adaptive_k import AdaptiveK
from mtpserve.workers.block_manager import BlockManager
from mtpserve.workers.host_sync import to_host
from mtpserve.workers.model.attention_metadata import stage_lists
from mtpserve.workers.outputs import (
    RequestOutput,
    logprob_rows,
    logprobs_from_rows,
    request_output,
)
from mtpserve.workers.request import Request
from mtpserve.workers.round_limits import RoundLimits
from mtpserve.workers.scheduler import PrefillChunk, draft_slots
from mtpserve.workers.spec_decode.keyed_random import SLOT_FINAL, uniforms_for
from mtpserve.workers.spec_decode.mtp_proposer import MTPExtend
from mtpserve.workers.spec_decode.rejection_sampler import RejectionSampler
from mtpserve.workers.spec_decode.sampling import (
    processed_probs,
    sample_with_uniforms,
    suppress_tokens,
)
from mtpserve.workers.structured.guide import StructuredGuide


class RoundOutcomes:
    """Logits -> emitted tokens, rollback, drafts to extend (module docstring)."""

    def __init__(self, runner: Any, block_manager: BlockManager, sampler: RejectionSampler,
                 adaptive: AdaptiveK, limits: RoundLimits, num_mtp_modules: int,
                 guide: StructuredGuide | None = None) -> None:
        self.runner = runner  # a workers.model_runner.Runner
        self.block_manager = block_manager
        self.sampler = sampler
        self.adaptive = adaptive
        self.limits = limits
        self.num_mtp_modules = num_mtp_modules
        self.guide = guide
        # constrained_*: the drafts of requests under a grammar (their acceptance, apart).
        self.totals = {"rounds": 0, "drafted": 0, "accepted": 0, "emitted": 0,
                       "constrained_drafted": 0, "constrained_accepted": 0}

    def greedy_round(self, reqs: list[Request]
                     ) -> tuple[list[RequestOutput], list[Request]] | None:
        """The round as one compiled graph (ModelRunner.greedy_round) when every row is greedy
        with the same k and nothing per-token applies (logprobs, a min_tokens mask, adaptive
        k); None otherwise, or when no graph fits. Same tokens and drafts as step by step."""
        K = reqs[0].num_drafts  # not draft_token_ids: that would copy device drafts here
        if (not getattr(self.runner, "fuses_greedy_rounds", False) or K == 0
                or self.adaptive.enabled
                or self.num_mtp_modules != 1
                or any(r.num_drafts != K or self.limits.k(r) != K or not r.params.greedy
                       or r.params.logprobs is not None or r.constraint is not None
                       or r.num_output_tokens < r.params.min_tokens for r in reqs)):
            return None
        # Drafts the next round may make if this one accepts nothing (it emits one token).
        room = [self.limits.room(r) - 1 for r in reqs]
        res = self.runner.greedy_round(
            [[r.output_token_ids[-1]] + r.draft_token_ids for r in reqs],
            [r.num_computed_tokens for r in reqs], [r.block_ids for r in reqs], room)
        if res is None:
            return None
        outputs = []
        for r, acc, bonus, drafts in zip(reqs, *res, strict=True):
            n = r.num_computed_tokens
            emitted = self.limits.append(r, r.draft_token_ids[:acc] + [bonus])
            self.count_round(r, K, min(acc, len(emitted)), emitted)
            r.draft_token_ids, r.draft_probs = [], None
            if not r.finished:
                r.num_computed_tokens = n + acc + 1
                self.block_manager.truncate(r, draft_slots(r))
                r.draft_token_ids = drafts[: self.limits.num_drafts(r)]
            # The graph wrote the MTP entries of the accepted tokens only if it went on.
            self.block_manager.register(r, n if r.finished else r.num_computed_tokens)
            outputs.append(request_output(r, emitted))
        return outputs, [r for r in reqs if r.finished]

    def count_round(self, r: Request, k_used: int, a: int, emitted: list[int]) -> None:
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
        if r.params.structured is not None:
            self.totals["constrained_drafted"] += k_used
            self.totals["constrained_accepted"] += a
        self.adaptive.observe(k_used, a)

    def first_tokens(self, chunks: list[PrefillChunk], logits: torch.Tensor, last: list[int]
                     ) -> torch.Tensor | None:
        """The first tokens of the chunks that complete a fresh prompt (logits [len(last),
        V]), on the device; None when there are none. A recompute (preempted / resumed
        request) stops one token short of the end and samples nothing: its last emitted
        token is verified next round with fresh drafts."""
        fresh = [i for i, j in enumerate(last) if not chunks[j].request.output_token_ids]
        if not fresh:
            return None
        rows = logits if len(fresh) == len(last) else logits[stage_lists([fresh],
                                                                          logits.device)[0]]
        return self.sample_on_device(rows, [chunks[last[i]].request for i in fresh])

    def first_logprobs(self, chunks: list[PrefillChunk], logits: torch.Tensor, last: list[int],
                       tokens: torch.Tensor | None) -> torch.Tensor | None:
        """Logprob rows (`outputs.logprob_rows`) of the first tokens `first_tokens()` gave
        (`tokens`, on the device) for the fresh requests that asked for logprobs, in their
        order; None when none asked. They ride the same host copy as the tokens."""
        if tokens is None:
            return None
        fresh = [i for i, j in enumerate(last) if not chunks[j].request.output_token_ids]
        want = [f for f, i in enumerate(fresh)
                if chunks[last[i]].request.params.logprobs is not None]
        if not want:
            return None
        n = max(chunks[last[fresh[f]]].request.params.logprobs for f in want)
        rows, toks = logits, tokens
        if len(want) < len(last):
            rows_idx, tok_idx = stage_lists([[fresh[f] for f in want], want], logits.device)
            rows, toks = logits[rows_idx], tokens[tok_idx]
        return logprob_rows(rows, toks, n)

    def prefilled_chunks(self, chunks: list[PrefillChunk], logits: torch.Tensor,
                          last: list[int], chunk_rows: list[list[int]], W: int,
                          first_tokens: list[int] | None = None,
                          first_lp: list[list[int]] | None = None,
                          ) -> tuple[list[RequestOutput], list[MTPExtend]]:
        """Bookkeeping after the forward that computed `chunks` (logits [len(last), V]: the
        rows of the chunks that complete a prompt): first tokens and MTP extends.
        `first_tokens` / `first_lp`: `first_tokens()` / `first_logprobs()` values when they
        came to the host already (with a round's accepted ids); None: sampled and copied
        here, in one host copy."""
        fresh = [i for i, j in enumerate(last) if not chunks[j].request.output_token_ids]
        if first_tokens is None:
            dev = self.first_tokens(chunks, logits, last)
            lp_dev = self.first_logprobs(chunks, logits, last, dev)
            host = ([] if dev is None else
                    to_host([dev] + ([lp_dev] if lp_dev is not None else []), "first tokens"))
            first_tokens = host[0] if host else []
            first_lp = host[1] if lp_dev is not None else None
        first = dict(zip(fresh, first_tokens, strict=True))
        lp_rows = iter(first_lp or [])
        for c in chunks:
            c.request.num_computed_tokens = c.end
        outputs: list[RequestOutput] = []
        extends = []
        for j, c in enumerate(chunks):
            req = c.request
            if c.is_last and last.index(j) in fresh:
                i = last.index(j)
                emitted = self.limits.append(req, [first[i]])
                self.totals["emitted"] += len(emitted)
                lp = (logprobs_from_rows([next(lp_rows)], emitted, req.params.logprobs)
                      if req.params.logprobs is not None else None)
                outputs.append(request_output(req, emitted, lp))
            if req.num_speculative_tokens == 0 or req.finished:
                # No MTP extend: only the blocks before this chunk are whole.
                self.block_manager.register(req, c.start)
                continue
            self.block_manager.register(req, c.end)  # the extends below complete the chunk
            tokens = req.all_token_ids[c.start + 1 : c.end + 1]
            # One MTP entry row per main row (same split), drafts from the last one.
            for p in range(0, len(tokens), W):
                q = min(p + W, len(tokens))
                drafts = self.limits.num_drafts(req) if c.is_last and q == len(tokens) else 0
                extends.append(MTPExtend(req, c.start + p, tokens[p:q], chunk_rows[j][p:q],
                                         drafts))
        return outputs, extends

    def verify(self, reqs: list[Request], raw: torch.Tensor, S: int, W: int,
               inputs: torch.Tensor, ride_along: list[torch.Tensor] | None = None
               ) -> tuple[list[RequestOutput], list[MTPExtend], list[Request], list[list]]:
        """Rejection-sample a round (raw [R * S, V]: row b * S + s; main rows b * W + s;
        inputs [R, S] on the device: each row's last token and drafts, 0 past its count,
        from `device_drafts.verify_inputs`) and update the requests. The round's one host
        sync brings its accepted ids, its recovered / bonus tokens and, for drafts that were
        still on the device, their values, and the values of `ride_along` (1-D int tensors on
        the device: a mixed step's first tokens). Returns outputs, MTP extends, the requests
        that finished and the ride-along values."""
        # Row (b, s) decides the token at position n_b + 1 + s; min_tokens masks it like q.
        first_pos = [r.num_computed_tokens + 1 for r in reqs]
        banned = [self.limits.banned(r, first_pos[b] + s)
                  for b, r in enumerate(reqs) for s in range(S)]
        logits = (self.guide.mask_verify(raw, reqs, S, banned) if self.guide is not None
                  else suppress_tokens(raw, banned))
        counts = [r.num_drafts for r in reqs]
        acc, extra = self.sampler.on_device(
            logits.view(len(reqs), S, -1), inputs[:, 1:], counts, [r.draft_probs for r in reqs],
            [r.params for r in reqs], [r.seed for r in reqs], first_pos)
        on_device = any(r.device_drafts is not None for r in reqs)
        rides = list(ride_along or [])
        lp_reqs = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
        lp_dev = (self._verify_logprobs(reqs, raw, inputs, acc, extra, lp_reqs, S)
                  if lp_reqs else None)
        host = to_host([acc, extra, *rides] + ([inputs[:, 1:]] if on_device else [])
                       + ([lp_dev] if lp_dev is not None else []), "accepted ids")
        accepted, final = host[0], host[1]
        ride_values = host[2: 2 + len(rides)]
        drafts_host = host[2 + len(rides)] if on_device else None
        lp_host = dict(zip(lp_reqs, host[-1], strict=True)) if lp_dev is not None else {}
        outputs, extends = [], []
        emitted_rows: list[list[int]] = []
        for b, r in enumerate(reqs):
            k_used = counts[b]
            drafts = drafts_host[b][:k_used] if on_device else r.draft_token_ids
            n = r.num_computed_tokens
            emitted = self.limits.append(r, drafts[: accepted[b]] + [final[b]])
            emitted_rows.append(emitted)
            # Drafts cut off by EOS / a stop token / the length limit were never emitted.
            a = min(accepted[b], len(emitted))
            self.count_round(r, k_used, a, emitted)
            r.draft_token_ids, r.draft_probs = [], None
            if r.finished:
                self.block_manager.register(r, n)
                continue
            r.num_computed_tokens = n + a + 1  # main KV: last token + accepted drafts
            self.block_manager.truncate(r, draft_slots(r))  # roll back rejected slots
            # Named now, written by this step's MTP extend before any later step reads them.
            self.block_manager.register(r, r.num_computed_tokens)
            if r.num_speculative_tokens:
                extends.append(MTPExtend(r, n, emitted, [b * W + i for i in range(a + 1)],
                                         self.limits.num_drafts(r)))
        for b, r in enumerate(reqs):
            lp = None
            if b in lp_host:
                flat = lp_host[b]
                w = len(flat) // S
                lp = logprobs_from_rows([flat[s * w: (s + 1) * w] for s in range(S)],
                                        emitted_rows[b], r.params.logprobs)
            outputs.append(request_output(r, emitted_rows[b], lp))
        return outputs, extends, [r for r in reqs if r.finished], ride_values

    @staticmethod
    def _verify_logprobs(reqs: list[Request], raw: torch.Tensor, inputs: torch.Tensor,
                         acc: torch.Tensor, extra: torch.Tensor, rows: list[int], S: int
                         ) -> torch.Tensor:
        """[len(rows), S * (1 + 2n)] logprob rows of the round's candidate tokens, on the
        device before anyone knows what was accepted: row (b, s) of the verify forward (the
        plain forward's row for emitted token s) decided draft s + 1 below the accepted
        count and the recovered / bonus token at it; rows past it are never read."""
        R = inputs.shape[0]
        cand = torch.cat([inputs[:, 1:], extra.unsqueeze(1)], dim=1)  # [R, S]
        cand = cand.scatter(1, acc.unsqueeze(1), extra.unsqueeze(1))
        logits = raw.view(R, S, -1)
        if len(rows) < R:
            (idx,) = stage_lists([rows], raw.device)
            logits, cand = logits[idx], cand[idx]
        n = max(reqs[b].params.logprobs for b in rows)
        return logprob_rows(logits.reshape(len(rows) * S, -1), cand.reshape(-1), n).view(
            len(rows), -1)

    def sample(self, logits: torch.Tensor, reqs: list[Request]) -> list[int]:
        """The first token of each request (logits [R, V]), keyed at its position."""
        if not reqs:
            return []
        return to_host([self.sample_on_device(logits, reqs)], "first tokens")[0]

    def sample_on_device(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """`sample`'s tokens [R], left on the logits' device."""
        pos = [r.num_tokens for r in reqs]
        banned = [self.limits.banned(r, p) for r, p in zip(reqs, pos, strict=True)]
        logits = (self.guide.mask_rows(logits, reqs, banned) if self.guide is not None
                  else suppress_tokens(logits, banned))
        rows = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if not rows:
            return logits.argmax(dim=-1)
        u = uniforms_for([reqs[i].seed for i in rows], [pos[i] for i in rows], SLOT_FINAL,
                         logits.device)
        if len(rows) == len(reqs):
            return sample_with_uniforms(processed_probs(logits, [r.params for r in reqs]), u)
        tokens = logits.argmax(dim=-1)
        (idx,) = stage_lists([rows], logits.device)
        tokens[idx] = sample_with_uniforms(
            processed_probs(logits[idx], [reqs[i].params for i in rows]), u)
        return tokens
