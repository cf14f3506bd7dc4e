"""An ordered queue of small JSON messages kept in a c10d store (many writers, one reader)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

MAILBOX = "mailbox"  # queue in a sender's store where decode ranks announce (re)connections


def post(store: dist.Store, queue: str, msg: dict[str, Any]) -> int:
    """Append `msg` to `queue`; returns its slot.

    Slots come from the store's atomic counter, so any process or thread (e.g. an owner waking
    its own reader with a stop message) can append without coordination.
    """
    slot = store.add(f"{queue}/n", 1)  # first slot is 1
    store.set(f"{queue}/{slot}", json.dumps(msg))
    return slot


class QueueReader:
    """Reads one queue's messages in slot order and deletes them, so the store stays small.

    Not thread-safe; a store client blocked in `wait` holds its connection, so a reader that
    waits for long should own its store client.
    """

    def __init__(self, store: dist.Store, queue: str) -> None:
        self._store = store
        self._queue = queue
        self._next = 1

    def get(self, timeout_s: float) -> dict[str, Any]:
        """Next message; raises TimeoutError after `timeout_s`, DistError if the store is gone."""
        key = f"{self._queue}/{self._next}"
        try:
            self._store.wait([key], timedelta(seconds=max(timeout_s, 1e-3)))
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower():
                raise TimeoutError(f"no message on {self._queue} within {timeout_s:.1f}s") from e
            raise
        msg = json.loads(self._store.get(key))
        self._store.delete_key(key)
        self._next += 1
        return msg
