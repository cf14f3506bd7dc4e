"""A message channel between the Serve shell and its engine core process over shared memory.

Each direction is a single-producer single-consumer byte ring in a `memfd` mapping that both
processes map. A sender pickles the message (plain Python objects; tensors never cross),
copies the frame into the ring and publishes the new write position; it rings the doorbell
only when the receiver said it is about to sleep, so a receiver that is busy draining takes
any number of messages with no system call at all. The doorbell is one byte on the Unix
socket pair the two processes share: a sleeping receiver blocks in `recv` on it, which also
returns EOF the moment the peer process dies (no extra file descriptor to watch).

Ordering: a writer stores the payload, then a full fence, then the write position; a reader
loads the write position, a fence, then the payload, and stores its read position only after
a fence past its last read of the ring. The "I will sleep" flag and the write position form a
Dekker pair (each side stores its own, fences, then loads the other's), so a wake-up is never
lost. CPython has no atomics API; a lock's acquire/release (a pthread mutex: a locked
read-modify-write) is the fence, and 8-byte positions at 8-byte aligned offsets are written
by one aligned store (a memoryview cast to native "Q": `struct`'s little-endian "<Q" goes
byte by byte, and a torn position read mid-update can run past the data).

Linux only (`memfd_create`); `ProcessCore` falls back to the socket elsewhere.
"""

from __future__ import annotations

import mmap
import os
import pickle
import select
import socket
import struct
import threading
import time
from typing import Any

RING_BYTES = 4 << 20  # a batch of chunks is a few KiB; a prefix summary can be a few hundred

_LEN = struct.Struct("<Q")  # a frame's length prefix
# Header, 8-byte words: the writer's position, the reader's position and the reader's sleep
# flag, each on its own cache line so the two processes do not write the same line.
_WRITE_POS, _READ_POS, _SLEEPING = 0, 8, 16
_DATA = 192
# A full ring makes the writer wait for the reader, polling this often.
_FULL_POLL_S = 0.0005

_fence_lock = threading.Lock()


def _fence() -> None:
    with _fence_lock:
        pass


def available() -> bool:
    return hasattr(os, "memfd_create")


class Ring:
    """One direction: a memfd-backed byte ring (an inheritable file descriptor, so a child
    started with `pass_fds` maps the same memory)."""

    def __init__(self, mem_fd: int, capacity: int) -> None:
        self.mem_fd, self.capacity = mem_fd, capacity
        self.mm = mmap.mmap(mem_fd, _DATA + capacity)
        self.buf = memoryview(self.mm)
        self.words = self.buf[:_DATA].cast("Q")

    @classmethod
    def create(cls, capacity: int = RING_BYTES) -> Ring:
        mem_fd = os.memfd_create("mtpserve-core-ring", 0)
        os.ftruncate(mem_fd, _DATA + capacity)
        os.set_inheritable(mem_fd, True)
        return cls(mem_fd, capacity)

    def fds(self) -> list[int]:
        return [self.mem_fd]

    def close(self) -> None:
        self.words.release()
        self.buf.release()
        self.mm.close()
        try:
            os.close(self.mem_fd)
        except OSError:
            pass


