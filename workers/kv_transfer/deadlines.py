"""Deadlines of the decode side: time left before one, and calls bounded by one even when
the peer's TCPStore freezes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from mtpserve.workers.kv_transfer.channel import KVTransferError, PairChannel

# How long past its deadline a bounded call may run: its own timeouts should fire first and
# report better errors than "did not answer".
GRACE_S = 0.5


def call_bounded(
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
    thread.join(max(deadline - time.monotonic(), 0.0) + GRACE_S)
    if thread.is_alive():
        abandoned.set()
        return False, thread
    if "error" in box:
        raise box["error"]
    return True, box["value"]


def remaining(deadline: float, what: str, channel: PairChannel | None = None) -> float:
    """Seconds left before `deadline` (time.monotonic()); KVTransferError if none are."""
    left = deadline - time.monotonic()
    if left <= 0:
        if channel is not None:
            channel.mark_broken()  # mid-exchange: the stream is out of step now
        raise KVTransferError(f"KV pull deadline passed before {what}")
    return left
