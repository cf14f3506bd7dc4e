"""KVReceiver: the decode side. Pulls a request's KV slice from prefill ranks.

This module keeps one link per sender (store connection, channel, generation) and bounds
every call on it; what travels on the channel during a pull or probe is in exchanges.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from mtpserve.workers.device import runtime
from mtpserve.workers.kv_transfer.auth import KVAuth, Secret
from mtpserve.workers.kv_transfer.channel import (
    MAX_PROBE_BYTES,
    RECEIVER_RANK,
    KVTransferError,
    PairChannel,
    connect_store,
)
from mtpserve.workers.kv_transfer.deadlines import call_bounded, remaining
from mtpserve.workers.kv_transfer.exchanges import Exchange, IdlePairClosed
from mtpserve.workers.kv_transfer.mailbox import MAILBOX, post, post_to_senders

_CLOSE_TIMEOUT_S = 1.0  # a goodbye to a frozen sender must not hang our shutdown for long
_T = TypeVar("_T")

# Cumulative counters. Pulls: `bytes_received` (KV + extras payload) and `pull_seconds`
# (request sent -> last byte received) count successful pulls only, so achieved bandwidth is
# bytes_received / pull_seconds; `pulls` == `transfers` (kept for older readers). Probes count
# apart, so they never inflate the KV numbers.
# How long a pull waits for an earlier, hung call to its sender to end before failing.
_STUCK_WAIT_S = 2.0

_STAT_KEYS = (
    "bytes_received",
    "bytes_saved",  # KV not pulled: blocks this side's prefix cache already held
    "pairs_closed",  # idle pairs closed to stay within max_links
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
    dropped: bool = False  # an exchange on it failed or hung: waiters must not reuse it
    last_used: float = 0.0  # time.monotonic() of its last exchange (LRU close past max_links)
    retired: bool = False  # closed to stay within max_links: a caller takes a fresh link
    stream: Any = None  # CUDA: the pair's own stream; every NCCL op of the pair is issued on it


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
        max_links: int = 64,
        secret: Secret | bytes | None = None,
    ) -> None:
        self.receiver_id = f"{name}-{uuid.uuid4().hex[:8]}"
        # Live pairs (a store connection, a gloo/NCCL group, buffers) are budgeted: past
        # `max_links`, the least recently used idle one is closed before a new one opens.
        self.max_links = max(1, max_links)
        self.backend = backend
        self._device = torch.device(device)
        self._interface = interface
        self._secret = secret
        self._auth = KVAuth(secret)  # senders with the deployment's secret refuse unsigned
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
        skip_blocks: int = 0,
        copies: int = 1,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Fetch global KV heads [head_start, head_end) of a held request and ack it.

        Returns (kv [n_layers, 2, n_blocks, block_size, n_heads, head_dim] on this receiver's
        device, extras). `timeout_s` bounds the whole pull, connection included. With `buffer`
        (uint8 on this device) the bytes land in its prefix when they fit, so a caller that
        pulls one request after another allocates nothing; the results are then views into
        `buffer`, valid until the caller reuses it. `skip_blocks`: leading blocks this side
        already holds (its prefix cache); only the blocks after them travel. `copies`: how
        many decode ranks pull these heads from this sender (a replicated cache, see
        resharding.py); the sender keeps the hold until that many acks came.
        """
        heads = (head_start, head_end)
        what = f"the pull of request {request_id!r} from {sender_address}"

        def op(exchange: Exchange, link: _Link) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            return exchange.pull(request_id, heads, with_extras, buffer, skip_blocks, copies)

        return self._exchange(sender_address, what, timeout_s, op, "failures")

    def drop(self, sender_address: str, request_id: str, timeout_s: float = 5.0) -> bool:
        """Tell a sender that this decode group will not pull its hold of `request_id` (a
        replica of a replicated cache that another prefill rank served): a signed `drop` in
        its mailbox, posted on a store client of its own (a link's client may be waiting on a
        pull). True if the post went through within `timeout_s`."""
        return post_to_senders([sender_address], {"op": "drop", "request_id": request_id},
                               timeout_s, self._secret)

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

        def op(exchange: Exchange, link: _Link) -> dict[str, Any]:
            return exchange.probe(probe_id, self._probe_buffer(link, num_bytes))

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
                    done, _ = call_bounded(
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
        op: Callable[[Exchange, _Link], _T],
        failure_key: str,
    ) -> _T:
        """Run one ordered exchange (`op`) on the channel to `sender_address`.

        `timeout_s` bounds everything, connection included, from when this call has the pair
        to itself: waiting for the pair's lock while it serves an earlier pull (each bounded
        by its own deadline) does not use it up, so concurrent pulls from one live sender all
        complete. If the pair failed or hung meanwhile, waiters fail at once instead of each
        running down a full timeout against a frozen peer. `op` is retried once on a fresh
        channel if the sender had closed the idle pair before reading our request.
        """
        deadline = time.monotonic() + timeout_s
        try:
            with self._locked_link(sender_address, deadline) as link:
                if link.dropped:
                    raise KVTransferError(
                        f"KV sender {sender_address} failed an earlier exchange on this pair "
                        f"while {what} waited for it")
                deadline = time.monotonic() + timeout_s
                link.last_used = time.monotonic()
                abandoned = threading.Event()

                if self._device.type == "cuda" and link.stream is None:
                    link.stream = runtime().new_stream(self._device)

                def run() -> _T:
                    # Issued on this (helper) thread: the stream must be made current here.
                    with runtime().on_stream(link.stream):
                        return run_ops()

                def run_ops() -> _T:
                    try:
                        for attempt in (0, 1):
                            channel = self._ensure_channel(link, deadline)
                            exchange = Exchange(
                                channel, deadline, abandoned, self._device, self._count
                            )
                            try:
                                return op(exchange, link)
                            except IdlePairClosed:
                                if attempt:
                                    raise
                        raise AssertionError("unreachable")
                    finally:
                        if abandoned.is_set():  # the caller gave up: this link is dropped
                            self._close_link(link)

                done, result = call_bounded(run, deadline, abandoned)
                if not done:
                    self._drop(link, stuck=result)
                    raise KVTransferError(
                        f"KV sender {sender_address} did not answer during {what} within "
                        f"{timeout_s:.1f}s (its store is unresponsive); channel dropped"
                    )
                return result
        except KVTransferError:
            self._count({failure_key: 1})
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
            # A call to this sender hung earlier; it ends when the sender thaws or dies. Give
            # a thawing sender a moment, then fail (the request is recomputed elsewhere)
            # rather than spend every queued pull's whole timeout on a frozen peer.
            stuck.join(min(remaining(deadline, f"a hung call to {address} to end"),
                           _STUCK_WAIT_S))
            if stuck.is_alive():
                raise KVTransferError(f"KV sender {address} is still unresponsive")
            with self._lock:
                self._stuck.pop(address, None)
        done, store = call_bounded(
            lambda: connect_store(address, remaining(deadline, f"connecting to {address}")),
            deadline,
            threading.Event(),
        )
        if not done:
            with self._lock:
                self._stuck[address] = store
            raise KVTransferError(f"KV sender {address} accepted no store connection in time")
        with self._lock:
            # Another thread may have connected meanwhile; keep the first link.
            link = self._links.setdefault(address, _Link(address, store))
            idle = self._over_budget(keep=link)
        for old in idle:
            self._retire(old)
        return link

    @contextlib.contextmanager
    def _locked_link(self, address: str, deadline: float) -> Iterator[_Link]:
        """The link to `address`, its lock held; one retired for the pair budget between
        lookup and lock is replaced by a fresh one."""
        link = self._link(address, deadline)
        link.lock.acquire()
        try:
            while link.retired:
                link.lock.release()
                link = self._link(address, deadline)
                link.lock.acquire()
            yield link
        finally:
            link.lock.release()

    def _over_budget(self, keep: _Link) -> list[_Link]:
        """Under self._lock: the least recently used idle links beyond `max_links`, removed
        from the table (their owner closes them)."""
        out: list[_Link] = []
        excess = len(self._links) - self.max_links
        for link in sorted(self._links.values(), key=lambda x: x.last_used):
            if excess <= 0:
                break
            if link is keep or link.lock.locked():
                continue  # in use: a pull or probe is on it
            del self._links[link.address]
            link.retired = True
            out.append(link)
            excess -= 1
        return out

    def _retire(self, link: _Link) -> None:
        """Close an idle pair: tell the sender (bounded), then close our side."""
        with link.lock:
            channel = link.channel
            if channel is not None and channel.connected:
                done, _ = call_bounded(lambda c=channel: _say_close(c),
                                       time.monotonic() + _CLOSE_TIMEOUT_S, threading.Event())
                if not done:
                    return  # a frozen sender: its helper thread still holds the channel
            self._close_link(link)
        self._count({"pairs_closed": 1})

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
            post(link.store, MAILBOX, self._auth.stamp(announcement, MAILBOX))
        except (RuntimeError, dist.DistError) as e:
            self._drop(link)  # the sender's store is gone: reconnect from scratch next time
            raise KVTransferError(
                f"KV sender {link.address} is unreachable (store: {str(e).splitlines()[0]})"
            ) from e
        if old is None:
            link.channel = PairChannel.for_pair(
                link.store,
                self.receiver_id,
                RECEIVER_RANK,
                peer=f"prefill {link.address}",
                backend=self.backend,
                interface=self._interface,
                generation=generation,
                auth=self._auth,
            )
            link.channel.connect(remaining(deadline, f"connecting to {link.address}"))
        else:
            old.reconnect(generation, remaining(deadline, f"reconnecting to {link.address}"))
        return link.channel

    def _probe_buffer(self, link: _Link, num_bytes: int) -> torch.Tensor:
        """A [num_bytes] uint8 view of the link's probe buffer (caller holds link.lock)."""
        if link.probe_buf is None or link.probe_buf.numel() < num_bytes:
            link.probe_buf = None  # free the smaller one first: sizes go up to 1 GiB
            link.probe_buf = torch.empty(num_bytes, dtype=torch.uint8, device=self._device)
        return link.probe_buf[:num_bytes]  # a prefix: contiguous, so gloo/NCCL take it as is

    def _drop(self, link: _Link, stuck: threading.Thread | None = None) -> None:
        """Forget the link (the next pull reconnects); a stuck helper thread closes it later."""
        link.dropped = True
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]
            if stuck is not None:
                self._stuck[link.address] = stuck
        if stuck is None:
            self._close_link(link)

    def _count(self, deltas: Mapping[str, int | float]) -> None:
        with self._lock:
            for key, n in deltas.items():
                self._stats[key] += n

    @staticmethod
    def _close_link(link: _Link) -> None:
        if link.channel is not None:
            link.channel.close()
            link.channel = None


def _say_close(channel: PairChannel) -> None:
    try:
        channel.put({"op": "close"})
    except KVTransferError:
        pass  # the sender notices on its own
