"""The engine's one door from the device to the host on the hot path.

A speculative round needs one thing on the host before it can go on: how many drafts each
request accepted and the token after them (the next round's shapes and stop checks depend on
them). Everything else stays on the device: the drafts feed the next verify forward from there
and reach the host in the same copy as the round's accepted ids (workers/spec_decode/
device_drafts.py). `to_host` is that copy: small int tensors packed into one device buffer,
one non-blocking copy into a pinned host buffer, one wait on an event recorded after it.
Every device -> host read of the engine's hot path goes through it and `HOST_SYNCS` counts
them by reason, so a CPU test can hold a round to one (tests/test_host_syncs.py); on a GPU
`benchmarks/gpu_check.py` also counts, with CUDA sync debug mode, any sync that bypasses it.
Off CUDA the copy is a plain copy and nothing waits (pinned memory needs CUDA). The CUDA copy
is the device seam's `read_host` (workers/device.py), which the fake-CUDA tier supplies.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

import torch

from mtpserve.workers.device import runtime


class HostSyncs:
    """Counts `to_host` calls (each one wait of the host on the device), by reason."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # engines of a TP test run in threads
        self.by_reason: collections.Counter[str] = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())

    def record(self, reason: str) -> None:
        with self._lock:
            self.by_reason[reason] += 1

    def snapshot(self) -> collections.Counter[str]:
        with self._lock:
            return collections.Counter(self.by_reason)


HOST_SYNCS = HostSyncs()


def to_host(tensors: Sequence[torch.Tensor], reason: str) -> list[list]:
    """Integer tensors on one device -> their values as (nested) Python lists, in one copy
    and one wait. `reason` names the sync in `HOST_SYNCS` ("accepted ids", "drafts", ...)."""
    HOST_SYNCS.record(reason)
    if not tensors:
        return []
    device = tensors[0].device
    flat = [t.reshape(-1).to(torch.long) for t in tensors]
    packed = flat[0] if len(flat) == 1 else torch.cat(flat)
    values = runtime().read_host(packed, reason) if device.type == "cuda" else packed.tolist()
    out, n = [], 0
    for t in tensors:
        m = t.numel()
        part = values[n: n + m]
        n += m
        if t.dim() == 2:
            w = t.shape[1]
            part = [part[i * w: (i + 1) * w] for i in range(t.shape[0])]
        elif t.dim() == 0:
            part = part[0]
        elif t.dim() != 1:
            raise ValueError(f"to_host: at most 2-D tensors, not {tuple(t.shape)}")
        out.append(part)
    return out
