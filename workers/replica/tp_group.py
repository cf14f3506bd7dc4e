"""One TP rank of a prefill or decode replica, and the rank-0 driver of the group.

Rank 0 (in the Serve replica) schedules and samples; it sends every command (a forward, a KV
hold / release, a batch of KV pulls, a poll, a ping) to the other ranks over the gloo
*control* group (workers/replica/control_plane.py); the model's collectives run on the *data* group
(NCCL on GPUs, gloo on CPU), which only ever carries tensors on the engine's device. Ranks
>= 1 run `worker_loop`. Ray-free: the Ray actors that host ranks live in `tp_workers.py`.

KV moves off the engine thread: a decode rank's `KVPuller` thread receives into blocks rank 0
allocated, a prefill rank's `KVSender` threads serve held blocks. Rank 0 learns what finished
on *every* rank by a poll (one MAX all-reduce of per-request flags on the control group, like
vLLM's finished-receiving aggregation); all ranks keep their pending lists in the same order
because the commands that append to them are broadcast in order.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from mtpserve.workers.engine_config import compile_enabled
from mtpserve.workers.kv_transfer import KVReceiver, KVSender
from mtpserve.workers.kv_transfer.auth import Secret
from mtpserve.workers.kv_transfer.puller import KVPuller
from mtpserve.workers.kv_transfer.states import state_extras
from mtpserve.workers.model import shm_collectives
from mtpserve.workers.model.decode_graph import GraphKey
from mtpserve.workers.model.parallel import set_tp
from mtpserve.workers.model.shm_collectives import ShmCollectives
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
from mtpserve.workers.replica.control_plane import (
    OP_FORWARD,
    OP_OBJECT,
    OP_PING,
    OP_POLL,
    OP_SHUTDOWN,
    ControlPlane,
)
from mtpserve.workers.replica.tp_commands import (
    GreedyRound,
    HoldKV,
    InjectFault,
    KeepStates,
    ProbeKV,
    PullOutcome,
    ReleaseKV,
    RenewKV,
    StartPulls,
    WarmGraph,
)

logger = logging.getLogger(__name__)

# Ranks >= 1 wait for their next command in a control-group broadcast, which may idle for
# long. A dead peer closes its sockets (gloo raises at once); a hung one is caught by the
# health check's deadline (`TPDriver.ping` under `AsyncEngine.ping`), which fails the replica.
IDLE_TIMEOUT = timedelta(hours=24)
# Per rank and buffer: a decode forward's activations fit (32 tokens x 8192 hidden in fp32);
# larger ones (long prefill chunks, bandwidth-bound anyway) go over the data group. Small, since
# a container's /dev/shm is often 64 MiB: the segment is 2 x tp_size x this.
SHM_SLOT_BYTES = 1 << 20
# How long a rank waits in the rendezvous for the others (model loading included).
RENDEZVOUS_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its shard; the same for every rank of a group."""

    model: str
    role: Literal["prefill", "decode"]
    tp_size: int
    num_kv_blocks: int | None  # None: sized from kv_cache_memory_fraction (CUDA)
    block_size: int = 16
    dtype: str = "auto"  # EngineConfig.dtype (auto: bfloat16 on CUDA, float32 on CPU)
    device: str = "cpu"
    init_method: str | None = None  # tcp://host:port of rank 0's rendezvous (tp_size > 1)
    kv_backend: str = "gloo"
    kv_host: str = "127.0.0.1"
    kv_interface: str | None = None  # network interface of kv_host (gloo pairs bind it)
    kv_timeout_s: float = 30.0
    kv_hold_ttl_s: float = 60.0
    kv_max_concurrent_pulls: int = 4  # KVPuller lanes per decode rank
    kv_max_pairs: int = 64  # live KV pairs per decode rank (LRU close of idle ones past it)
    kv_send_buffer_budget_mib: int = 1024  # pack buffers prefill pairs keep, summed
    kv_store_port_range: tuple[int, int] | None = None  # KVSender store port (None: any)
    data_timeout_s: float = 600.0  # one model collective on the data group
    num_threads: int | None = None
    draft_vocab_size: int | None = None
    draft_dtype: str = "auto"  # EngineConfig.draft_dtype
    compile: str = "auto"  # EngineConfig.compile
    compile_cache_dir: str | None = None  # EngineConfig.compile_cache_dir
    attention_backend: str = "auto"  # EngineConfig.attention_backend
    kv_cache_memory_fraction: float = 0.9  # EngineConfig.kv_cache_memory_fraction
    num_state_slots: int = 64  # hybrid models: the engine's max_num_seqs (one per request)
    profile_tokens: int = 512  # the largest forward the engine runs (sizes the KV pool on CUDA)
    # Hybrid models: verify buffers for num_state_slots rows of this many drafts (the engine's
    # k; None: the runner's default), counted by the KV sizing.
    num_speculative_tokens: int | None = None
    # The deployment's KV secret (cluster.app builds it; its repr is redacted): senders
    # accept only pairs, drops and renewals signed with it. None: no KV auth (tests).
    kv_secret: Secret | None = None