def _peer_gone(sock: socket.socket) -> bool:
    """Whether the peer's end of `sock` closed, without waiting and without taking the
    doorbell bytes that are the reader's."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # our end is closed
        return True


class Writer:
    """The sending end of one ring (callers serialize `send` themselves)."""

    def __init__(self, ring: Ring, bell: socket.socket) -> None:
        self.ring = ring
        self.bell = bell
        self.w = ring.words[_WRITE_POS]  # only this writer moves it
        self.closed = False  # set from another thread to stop a send waiting on a full ring

    def send(self, obj: Any) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self._write(_LEN.pack(len(payload)) + payload)
        _fence()  # the published position before the look at the sleep flag (Dekker)
        if self.ring.words[_SLEEPING]:
            self._ring_bell()

    def _write(self, data: bytes) -> None:
        r = self.ring
        cap, buf, words = r.capacity, r.buf, r.words
        w, n = self.w, len(data)
        start = w % cap
        if n <= cap - (w - words[_READ_POS]) and start + n <= cap:  # fits, no wrap: one copy
            buf[_DATA + start:_DATA + start + n] = data
            self._publish(w + n)
            return
        view = memoryview(data)
        while view:
            free = cap - (w - words[_READ_POS])
            if free == 0:  # the reader has a full ring to drain: wake it, then wait
                self._ring_bell()
                time.sleep(_FULL_POLL_S)
                if self.closed or _peer_gone(self.bell):
                    raise OSError("the channel is closed")
                continue
            start = w % cap
            n = min(len(view), free, cap - start)
            buf[_DATA + start:_DATA + start + n] = view[:n]
            view = view[n:]
            w += n
            self._publish(w)

    def _publish(self, w: int) -> None:
        _fence()  # the bytes before the position that publishes them
        self.w = self.ring.words[_WRITE_POS] = w

    def _ring_bell(self) -> None:
        try:
            self.bell.send(b"\0", socket.MSG_DONTWAIT)
        except BlockingIOError:  # the socket is full of doorbells: the reader wakes anyway
            pass


class Reader:
    """The receiving end of one ring; `recv` blocks until a message arrives and raises
    EOFError once the peer's end of the doorbell socket closed (the peer process is gone)."""

    def __init__(self, ring: Ring, bell: socket.socket) -> None:
        self.ring = ring
        self.bell = bell
        self.rp = ring.words[_READ_POS]  # only this reader moves it
        self._pending = bytearray()  # a frame's beginning, when it wrapped or is partial
        self._messages: list[Any] = []

    def recv(self, timeout_s: float | None = None) -> Any:
        """The next message; TimeoutError past `timeout_s` (None: wait for ever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._messages:
            if not self._drain():
                self._sleep(deadline)
        return self._messages.pop(0)

    def _drain(self) -> bool:
        """Unpickle what the writer published; False if nothing was."""
        r = self.ring
        cap, buf, words = r.capacity, r.buf, r.words
        rp, w = self.rp, words[_WRITE_POS]
        if w == rp:
            return False
        _fence()  # the position before the bytes it publishes
        start = rp % cap
        if not self._pending and start + (w - rp) <= cap:  # contiguous: read in place
            with buf[_DATA + start:_DATA + start + (w - rp)] as view:
                used = self._split(view)
                self._pending += view[used:]
        else:
            while rp < w:
                start = rp % cap
                n = min(w - rp, cap - start)
                self._pending += buf[_DATA + start:_DATA + start + n]
                rp += n
            with memoryview(self._pending) as view:  # released before the resize below
                used = self._split(view)
            del self._pending[:used]
        _fence()  # every read of the ring before the position that lets the writer reuse it
        self.rp = words[_READ_POS] = w
        return True

    def _split(self, view: memoryview) -> int:
        """Unpickle the whole frames at the start of `view`; the bytes they took."""
        off, size = 0, len(view)
        while size - off >= 8:
            n = _LEN.unpack_from(view, off)[0]
            if size - off - 8 < n:
                break
            self._messages.append(pickle.loads(view[off + 8:off + 8 + n]))
            off += 8 + n
        return off

    def _sleep(self, deadline: float | None) -> None:
        words = self.ring.words
        words[_SLEEPING] = 1
        _fence()  # the flag before the second look at the position (Dekker)
        try:
            if words[_WRITE_POS] != self.rp:
                return
            if deadline is not None:
                ready, _, _ = select.select([self.bell], [], [],
                                            max(0.0, deadline - time.monotonic()))
                if not ready:
                    raise TimeoutError
            if not self.bell.recv(4096):  # doorbells (any number), or EOF
                raise EOFError("the peer process is gone")
        finally:
            words[_SLEEPING] = 0


class ShmChannel:
    """Both directions between two processes: `send` / `recv` like a multiprocessing
    `Connection`, EOFError when the peer is gone."""

    def __init__(self, send_ring: Ring, recv_ring: Ring, sock: socket.socket) -> None:
        self.sock = sock  # both doorbells, and EOF when the peer dies
        self._writer = Writer(send_ring, sock)
        self._reader = Reader(recv_ring, sock)
        self._rings = (send_ring, recv_ring)

    def send(self, obj: Any) -> None:
        if self._writer.closed:
            raise OSError("the channel is closed")
        self._writer.send(obj)

    def recv(self, timeout_s: float | None = None) -> Any:
        return self._reader.recv(timeout_s)

    def close(self) -> None:
        """Stop a blocked send and close the socket (the peer's recv sees EOF)."""
        self._writer.closed = True
        try:
            self.sock.close()
        except OSError:
            pass

    def release(self) -> None:
        for ring in self._rings:
            ring.close()


def fds_arg(to_core: Ring, to_shell: Ring) -> str:
    """The child's view of the two rings, as one argv item."""
    return f"{to_core.mem_fd},{to_shell.mem_fd},{to_core.capacity}"


def child_channel(arg: str, sock: socket.socket) -> ShmChannel:
    """The core's end, from `fds_arg`: it reads the shell -> core ring, writes the other."""
    in_mem, out_mem, cap = map(int, arg.split(","))
    return ShmChannel(Ring(out_mem, cap), Ring(in_mem, cap), sock)
