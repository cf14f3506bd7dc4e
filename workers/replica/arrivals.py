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

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mtpserve.workers import hop_trace
from mtpserve.workers.replica.tp_commands import PullKV, ReleaseKV, StartPulls
from mtpserve.workers.replica.tp_group import TPDriver

if TYPE_CHECKING:
    from mtpserve.workers.engine import Engine
    from mtpserve.workers.messages import KVTransferParams
    from mtpserve.workers.request import Request

# While rank 0 is done but another rank is not, poll at most this often.
POLL_INTERVAL_S = 0.002


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

    def park(self, engine: Engine, req: Request, params: KVTransferParams,
             num_slots: int) -> None:
        """Engine thread: queue `req` (validated, first token appended) for its KV."""
        engine.add_transferred(req, num_slots)
        queued = {r.request_id for r, _ in engine.scheduler.awaiting_kv}
        # Requests aborted while queued leave no trace in the scheduler: forget their params.
        self._params = {rid: p for rid, p in self._params.items() if rid in queued}
        self._params[req.request_id] = params

    def next_poll_in(self) -> float | None:
        sched = self.engine.scheduler
        if sched.can_admit_transferred():
            return 0.0
        return self._due() if sched.receiving else None

    def poll(self) -> bool:
        engine = self.engine
        sched = engine.scheduler
        changed = False
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
                    drafts = o.extras.get("draft_token_ids")
                    req.draft_token_ids = drafts.tolist() if drafts is not None else []
                    req.draft_probs = o.extras.get("draft_probs")
                    engine.activate_transferred(req)
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
                      p.num_kv_heads, self.timeout_s, skip_blocks=cached)


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
