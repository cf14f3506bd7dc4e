"""An ordered queue of small JSON messages kept in a c10d store (many writers, one reader)."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from mtpserve.workers.kv_transfer.auth import KVAuth, Secret

MAILBOX = "mailbox"  # queue in a sender's store where decode ranks announce (re)connections


class BadMessage(ValueError):
    """A queued message that is not a JSON object: skipped by its reader, which goes on."""


def post(store: dist.Store, queue: str, msg: dict[str, Any]) -> None:
    """Append `msg` to `queue`: one store round trip.

    The store's native queue (`queue_push`) is atomic, so any process or thread (e.g. an owner
    waking its own reader with a stop message) can append without coordination.
    """
    store.queue_push(queue, json.dumps(msg))


class QueueReader:
    """Reads one queue's messages in order; a read removes the message, so the store stays
    small. One blocking store round trip per message (`queue_pop`), no polling.

    Not thread-safe; a store client blocked in a read holds its connection, so a reader that
    waits for long should own its store client. Reads change the client's timeout for their
    duration only.
    """

    def __init__(self, store: dist.Store, queue: str) -> None:
        self._store = store
        self._queue = queue

    def get(self, timeout_s: float) -> dict[str, Any]:
        """Next message; raises TimeoutError after `timeout_s`, DistError if the store is gone."""
        store = self._store
        default = store.timeout
        store.set_timeout(timedelta(seconds=max(timeout_s, 1e-3)))  # local: no round trip
        try:
            raw = store.queue_pop(self._queue)
        except dist.DistStoreError as e:
            if "timeout" in str(e).lower():
                raise TimeoutError(f"no message on {self._queue} within {timeout_s:.1f}s") from e
            raise
        finally:
            store.set_timeout(default)
        try:
            msg = json.loads(raw)
        except ValueError as e:  # anyone who reaches the store can push bytes
            raise BadMessage(f"{self._queue}: not JSON ({len(raw)} bytes)") from e
        if not isinstance(msg, dict):
            raise BadMessage(f"{self._queue}: not a JSON object")
        return msg


def drop_holds(sender_addresses: list[str], request_id: str, timeout_s: float,
               secret: Secret | None = None) -> bool:
    """Release a request's KV holds by posting `drop` to every prefill rank's sender store:
    the orchestrator's release path that never waits behind prefill requests in a Serve
    queue. True if every post went through within `timeout_s` (a frozen store hangs its
    client, so each post runs bounded); the sender drops the hold when it reads it.
    `secret`: the deployment's KV secret (senders that have one ignore unsigned posts)."""
    return post_to_senders(sender_addresses, {"op": "drop", "request_id": request_id},
                           timeout_s, secret)


def renew_holds(sender_addresses: list[str], request_ids: list[str], timeout_s: float,
                secret: Secret | None = None) -> bool:
    """Extend the leases of held requests (one `renew` message per sender): a decode replica
    whose queue keeps them waiting for KV blocks says it still wants them."""
    return post_to_senders(sender_addresses, {"op": "renew", "request_ids": list(request_ids)},
                           timeout_s, secret)


def post_to_senders(sender_addresses: list[str], msg: dict[str, Any], timeout_s: float,
                    secret: Secret | None = None) -> bool:
    """Post one signed mailbox message to each sender store, each post bounded; True if all
    went through within `timeout_s`."""
    import threading
    import time

    from mtpserve.workers.kv_transfer.channel import connect_store
    from mtpserve.workers.kv_transfer.deadlines import call_bounded

    auth = KVAuth(secret)
    deadline = time.monotonic() + timeout_s
    for address in sender_addresses:
        def send(a: str = address) -> None:
            post(connect_store(a, max(deadline - time.monotonic(), 1e-3)), MAILBOX,
                 auth.stamp(msg, MAILBOX))
        try:
            done, _ = call_bounded(send, deadline, threading.Event())
        except Exception:  # unreachable store: the caller falls back
            return False
        if not done:
            return False
    return True
