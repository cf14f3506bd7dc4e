"""The engine core of a replica: everything that runs where its engine runs.

`CoreHost` owns rank 0 of the replica's TP group (`TPDriver`: model shard, KV cache, KV
sender or pullers), the `Engine` on its thread (`AsyncEngine`), the KV arrivals or holds
poller (workers/replica/arrivals.py) and the metrics recorder. Its public methods are the
*named commands* the Serve shell sends it (add a request, hold / release / renew KV, stats,
prefix summary, ping, fault injection): plain arguments in, plain results out, so the same
commands run in this process (`ThreadCore`, `engine_core: thread`) or in a child process
(`ProcessCore` in engine_core_proc.py, `engine_core: process`) without closures crossing the
boundary. Commands take the engine first and run on the engine thread, except those in
`OFF_THREAD` (they must not wait behind a step).

Ray-free: the child process imports this module without connecting to Ray.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch

from mtpserve.workers.async_engine import AsyncEngine, Poller
from mtpserve.workers.block_manager import blocks_for
from mtpserve.workers.engine import Engine, EngineConfig, EngineError
from mtpserve.workers.messages import (
    ERROR_KV_TRANSFER,
    GenerateRequest,
    KVTransferParams,
    TokenChunk,
)
from mtpserve.workers.replica.addresses import resolve_kv_endpoint
from mtpserve.workers.replica.arrivals import KVArrivals, PrefillHolds
from mtpserve.workers.replica.tp_commands import HoldKV, InjectFault, ProbeKV, RenewKV
from mtpserve.workers.replica.tp_group import RankSpec, TPDriver
from mtpserve.workers.request import Request
from mtpserve.workers.scheduler import decode_slots, draft_slots


class ReplicaUnavailableError(RuntimeError):
    """This replica's TP group or engine core failed: it refuses new work until Serve
    replaces it (the orchestrator retries such a refusal on another replica, as for a dead
    one)."""


def role_settings(cfg, role: str):
    return cfg.prefill if role == "prefill" else cfg.decode


def rank_spec(cfg, role: str) -> RankSpec:
    """The RankSpec of every rank of a `role` replica, from the cluster config."""
    side = role_settings(cfg, role)
    kv = cfg.kv_transfer
    host, interface = resolve_kv_endpoint(
        getattr(kv, "host", None) or os.environ.get("MTPSERVE_KV_HOST"),
        getattr(kv, "interface", None))
    return RankSpec(
        model=cfg.model, role=role, tp_size=side.tp_size,
        num_kv_blocks=side.num_kv_blocks, block_size=cfg.block_size, dtype=cfg.dtype,
        device=cfg.device, kv_backend=kv.backend, kv_host=host, kv_interface=interface,
        kv_timeout_s=kv.timeout_s, kv_hold_ttl_s=kv.hold_ttl_s,
        kv_max_concurrent_pulls=kv.max_concurrent_pulls, kv_max_pairs=kv.max_pairs_per_rank,
        kv_send_buffer_budget_mib=kv.send_buffer_budget_mib,
        kv_store_port_range=kv.store_port_range,
        num_threads=max(1, int(side.cpus_per_rank)),
        draft_vocab_size=cfg.speculation.draft_vocab_size,
        draft_dtype=cfg.speculation.draft_dtype, compile=cfg.engine.compile,
        compile_cache_dir=cfg.engine.compile_cache_dir,
        attention_backend=cfg.engine.attention_backend,
        # Of the rank's share of its GPU: two ranks at 0.5 GPU each split one device.
        kv_cache_memory_fraction=cfg.engine.kv_cache_memory_fraction
        * min(1.0, side.gpus_per_rank or 1.0),
        kv_secret=getattr(kv, "secret", None),
        num_state_slots=getattr(side, "max_num_seqs", 64),
        # The KV pool is sized after the largest forward: a prefill chunk, or a full decode
        # batch verifying k drafts (main + MTP activations of that many rows).
        profile_tokens=max(getattr(side, "max_num_batched_tokens", 512),
                           getattr(side, "max_num_seqs", 1)
                           * (cfg.speculation.num_speculative_tokens + 1)),
        num_speculative_tokens=cfg.speculation.num_speculative_tokens,
    )


def engine_config(cfg, role: str, num_kv_blocks: int) -> EngineConfig:
    """The replica's EngineConfig; `num_kv_blocks`: the pool the ranks built (sized from
    memory on CUDA when not configured)."""
    side = role_settings(cfg, role)
    return EngineConfig(
        model=cfg.model, dtype=cfg.dtype, device=cfg.device,
        num_speculative_tokens=cfg.speculation.num_speculative_tokens,
        adaptive_k=cfg.speculation.adaptive and role == "decode",
        draft_vocab_size=cfg.speculation.draft_vocab_size,
        draft_dtype=cfg.speculation.draft_dtype,
        block_size=cfg.block_size, num_kv_blocks=num_kv_blocks,
        max_num_seqs=getattr(side, "max_num_seqs", 64),
        max_num_batched_tokens=getattr(side, "max_num_batched_tokens", 512),
        max_model_len=cfg.max_model_len, role=role, compile=cfg.engine.compile,
        warmup_budget_s=cfg.engine.warmup_budget_s,
        prefill_threads=getattr(side, "idle_prefill_threads", 0),
        warmup_restart_budget_s=cfg.engine.warmup_restart_budget_s,
        background_compile=cfg.engine.background_compile,
        compile_cache_dir=cfg.engine.compile_cache_dir,
        attention_backend=cfg.engine.attention_backend,
        prefix_caching=cfg.prefix_caching.enabled,
        grammar_compile_workers=cfg.engine.grammar_compile_workers,
        grammar_compile_timeout_s=cfg.engine.grammar_compile_timeout_s,
    )


class CoreHost:
    """Rank 0 + engine thread + poller + recorder of one replica (see the module docstring).

    Built on the thread that then serves the shell (the Serve replica's, or the child
    process's main thread); every command but `OFF_THREAD` runs on the engine thread."""

    role: str
    OFF_THREAD: frozenset[str] = frozenset({"kv_probe", "set_kv_addresses"})

    def __init__(self, cfg, driver: TPDriver, kv_addresses: list[str | None],
                 replica_id: str | None,
                 sink: Callable[[str, TokenChunk], None] | None = None,
                 on_tick: Callable[[], None] | None = None,
                 push_metrics: bool = True) -> None:
        from mtpserve.workers.replica.metrics import attach_replica_metrics

        self.cfg = cfg
        self.driver = driver
        self.kv_addresses = kv_addresses
        self.replica_id = replica_id  # prefill: named in KVTransferParams for `release`
        engine = Engine(engine_config(cfg, self.role, driver.runner.kv_cache.num_blocks),
                        runner=driver)  # warms up the decode graphs before Serve sees it ready
        engine.guide.warm()  # token healing / grammars: loaded before ready, not mid-batch
        self.poller = self._make_poller()
        self.poller.engine = engine
        self.engine = AsyncEngine(engine, self.poller, sink=sink, on_tick=on_tick)
        self.engine.annotate = self._annotate
        driver.core.on_event = self.engine.wake  # transfer threads wake the engine
        # Metrics and windowed autoscaling signals; profiles a decode engine once here.
        self.recorder = attach_replica_metrics(self, self.role)
        if not push_metrics:  # in a child process: the shell pushes what `metrics` returns
            self.recorder.pusher.set()

    def _make_poller(self) -> Poller:
        raise NotImplementedError

    _annotate: Callable[[str, TokenChunk], None] | None = None  # AsyncEngine.annotate

    @property
    def failed(self) -> bool:
        """The TP group failed (any thread may read it)."""
        return self.driver.failed or self.driver.core.failed

    # Commands (engine thread) ------------------------------------------------------------------
    def add(self, engine: Engine, req: GenerateRequest,
            params: KVTransferParams | None = None) -> None:
        """A new request: from its prompt and resumed tokens (prefill, recompute, migration)."""
        engine.add_resumed(req.request_id, req.prompt_token_ids, req.params,
                           list(req.resume_token_ids))

    def abort(self, engine: Engine, request_id: str) -> None:
        engine.abort(request_id)

    def stats(self, engine: Engine) -> dict:
        """`Engine.stats()` plus the role's KV data path and the autoscaling report."""
        return engine.stats()

    def autoscaling_stats(self, engine: Engine) -> dict:
        return self.recorder.autoscaling_stats(engine.stats())

    def metrics(self, engine: Engine, key: str) -> dict:
        """What /metrics needs from this replica (`EngineRecorder.snapshot`)."""
        return self.recorder.snapshot(key, engine.stats())

    def prefix_summary(self, engine: Engine, max_blocks: int) -> Any:
        return engine.block_manager.summary(max_blocks)

    def ping(self, engine: Engine) -> None:
        """Every TP rank answers over the control group and none failed (else raises)."""
        self.driver.ping()

    def fault(self, engine: Engine, delay_s: float, count: int) -> None:
        self.driver.run(InjectFault(delay_s, count))

    # Commands (any thread) ----------------------------------------------------------------------
    def set_kv_addresses(self, addresses: list[str | None]) -> None:
        """Every rank's KV sender address (a child learns the other ranks' after start)."""
        self.kv_addresses = list(addresses)


class DecodeCore(CoreHost):
    """Decode: requests arrive with `KVTransferParams` and wait for their KV pulls."""

    role = "decode"

    def _make_poller(self) -> KVArrivals:
        # A failed pull ends the stream with a typed error: the orchestrator then applies
        # kv_transfer.failure_policy (recompute or fail) instead of migrating.
        return KVArrivals(self.driver, self.cfg.kv_transfer.timeout_s,
                          on_failed=lambda rid, msg: self.engine.fail(rid, msg,
                                                                      ERROR_KV_TRANSFER))

    def add(self, engine: Engine, req: GenerateRequest,
            params: KVTransferParams | None = None) -> None:
        if params is None:  # recomputed here from its prompt and resumed tokens
            super().add(engine, req)
            return
        self._add_transferred(engine, req, params)

    def _add_transferred(self, engine: Engine, req: GenerateRequest,
                         params: KVTransferParams) -> Request:
        """Validate and park the request as waiting-for-KV; its pull starts when the
        scheduler admits it (a sequence slot and blocks are free)."""
        r = engine.make_request(req.request_id, req.prompt_token_ids + req.resume_token_ids,
                                req.params)
        r.output_token_ids.append(params.first_token_id)
        r.num_computed_tokens = params.num_computed_tokens
        # Prefill drafts at most k (fewer when max_tokens leaves no room); the first round
        # verifies what it got, later rounds draft k again.
        if params.num_drafts > r.num_speculative_tokens:
            raise EngineError(f"prefill drafted {params.num_drafts} tokens, this replica "
                              f"drafts at most k={r.num_speculative_tokens}")
        slots = max(params.num_tokens, decode_slots(r))
        if blocks_for(slots, engine.block_manager.block_size) > engine.block_manager.num_blocks:
            raise EngineError("the request's KV does not fit this decode replica's cache")
        self.poller.park(engine, r, params, slots)
        return r

    def stats(self, engine: Engine) -> dict:
        s = engine.stats()
        s["kv_receiver"] = self.driver.core.receiver.stats()
        s["kv_puller"] = self.driver.core.puller.stats()  # receive + scatter, rank 0
        s["num_waiting_for_kv"] = len(engine.scheduler.awaiting_kv) + len(
            engine.scheduler.receiving)
        s["autoscaling"] = self.recorder.autoscaling_stats(s)
        return s

    def kv_probe(self, sender_address: str, num_bytes: int) -> dict:
        """Off the engine thread: rank 0's receiver (the channel's lock orders it with
        pulls)."""
        return self.driver.core.handle_object(ProbeKV(sender_address, num_bytes))


class PrefillCore(CoreHost):
    """Prefill: the first token, then the KV held for a decode replica."""

    role = "prefill"

    def _make_poller(self) -> PrefillHolds:
        # Frees held blocks once every rank's sender released them (acked, expired, failed).
        return PrefillHolds(self.driver)

    def hold(self, engine: Engine, rid: str, first_token: int) -> KVTransferParams:
        """Hand the prefilled request's blocks to every rank's sender; what decode pulls."""
        r = engine.prefilled[rid]
        extras = {"draft_token_ids": torch.tensor(r.draft_token_ids, dtype=torch.long)}
        if r.draft_probs is not None:
            extras["draft_probs"] = r.draft_probs.float().contiguous()
        slots = draft_slots(r)  # committed prompt + the k-1 speculative MTP entries
        state_slot = engine.block_manager.state_slot(r) if engine.hybrid else None
        self.driver.run(HoldKV(rid, list(r.block_ids), slots, extras, state_slot))
        return KVTransferParams(
            request_id=rid, sender_addresses=list(self.kv_addresses),
            prefill_tp_size=self.driver.tp_size,
            num_kv_heads=engine.model_config.num_cache_heads, num_tokens=slots,
            num_computed_tokens=r.num_computed_tokens, first_token_id=first_token,
            num_drafts=len(r.draft_token_ids), prefill_replica=self.replica_id,
        )

    def _annotate(self, rid: str, chunk: TokenChunk) -> None:
        """Engine thread, as the step emits a request's first token: hold its KV now and send
        the pull params with that chunk. A `hold` command from the shell would reach this
        thread only after the current step, queued behind the next prompts' prefill."""
        engine = self.engine.engine
        if (chunk.finished or not chunk.token_ids or rid not in engine.prefilled
                or rid in self.driver.core.holds):
            return
        chunk.kv_transfer = self.hold(engine, rid, chunk.token_ids[0])

    def release(self, engine: Engine, rid: str) -> bool:
        return self.poller.release(rid)

    def release_or_abort(self, engine: Engine, rid: str) -> None:
        """The prefill was cancelled or failed: free its blocks (a hold is released)."""
        self.poller.release(rid) or engine.abort(rid)

    def renew(self, engine: Engine, rid: str) -> bool:
        if rid not in self.driver.core.holds:
            return False
        return bool(self.driver.run(RenewKV(rid)))

    def stats(self, engine: Engine) -> dict:
        s = engine.stats()
        s["kv_sender"] = self.driver.core.sender.stats()
        return s


HOSTS: dict[str, type[CoreHost]] = {"decode": DecodeCore, "prefill": PrefillCore}


class ThreadCore:
    """The engine core in the shell's own process (`engine_core: thread`): named commands
    run on the host's engine thread, chunks reach asyncio through per-request queues."""

    def __init__(self, host: CoreHost) -> None:
        self.host = host

    @property
    def failed(self) -> bool:
        return self.host.failed

    async def call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.host, name)
        if name in self.host.OFF_THREAD:
            return await asyncio.to_thread(fn, *args)
        return await self.host.engine.acall(lambda e: fn(e, *args))

    def cast(self, name: str, *args: Any) -> None:
        """Fire and forget (on the engine thread)."""
        fn = getattr(self.host, name)
        self.host.engine.call(lambda e: fn(e, *args))

    def generate(self, req: GenerateRequest, params: KVTransferParams | None = None,
                 abort_on_exit: bool = True, interval_s: float = 0.0
                 ) -> AsyncIterator[TokenChunk]:
        return self.host.engine.generate(req, add=lambda e: self.host.add(e, req, params),
                                         abort_on_exit=abort_on_exit, interval_s=interval_s)

    async def ping(self, deadline_s: float) -> None:
        await self.host.engine.ping(self.host.ping, deadline_s)

    def shutdown(self) -> None:
        self.host.engine.shutdown()