def rendezvous_store(init_method: str | None, rank: int) -> dist.TCPStore:
    """The TP group's rendezvous store from `tcp://host:port`: rank 0 hosts it on `host`
    only (`init_process_group(init_method=...)` would have it listen on every interface),
    the other ranks connect to it. Every rank passes the store itself to
    init_process_group, so all of them name their keys alike."""
    from mtpserve.workers.kv_transfer.channel import listen_store

    if not init_method or not init_method.startswith("tcp://"):
        raise ValueError(f"TP rendezvous must be tcp://host:port, got {init_method!r}")
    host, _, port = init_method.removeprefix("tcp://").rpartition(":")
    timeout = timedelta(seconds=RENDEZVOUS_TIMEOUT_S)
    if rank == 0:
        return listen_store(host, int(port), timeout)
    return dist.TCPStore(host, int(port), None, False, timeout)


class RankCore:
    """Model shard + KV cache + this rank's KV sender (prefill) or transfer thread (decode)."""

    def __init__(self, spec: RankSpec, rank: int, store: dist.Store | None = None) -> None:
        """`store`: a client of the group's rendezvous store (tp_workers.Rendezvous, which
        closes it once the group is formed); else `rendezvous_store(spec.init_method)`."""
        from mtpserve.workers.engine import DTYPES
        from mtpserve.workers.engine_config import (
            resolve_attention_backend,
            resolve_draft_dtype,
            resolve_dtype,
        )

        self.spec, self.rank = spec, rank
        self.failed = False  # a command raised on this rank: the replica must be replaced
        self.on_event: Callable[[], None] | None = None  # rank 0: wake the engine thread
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        if spec.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
        self.control: ControlPlane | None = None
        self.data_group = None
        # A failed or timed-out NCCL op raises (and aborts that communicator) instead of the
        # watchdog tearing the process down: KV pairs are rebuilt, a broken TP group fails
        # the health check. Read when each NCCL group is built.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
        if spec.kv_backend == "nccl" and spec.kv_interface:
            # NCCL picks its bootstrap/socket interface from the environment, read when a
            # communicator is built: the KV pairs must use the configured one.
            os.environ.setdefault("NCCL_SOCKET_IFNAME", spec.kv_interface)
        if spec.tp_size > 1:
            # The TP group never leaves its node (STRICT_PACK): loopback serves the control
            # group. KV pairs get their interface explicitly (spec.kv_interface).
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            if store is None:
                store = rendezvous_store(spec.init_method, rank)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=spec.tp_size,
                                    timeout=IDLE_TIMEOUT)
            self.control = ControlPlane(dist.group.WORLD, rank)
            self.data_group = dist.new_group(
                backend="nccl" if spec.device == "cuda" else "gloo",
                timeout=timedelta(seconds=spec.data_timeout_s))
            if spec.device == "cuda":
                # NCCL builds a communicator at its first collective, through the rendezvous
                # store; build it now, so the store can close once the group is formed.
                dist.all_reduce(torch.zeros(1, device="cuda"), group=self.data_group)
            # Same-node CPU ranks (the whole group, above) exchange activations through shared
            # memory: ~30 us per collective instead of ~1 ms over gloo's loopback TCP here.
            shm = None
            if shm_collectives.enabled() and shm_collectives.available(spec.device):
                shm = ShmCollectives.create(self.control.group, rank, spec.tp_size,
                                            SHM_SLOT_BYTES, fallback=self.data_group,
                                            timeout_s=spec.data_timeout_s)
            set_tp(rank, spec.tp_size, self.data_group, shm)
        # Graphs pay off in decode rounds; a prefill replica runs long chunks (eager anyway),
        # so it skips the warm-up a graph runner needs.
        graphs = spec.role == "decode" and compile_enabled(spec.compile, spec.device,
                                                           spec.tp_size)
        dtype = resolve_dtype(spec.dtype, spec.device)
        self.runner = ModelRunner(spec.model, spec.num_kv_blocks, spec.block_size,
                                  DTYPES[dtype], spec.device, decode_graphs=graphs,
                                  compile_cache_dir=spec.compile_cache_dir,
                                  draft_vocab_size=spec.draft_vocab_size,
                                  mtp_dtype=DTYPES[resolve_draft_dtype(
                                      spec.draft_dtype, dtype, spec.device, spec.model)],
                                  attention_backend=resolve_attention_backend(
                                      spec.attention_backend, spec.device),
                                  kv_cache_memory_fraction=spec.kv_cache_memory_fraction,
                                  num_state_slots=spec.num_state_slots,
                                  profile_tokens=spec.profile_tokens,
                                  num_speculative_tokens=spec.num_speculative_tokens)
        cfg = self.runner.config
        self.head_start = rank * cfg.num_cache_heads // spec.tp_size
        self._lock = threading.Lock()
        self.sender = self.receiver = self.puller = None
        # Pending work, in the same order on every rank (appended by broadcast commands).
        self.holds: list[str] = []  # prefill: held request ids
        self._released: set[str] = set()  # prefill: released by this rank's sender (⊆ holds)
        self.inflight: list[str] = []  # decode: pulls started
        # Where KV bytes travel: device memory over NCCL; host memory over gloo (a CPU
        # transport: on a GPU engine the payload is staged through the host).
        kv_device = spec.device if spec.kv_backend == "nccl" else "cpu"
        if spec.role == "prefill":
            port = tuple(spec.kv_store_port_range) if spec.kv_store_port_range else 0
            self.sender = KVSender(host=spec.kv_host, port=port, backend=spec.kv_backend,
                                   send_buffer_budget_bytes=spec.kv_send_buffer_budget_mib << 20,
                                   device=kv_device, interface=spec.kv_interface,
                                   hold_ttl_s=spec.kv_hold_ttl_s,
                                   transfer_timeout_s=spec.kv_timeout_s,
                                   on_release=self._on_release, name=f"prefill-r{rank}",
                                   secret=spec.kv_secret,
                                   # Pack ahead in host memory; on NCCL the gather is a fast
                                   # device kernel and device memory is precious.
                                   prepack=spec.kv_backend != "nccl")
        else:
            self.receiver = KVReceiver(backend=spec.kv_backend, device=kv_device,
                                       interface=spec.kv_interface, name=f"decode-r{rank}",
                                       max_links=spec.kv_max_pairs, secret=spec.kv_secret)
            self.puller = KVPuller(self.receiver, self.runner.kv_cache.transfer_layers,
                                   spec.tp_size, rank, on_done=self._wake,
                                   name=f"decode-r{rank}",
                                   max_concurrent=spec.kv_max_concurrent_pulls,
                                   state_cache=self.runner.state_cache)

    @property
    def kv_address(self) -> str | None:
        return self.sender.address if self.sender else None

    def _wake(self) -> None:
        if self.on_event is not None:
            self.on_event()

    def _on_release(self, request_id: str, reason: str) -> None:
        # Sender thread. The blocks are freed once every rank has released (see `poll`).
        with self._lock:
            self._released.add(request_id)
        self._wake()

    # Commands ----------------------------------------------------------------------------
    def handle(self, op: int, arg: Any) -> Any:
        if op == OP_FORWARD:
            return self.runner.execute(arg)
        if op == OP_OBJECT:
            return self.handle_object(arg)
        if op == OP_PING:
            return self.ping_collective()
        if op == OP_POLL:
            return self.poll(arg)
        raise ValueError(f"unknown opcode {op}")

    def handle_object(self, cmd: Any) -> Any:
        if isinstance(cmd, HoldKV):
            extras = cmd.extras
            if cmd.state_slot is not None:  # hybrid: this rank's shard of the state
                extras = {**extras, **state_extras(self.runner.state_cache, cmd.state_slot)}
            self.sender.hold(cmd.request_id, self.runner.kv_cache.transfer_layers,
                             cmd.block_ids, cmd.num_tokens, self.head_start, extras)
            self.holds.append(cmd.request_id)
            return None
        if isinstance(cmd, ReleaseKV):
            return self.sender.drop(cmd.request_id)
        if isinstance(cmd, RenewKV):
            return self.sender.renew(cmd.request_id, cmd.ttl_s)
        if isinstance(cmd, StartPulls):
            for p in cmd.pulls:
                self.inflight.append(p.request_id)
                self.puller.submit(p)
            return None
        if isinstance(cmd, InjectFault):
            target = self.sender if self.sender is not None else self.puller
            target.inject_fault(cmd.delay_s, cmd.count)
            return None
        if isinstance(cmd, WarmGraph):
            with torch.inference_mode():
                return self.runner.graphs.warm_bucket(cmd.key)
        if isinstance(cmd, KeepStates):
            return self.runner.keep_states(cmd.rows, cmd.positions)
        if isinstance(cmd, GreedyRound):
            return self.runner.greedy_round(cmd.input_ids, cmd.starts, cmd.tables, cmd.room)
        if isinstance(cmd, ProbeKV):  # rank 0 only; never broadcast
            return self.receiver.probe(cmd.sender_address, cmd.num_bytes)
        raise TypeError(f"unknown command {type(cmd).__name__}")

    def data_path_failure(self) -> str | None:
        """Why this rank's KV data path cannot serve (a supervised thread died), or None."""
        for part in (self.sender, self.puller):
            why = part.healthy() if part is not None else None
            if why:
                return why
        return None

    def ping_collective(self) -> bool:
        """True if any rank has failed or lost its KV data path (collective over the control
        group)."""
        why = self.data_path_failure()
        if why:
            logger.error("rank %d: %s", self.rank, why)
        flags = [int(self.failed or why is not None)]
        if self.control is not None:
            flags = self.control.all_reduce_max(flags)
        return bool(flags[0])

    # Polling -----------------------------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return len(self.holds) + len(self.inflight)

    def has_local_progress(self) -> bool:
        """Rank 0: something pending finished here; only then can it have finished on all."""
        with self._lock:
            if self._released:
                return True
        return self.puller is not None and self.puller.num_finished(self.inflight) > 0

    def poll(self, n: int) -> list[str] | list[PullOutcome]:
        """Collective: what finished on every rank. Prefill: released request ids; decode:
        outcomes of pulls. `n` is rank 0's pending count (every rank must agree)."""
        assert n == self.num_pending, f"rank {self.rank}: {self.num_pending} pending, rank 0 {n}"
        if self.sender is not None:
            with self._lock:
                flags = [0 if r in self._released else 1 for r in self.holds]
        else:
            results = [self.puller.result(r) for r in self.inflight]
            flags = ([0 if x is not None else 1 for x in results]
                     + [1 if x is not None and not x.ok else 0 for x in results])
        if self.control is not None:
            flags = self.control.all_reduce_max(flags)
        if self.sender is not None:
            done = [r for r, f in zip(self.holds, flags, strict=True) if f == 0]
            with self._lock:
                self._released.difference_update(done)
            self.holds = [r for r, f in zip(self.holds, flags, strict=True) if f]
            return done
        m = len(self.inflight)
        outcomes, still = [], []
        for i, rid in enumerate(self.inflight):
            if flags[i]:
                still.append(rid)
                continue
            local = self.puller.take(rid)
            ok = not flags[m + i]
            error = local.error if not local.ok else (
                None if ok else f"KV transfer of {rid} failed on another rank")
            outcomes.append(PullOutcome(rid, ok, error, local.extras if ok else {}))
        self.inflight = still
        return outcomes

    def close(self) -> None:
        for x in (self.puller, self.sender, self.receiver):
            if x is not None:
                x.close()


