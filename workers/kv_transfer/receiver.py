"""KVReceiver: the decode side. Pulls a request's KV slice from prefill ranks."""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from workers.kv_transfer.channel import (
    RECEIVER_RANK,
    KVTransferError,
    PairChannel,
    connect_store,
)
from workers.kv_transfer.mailbox import MAILBOX, post
from workers.kv_transfer.packing import extras_nbytes, parse_dtype, unpack_extras


@dataclass
class _Link:
    """This receiver's channel to one sender, with the lock that keeps its stream ordered."""

    address: str
    store: dist.TCPStore
    channel: PairChannel | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


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
        self._stats = dict.fromkeys(
            ("bytes_received", "transfers", "failures", "channel_builds", "channel_rebuilds"), 0
        )

    def pull(
        self,
        sender_address: str,
        request_id: str,
        head_start: int,
        head_end: int,
        timeout_s: float = 30.0,
        *,
        with_extras: bool = True,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Fetch global KV heads [head_start, head_end) of a held request and ack it.

        Returns (kv [n_layers, 2, n_blocks, block_size, n_heads, head_dim] on this receiver's
        device, extras). `timeout_s` bounds the whole pull, connection included.
        """
        deadline = time.monotonic() + timeout_s
        link = self._link(sender_address, deadline)
        with link.lock:
            try:
                channel = self._ensure_channel(link, deadline)
                return self._pull_on(
                    channel, request_id, head_start, head_end, with_extras, deadline
                )
            except KVTransferError:
                with self._lock:
                    self._stats["failures"] += 1
                raise

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "channels": len(self._links)}

    def close(self) -> None:
        """Tell senders we are gone and close every channel and store connection."""
        with self._lock:
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            with link.lock:
                if link.channel is not None:
                    if link.channel.connected:
                        try:
                            link.channel.put({"op": "close"})
                        except KVTransferError:
                            pass
                    link.channel.close()
                    link.channel = None

    # -- internals -------------------------------------------------------------------------------

    def _link(self, address: str, deadline: float) -> _Link:
        with self._lock:
            if self._closed:
                raise RuntimeError("KVReceiver is closed")
            link = self._links.get(address)
        if link is not None:
            return link
        store = connect_store(address, _remaining(deadline, f"connecting to {address}"))
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
        head_start: int,
        head_end: int,
        with_extras: bool,
        deadline: float,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        what = f"request {request_id!r}"

        def left() -> float:
            return _remaining(deadline, what, channel)

        heads = {"head_start": head_start, "head_end": head_end}
        channel.put({"op": "pull", "request_id": request_id, **heads, "extras": with_extras})
        reply = channel.take(left(), f"the reply to the pull of {what}")
        if reply.get("status") != "ok":
            if reply.get("broken"):
                channel.mark_broken()
            raise KVTransferError(
                f"KV sender {channel.peer} refused the pull of {what} "
                f"(heads [{head_start}, {head_end})): {reply.get('error')}"
            )
        if reply.get("request_id") != request_id:
            channel.mark_broken()  # the stream is out of step; never hand over wrong KV
            raise KVTransferError(f"KV channel {channel.peer} answered {reply} to {what}")
        # [n_layers, 2, n_blocks, block_size, n_heads, head_dim]
        dtype = parse_dtype(reply["kv_dtype"])
        kv = torch.empty(reply["kv_shape"], dtype=dtype, device=self._device)
        if kv.numel():
            channel.recv(kv, left(), f"KV of {what}")
        blob = torch.empty(extras_nbytes(reply["extras"]), dtype=torch.uint8, device=self._device)
        if blob.numel():
            channel.recv(blob, left(), f"extras of {what}")
        channel.put({"op": "ack", "request_id": request_id})
        with self._lock:
            self._stats["transfers"] += 1
            self._stats["bytes_received"] += kv.numel() * kv.element_size() + blob.numel()
        return kv, unpack_extras(reply["extras"], blob)

    def _drop(self, link: _Link) -> None:
        with self._lock:
            if self._links.get(link.address) is link:
                del self._links[link.address]
        if link.channel is not None:
            link.channel.close()
            link.channel = None


def _remaining(deadline: float, what: str, channel: PairChannel | None = None) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        if channel is not None:
            channel.mark_broken()  # mid-exchange: the stream is out of step now
        raise KVTransferError(f"KV pull deadline passed before {what}")
    return left
