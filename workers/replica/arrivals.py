"""Engine-thread side of asynchronous KV movement (docs/architecture.md decision 11).

`KVArrivals` (decode): a transferred request is parked as waiting-for-KV; when the scheduler
admits it (a sequence slot and blocks free) its pulls start on every rank's transfer thread;
once every rank reports it done (one poll over the control group) it joins the decode rounds.
`PrefillHolds` (prefill): held KV is freed once every rank's sender has released it (acked,
expired, failed) or at once on an explicit `release`.

Both are `AsyncEngine` pollers: they never block the engine thread on the network, and they
poll again only when rank 0 has seen progress (its own transfer thread finished), rate-limited
while other ranks catch up.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from mtpserve.workers import hop_trace
from mtpserve.workers.kv_transfer.mailbox import renew_holds
from mtpserve.workers.replica.tp_commands import PullKV, ReleaseKV, StartPulls
from mtpserve.workers.replica.tp_group import TPDriver

if TYPE_CHECKING:
    from mtpserve.workers.engine import Engine
    from mtpserve.workers.messages import KVTransferParams
    from mtpserve.workers.request import Request

logger = logging.getLogger(__name__)

# While rank 0 is done but another rank is not, poll at most this often.
POLL_INTERVAL_S = 0.002
# A waiting request's prefill hold is renewed this many times per hold_ttl_s, so a renewal
# that is late or lost still leaves the lease standing.
RENEWALS_PER_TTL = 3


class _RankPoller:
    def __init__(self, driver: TPDriver) -> None:
        self.driver = driver
        self.engine: Engine | None = None  # bound by the owner after the engine exists
        self._fruitless_at = float("-inf")  # last poll that found nothing done on all ranks

    def _due(self) -> float | None:
        if not self.driver.core.has_local_progress():
            return None  # rank 0's own thread wakes the engine when it finishes something
        return max(self._fruitless_at + POLL_INTERVAL_S - time.monotonic(), 0.0)

    def _poll_group(self) -> list:
        done = self.driver.poll()
        if not done:
            self._fruitless_at = time.monotonic()
        return done


class KVArrivals(_RankPoller):
    """Decode: admission, pull start and activation of transferred requests."""

    def __init__(self, driver: TPDriver, timeout_s: float,
                 on_failed: Callable[[str, str], None]) -> None:
        super().__init__(driver)
        self.timeout_s = timeout_s
        self.on_failed = on_failed  # (request_id, message): end the client's stream
        self._params: dict[str, KVTransferParams] = {}
        # Leases: a request that waits here for blocks or for its pull keeps its prefill
        # hold, renewed every hold_ttl_s / RENEWALS_PER_TTL (same config on both sides), so
        # a long decode queue never turns into an expired hold and a recompute.
        spec = driver.core.spec
        self._renew_every_s = spec.kv_hold_ttl_s / RENEWALS_PER_TTL
        self._leases: dict[str, tuple[tuple[str, ...], float]] = {}  # rid -> (senders, due)
        self._hold_ids: dict[str, str] = {}  # rid -> the prefill's id for its held KV
        self._renewer = _Renewer(spec.kv_secret, min(self.timeout_s, self._renew_every_s))

    def park(self, engine: Engine, req: Request, params: KVTransferParams,
             num_slots: int) -> None:
        """Engine thread: queue `req` (validated, first token appended) for its KV."""
        engine.add_transferred(req, num_slots)
        queued = {r.request_id for r, _ in engine.scheduler.awaiting_kv}
        # Requests aborted while queued leave no trace in the scheduler: forget their params.
        self._params = {rid: p for rid, p in self._params.items() if rid in queued}
        self._params[req.request_id] = params
        self._leases[req.request_id] = (tuple(params.sender_addresses),
                                        time.monotonic() + self._renew_every_s)
        # The prefill holds the KV under its attempt's id (a retried prefill has its own).
        self._hold_ids[req.request_id] = params.request_id

    def next_poll_in(self) -> float | None:
        sched = self.engine.scheduler
        if sched.can_admit_transferred():
            return 0.0
        due = self._due() if sched.receiving else None
        if self._leases:
            renew = max(min(d for _, d in self._leases.values()) - time.monotonic(), 0.0)
            due = renew if due is None else min(due, renew)
        return due

    def _renew_leases(self) -> None:
        """Engine thread: hand the leases that are due to the renewal thread (never blocks)."""
        sched = self.engine.scheduler
        waiting = {r.request_id for r, _ in sched.awaiting_kv}
        waiting.update(r.request_id for r in sched.receiving)
        now = time.monotonic()
        due: dict[tuple[str, ...], list[str]] = {}
        for rid, (senders, at) in list(self._leases.items()):
            if rid not in waiting or rid in sched.cancelled:
                del self._leases[rid]  # pulled, failed or aborted: its hold is not ours
                self._hold_ids.pop(rid, None)
            elif at <= now:
                due.setdefault(senders, []).append(self._hold_ids.get(rid, rid))
                self._leases[rid] = (senders, now + self._renew_every_s)
        for senders, rids in due.items():
            self._renewer.submit(senders, rids)

    def poll(self) -> bool:
        engine = self.engine
        sched = engine.scheduler
        changed = False
        if self._leases:
            self._renew_leases()
        admitted = sched.admit_transferred()
        if admitted:
            # One command for all admitted requests: every rank starts its pulls in order.
            self.driver.run(StartPulls([self._pull(r) for r in admitted]))
            changed = True
        if sched.receiving and self.driver.core.has_local_progress():
            receiving = {r.request_id: r for r in sched.receiving}
            for o in self._poll_group():
                req = receiving[o.request_id]
                cancelled = o.request_id in sched.cancelled
                if o.ok:
                    engine.activate_transferred(req, o.extras)
                    if not cancelled:  # its stream is gone: nothing would take the note
                        hop_trace.note(o.request_id, "activated")
                else:
                    engine.drop_transferred(req)
                    if not cancelled:
                        self.on_failed(o.request_id, o.error or "KV transfer failed")
                changed = True
        return changed

    def _pull(self, req: Request) -> PullKV:
        p = self._params.pop(req.request_id)  # only needed to start the pull
        cached = req.num_registered_blocks  # this replica's prefix cache holds them
        return PullKV(req.request_id, list(p.sender_addresses), list(req.block_ids[cached:]),
                      p.num_kv_heads, self.timeout_s, skip_blocks=cached,
                      hold_id=p.request_id,
                      state_slot=(self.engine.block_manager.state_slot(req)
                                  if self.engine.hybrid else None),
                      prefill_tp_size=p.prefill_tp_size)


class _Renewer:
    """Posts lease renewals to prefill senders' stores on its own thread (a frozen store
    must not stall the engine thread); started on first use."""

    def __init__(self, secret: Any, timeout_s: float) -> None:
        self._secret = secret
        self._timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[tuple[tuple[str, ...], list[str]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.posted = 0  # renew messages that went through

    def submit(self, senders: tuple[str, ...], request_ids: list[str]) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kv-lease-renew",
                                            daemon=True)
            self._thread.start()
        self._jobs.put((senders, request_ids))

    def _loop(self) -> None:
        while True:
            senders, rids = self._jobs.get()
            try:
                if renew_holds(list(senders), rids, self._timeout_s, self._secret):
                    self.posted += 1
                else:  # the prefill replica is unreachable; its pull will say so
                    logger.debug("renewing the holds of %s at %s failed", rids, senders)
            except Exception:
                logger.exception("renewing the holds of %s failed", rids)


class PrefillHolds(_RankPoller):
    """Prefill: frees held KV blocks once every rank has released them."""

    def next_poll_in(self) -> float | None:
        return self._due() if self.driver.core.holds else None

    def poll(self) -> bool:
        released = self._poll_group()
        for rid in released:
            self.engine.release_prefilled(rid)
        return bool(released)

    def release(self, request_id: str) -> bool:
        """Engine thread: drop the hold on every rank now and free the blocks if no pull of
        it is in flight (else when that pull ends). False if the request is not held."""
        if request_id not in self.engine.prefilled or request_id not in self.driver.core.holds:
            return False
        self.driver.run(ReleaseKV(request_id))
        self.poll()
        return True
