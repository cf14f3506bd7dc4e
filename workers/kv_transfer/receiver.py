"""KVReceiver: the decode side. Pulls a request's KV slice from prefill ranks."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from mtpserve.workers.kv_transfer.channel import (
    MAX_PROBE_BYTES,
    RECEIVER_RANK,
    KVTransferError,
    PairChannel,
    connect_store,
)
from mtpserve.workers.kv_transfer.mailbox import MAILBOX, post
from mtpserve.workers.kv_transfer.packing import (
    extras_nbytes,
    parse_dtype,
    payload_layout,
    unpack_payload,
)

_GRACE_S = 0.5
_CLOSE_TIMEOUT_S = 1.0
_T = TypeVar("_T")

# Cumulative counters. Pulls: `bytes_received` (KV + extras payload) and `pull_seconds`
# (request sent -> last byte received) count successful pulls only, so achieved bandwidth is
# bytes_received / pull_seconds; `pulls` == `transfers` (kept for older readers). Probes count
# apart, so they never inflate the KV numbers.
_STAT_KEYS = (
    "bytes_received",
    "pull_seconds",
    "pulls",
    "transfers",
    "failures",
    "probes",
    "probe_bytes",
    "probe_seconds",
    "probe_failures",
    "channel_builds",
    "channel_rebuilds",
)


@dataclass
class _Link:
    """This receiver's channel to one sender, with the lock that keeps its stream ordered."""

    address: str
    store: dist.TCPStore
    channel: PairChannel | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    probe_buf: torch.Tensor | None = None  # grow-only, so repeated probes allocate nothing


