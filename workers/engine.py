"""The engine: scheduler + model runner + MTP proposer + rejection sampler.

`step()` runs one prefill step or one speculative decode round for all running requests (or,
with mixed batches, both in one forward) and returns what each request emitted. Roles: "both"
(offline / single process), "prefill" (stop after the first token and the first k drafts, keep
the KV for transfer) and "decode"
(requests arrive with their KV already in place).

Randomness: every draw is keyed by (request seed, position of the token it decides, slot)
(workers.spec_decode.keyed_random), so a seeded request's output depends only on its prompt,
seed and k: not on the batch, TP, prefill->decode, preemption or resumption elsewhere. A resumed or
preempted request recomputes all tokens but the last emitted one and goes straight to a
verify round, which keeps its round structure (and so its draws) unchanged.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import torch

from mtpserve.workers.adaptive_k import AdaptiveK
from mtpserve.workers.allocator import preloaded
from mtpserve.workers.block_manager import BlockManager, blocks_for
from mtpserve.workers.engine_config import (
    DTYPES,
    EngineConfig,
    EngineError,
    compile_enabled,
    fused_greedy_rounds,
    resolve_attention_backend,
    resolve_draft_dtype,
    resolve_dtype,
)
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
from mtpserve.workers.outputs import RequestOutput, failed_output
from mtpserve.workers.prefix_cache import cache_salt
from mtpserve.workers.request import Request, RequestStatus
from mtpserve.workers.round_limits import RoundLimits
from mtpserve.workers.round_outcomes import RoundOutcomes
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.scheduler import PrefillChunk, Scheduler
from mtpserve.workers.spec_decode import device_drafts
from mtpserve.workers.spec_decode.mtp_proposer import MTPProposer
from mtpserve.workers.spec_decode.rejection_sampler import RejectionSampler
from mtpserve.workers.spec_decode.sampling import sampling_fault
from mtpserve.workers.structured.guide import StructuredGuide
from mtpserve.workers.structured.spec import GrammarError

__all__ = ["DTYPES", "Engine", "EngineConfig", "EngineError", "RequestOutput"]

logger = logging.getLogger(__name__)


class Engine:
    """Scheduler + model runner + MTP proposer + rejection sampler (module docstring)."""

    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        dtype = resolve_dtype(config.dtype, config.device)
        self.runner = runner or ModelRunner(
            config.model, config.num_kv_blocks, config.block_size,
            DTYPES[dtype], config.device, draft_vocab_size=config.draft_vocab_size,
            mtp_dtype=DTYPES[resolve_draft_dtype(config.draft_dtype, dtype, config.device,
                                                  config.model)],
            decode_graphs=compile_enabled(config.compile, config.device),
            compile_cache_dir=config.compile_cache_dir,
            attention_backend=resolve_attention_backend(config.attention_backend,
                                                        config.device),
            num_state_slots=config.max_num_seqs,
            kv_cache_memory_fraction=config.kv_cache_memory_fraction,
            profile_tokens=config.max_num_batched_tokens,
            num_speculative_tokens=config.num_speculative_tokens,
            greedy_rounds=fused_greedy_rounds(config),
        )
        if config.num_kv_blocks is None:  # CUDA: the runner sized the pool from memory
            self.config = config = dataclasses.replace(
                config, num_kv_blocks=self.runner.kv_cache.num_blocks)
        mcfg = self.runner.config
        self.model_config = mcfg
        self.max_model_len = min(config.max_model_len or mcfg.max_position_embeddings,
                                 mcfg.max_position_embeddings)
        if config.num_speculative_tokens > 0 and mcfg.num_mtp_modules == 0:
            raise EngineError("num_speculative_tokens > 0 needs a model with an MTP module")
        self.hybrid = mcfg.is_hybrid
        if self.hybrid:
            self.block_manager = self._hybrid_block_manager(config, mcfg, dtype)
            # The runner's pool (a TP driver's: its rank's) must hold every slot handed out.
            pool = getattr(getattr(self.runner, "runner", self.runner), "state_cache", None)
            if pool is not None and pool.num_slots < config.max_num_seqs:
                raise EngineError(f"the runner has {pool.num_slots} state slots, "
                                  f"max_num_seqs is {config.max_num_seqs}")
            if pool is not None and pool.num_speculative_tokens < config.num_speculative_tokens:
                raise EngineError(f"the runner keeps verify states for k = "
                                  f"{pool.num_speculative_tokens} drafts, k is "
                                  f"{config.num_speculative_tokens}")
        else:
            self.block_manager = BlockManager(
                config.num_kv_blocks, config.block_size, prefix_caching=config.prefix_caching,
                salt=cache_salt(dataclasses.asdict(mcfg), dtype, config.block_size),
                has_mtp=mcfg.num_mtp_modules > 0)
        # Hybrid: no mixed batches, so a verify forward holds only verify rows (each keeps the
        # recurrent state after every position) and a chunk is never split over rows (rows
        # of one forward run side by side, but a request's state is sequential).
        self.scheduler = Scheduler(
            self.block_manager, config.max_num_seqs, config.max_num_batched_tokens,
            config.mixed_prefill_tokens if config.mixed_batches and not self.hybrid else 0)
        self.sampler = RejectionSampler()
        # Always present: it observes every round (windows, metrics hook into it); it only
        # changes k when adaptive_k is on.
        self.adaptive = AdaptiveK(config.num_speculative_tokens, enabled=config.adaptive_k)
        # Drafts verified / accepted per draft depth since start (`stats()`); depth m drafts
        # with MTP module min(m, N - 1) (workers/spec_decode/mtp_proposer.py).
        self.drafted_per_position = [0] * config.num_speculative_tokens
        self.accepted_per_position = [0] * config.num_speculative_tokens
        self.adaptive.on_drafts.append(self._count_positions)
        self.eos_ids = set(mcfg.eos_token_ids)  # config.json + generation_config.json
        self.limits = RoundLimits(self.adaptive, self.scheduler, self.eos_ids,
                                  self.max_model_len)
        self.proposer = MTPProposer(self.runner.execute, mcfg.num_mtp_modules,
                                    self.limits.banned,
                                    block_size=self.block_manager.block_size)
        # Structured outputs: matchers built at admission from the request's tokens (so a
        # resumed request and the decode side of P/D rebuild them), dropped when it ends.
        self.guide = StructuredGuide(config.model, mcfg.vocab_size, sorted(self.eos_ids),
                                     compile_workers=config.grammar_compile_workers)
        # Requests whose grammar compiles off this thread, with their deadline; `on_wake`
        # (set by the engine loop's owner) is called from the compile thread when one is done.
        self.compiling: dict[str, tuple[Request, float]] = {}
        self.on_wake: Callable[[], None] | None = None
        self.proposer.guide = self.guide
        self.outcomes = RoundOutcomes(self.runner, self.block_manager, self.sampler,
                                      self.adaptive, self.limits, mcfg.num_mtp_modules,
                                      self.guide)
        self.requests: dict[str, Request] = {}
        # Mixed steps run as two forwards when decode rounds have compiled graphs (`_step`).
        self.split_mixed = getattr(getattr(self.runner, "runner", self.runner), "graphs",
                                   None) is not None
        self._compiling = False  # a background compiler is building buckets for us
        # A serving engine compiles before its replica reports ready; an offline one compiles
        # only what `LLM.generate` asks for. Either way a bucket never compiled runs eagerly:
        # nothing compiles inside a step.
        self.warmup(budget_s=None if config.role != "both" else 0.0)
        self.prefilled: dict[str, Request] = {}  # role "prefill": KV held for transfer
        self.num_steps = 0  # engine steps that ran a forward (pulls per step: gpu_check)

    @staticmethod
    def _hybrid_block_manager(config: EngineConfig, mcfg, dtype: str) -> BlockManager:
        """KV blocks + one recurrent-state slot per request (workers/state_pool.py)."""
        from mtpserve.workers.model.gated_deltanet import RECURRENT_MAX
        from mtpserve.workers.state_pool import HybridBlockManager

        if config.num_speculative_tokens + 1 > RECURRENT_MAX:
            raise EngineError(f"hybrid models verify at most {RECURRENT_MAX - 1} drafts")
        if config.prefix_caching:
            logger.info("prefix caching off for %s: a hybrid model's cached blocks would "
                        "restore KV but not the recurrent state", mcfg.model_type)
        return HybridBlockManager(
            config.num_kv_blocks, config.block_size, config.max_num_seqs,
            has_mtp=mcfg.num_mtp_modules > 0,
            salt=cache_salt(dataclasses.asdict(mcfg), dtype, config.block_size))

    def warmup(self, max_batch: int | None = None, max_context: int | None = None,
               budget_s: float | None = None, cached_only: bool = False) -> int:
        """Compile the decode buckets requests can hit (a no-op for an eager runner) before
        they run: batches up to `max_batch` (default max_num_seqs), verify rows of 1..k+1
        tokens, contexts up to `max_context` (default the window). Serving engines call it at
        start; `LLM.generate` before each batch of prompts. Bounded by `budget_s` (default
        `warmup_budget_s`); afterwards a bucket not compiled runs eagerly."""
        k = self.config.num_speculative_tokens
        max_batch = min(max_batch or self.config.max_num_seqs, self.config.max_num_seqs)
        t0 = time.monotonic()
        shapes = dict(batch_sizes=list(range(1, max_batch + 1)), query_lens=list(range(1, k + 2)),
                      max_context=min(max_context or self.max_model_len, self.max_model_len),
                      mtp_modules=None if k else 0)  # k = 0 never drafts
        n = self.runner.warmup_graphs(shapes["batch_sizes"], shapes["query_lens"],
                                      shapes["max_context"], mtp_modules=shapes["mtp_modules"],
                                      budget_s=self.config.warmup_budget_s if budget_s is None
                                      else budget_s, log=logger.info,
                                      cached_only=cached_only,
                                      # serving replicas only: LLM(compile="on") compiles all
                                      restart_budget_s=self.config.warmup_restart_budget_s
                                      if self.config.role != "both" else None)
        if n:
            logger.info("warm-up: %d decode graphs compiled in %.1f s", n,
                        time.monotonic() - t0)
        # A decode replica compiles what the budget left in a child process and adopts it
        # between steps (workers/model/background_compile.py), instead of running those
        # buckets eagerly for good.
        if self.config.background_compile and self.config.role == "decode" and not cached_only:
            self._compiling = self.runner.compile_in_background(**shapes) > 0
        return n

    # Requests ------------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, resume_token_ids: list[int] | None = None,
                     defer_grammar: bool = False) -> Request:
        """Validate and build a request. `resume_token_ids`: tokens already emitted elsewhere
        (migration); they count towards max_tokens and the request continues after them
        exactly as it would have where it started (same seed, same k). `defer_grammar`: a
        grammar not compiled yet compiles off the engine thread (`req.grammar` set; the
        request waits for it in `compiling`) instead of here."""
        resume = list(resume_token_ids or [])
        if request_id in self.requests or request_id in self.prefilled:
            # Held for transfer counts too: a retry under the same id must not free (or
            # leak) the first attempt's blocks.
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
        params = params.for_vocab(vocab)
        if min(prompt_token_ids + resume) < 0 or max(prompt_token_ids + resume) >= vocab:
            raise EngineError(f"prompt token ids must be in [0, {vocab})")
        if any(t < 0 or t >= vocab for t in params.stop_token_ids):
            raise EngineError(f"stop_token_ids must be in [0, {vocab})")
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
        req = Request(request_id, list(prompt_token_ids), params, arrival=time.monotonic(),
                      num_speculative_tokens=k, output_token_ids=resume)
        if params.structured is not None:
            try:
                if defer_grammar:
                    self.guide.begin(req, self._wake)
                else:
                    self.guide.admit(req)
            except GrammarError as e:
                raise EngineError(str(e)) from None
        return req

    def _wake(self) -> None:
        if self.on_wake is not None:
            self.on_wake()

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, resume_token_ids: list[int] | None = None
                    ) -> Request:
        req = self.make_request(request_id, prompt_token_ids, params, resume_token_ids,
                                defer_grammar=self.config.grammar_compile_workers > 0)
        self.requests[request_id] = req
        if req.grammar is not None:
            self.compiling[request_id] = (
                req, time.monotonic() + self.config.grammar_compile_timeout_s)
        else:
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

    def activate_transferred(self, req: Request,
                             extras: dict[str, torch.Tensor] | None = None) -> None:
        """Every TP rank has received the request's KV: it joins the decode rounds (or, if
        it was aborted meanwhile, its blocks are freed now). `extras`: what the prefill sent
        beside the KV, as the puller copied it to the host: the drafts and, for a sampled
        request, their q, which moves to this engine's device here: its first verify round
        stacks it with the other rows' q (on CUDA a host q there fails the whole batch)."""
        if extras is not None:
            drafts = extras.get("draft_token_ids")
            req.draft_token_ids = drafts.tolist() if drafts is not None else []
            q = extras.get("draft_probs")
            req.draft_probs = None if q is None else q.to(self.runner.kv_cache.buffers[0].device)
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
        self.guide.release(req)
        return True

    def abort(self, request_id: str) -> bool:
        """Stop a request and free its KV blocks; False if unknown or already finished."""
        req = self.requests.pop(request_id, None) or self.prefilled.pop(request_id, None)
        if req is None:
            return False
        self.compiling.pop(request_id, None)
        self.scheduler.remove(req)
        req.status = RequestStatus.FINISHED_ABORTED
        self.guide.release(req)
        return True

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (vLLM's reset_prefix_cache); blocks in use stay with
        their requests. Returns how many blocks were cached."""
        return self.block_manager.flush()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self.compiling)

    def grammar_wait_s(self) -> float | None:
        """Seconds until the nearest compile deadline of a waiting request (None: none
        waits): the engine loop wakes then at the latest (a finished compile wakes it
        through `on_wake`)."""
        if not self.compiling:
            return None
        return max(0.0, min(d for _, d in self.compiling.values()) - time.monotonic())

    def wait_grammars(self, timeout: float | None = None) -> None:
        """Block until a waiting request's compile finishes or `timeout` passes (offline
        loops: nothing else to step meanwhile)."""
        futures = [r.grammar for r, _ in self.compiling.values() if r.grammar is not None]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar finished compiling join the scheduler; a compile that
        failed or ran past `grammar_compile_timeout_s` fails its request alone."""
        out = []
        now = time.monotonic()
        for rid, (req, deadline) in list(self.compiling.items()):
            if req.grammar.done():
                del self.compiling[rid]
                try:
                    self.guide.finish(req)
                except GrammarError as e:
                    self.abort(rid)
                    out.append(failed_output(req, str(e)))
                    continue
                self.scheduler.add(req)
            elif now >= deadline:
                self.abort(rid)
                out.append(failed_output(req, (
                    f"the {req.params.structured.kind} constraint did not compile within "
                    f"{self.config.grammar_compile_timeout_s:g}s")))
        return out

    # Steps -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        admitted = self._admit_compiled() if self.compiling else []
        return admitted + self._step_batch() if admitted else self._step_batch()

    def _step_batch(self) -> list[RequestOutput]:
        if self._compiling:
            self._compiling = self.runner.adopt_compiled() > 0
        out = self.scheduler.schedule()
        if not (out.prefill or out.decode):
            return []
        self.num_steps += 1
        self.adaptive.round_index = self.num_steps  # the drafts made now are for the next round
        batch = [*out.decode, *(c.request for c in out.prefill)]
        marks = [_Mark.of(r) for r in batch]
        threads = self.config.prefill_threads if not out.decode else 0
        try:
            with intra_op_threads(threads):
                return self._step(out.decode, out.prefill)
        except Exception:
            vocab = self.model_config.vocab_size
            faults = {r.request_id: f for r in batch
                      if (f := sampling_fault(r.params, vocab)) is not None}
            if not faults:
                raise  # an engine fault: the caller fails the batch over (migration)
            logger.exception("engine step failed on the inputs of %s", sorted(faults))
            return self._isolate(marks, faults)

    def _isolate(self, marks: list[_Mark], faults: dict[str, str]) -> list[RequestOutput]:
        """A step raised because of some requests' own inputs (`faults`): those fail alone
        (an error output, never migrated); every other request of the batch is rolled back
        to where the step found it and recomputed, which keyed randomness makes exact.
        Blocks this step named for the prefix cache may lack their MTP entries (the extends
        did not run): the cache is flushed rather than trusted."""
        self.block_manager.flush()
        outputs = []
        for m in marks:
            r = m.restore()
            if r.request_id in faults:
                self.abort(r.request_id)
                outputs.append(failed_output(r, faults[r.request_id]))
            else:
                self.scheduler.requeue(r)
        return outputs

    def _step(self, reqs: list[Request], chunks: list[PrefillChunk]) -> list[RequestOutput]:
        """One main forward holding a speculative verify round for `reqs` (rows [last,
        d1..dk]) and/or prefill `chunks`, then one MTP extend for both (mixed batches when
        both are given). Rows are padded to a common width W; a chunk longer than W is split
        into several rows of the same request (each row attends to the KV the rows before it
        wrote in the same forward), so a chunk riding along a decode round pads the verify
        rows only to W, not to the chunk's length."""
        if chunks and reqs and self.split_mixed:
            # Compiled decode graphs run verify rows at their own width; prefill tokens in the
            # same forward would pad every row to W and run the graph's decode attention (on
            # CPU ~1.9x the eager SDPA prefill's cost per token; 32 rows ran 1.35x faster
            # alternating than mixed): the round runs in its graph, the chunks in their own
            # forward, in the same step.
            return self._step(reqs, []) + self._step([], chunks)
        for r in reqs:  # drafting is capped the same way; this only guards transferred drafts
            device_drafts.truncate(r, max(self.limits.room(r), 0))
        if not chunks and reqs:
            fused = self.outcomes.greedy_round(reqs)
            if fused is not None:
                outputs, finished = fused
                for r in finished:
                    self._finish(r)
                return outputs
        S = max((r.num_drafts for r in reqs), default=-1) + 1  # verify row length
        lens = [c.end - c.start for c in chunks]
        if not reqs:  # a hybrid model's chunk is one row (its recurrent state is sequential)
            W = max(lens) if self.hybrid else prefill_width(lens)
        else:
            # Enough prefill rows to match the decode rows: padding stays ~ the chunk tokens.
            W = max(S, -(-sum(lens) // len(reqs))) if chunks else S
            # The runner pads to the longest row: W must be one (flat rows are b * W + s).
            W = min(W, max([S, *lens]))
        # Verify rows [last, d1..dk] on the device (drafts the last chain left there stay
        # there: the round's one host sync brings them back with its accepted ids).
        inputs = (device_drafts.verify_inputs(reqs, S - 1, self.runner.kv_cache.buffers[0].device)
                  if reqs else None)
        feed = (inputs is not None and self.proposer.device_feed
                and any(r.device_drafts is not None for r in reqs))
        # With the device feed the host rows only give the row lengths.
        input_ids = [[r.output_token_ids[-1]] + ([0] * r.num_drafts if feed
                                                 else r.draft_token_ids) for r in reqs]
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
            state_slots=self._state_slots(reqs, chunks, len(input_ids)),
            device_ids=inputs if feed else None,
        ))  # [R * S + len(last), V]
        n_verify = len(logit_rows)
        outputs, extends, done = [], [], []
        first = None  # chunks' first tokens, when they came back with the round's accepted ids
        first_lp = None  # and their logprob rows
        if reqs:
            # A mixed step's first tokens ride along the round's one host sync.
            dev_first = (self.outcomes.first_tokens(chunks, raw[n_verify:], last)
                         if chunks else None)
            dev_lp = (self.outcomes.first_logprobs(chunks, raw[n_verify:], last, dev_first)
                      if chunks else None)
            rides = [t for t in (dev_first, dev_lp) if t is not None]
            outputs, extends, done, ride = self.outcomes.verify(
                reqs, raw[:n_verify], S, W, inputs, ride_along=rides or None)
            if chunks:
                first = ride[0] if dev_first is not None else []
                first_lp = ride[1] if dev_lp is not None else None
            if self.hybrid:  # keep each row's state at its last accepted token
                keep = [(b, r.num_computed_tokens - 1 - starts[b]) for b, r in enumerate(reqs)
                        if not r.finished and r.num_computed_tokens - starts[b] < len(
                            input_ids[b])]
                self.runner.keep_states([b for b, _ in keep], [p for _, p in keep])
        if chunks:
            p_out, p_ext = self.outcomes.prefilled_chunks(chunks, raw[n_verify:], last,
                                                          chunk_rows, W, first, first_lp)
            outputs += p_out
            extends += p_ext
        for r in done:
            self._finish(r)
        self.proposer.extend(extends)
        for c in chunks:
            if c.is_last:
                self._after_prefill(c.request)
        return outputs

    def _state_slots(self, reqs: list[Request], chunks: list[PrefillChunk],
                     rows: int) -> list[int] | None:
        """Hybrid models: the state slot of each main row (verify rows, then one row per
        chunk: no mixed batches, so chunks are never split)."""
        if not self.hybrid:
            return None
        owners = [*reqs, *(c.request for c in chunks)]
        assert len(owners) == rows, "hybrid rows: one per request"
        return [self.block_manager.state_slot(r) for r in owners]

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

    # Helpers -----------------------------------------------------------------------------
    def _finish(self, req: Request) -> None:
        req.finish_time = time.monotonic()
        self.scheduler.remove(req)
        self.requests.pop(req.request_id, None)
        self.guide.release(req)

    @property
    def totals(self) -> dict[str, int]:
        """Rounds, drafted, accepted and emitted tokens since start (metrics read these)."""
        return self.outcomes.totals

    def _count_positions(self, num_drafts: int, num_accepted: int) -> None:
        for i in range(min(num_drafts, len(self.drafted_per_position))):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    def stats(self) -> dict:
        t = self.outcomes.totals
        n_mtp = self.model_config.num_mtp_modules
        return {
            **self.block_manager.stats(),
            "num_waiting": len(self.scheduler.waiting),
            # Disaggregated decode: queued for KV blocks, and pulling their KV now.
            "num_awaiting_kv": len(self.scheduler.awaiting_kv),
            "num_receiving": len(self.scheduler.receiving),
            "num_prefilling": len(self.scheduler.prefilling),
            "num_running": len(self.scheduler.running),
            "num_prefilled_held": len(self.prefilled),
            "num_steps": self.num_steps,
            "num_speculative_tokens": self.adaptive.k if self.adaptive
            else self.config.num_speculative_tokens,
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else None,
            "mean_accepted_length": (t["accepted"] + t["rounds"]) / t["rounds"]
            if t["rounds"] else None,
            **{f"total_{k}": v for k, v in t.items()},
            # Per draft depth m (drafted with MTP module min(m, N - 1)): drafts verified,
            # accepted, and accepted / drafted (None where nothing was drafted).
            "drafted_per_position": list(self.drafted_per_position),
            "accepted_per_position": list(self.accepted_per_position),
            "acceptance_per_position": [a / d if d else None for d, a in zip(
                self.drafted_per_position, self.accepted_per_position, strict=True)],
            "mtp_module_per_position": [min(m, n_mtp - 1) for m in range(
                len(self.drafted_per_position))] if n_mtp else [],
            # Decode graphs: buckets covered / done / compiling, ETA (None: eager).
            "compile": self.runner.compile_progress(),
            # This process's malloc: tcmalloc's or jemalloc's path, or glibc (allocator.py).
            "malloc": preloaded() or "glibc",
        }


