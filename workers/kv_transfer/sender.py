"""KVSender: the prefill side. Holds finished requests' KV until the decode side pulls it.

This module owns the holds (TTL expiry, packing ahead, release accounting) and the pairs'
lifecycle (accepting announced decode ranks, interrupting replaced pairs); the pull protocol
of each pair runs on its own thread in `pair_server.PairServer`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mtpserve.workers.device import runtime
from mtpserve.workers.kv_transfer.auth import KVAuth, ReplayGuard, Secret
from mtpserve.workers.kv_transfer.channel import (
    SENDER_RANK,
    KVTransferError,
    PairChannel,
    connect_store,
    listen_store,
)
from mtpserve.workers.kv_transfer.mailbox import MAILBOX, BadMessage, QueueReader, post
from mtpserve.workers.kv_transfer.packing import Packed, pack_payload
from mtpserve.workers.kv_transfer.pair_server import IDLE_WAIT_S, PairServer

logger = logging.getLogger(__name__)

# "acked" / "expired" / "failed" count releases by reason. `bytes_sent` is the KV + extras
# payload of acked transfers; bandwidth probes count apart in `probes` / `probe_bytes_sent`.
_STAT_KEYS = (
    "bytes_sent",
    "transfers",
    "probes",
    "probe_bytes_sent",
    "pulls_rejected",
    "acked",
    "expired",
    "failed",
    "released",
    "channel_builds",
    "channel_rebuilds",
    "channel_failures",
    "renewed",  # leases extended by a decode replica that still queues the request
    "mailbox_rejected",  # mailbox messages refused: malformed, unsigned, stale or replayed
    "mailbox_errors",  # store errors or crashes the accept loop survived
)
# After a store error, the accept loop reconnects after this pause (doubling to the max), so
# a persistent fault logs a line per pause instead of spinning.
_ACCEPT_RETRY_S, _ACCEPT_RETRY_MAX_S = 0.05, 5.0
# This many store errors in a row (~15 s of retries) mean the sender's own store is broken:
# the loop gives up, and the health check fails, so Serve replaces the replica.
_ACCEPT_MAX_ERRORS = 9
# (request_id, "acked" | "expired" | "failed" | "released")
ReleaseCallback = Callable[[str, str], None]


@dataclass
class Held:
    """A request held for pulls; its transfer state changes under the KVSender's lock."""

    kv_layers: list[torch.Tensor]  # each [2, num_blocks, block_size, H_local, D]
    block_ids: list[int]
    num_tokens: int
    head_start: int  # global index of kv_layers' first head
    num_heads: int
    extras: dict[str, torch.Tensor]  # MTP seed state, replicated across ranks
    deadline: float  # time.monotonic()
    # Acks per global head; a replicated cache's head is pulled by `copies` decode ranks
    # (the pulls say how many, resharding.py), so the hold waits for that many acks of each.
    acks: dict[int, int] = field(default_factory=dict)
    copies: int = 1
    in_flight: int = 0
    failed: bool = False
    # (payload, kv view, extras meta) of all held heads + extras, packed right after the hold,
    # so a pull of the whole range only sends (the gather is off the pull's critical path).
    packed: Packed | None = None
    packing: threading.Event | None = None  # set once packing ahead has ended
    # CUDA: recorded on the holding thread's stream right after the hold, i.e. after the
    # kernels that wrote this KV; pair threads pack on their own streams after waiting for it
    # (never the whole device).
    ready: Any = None  # a CUDA event (workers/device.py); None off CUDA


