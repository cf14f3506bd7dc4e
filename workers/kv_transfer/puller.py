"""KVPuller: a decode rank's transfer thread. Receives requests' KV into blocks rank 0 has
already allocated, so the engine thread never waits on the network (docs/architecture.md,
decision 11).

Up to `max_concurrent` pulls (`kv_transfer.max_concurrent_pulls`, default 4) run at once,
each on its own thread with its own reused grow-only buffer and CUDA stream: a pull from one
prefill replica never waits behind a slow pull from another. Pulls from the same sender still
go one after another (the receiver's per-pair lock keeps one ordered stream per pair, as NCCL
needs); a pull's timeout starts when it has the pair, and if the pair failed or hung while it
waited it fails at once, so a frozen sender costs one timeout, not one per queued pull. A
result is posted only after the scatter into the cache has completed, so once every rank
reports a request done, its blocks are complete on every rank.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from mtpserve.workers import hop_trace
from mtpserve.workers.device import runtime
from mtpserve.workers.kv_transfer.packing import scatter_blocks
from mtpserve.workers.kv_transfer.receiver import KVReceiver
from mtpserve.workers.kv_transfer.resharding import head_range, pull_slices
from mtpserve.workers.kv_transfer.states import install_states, split_states

logger = logging.getLogger(__name__)


@dataclass
class PullResult:
    ok: bool
    error: str | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # on the host
    seconds: float = 0.0


DEFAULT_MAX_CONCURRENT = 4


class KVPuller:
    """Runs `PullKV` jobs (workers.replica.tp_commands) on background threads; results are polled.

    `on_done()` runs on the thread after each result (rank 0 wakes its engine with it).
    Thread-safe: `submit`, `result`, `take`, `num_finished` may be called from any thread.
    """

    def __init__(
        self,
        receiver: KVReceiver,
        kv_layers: list[torch.Tensor],  # each [2, num_blocks, block_size, H_local, D]
        tp_size: int,
        rank: int,
        on_done: Callable[[], None] | None = None,
        name: str = "decode",
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        state_cache: Any = None,  # hybrid models: this rank's workers.state_pool.StateCache
    ) -> None:
        self.receiver = receiver
        self.kv_layers = kv_layers
        self.state_cache = state_cache
        self.tp_size, self.rank = tp_size, rank
        self.on_done = on_done
        self._device = kv_layers[0].device
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._results: dict[str, PullResult] = {}
        self._fault_delay_s, self._fault_count = 0.0, 0
        # End-to-end (receive + scatter into the cache) counters of successful pulls, and the
        # most pulls this rank had under way at once (taken by a lane, result not yet posted;
        # one waiting for its pair counts): 1 means arrivals were admitted one at a time.
        self._stats = {"pulls": 0, "failures": 0, "seconds": 0.0, "peak_in_flight": 0}
        self._in_flight = 0
        self._closed = False
        self._threads = [threading.Thread(target=self._loop, args=(_Lane(self._device),),
                                          name=f"{name}-kv-pull-{i}", daemon=True)
                         for i in range(max(1, max_concurrent))]
        for t in self._threads:
            t.start()

    # any thread ----------------------------------------------------------------------------
    def submit(self, job: Any) -> None:  # a workers.replica.tp_commands.PullKV
        self._jobs.put(job)

    def result(self, request_id: str) -> PullResult | None:
        with self._lock:
            return self._results.get(request_id)

    def take(self, request_id: str) -> PullResult:
        with self._lock:
            return self._results.pop(request_id)

    def num_finished(self, request_ids: Sequence[str]) -> int:
        with self._lock:
            return sum(r in self._results for r in request_ids)

    def inject_fault(self, delay_s: float, count: int = 1) -> None:
        """Tests only: the next `count` pulls sleep `delay_s` first (on this thread)."""
        with self._lock:
            self._fault_delay_s, self._fault_count = delay_s, count

    def stats(self) -> dict[str, float]:
        with self._lock:
            return dict(self._stats)

    def healthy(self) -> str | None:
        """None while every transfer lane runs, else how many died: the replica's health
        check fails on it (a dead lane's queued pulls would wait for ever)."""
        if self._closed:
            return None
        dead = sum(t.ident is not None and not t.is_alive() for t in self._threads)
        return f"{dead} of {len(self._threads)} KV pull lanes died" if dead else None

    def close(self) -> None:
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for t in self._threads:
            t.join(timeout=5.0)

    # transfer thread -----------------------------------------------------------------------
    def _loop(self, lane: _Lane) -> None:
        while (job := self._jobs.get()) is not None:
            t0, delay = time.perf_counter(), 0.0
            with self._lock:
                self._in_flight += 1
                self._stats["peak_in_flight"] = max(self._stats["peak_in_flight"],
                                                    self._in_flight)
            try:
                with self._lock:
                    delay = self._fault_delay_s if self._fault_count > 0 else 0.0
                    self._fault_count -= delay > 0
                if delay:
                    time.sleep(delay)
                self._trace(job.request_id, "pull_start")
                res = PullResult(True, extras=self._pull(job, job.timeout_s, lane))
                self._trace(job.request_id, "pull_end")
            except Exception as e:  # this request fails; the replica goes on
                lane.buffer = None  # an abandoned receive may still write into it
                err = f"KV transfer of {job.request_id} failed on rank {self.rank}: {e}"
                logger.warning(err)
                res = PullResult(False, err)
            res.seconds = time.perf_counter() - t0
            with self._lock:
                self._in_flight -= 1
                self._results[job.request_id] = res
                self._stats["pulls" if res.ok else "failures"] += 1
                if res.ok:
                    self._stats["seconds"] += res.seconds - delay
            if self.on_done is not None:
                try:
                    self.on_done()
                except Exception:
                    logger.exception("KVPuller on_done raised")

    def _trace(self, request_id: str, hop: str) -> None:
        if self.rank == 0:  # the replica's process, where the request's chunks are made
            hop_trace.note(request_id, hop)

    def _pull(self, job: Any, timeout_s: float, lane: _Lane) -> dict[str, torch.Tensor]:
        """Receive this rank's KV heads of `job` into its blocks within `timeout_s`, through
        `lane`'s buffer and stream; returns the extras."""
        local0 = head_range(job.num_kv_heads, self.tp_size, self.rank)[0]
        extras: dict[str, torch.Tensor] = {}
        slot = getattr(job, "state_slot", None)
        states: list[tuple[int, dict[str, torch.Tensor]]] = []  # hybrid: (rank, shard)
        steps = pull_slices(
            self.receiver, job.sender_addresses, job.hold_id or job.request_id, job.num_kv_heads,
            self.tp_size, self.rank, timeout_s, buffer=lambda: lane.buffer,
            skip_blocks=job.skip_blocks, extras_every_step=slot is not None,
        )
        for i, (step, kv, got) in enumerate(steps):
            lane.keep_buffer(kv)
            heads = slice(step.head_start - local0, step.head_end - local0)
            if slot is not None:  # hybrid: this prefill rank's state shard, apart from extras
                got_states, got = split_states(got)
            if lane.stream is not None:
                # Scatter on this lane's own stream, not after the engine's step in flight:
                # the blocks were free when allocated (the engine frees blocks only after its
                # step's host sync), so no kernel of the engine touches them.
                with runtime().on_stream(lane.stream):
                    scatter_blocks(self.kv_layers, job.block_ids[: kv.shape[2]], kv, heads)
                    if slot is not None:
                        states.append((step.src_rank, _copied(got_states, self.state_cache)))
                runtime().sync_stream(lane.stream)  # the buffer is reused by this lane's next pull
            else:
                scatter_blocks(self.kv_layers, job.block_ids[: kv.shape[2]], kv, heads)
                if slot is not None:
                    states.append((step.src_rank, _copied(got_states, self.state_cache)))
            if i == 0:  # replicated across prefill ranks; copied out of the reused buffer
                extras = {k: v.to("cpu", copy=True) for k, v in got.items()}
        if slot is not None:
            # Like the blocks, the slot is this request's alone until it is activated: written
            # on the lane's stream (as the scatter), complete before the result is posted.
            if lane.stream is not None:
                with runtime().on_stream(lane.stream):
                    install_states(self.state_cache, slot, states, job.prefill_tp_size,
                                   self.tp_size, self.rank)
                runtime().sync_stream(lane.stream)
            else:
                install_states(self.state_cache, slot, states, job.prefill_tp_size,
                               self.tp_size, self.rank)
        return extras


def _copied(states: dict[str, torch.Tensor], cache: Any) -> dict[str, torch.Tensor]:
    """State entries copied out of the lane's reused buffer onto the state pool's device."""
    device = cache.conv[cache.layers[0]].device
    return {k: v.to(device, copy=True) for k, v in states.items()}


class _Lane:
    """One transfer thread's own receive buffer and CUDA stream: concurrent pulls never
    share a buffer, and a lane whose pull failed drops its buffer (a receive abandoned at
    its timeout may still be writing into it)."""

    def __init__(self, device: torch.device) -> None:
        self.stream = runtime().new_stream(device) if device.type == "cuda" else None
        self.buffer: torch.Tensor | None = None  # [nbytes] uint8, grow-only

    def keep_buffer(self, kv: torch.Tensor) -> None:
        """Adopt the receiver's fresh allocation as the reusable buffer when it is larger."""
        storage = kv.untyped_storage()
        if self.buffer is None or storage.nbytes() > self.buffer.numel():
            # On the receiver's device: host memory when gloo stages a GPU engine's KV.
            self.buffer = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
                storage)
