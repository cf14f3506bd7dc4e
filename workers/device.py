"""The device seam: the CUDA runtime calls of the engine's hot path, in one place.

Tensor ops run the same on any device; what does not are the runtime's own objects (streams,
events, the host copy that waits for the device, allocator statistics, device properties).
The engine reaches them only through `runtime()`, and only where the device is `cuda`, so a
test can swap in another runtime (`use_runtime`): the fake-CUDA tier (tests/fake_cuda.py)
runs the engine's CUDA code paths on this CPU-only machine with fake `cuda` tensors and a
runtime whose streams are no-ops and whose host copy returns values the test supplies. What
that proves and what only a real GPU can is in CONTRIBUTING.md ("The fake-CUDA tier").
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch


class CUDARuntime:
    """The real one: torch.cuda."""

    def name(self, device: torch.device) -> str:
        return torch.cuda.get_device_name(device)

    def capability(self, index: int) -> tuple[int, int]:
        return torch.cuda.get_device_capability(index)

    def current_index(self) -> int:
        return torch.cuda.current_device()

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    def record_event(self, device: torch.device) -> Any:
        """An event recorded on this thread's current stream of `device`."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        return event

    def synchronize(self, device: torch.device) -> None:
        torch.cuda.synchronize(device)

    def sync_stream(self, stream: Any) -> None:
        stream.synchronize()

    def wait_event(self, stream: Any, event: Any) -> None:
        """`stream`'s later work waits for `event` (no host wait)."""
        stream.wait_event(event)

    def event_done(self, event: Any) -> bool:
        return event.query()

    def read_host(self, packed: torch.Tensor, reason: str) -> list:
        """The device -> host copy of `host_sync.to_host`: one non-blocking copy of a 1-D long
        tensor into pinned memory, one wait on an event recorded after it, its values."""
        host = torch.empty(packed.shape, dtype=torch.long, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        done.synchronize()
        return host.tolist()

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return torch.cuda.mem_get_info(device)

    def memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.memory_allocated(device)

    def memory_reserved(self, device: torch.device) -> int:
        return torch.cuda.memory_reserved(device)

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)

    def max_memory_allocated(self, device: torch.device) -> int:
        return torch.cuda.max_memory_allocated(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()


_lock = threading.Lock()
_runtime: Any = CUDARuntime()


def runtime() -> CUDARuntime:
    """The runtime CUDA code paths call (`CUDARuntime` unless a test swapped it)."""
    return _runtime


@contextlib.contextmanager
def use_runtime(rt: Any) -> Iterator[Any]:
    """Swap the runtime for the duration (process-wide: engines of a TP test run in
    threads and must all see it)."""
    global _runtime
    with _lock:
        prev, _runtime = _runtime, rt
    try:
        yield rt
    finally:
        with _lock:
            _runtime = prev
