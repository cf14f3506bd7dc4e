"""The decode side of one pull or probe on a connected pair channel.

Message order (the sender's side is pair_server.PairServer):
pull: pull -> header with shapes (or an error) -> KV + extras bytes -> ack.
probe: probe -> ok -> `num_bytes` raw bytes (no ack).
Both are timed the same way, request sent -> last byte received, so their rates compare.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from mtpserve.workers.kv_transfer.channel import KVTransferError, PairChannel, wait_stream
from mtpserve.workers.kv_transfer.deadlines import remaining
from mtpserve.workers.kv_transfer.packing import (
    extras_nbytes,
    parse_dtype,
    payload_layout,
    unpack_payload,
)


class IdlePairClosed(KVTransferError):
    """The sender had closed the idle pair before reading our request: reconnect and send it
    again."""


@dataclass(frozen=True)
class Exchange:
    """One pull or probe on `channel`, bounded by `deadline` and by its caller giving up."""

    channel: PairChannel
    deadline: float  # time.monotonic()
    abandoned: threading.Event  # set when the caller gave up waiting (deadlines.call_bounded)
    device: torch.device  # where received bytes land
    record: Callable[[Mapping[str, int | float]], None]  # adds to the receiver's stats

    def pull(
        self,
        request_id: str,
        heads: tuple[int, int],  # global [start, end)
        with_extras: bool,
        buffer: torch.Tensor | None = None,
        skip_blocks: int = 0,
        copies: int = 1,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(kv, extras) of the request's `heads`, acked; see `KVReceiver.pull` for `buffer`,
        `skip_blocks` and `copies`."""
        channel = self.channel
        head_start, head_end = heads
        what = f"request {request_id!r}"

        def left() -> float:  # checked before every op
            return self._left(f"the pull of {what}", what)

        header = {"head_start": head_start, "head_end": head_end, "extras": with_extras,
                  "skip_blocks": skip_blocks, "copies": copies}
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
        if fits and buffer.device.type == self.device.type:
            payload = buffer[:size]  # a prefix: contiguous, received in place
        else:
            payload = torch.empty(size, dtype=torch.uint8, device=self.device)
        if payload.numel():
            channel.recv(payload, left(), f"KV of {what}")
        self._settle(left(), f"KV of {what}")
        seconds = time.perf_counter() - t0
        left()  # no ack once abandoned: the sender then releases the request as failed
        channel.put({"op": "ack", "request_id": request_id})
        shape = reply["kv_shape"]  # [L, 2, n_blocks, block_size, h, D]
        per_block = kv_nbytes // shape[2] if shape[2] else 0
        self.record({"pulls": 1, "transfers": 1, "bytes_received": nbytes,
                     "bytes_saved": skip_blocks * per_block, "pull_seconds": seconds})
        return unpack_payload(payload, reply["kv_shape"], dtype, reply["extras"])

    def probe(self, probe_id: str, buf: torch.Tensor) -> dict[str, Any]:
        """Receive `buf.numel()` raw bytes into `buf` ([num_bytes] uint8); the rate achieved."""
        channel = self.channel
        num_bytes = buf.numel()
        what = f"probe {probe_id}"

        def left() -> float:
            return self._left(what, what)

        t0 = time.perf_counter()
        channel.put({"op": "probe", "probe_id": probe_id, "num_bytes": num_bytes})
        reply = channel.take(left(), f"the reply to {what}")
        _check_reply(channel, reply, ("probe_id", probe_id), what)
        if reply.get("num_bytes") != num_bytes:
            channel.mark_broken()  # the sender would send a different size: out of step
            raise KVTransferError(f"KV channel {channel.peer} answered {reply} to {what}")
        channel.recv(buf, left(), f"bytes of {what}")
        self._settle(left(), f"bytes of {what}")
        seconds = time.perf_counter() - t0
        self.record({"probes": 1, "probe_bytes": num_bytes, "probe_seconds": seconds})
        return {"bytes": num_bytes, "seconds": seconds, "gib_per_s": num_bytes / seconds / 2**30}

    def _settle(self, timeout_s: float, what: str) -> None:
        """Wait for a CUDA recv to land, within the deadline: NCCL's wait() may only order the
        current stream (the pair's own, see KVReceiver._exchange), not the host, and the clock
        must stop at the last byte. Only that stream is waited for, never the device; a recv
        stuck past the deadline (a dead peer) aborts the pair's communicator."""
        try:
            wait_stream(self.device, timeout_s)
        except TimeoutError as e:
            self.channel.mark_broken()
            raise KVTransferError(f"KV channel {self.channel.peer}: {what} did not land "
                                  f"within the deadline ({e}); channel aborted") from e

    def _left(self, op: str, what: str) -> float:
        """Seconds left for the next step of `op` (before `what`). An abandoned exchange breaks
        the channel: the caller has stopped waiting, so its stream is out of step."""
        if self.abandoned.is_set():
            self.channel.mark_broken()
            raise KVTransferError(f"{op} was abandoned")
        return remaining(self.deadline, what, self.channel)


def _check_reply(
    channel: PairChannel, reply: dict[str, Any], key: tuple[str, str], what: str
) -> None:
    """Raise unless `reply` is an ok answer carrying our id (`key` = (field, value))."""
    if reply.get("status") != "ok":
        if reply.get("retry") or reply.get("broken"):
            channel.mark_broken()
        if reply.get("retry"):  # the sender closed the idle pair before reading our request
            raise IdlePairClosed(f"KV sender {channel.peer} closed an idle channel")
        raise KVTransferError(f"KV sender {channel.peer} refused {what}: {reply.get('error')}")
    if reply.get(key[0]) != key[1]:
        channel.mark_broken()  # the stream is out of step; never hand over wrong bytes
        raise KVTransferError(f"KV channel {channel.peer} answered {reply} to {what}")
