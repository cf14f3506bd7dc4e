"""All-reduce and all-gather between the TP ranks of one CPU node through shared memory.

A decode step of a small model on CPU runs ~26 collectives of a few KiB each (one per
row-parallel linear, the embedding and the head); over gloo each is a loopback TCP round trip
(~100+ us here), which made a TP=2 decode 3-5x slower than TP=1. Ranks of one node can instead
write their partial results into a shared segment and read each other's: a few microseconds
plus the wait for the slowest rank (vLLM and DeepSpeed ship the same idea for CPU TP in C++).

Protocol (one segment per TP group, two alternating buffers): for its n-th collective a rank
copies its input into its slot of buffer n % 2, then publishes n in its flag; once every flag is
>= n, each rank reads all slots. A rank can only reuse buffer n % 2 at collective n + 2, which
needs every peer's flag >= n + 1, set after that peer finished reading collective n, so no slot
is overwritten while read. Every rank sums the slots in rank order, so all ranks hold bitwise
the same result (as after gloo's all-reduce).

The flags are plain 8-byte stores and loads: correct on x86-64's total store order (the data
written before a flag is visible before the flag), not on weakly ordered CPUs, where
`available()` is False and gloo stays in use. Waiting spins briefly, then yields and sleeps, so
a rank waiting for a slow peer (a compile, a time-sliced core) does not burn the shared CPU.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

_FLAG_STRIDE = 8  # int64s between flags: one 64-byte cache line each (no false sharing)
_SPIN = 200  # flag checks before yielding the CPU (~20-40 us)
_YIELD = 2000  # then sched_yield()s before sleeping


def available(device: str) -> bool:
    """Shared-memory collectives apply to CPU tensors on a total-store-order CPU."""
    return device == "cpu" and platform.machine().lower() in ("x86_64", "amd64")


def enabled() -> bool:
    """`MTPSERVE_SHM_COLLECTIVES=0` keeps a CPU TP group on gloo (benchmarks compare both)."""
    return os.environ.get("MTPSERVE_SHM_COLLECTIVES", "1") != "0"


class ShmCollectives:
    """Sum all-reduce and last-dim all-gather over one shared segment (see module docstring).
    Every rank must call the same collectives in the same order with the same shapes (as with
    any process group); tensors larger than `slot_bytes` go to the fallback group instead."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int,
                 fallback: dist.ProcessGroup | None = None, timeout_s: float = 600.0) -> None:
        self.rank, self.size, self.slot_bytes = rank, size, slot_bytes
        self.fallback, self.timeout_s = fallback, timeout_s
        header = size * _FLAG_STRIDE * 8
        self._data_offset = -(-header // 4096) * 4096
        total = self._data_offset + 2 * size * slot_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, total)
        finally:
            os.close(fd)
        self._flags = np.frombuffer(self._mm, dtype=np.int64, count=size * _FLAG_STRIDE)
        self._bytes = torch.frombuffer(self._mm, dtype=torch.uint8)  # the whole segment
        self._peers = [r * _FLAG_STRIDE for r in range(size) if r != rank]
        # Each rank's pid sits next to its flag: a waiting rank notices a dead peer within a
        # sleep step instead of at the timeout (gloo noticed at once through closed sockets).
        self._flags[rank * _FLAG_STRIDE + 1] = os.getpid()
        self._seq = 0
        self.calls = 0  # collectives served from shared memory (tests check it is used)

    @classmethod
    def create(cls, group: dist.ProcessGroup, rank: int, size: int, slot_bytes: int,
               fallback: dist.ProcessGroup | None = None,
               timeout_s: float = 600.0) -> ShmCollectives:
        """Collective over `group` (the TP group's CPU control group): rank 0 creates the
        segment, every rank maps it, then rank 0 unlinks the name, so the memory goes away
        with the last process that maps it, even if every rank is killed."""
        name = [None]
        header = -(-(size * _FLAG_STRIDE * 8) // 4096) * 4096
        if rank == 0:
            root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
            path = os.path.join(root, f"mtpserve-tp-{uuid.uuid4().hex}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.ftruncate(fd, header + 2 * size * slot_bytes)  # zero-filled: flags = 0
            finally:
                os.close(fd)
            name = [path]
        dist.broadcast_object_list(name, src=0, group=group)
        try:
            shm = cls(name[0], rank, size, slot_bytes, fallback, timeout_s)
        finally:
            dist.barrier(group=group)  # every rank has mapped it (or failed trying)
            if rank == 0:
                os.unlink(name[0])
        return shm

    def close(self) -> None:
        del self._flags, self._bytes
        self._mm.close()

    # -- collectives ------------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (a new tensor; every rank gets the same bits)."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            out = x.clone()
            dist.all_reduce(out, group=self.fallback)
            return out
        slots = self._exchange(x, nbytes)
        out = slots[0].clone()
        for s in slots[1:]:
            out += s
        return out.view(x.shape)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dim, in rank order."""
        nbytes = x.numel() * x.element_size()
        if nbytes > self.slot_bytes:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.fallback)
            return torch.cat(parts, dim=-1)
        slots = self._exchange(x, nbytes)
        return torch.cat([s.view(x.shape) for s in slots], dim=-1)

    def _exchange(self, x: torch.Tensor, nbytes: int) -> list[torch.Tensor]:
        """Publish `x`, wait for every rank's, return views of all slots (flat, x's dtype)."""
        self._seq += 1
        self.calls += 1
        n = self._seq
        base = self._data_offset + (n & 1) * self.size * self.slot_bytes
        views = [self._bytes[base + r * self.slot_bytes: base + r * self.slot_bytes + nbytes]
                 .view(x.dtype) for r in range(self.size)]
        views[self.rank].copy_(x.reshape(-1))
        self._flags[self.rank * _FLAG_STRIDE] = n
        self._wait(n)
        return views

    def _wait(self, n: int) -> None:
        flags, spins, deadline = self._flags, 0, None
        for i in self._peers:
            while flags[i] < n:
                spins += 1
                if spins < _SPIN:
                    continue
                if spins < _YIELD:
                    os.sched_yield()
                    continue
                if deadline is None:
                    deadline = time.monotonic() + self.timeout_s
                elif time.monotonic() > deadline:
                    raise TimeoutError(f"TP rank {i // _FLAG_STRIDE} did not join shared-memory "
                                       f"collective {n} within {self.timeout_s:.0f} s")
                if spins % 512 == 0:  # every ~0.1 s of sleeping
                    self._check_alive(i)
                time.sleep(0.0002)

    def _check_alive(self, i: int) -> None:
        pid = int(self._flags[i + 1])
        if pid <= 0:  # not mapped yet (create() waits for every rank before any collective)
            return
        if not _alive(pid):
            raise RuntimeError(f"TP rank {i // _FLAG_STRIDE} (pid {pid}) exited during "
                               "a shared-memory collective")


def _alive(pid: int) -> bool:
    """Whether `pid` runs (an exited process not yet reaped by its parent counts as dead)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:  # no procfs: trust kill()
        return True