class KVReceiver:
    """Pulls KV from KVSenders; one per decode rank, one cached channel per sender.

    `pull` drives the whole exchange (the sender only answers), so one prefill rank can serve
    any number of decode ranks. A failed pull raises KVTransferError naming the peer, request
    and step; the channel is rebuilt under a new generation on the next pull to that sender.
    Pulls to different senders may run concurrently from different threads.
    """

    def __init__(
        self,
        *,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        interface: str | None = None,
        name: str = "decode",
    ) -> None:
        self.receiver_id = f"{name}-{uuid.uuid4().hex[:8]}"
        self.backend = backend
        self._device = torch.device(device)
        self._interface = interface
        self._lock = threading.Lock()
        self._links: dict[str, _Link] = {}
        self._generation = 0  # per receiver, so every (re)connection gets a fresh namespace
        self._closed = False
        self._stuck: dict[str, threading.Thread] = {}  # address -> call hung on a frozen sender
        self._stats: dict[str, int | float] = dict.fromkeys(_STAT_KEYS, 0)
        self._stats["pull_seconds"] = self._stats["probe_seconds"] = 0.0
        self._probe_id = 0

    def pull(
        self,
        sender_address: str,
        request_id: str,
        head_start: int,
        head_end: int,
        timeout_s: float = 30.0,
        *,
        with_extras: bool = True,
        buffer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Fetch global KV heads [head_start, head_end) of a held request and ack it.

        Returns (kv [n_layers, 2, n_blocks, block_size, n_heads, head_dim] on this receiver's
        device, extras). `timeout_s` bounds the whole pull, connection included. With `buffer`
        (uint8 on this device) the bytes land in its prefix when they fit, so a caller that
        pulls one request after another allocates nothing; the results are then views into
        `buffer`, valid until the caller reuses it.
        """
        heads = (head_start, head_end)
        what = f"the pull of request {request_id!r} from {sender_address}"

        def op(
            channel: PairChannel, link: _Link, deadline: float, abandoned: threading.Event
        ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return self._pull_on(
                channel, request_id, heads, with_extras, deadline, abandoned, buffer
            )

        return self._exchange(sender_address, what, timeout_s, op, "failures")

    def probe(self, sender_address: str, num_bytes: int, timeout_s: float = 30.0) -> dict[str, Any]:
        """Raw bandwidth of the channel KV pulls use: `num_bytes` bytes, no packing, no ack.

        Timed like a pull (request sent -> last byte received, after the same control round
        trip), into a buffer allocated before the clock starts. Returns {"bytes", "seconds",
        "gib_per_s"}. A probe is a channel op like a pull: a failure raises KVTransferError
        and the channel is rebuilt on its next use. The first probe of a new, larger size
        includes the sender's one-off buffer allocation (and, on NCCL, the first op of a pair
        builds the communicator), so benchmarks should discard a warm-up probe.
        """
        if not isinstance(num_bytes, int) or not 0 < num_bytes <= MAX_PROBE_BYTES:
            raise ValueError(
                f"probe size must be in (0, {MAX_PROBE_BYTES}] bytes (1 GiB), got {num_bytes}"
            )
        with self._lock:
            self._probe_id += 1
            probe_id = f"{self.receiver_id}/p{self._probe_id}"
        what = f"probe {probe_id} of {num_bytes} bytes from {sender_address}"

        def op(
            channel: PairChannel, link: _Link, deadline: float, abandoned: threading.Event
        ) -> dict[str, Any]:
            buf = self._probe_buffer(link, num_bytes)
            return self._probe_on(channel, probe_id, buf, deadline, abandoned)

        return self._exchange(sender_address, what, timeout_s, op, "probe_failures")

    def stats(self) -> dict[str, int | float]:
        """Cumulative counters (see _STAT_KEYS) plus the number of open channels."""
        with self._lock:
            return {**self._stats, "channels": len(self._links)}

    def close(self) -> None:
        """Tell senders we are gone and close every channel and store connection."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            with link.lock:
                channel = link.channel
                if channel is not None and channel.connected:
                    # Best effort and bounded: a frozen sender must not hang our shutdown.
                    done, _ = _call_bounded(
                        lambda c=channel: _say_close(c),
                        time.monotonic() + _CLOSE_TIMEOUT_S,
                        threading.Event(),
                    )
                    if not done:
                        continue  # the helper thread still uses the link; leave it be
                self._close_link(link)

    # -- internals -------------------------------------------------------------------------------

    def _exchange(
        self,
        sender_address: str,
        what: str,
        timeout_s: float,
        op: Callable[[PairChannel, _Link, float, threading.Event], _T],
        failure_key: str,
    ) -> _T:
        """Run one ordered exchange (`op`) on the channel to `sender_address`.

        `timeout_s` bounds everything, connection included. `op` is retried once on a fresh
        channel if the sender had closed the idle pair before reading our request.
        """
        deadline = time.monotonic() + timeout_s
        try:
            link = self._link(sender_address, deadline)
            with link.lock:
                abandoned = threading.Event()

                def run() -> _T:
                    try:
                        for attempt in (0, 1):
                            channel = self._ensure_channel(link, deadline)
                            try:
                                return op(channel, link, deadline, abandoned)
                            except _Retry:
                                if attempt:
                                    raise
                        raise AssertionError("unreachable")
                    finally:
                        if abandoned.is_set():  # the caller gave up: this link is dropped
                            self._close_link(link)

                done, result = _call_bounded(run, deadline, abandoned)
                if not done:
                    self._drop(link, stuck=result)
                    raise KVTransferError(
                        f"KV sender {sender_address} did not answer during {what} within "
                        f"{timeout_s:.1f}s (its store is unresponsive); channel dropped"
                    )
                return result
        except KVTransferError:
            with self._lock:
                self._stats[failure_key] += 1
            raise

    def _link(self, address: str, deadline: float) -> _Link:
        with self._lock:
            if self._closed:
                raise RuntimeError("KVReceiver is closed")
            link = self._links.get(address)
            stuck = self._stuck.get(address)
        if link is not None:
            return link
        if stuck is not None:
            # A call to this sender hung earlier; it ends when the sender thaws or dies.
            stuck.join(_remaining(deadline, f"a hung call to {address} to end"))
            if stuck.is_alive():
                raise KVTransferError(f"KV sender {address} is still unresponsive")
            with self._lock:
                self._stuck.pop(address, None)
        done, store = _call_bounded(
            lambda: connect_store(address, _remaining(deadline, f"connecting to {address}")),
            deadline,
            threading.Event(),
        )
        if not done:
            with self._lock:
                self._stuck[address] = store
            raise KVTransferError(f"KV sender {address} accepted no store connection in time")
        with self._lock:
            # Another thread may have connected meanwhile; keep the first link.
            return self._links.setdefault(address, _Link(address, store))

    def _ensure_channel(self, link: _Link, deadline: float) -> PairChannel:
        """The link's connected channel; (re)builds it under a fresh generation if needed."""
        old = link.channel
        if old is not None and old.connected:
            return old
        with self._lock:
            self._generation += 1
            generation = self._generation
            self._stats["channel_builds" if old is None else "channel_rebuilds"] += 1
        try:
            # The announcement tells the sender to (re)start its side at this generation.
            announcement = {"op": "connect", "receiver": self.receiver_id, "generation": generation}
            post(link.store, MAILBOX, announcement)
        except (RuntimeError, dist.DistError) as e:
            self._drop(link)  # the sender's store is gone: reconnect from scratch next time
            raise KVTransferError(
                f"KV sender {link.address} is unreachable (store: {str(e).splitlines()[0]})"
            ) from e
        if old is None:
            link.channel = PairChannel(
                link.store,
                f"pair/{self.receiver_id}",
                RECEIVER_RANK,
                peer=f"prefill {link.address}",
                backend=self.backend,
                interface=self._interface,
                generation=generation,
            )
            link.channel.connect(_remaining(deadline, f"connecting to {link.address}"))
        else:
            old.reconnect(generation, _remaining(deadline, f"reconnecting to {link.address}"))
        return link.channel

    def _pull_on(
        self,
        channel: PairChannel,
        request_id: str,
        heads: tuple[int, int],  # global [start, end)
        with_extras: bool,
        deadline: float,
        abandoned: threading.Event,
        buffer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        head_start, head_end = heads
        what = f"request {request_id!r}"

        def left() -> float:  # checked before every op
            if abandoned.is_set():
                channel.mark_broken()
                raise KVTransferError(f"the pull of {what} was abandoned")
            return _remaining(deadline, what, channel)

        header = {"head_start": head_start, "head_end": head_end, "extras": with_extras}
        t0 = time.perf_counter()  # request -> last byte, the same span a probe times
        channel.put({"op": "pull", "request_id": request_id, **header})
        reply = channel.take(left(), f"the reply to the pull of {what}")
        _check_reply(
            channel,
            reply,
            ("request_id", request_id),
            f"the pull of {what} (heads [{head_start}, {head_end}))",
        )
        # One buffer for [n_layers, 2, n_blocks, block_size, n_heads, head_dim] KV + extras
        dtype = parse_dtype(reply["kv_dtype"])
        kv_nbytes, extras_offset = payload_layout(reply["kv_shape"], dtype, reply["extras"])
        nbytes = kv_nbytes + extras_nbytes(reply["extras"])  # the payload, without padding
        size = extras_offset + nbytes - kv_nbytes
        fits = buffer is not None and buffer.numel() >= size
        if fits and buffer.device.type == self._device.type:
            payload = buffer[:size]  # a prefix: contiguous, received in place
        else:
            payload = torch.empty(size, dtype=torch.uint8, device=self._device)
        if payload.numel():
            channel.recv(payload, left(), f"KV of {what}")
        _sync(self._device)
        seconds = time.perf_counter() - t0
        left()  # no ack once abandoned: the sender then releases the request as failed
        channel.put({"op": "ack", "request_id": request_id})
        with self._lock:
            self._stats["pulls"] += 1
            self._stats["transfers"] += 1
            self._stats["bytes_received"] += nbytes
            self._stats["pull_seconds"] += seconds
        return unpack_payload(payload, reply["kv_shape"], dtype, reply["extras"])

    def _probe_buffer(self, link: _Link, num_bytes: int) -> torch.Tensor:
        """A [num_bytes] uint8 view of the link's probe buffer (caller holds link.lock)."""
        if link.probe_buf is None or link.probe_buf.numel() < num_bytes:
            link.probe_buf = None  # free the smaller one first: sizes go up to 1 GiB
            link.probe_buf = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)
        return link.probe_buf[:num_bytes]  # a prefix: contiguous, so gloo/NCCL take it as is

    def _probe_on(
        self,
        channel: PairChannel,
        probe_id: str,
        buf: torch.Tensor,  # [num_bytes] uint8
        deadline: float,
        abandoned: threading.Event,
    ) -> dict[str, Any]:
        num_bytes = buf.numel()
        what = f"probe {probe_id}"

        def left() -> float:
            if abandoned.is_set():
                channel.mark_broken()
                raise KVTransferError(f"{what} was abandoned")
            return _remaining(deadline, what, channel)

        t0 = time.perf_counter()
        channel.put({"op": "probe", "probe_id": probe_id, "num_bytes": num_bytes})
        reply = channel.take(left(), f"the reply to {what}")
        _check_reply(channel, reply, ("probe_id", probe_id), what)
        if reply.get("num_bytes") != num_bytes:
            channel.mark_broken()  # the sender would send a different size: out of step
            raise KVTransferError(f"KV channel {channel.peer} answered {reply} to {what}")
        channel.recv(buf, left(), f"bytes of {what}")
        _sync(self._device)
        seconds = time.perf_counter() - t0
        with self._lock:
            self._stats["probes"] += 1
            self._stats["probe_bytes"] += num_bytes
            self._stats["probe_seconds"] += seconds
        return {"bytes": num_bytes, "seconds": seconds, "gib_per_s": num_bytes / seconds / 2**30}

    def _drop(self, link: _Link, stuck: threading.Thread | None = None) -> None:
        """Forget the link (the next pull reconnects); a stuck helper thread closes it later."""
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]
            if stuck is not None:
                self._stuck[link.address] = stuck
        if stuck is None:
            self._close_link(link)

    @staticmethod
    def _close_link(link: _Link) -> None:
        if link.channel is not None:
            link.channel.close()
            link.channel = None


