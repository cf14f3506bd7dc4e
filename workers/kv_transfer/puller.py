"""KVPuller: a decode rank's transfer thread. Receives requests' KV into blocks rank 0 has
already allocated, so the engine thread never waits on the network (docs/architecture.md,
decision 11).

Pulls run one after another in submission order on one thread (one ordered stream per pair,
as NCCL needs); each lands in a reused grow-only buffer and is scattered into the cache on
the thread's own CUDA stream. A result is posted only after the scatter has completed, so
once every rank reports a request done, its blocks are complete on every rank.
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

from mtpserve.workers.kv_transfer.packing import scatter_blocks
from mtpserve.workers.kv_transfer.receiver import KVReceiver
from mtpserve.workers.kv_transfer.resharding import head_range, pull_slices

logger = logging.getLogger(__name__)


@dataclass
class PullResult:
    ok: bool
    error: str | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # on the host
    seconds: float = 0.0


class KVPuller:
    """Runs `PullKV` jobs (workers.tp_group) on a background thread; results are polled.

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
    ) -> None:
        self.receiver = receiver
        self.kv_layers = kv_layers
        self.tp_size, self.rank = tp_size, rank
        self.on_done = on_done
        self._device = kv_layers[0].device
        self._stream = torch.cuda.Stream(self._device) if self._device.type == "cuda" else None
        self._jobs: queue.Queue[Any] = queue.Queue()
        self._lock = threading.Lock()
        self._results: dict[str, PullResult] = {}
        self._buffer: torch.Tensor | None = None  # [nbytes] uint8, grow-only
        self._fault_delay_s, self._fault_count = 0.0, 0
        # End-to-end (receive + scatter into the cache) counters of successful pulls.
        self._stats = {"pulls": 0, "failures": 0, "seconds": 0.0}
        self._thread = threading.Thread(target=self._loop, name=f"{name}-kv-pull", daemon=True)
        self._thread.start()

    # any thread ----------------------------------------------------------------------------
    def submit(self, job: Any) -> None:  # a workers.tp_commands.PullKV
        # The job's timeout runs from here, not from when the thread gets to it: jobs queued
        # behind a frozen peer's pull expire with it instead of one timeout after another.
        self._jobs.put((job, time.monotonic()))

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

    def close(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5.0)

    # transfer thread -----------------------------------------------------------------------
    def _loop(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, submitted = item
            t0, delay = time.perf_counter(), 0.0
            try:
                with self._lock:
                    delay = self._fault_delay_s if self._fault_count > 0 else 0.0
                    self._fault_count -= delay > 0
                if delay:
                    time.sleep(delay)
                left = job.timeout_s - (time.monotonic() - submitted)
                if left <= 0:
                    raise TimeoutError(f"waited {job.timeout_s:.1f}s behind earlier pulls")
                res = PullResult(True, extras=self._pull(job, left))
            except Exception as e:  # this request fails; the replica goes on
                err = f"KV transfer of {job.request_id} failed on rank {self.rank}: {e}"
                logger.warning(err)
                res = PullResult(False, err)
            res.seconds = time.perf_counter() - t0
            with self._lock:
                self._results[job.request_id] = res
                self._stats["pulls" if res.ok else "failures"] += 1
                if res.ok:
                    self._stats["seconds"] += res.seconds - delay
            if self.on_done is not None:
                try:
                    self.on_done()
                except Exception:
                    logger.exception("KVPuller on_done raised")

    def _pull(self, job: Any, timeout_s: float) -> dict[str, torch.Tensor]:
        """Receive this rank's KV heads of `job` into its blocks within `timeout_s`; returns
        the extras."""
        local0 = head_range(job.num_kv_heads, self.tp_size, self.rank)[0]
        extras: dict[str, torch.Tensor] = {}
        steps = pull_slices(
            self.receiver, job.sender_addresses, job.request_id, job.num_kv_heads,
            self.tp_size, self.rank, timeout_s, buffer=lambda: self._buffer,
        )
        for i, (step, kv, got) in enumerate(steps):
            self._keep_buffer(kv)
            heads = slice(step.head_start - local0, step.head_end - local0)
            if self._stream is not None:
                # Blocks were freed by the engine only after its step synchronised, but order
                # after the default stream anyway, then scatter on this thread's own stream.
                self._stream.wait_stream(torch.cuda.default_stream(self._device))
                with torch.cuda.stream(self._stream):
                    scatter_blocks(self.kv_layers, job.block_ids[: kv.shape[2]], kv, heads)
                self._stream.synchronize()  # the buffer is reused by the next pull
            else:
                scatter_blocks(self.kv_layers, job.block_ids[: kv.shape[2]], kv, heads)
            if i == 0:  # replicated across prefill ranks; copied out of the reused buffer
                extras = {k: v.to("cpu", copy=True) for k, v in got.items()}
        return extras

    def _keep_buffer(self, kv: torch.Tensor) -> None:
        """Adopt the receiver's fresh allocation as the reusable buffer when it is larger."""
        storage = kv.untyped_storage()
        if self._buffer is None or storage.nbytes() > self._buffer.numel():
            # On the receiver's device: host memory when gloo stages a GPU engine's KV.
            self._buffer = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(
                storage)