@contextlib.contextmanager
def intra_op_threads(n: int) -> Iterator[None]:
    """torch's intra-op threads at `n` inside the block (0: unchanged). Set on the calling
    thread, the engine's: OpenMP keeps the count per thread, and a second thread team in the
    process (say, the main thread's) makes libgomp stop spinning between parallel regions
    once its threads outnumber the cores, which made 2-thread eager ops slower than 1."""
    before = torch.get_num_threads()
    if not n or n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def prefill_width(lens: list[int], row_cost: int = 8) -> int:
    """Row width of a pure prefill forward over chunks of `lens` tokens: rows are padded to
    one width, a chunk longer than it splits into several rows. One row per chunk pads a
    1-token tail next to a 127-token chunk to 2 x 127 slots; the width here minimises the
    slots plus `row_cost` per row (a row re-reads its context in every layer), over the
    longest chunk and the powers of two below it."""
    widest = max(lens)
    best, best_cost = widest, len(lens) * (widest + row_cost)
    w = 16
    while w < widest:
        cost = sum(-(-n // w) for n in lens) * (w + row_cost)
        if cost < best_cost:
            best, best_cost = w, cost
        w *= 2
    return best


@dataclasses.dataclass
class _Mark:
    """A request's emitted state before a step, to roll back to if the step fails."""

    request: Request
    num_output_tokens: int
    status: RequestStatus
    num_rounds: int
    drafted: list[int]
    accepted: list[int]

    @classmethod
    def of(cls, r: Request) -> _Mark:
        return cls(r, len(r.output_token_ids), r.status, r.num_rounds,
                   list(r.drafted_per_position), list(r.accepted_per_position))

    def restore(self) -> Request:
        r = self.request
        del r.output_token_ids[self.num_output_tokens:]
        r.status, r.num_rounds = self.status, self.num_rounds
        r.drafted_per_position, r.accepted_per_position = self.drafted, self.accepted
        return r