class _Retry(KVTransferError):
    """The sender did not see the pull: reconnect and send it again."""


def _check_reply(
    channel: PairChannel, reply: dict[str, Any], key: tuple[str, str], what: str
) -> None:
    """Raise unless `reply` is an ok answer carrying our id (`key` = (field, value))."""
    if reply.get("status") != "ok":
        if reply.get("retry") or reply.get("broken"):
            channel.mark_broken()
        if reply.get("retry"):  # the sender closed the idle pair before reading our request
            raise _Retry(f"KV sender {channel.peer} closed an idle channel")
        raise KVTransferError(f"KV sender {channel.peer} refused {what}: {reply.get('error')}")
    if reply.get(key[0]) != key[1]:
        channel.mark_broken()  # the stream is out of step; never hand over wrong bytes
        raise KVTransferError(f"KV channel {channel.peer} answered {reply} to {what}")


def _sync(device: torch.device) -> None:
    """Wait for a CUDA recv to land: NCCL's wait() may only order the stream, not the host,
    and the clock must stop at the last byte."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _say_close(channel: PairChannel) -> None:
    try:
        channel.put({"op": "close"})
    except KVTransferError:
        pass  # the sender notices on its own


def _call_bounded(
    fn: Callable[[], Any], deadline: float, abandoned: threading.Event
) -> tuple[bool, Any]:
    """Run `fn` on a helper thread; (True, result) or, past `deadline`, (False, the thread).

    Why: a TCPStore client blocks without bound when its server is frozen (SIGSTOP, a network
    partition), even in `wait` with a timeout, so only gloo ops honor their timeouts. The
    hung call is abandoned (`abandoned` is set for it to see) and ends when the peer thaws
    or its connection dies. Exceptions of `fn` are re-raised here.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # handed to the caller
            box["error"] = e

    thread = threading.Thread(target=run, name="kv-receiver-call", daemon=True)
    thread.start()
    # Grace past the deadline: fn's own timeouts should fire first and report better errors.
    thread.join(max(deadline - time.monotonic(), 0.0) + _GRACE_S)
    if thread.is_alive():
        abandoned.set()
        return False, thread
    if "error" in box:
        raise box["error"]
    return True, box["value"]


def _remaining(deadline: float, what: str, channel: PairChannel | None = None) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        if channel is not None:
            channel.mark_broken()  # mid-exchange: the stream is out of step now
        raise KVTransferError(f"KV pull deadline passed before {what}")
    return left