def worker_loop(core: RankCore) -> None:
    """Ranks >= 1: execute rank 0's commands until shutdown or until the group breaks."""
    assert core.control is not None
    while True:
        try:
            op, arg = core.control.recv()
        except Exception:  # rank 0 is gone or the group broke: nothing left to serve
            logger.exception("rank %d: control group failed", core.rank)
            core.failed = True
            core.close()
            return
        if op == OP_SHUTDOWN:
            core.close()
            return
        try:
            core.handle(op, arg)
        except Exception:
            # Reported by the next ping; a forward that raised here leaves rank 0 waiting in a
            # data collective, which the health check's deadline turns into a replacement.
            logger.exception("rank %d failed on opcode %d", core.rank, op)
            core.failed = True


class TPDriver:
    """Rank 0: the `ModelRunner` interface the engine uses, plus KV commands, all mirrored to
    the other ranks. Must be called from one thread (the engine thread)."""

    def __init__(self, core: RankCore) -> None:
        self.core = core
        self.runner = core.runner
        self.config = core.runner.config
        self.kv_cache = core.runner.kv_cache
        self.tp_size = core.spec.tp_size
        self.failed = False  # a control-group call raised: the group is broken

    def _send(self, fn: Callable[[], None]) -> None:
        if self.failed:  # a desynchronised group must not start another collective
            raise RuntimeError("the TP group failed earlier; the replica is being replaced")
        try:
            fn()
        except Exception:
            self.failed = True
            raise

    def run(self, cmd: Any) -> Any:
        """A rare (pickled) command on every rank; returns rank 0's result."""
        if self.tp_size > 1:
            self._send(lambda: self.core.control.send_object(cmd))
        return self.core.handle_object(cmd)

    @property
    def accepts_device_ids(self) -> bool:
        """`ForwardBatch.device_ids` only in one process (other ranks get the batch as data)."""
        return self.tp_size == 1

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        if self.tp_size == 1:
            return self.core.runner.execute(batch)
        self._send(lambda: self.core.control.send_forward(batch))
        try:
            return self.core.runner.execute(batch)
        except Exception:
            # The other ranks run this forward's collectives; rank 0 left them half-way, so
            # the group's next collective would pair the wrong calls. The group is done: the
            # replica refuses new work and fails its health check (Serve replaces it).
            self.failed = True
            raise

    def warmup_graphs(self, batch_sizes: list[int], query_lens: list[int], max_context: int,
                      mtp_modules: int | None = None, budget_s: float | None = None,
                      log: Callable[[str], None] | None = None,
                      cached_only: bool = False,
                      restart_budget_s: float | None = None,
                      run_bucket: Callable[[GraphKey], None] | None = None) -> int:
        """Rank 0 plans the warm-up (order, budget, what its cache holds) and paces it: each
        bucket is one broadcast command that every rank builds and runs in step, since the
        warm-up forward runs the graph's collectives; so every rank ends with the same
        buckets built, and a later forward takes the graph on all ranks or on none.
        `run_bucket`: see `ModelRunner.warmup_graphs` (default here: on every rank)."""
        if self.tp_size == 1 or self.runner.graphs is None:
            return self.runner.warmup_graphs(batch_sizes, query_lens, max_context, mtp_modules,
                                             budget_s, log, cached_only, restart_budget_s,
                                             run_bucket)
        done = self.runner.warmup_graphs(batch_sizes, query_lens, max_context, mtp_modules,
                                         budget_s, log, cached_only, restart_budget_s,
                                         run_bucket or (lambda key: self._collective(
                                             WarmGraph(key))))
        self.run(WarmGraph(None))
        return done

    def compile_in_background(self, batch_sizes: list[int], query_lens: list[int],
                              max_context: int, mtp_modules: int | None = None) -> int:
        """TP = 1 only: a TP group's ranks build each bucket in step (`warmup_graphs`)."""
        if self.tp_size != 1:
            return 0
        return self.runner.compile_in_background(batch_sizes, query_lens, max_context,
                                                 mtp_modules)

    def adopt_compiled(self) -> int:
        return self.runner.adopt_compiled() if self.tp_size == 1 else 0

    def compile_progress(self) -> dict | None:
        """Rank 0's: every rank builds the same buckets in step (`warmup_graphs`)."""
        return self.runner.compile_progress()

    @property
    def fuses_greedy_rounds(self) -> bool:
        return self.runner.fuses_greedy_rounds

    def greedy_round(self, input_ids: list[list[int]], starts: list[int],
                     tables: list[list[int]], room: list[int]
                     ) -> tuple[list[int], list[int], list[list[int]]] | None:
        """Every rank runs the round's graph (its collectives pair up); ranks agree on whether
        a graph exists for it (same buckets built), so None on rank 0 is None everywhere."""
        if not self.runner.fuses_greedy_rounds:
            return None
        return self._collective(GreedyRound(input_ids, starts, tables, room))

    def keep_states(self, rows: list[int], positions: list[int]) -> None:
        """Hybrid models: every rank keeps its state shard at the rows' accepted tokens."""
        if rows:
            self.run(KeepStates(rows, positions))

    def _collective(self, cmd: Any) -> Any:
        """`run` for a command whose work runs model collectives: if rank 0 raises half-way,
        the group is desynchronised and fails (as in `execute`)."""
        try:
            return self.run(cmd)
        except Exception:
            self.failed = self.tp_size > 1
            raise

    def ping(self) -> None:
        """Raise unless every rank answers and none has failed (collective)."""
        if self.failed:
            raise RuntimeError("the TP group's control plane failed earlier")
        if self.tp_size > 1:
            self._send(lambda: self.core.control.send_op(OP_PING))
            try:
                bad = self.core.ping_collective()
            except Exception:
                self.failed = True
                raise
        else:
            bad = self.core.ping_collective()
        if bad:
            raise RuntimeError("a TP rank failed (or its KV data path died)")

    def poll(self) -> list:
        """What finished on every rank (see `RankCore.poll`); [] when nothing is pending."""
        n = self.core.num_pending
        if n == 0 or self.failed:  # a failed group completes nothing more (and must not spin)
            return []
        if self.tp_size > 1:
            self._send(lambda: self.core.control.send_op(OP_POLL, n))
        try:
            return self.core.poll(n)
        except Exception:
            self.failed = self.tp_size > 1
            raise

    def shutdown(self) -> None:
        if self.tp_size > 1 and not self.failed:
            try:
                self.core.control.send_op(OP_SHUTDOWN)
            except Exception:
                logger.warning("TP shutdown broadcast failed", exc_info=True)
        self.core.close()