class KVSender:
    """Serves held KV to decode ranks that pull it; one per prefill rank.

    Hosts a TCPStore at `address` ('host:port'). A decode rank announces itself in the store's
    mailbox; a thread per (this rank, decode rank) pair then answers its pulls in order. A held
    request is released through `on_release(request_id, reason)` once decode ranks have acked
    every held head ("acked"), when its TTL passes unpulled ("expired"), or when a transfer of
    it fails or the sender closes ("failed"). `on_release` runs on a background thread; the
    engine frees the request's KV blocks there. The engine must not reuse held blocks before.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        port: int | tuple[int, int] = 0,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        interface: str | None = None,
        hold_ttl_s: float = 60.0,
        transfer_timeout_s: float = 30.0,
        pair_idle_s: float = 600.0,
        on_release: ReleaseCallback | None = None,
        name: str = "prefill",
        prepack: bool = True,
        send_buffer_budget_bytes: int = 1 << 30,
        secret: Secret | bytes | None = None,
    ) -> None:
        self.name = name
        self.pair_idle_s = pair_idle_s  # a pair unused this long is closed (its peer may be gone)
        # Pack buffers pairs keep for their next pull, summed over pairs (they grow with the
        # number of decode ranks): past this, a pair frees its buffer after each pull.
        self.send_buffer_budget_bytes = send_buffer_budget_bytes
        self.backend = backend
        self.hold_ttl_s = hold_ttl_s
        self.transfer_timeout_s = transfer_timeout_s
        self._device = torch.device(device)
        self._interface = interface
        self._on_release = on_release
        # Only holders of the deployment's secret may connect, drop or renew (auth.py).
        self._auth = KVAuth(secret)
        self._mailbox_guard = ReplayGuard(self._auth, MAILBOX)
        self._store = listen_store(host, port, timedelta(seconds=transfer_timeout_s))
        self.address = f"{host}:{self._store.port}"
        self._lock = threading.Condition()  # guards everything below; notified on hold/close
        self._holds: dict[str, Held] = {}
        self._servers: dict[str, PairServer] = {}  # by receiver id
        self._closed = False
        self._stats = dict.fromkeys(_STAT_KEYS, 0)
        self._probe_buf: torch.Tensor | None = None  # grow-only, shared by all pairs (read-only)
        self._fault_delay_s, self._fault_count = 0.0, 0  # test-only: see inject_fault
        self._prepack: queue.Queue[str | None] | None = queue.Queue() if prepack else None
        # Supervised: a loop that ends while the sender is open is recorded here, and
        # `healthy()` (read by the replica's health check) turns false.
        self._dead_loops: list[str] = []
        loops = [("accept", self._accept_loop), ("expire", self._expire_loop)]
        if self._prepack is not None:
            loops.append(("pack", self._pack_loop))
        self._threads = [
            threading.Thread(target=self._supervised, args=(what, fn),
                             name=f"{name}-kv-{what}", daemon=True)
            for what, fn in loops
        ]
        for t in self._threads:
            t.start()

    # -- engine API ------------------------------------------------------------------------------

    def hold(
        self,
        request_id: str,
        kv_layers: list[torch.Tensor],  # each [2, num_blocks, block_size, H_local, D]
        block_ids: list[int],
        num_tokens: int,
        head_start: int,
        extras: dict[str, torch.Tensor] | None = None,
        ttl_s: float | None = None,
    ) -> None:
        """Keep the request's blocks servable until acked or expired (the tensors are read at
        pull time, not copied now)."""
        if not kv_layers:
            raise ValueError("no KV layers to hold")
        block_size = kv_layers[0].shape[2]
        if not 0 < num_tokens <= len(block_ids) * block_size:
            raise ValueError(f"{num_tokens} tokens do not fit {len(block_ids)} blocks")
        held = Held(
            kv_layers=list(kv_layers),
            block_ids=list(block_ids),
            num_tokens=num_tokens,
            head_start=head_start,
            num_heads=kv_layers[0].shape[3],
            extras=dict(extras or {}),
            deadline=time.monotonic() + (self.hold_ttl_s if ttl_s is None else ttl_s),
            ready=_record_event(kv_layers[0].device),
        )
        with self._lock:
            if self._closed:
                raise RuntimeError("KVSender is closed")
            if request_id in self._holds:
                raise ValueError(f"request {request_id!r} is already held")
            self._holds[request_id] = held
            self._lock.notify_all()  # the expiry thread may need an earlier wake-up
        if self._prepack is not None:
            self._prepack.put(request_id)

    def renew(self, request_id: str, ttl_s: float | None = None) -> bool:
        """Extend a hold's lease to at least `ttl_s` (default hold_ttl_s) from now: the
        decode side is busy, not gone. False if the request is not held (any more)."""
        with self._lock:
            held = self._holds.get(request_id)
            if held is None or held.failed:
                return False
            ttl = self.hold_ttl_s if ttl_s is None else ttl_s
            held.deadline = max(held.deadline, time.monotonic() + ttl)
            return True

    def drop(self, request_id: str) -> bool:
        """Release a hold now (decode will not pull it). A transfer of it in flight finishes
        first and then releases it as failed; False if the request is not held."""
        with self._lock:
            held = self._holds.get(request_id)
            if held is None:
                return False
            if held.in_flight:
                held.failed = True  # _finish_pull releases it
                return True
            del self._holds[request_id]
        self._release(request_id, "released")
        return True

    def inject_fault(self, send_delay_s: float, count: int = 1) -> None:
        """Tests only: the next `count` KV sends sleep `send_delay_s` first."""
        with self._lock:
            self._fault_delay_s, self._fault_count = send_delay_s, count

    def healthy(self) -> str | None:
        """None while every data-path thread runs, else what died (the replica's health
        check fails on it, so Serve replaces the replica instead of every pull failing)."""
        with self._lock:
            if self._closed or not self._dead_loops:
                return None
            return f"{self.name}: KV {', '.join(self._dead_loops)} loop died"

    def held_request_ids(self) -> list[str]:
        with self._lock:
            return list(self._holds)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._stats, "held": len(self._holds), "peers": len(self._servers),
                    "send_buffer_bytes": self.send_buffer_bytes()}  # re-entrant lock

    def close(self) -> None:
        """Stop all threads, close channels and the store; release what is still held."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            servers = list(self._servers.values())
            self._lock.notify_all()
        post(self._store, MAILBOX, self._auth.stamp({"op": "stop"}, MAILBOX))
        if self._prepack is not None:
            self._prepack.put(None)
        for server in servers:
            server.interrupt(self._store)
        for t in [*self._threads, *(s.thread for s in servers)]:
            t.join(timeout=self.transfer_timeout_s + 1.0)  # a pair may be mid-send or building
        with self._lock:
            leftovers = list(self._holds)
            self._holds.clear()
        for request_id in leftovers:
            self._release(request_id, "failed")
        del self._store  # closes the listening socket once no client object refers to it

    # -- threads ---------------------------------------------------------------------------------

    def _supervised(self, what: str, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException:
            logger.exception("%s: KV %s loop died", self.name, what)
            raise
        finally:
            with self._lock:
                if not self._closed:
                    self._dead_loops.append(what)
                    logger.error("%s: KV %s loop ended while the sender is open; the "
                                 "replica's health check fails from now on", self.name, what)

    def _accept_loop(self) -> None:
        """Start a pair thread for each (re)connection announced in the mailbox; apply drops
        and renewals posted there. Survives what anyone who reaches the store can send
        (malformed, unsigned or replayed messages are counted and skipped) and store errors
        (it reconnects), so one bad message never ends KV serving for good."""
        store: dist.TCPStore | None = None
        retry_s, errors = _ACCEPT_RETRY_S, 0
        while True:
            if self._closed:
                return
            try:
                if store is None:
                    # An own client: a waiting client blocks its connection for everyone else.
                    store = connect_store(self.address, self.transfer_timeout_s)
                    mailbox = QueueReader(store, MAILBOX)
                try:
                    msg = mailbox.get(IDLE_WAIT_S)
                except TimeoutError:
                    continue
                retry_s, errors = _ACCEPT_RETRY_S, 0
                if not self._mailbox_guard.admit(msg):
                    raise BadMessage("unsigned, stale or replayed mailbox message")
                if self._handle_mailbox(msg):
                    return
            except BadMessage as e:
                self._count({"mailbox_rejected": 1})
                logger.warning("%s: skipped a mailbox message (%s)", self.name, e)
            except (KVTransferError, RuntimeError, dist.DistError) as e:
                # The store client broke (or a pair could not be set up): reconnect and go on.
                self._count({"mailbox_errors": 1})
                errors += 1
                if errors >= _ACCEPT_MAX_ERRORS:
                    raise RuntimeError(f"{errors} KV store errors in a row") from e
                logger.warning("%s: KV mailbox error (%s); reconnecting in %.2fs", self.name,
                               str(e).splitlines()[0][:200] if str(e) else type(e).__name__,
                               retry_s)
                store = None
                with self._lock:
                    if not self._closed:
                        self._lock.wait(retry_s)
                retry_s = min(2 * retry_s, _ACCEPT_RETRY_MAX_S)
            except Exception:  # a bug on one message must not end the loop
                self._count({"mailbox_errors": 1})
                logger.exception("%s: handling a mailbox message failed", self.name)

    def _handle_mailbox(self, msg: dict) -> bool:
        """Apply one admitted mailbox message; True on stop."""
        op = msg.get("op")
        if op == "stop":
            return True
        if op == "drop":  # a release posted straight to this store (drop_holds)
            self.drop(str(msg.get("request_id")))
            return False
        if op == "renew":  # a decode replica still queues these requests (renew_holds)
            rids = msg.get("request_ids")
            if not isinstance(rids, list):
                raise BadMessage("renew without a list of request ids")
            self._count({"renewed": sum(self.renew(str(r)) for r in rids[:4096])})
            return False
        if op != "connect":
            raise BadMessage(f"unknown op {str(op)[:20]!r}")
        receiver_id, generation = msg.get("receiver"), msg.get("generation")
        if not isinstance(receiver_id, str) or not isinstance(generation, int):
            raise BadMessage("connect without a receiver id and a generation")
        # The pair thread's own client: its waits block only this connection.
        pair_store = connect_store(self.address, self.transfer_timeout_s)
        channel = PairChannel.for_pair(
            pair_store,
            receiver_id,
            SENDER_RANK,
            peer=f"decode {receiver_id}",
            backend=self.backend,
            interface=self._interface,
            generation=generation,
            auth=self._auth,
        )
        server = PairServer(self, receiver_id, channel)
        with self._lock:
            if self._closed:
                return True
            old = self._servers.get(receiver_id)
            self._servers[receiver_id] = server
            self._stats["channel_builds" if old is None else "channel_rebuilds"] += 1
            server.start()  # under the lock, so close() never joins an unstarted one
        if old is not None:  # the decode side gave up on the old generation
            old.interrupt(self._store)
        return False

    def _pack_loop(self) -> None:
        """Pack each new hold's whole head range ahead of its pull (see `Held.packed`)."""
        while (request_id := self._prepack.get()) is not None:
            with self._lock:
                held = self._holds.get(request_id)
                if held is None or held.in_flight:  # released, or a pull already packs it
                    continue
                held.packing = threading.Event()
            try:
                held.packed = pack_payload(held.kv_layers, held.block_ids, slice(None),
                                           held.extras, self._device)
            except Exception:  # the pull packs on demand and reports the error itself
                logger.exception("%s: packing request %r ahead failed", self.name, request_id)
            finally:
                held.packing.set()

    def _expire_loop(self) -> None:
        """Release holds whose TTL passed while no transfer of them is in flight."""
        while True:
            expired = []
            with self._lock:
                if self._closed:
                    return
                now = time.monotonic()
                for request_id, held in list(self._holds.items()):
                    if held.deadline <= now and held.in_flight == 0:
                        del self._holds[request_id]
                        expired.append(request_id)
                pending = [h.deadline for h in self._holds.values() if h.in_flight == 0]
                if not expired:
                    # Holds in flight are re-checked when their transfer ends (notify).
                    wait_s = min(pending, default=now + IDLE_WAIT_S) - now
                    self._lock.wait(timeout=max(wait_s, 0.0))
                    continue
            for request_id in expired:
                self._release(request_id, "expired")

    # -- called by pair threads (pair_server.py) -------------------------------------------------

    def _begin_pull(
        self, request_id: str, head_start: int, head_end: int, copies: int = 1
    ) -> tuple[Held | None, str | None]:
        """(the hold, None) with a transfer of it now in flight, or (None, why it is refused).
        `copies`: how many decode ranks pull these heads from this rank (see `Held.acks`)."""
        with self._lock:
            held = self._holds.get(request_id)
            if held is None:
                error = f"request {request_id!r} is not held by {self.name} (unknown or released)"
            elif not held.head_start <= head_start < head_end <= held.head_start + held.num_heads:
                error = (
                    f"heads [{head_start}, {head_end}) of request {request_id!r} are not in "
                    f"[{held.head_start}, {held.head_start + held.num_heads}) held by {self.name}"
                )
            else:
                held.in_flight += 1  # _finish_pull ends it
                held.copies = max(held.copies, copies)
                return held, None
            self._stats["pulls_rejected"] += 1
        return None, error

    def _prepacked(self, held: Held) -> Packed | None:
        """The whole hold packed ahead by `_pack_loop`, if it was; waits for packing under way
        so that the same bytes are never packed twice."""
        with self._lock:
            packing = held.packing
        if packing is not None:
            packing.wait(self.transfer_timeout_s)
        with self._lock:
            return held.packed

    def _finish_pull(
        self, request_id: str, held: Held, heads: range, acked: bool, nbytes: int
    ) -> None:
        reason = None
        with self._lock:
            held.in_flight -= 1
            if acked:
                for h in heads:
                    held.acks[h] = held.acks.get(h, 0) + 1
                self._stats["transfers"] += 1
                self._stats["bytes_sent"] += nbytes
            else:
                held.failed = True  # the decode group cannot use the request any more
            done = all(held.acks.get(h, 0) >= held.copies
                       for h in range(held.head_start, held.head_start + held.num_heads))
            self._lock.notify_all()  # an expiry that waited for this transfer may be due
            if (done or held.failed) and held.in_flight == 0:
                if self._holds.get(request_id) is held:
                    del self._holds[request_id]
                    reason = "failed" if held.failed else "acked"
        if reason is not None:
            self._release(request_id, reason)

    def _fault_delay(self) -> float:
        with self._lock:
            if self._fault_count <= 0:
                return 0.0
            self._fault_count -= 1
            return self._fault_delay_s

    def _probe_buffer(self, num_bytes: int) -> torch.Tensor:
        """A [num_bytes] uint8 prefix of a buffer on the send device, allocated once per new
        maximum size so that repeated probes time the channel, not the allocator."""
        with self._lock:
            buf = self._probe_buf
            if buf is None or buf.numel() < num_bytes:
                self._probe_buf = buf = None  # let the old one go first: sizes go up to 1 GiB
        if buf is None:
            # Outside the lock (a 1 GiB fill must not stall hold()); two pairs racing here
            # each allocate once, harmlessly. Zeros, not empty: never ship stale memory.
            buf = torch.zeros(num_bytes, dtype=torch.uint8, device=self._device)
            with self._lock:
                self._probe_buf = buf
        return buf[:num_bytes]

    def _count(self, deltas: Mapping[str, int]) -> None:
        with self._lock:
            for key, n in deltas.items():
                self._stats[key] += n

    def _may_keep_buffer(self, server: PairServer, nbytes: int) -> bool:
        """Whether `server` may keep a pack buffer of `nbytes` within the budget."""
        with self._lock:
            others = sum(s.buffer_bytes for s in self._servers.values() if s is not server)
        return others + nbytes <= self.send_buffer_budget_bytes

    def send_buffer_bytes(self) -> int:
        """Bytes of pack buffers the pairs keep now."""
        with self._lock:
            return sum(s.buffer_bytes for s in self._servers.values())

    def _pair_ended(self, server: PairServer) -> None:
        """Forget a pair whose thread ends, unless a newer generation replaced it already."""
        with self._lock:
            if self._servers.get(server.receiver_id) is server:
                del self._servers[server.receiver_id]

    # -- helpers ---------------------------------------------------------------------------------

    def _release(self, request_id: str, reason: str) -> None:
        with self._lock:
            self._stats[reason] += 1
        if self._on_release is None:
            return
        try:
            self._on_release(request_id, reason)
        except Exception:
            logger.exception("%s: on_release(%r, %r) raised", self.name, request_id, reason)


def _record_event(device: torch.device) -> Any:
    """An event on the current CUDA stream of this thread (None off CUDA)."""
    if device.type != "cuda":
        return None
    return runtime().record_event(device)
