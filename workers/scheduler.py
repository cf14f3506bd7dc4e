"""Continuous batching: waiting / prefilling / running queues, chunked prefill, preemption.

Each engine step is either a prefill step (chunks of several requests within a token budget)
or a decode step (one speculative round for every running request). Steps alternate while
both kinds have work, so long prompts cannot starve decoding and vice versa. With
`mixed_prefill_tokens` > 0 they do not alternate: while requests are running, every step is a
decode round with up to that many prefill tokens riding along in the same forward, so running
requests emit tokens every step during a prefill burst.

Transferred requests (disaggregated decode) pass the same admission: they queue for a
sequence slot and KV blocks (`awaiting_kv`, FIFO), then receive their KV while parked in
`receiving` (blocks allocated, not schedulable), then run. `max_num_seqs` bounds running +
prefilling + receiving together.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from mtpserve.workers.block_manager import BlockManager, blocks_for
from mtpserve.workers.request import Request, RequestStatus

# A new prompt starts only with a chunk of at least this many tokens (or its whole rest).
MIN_NEW_CHUNK = 32


def decode_slots(req: Request) -> int:
    """KV slots one speculative round may touch: verify writes positions n..n+k, drafting
    writes MTP entries up to n+a+k-1 <= n+2k-1."""
    k = req.num_speculative_tokens
    return req.num_computed_tokens + max(k + 1, 2 * k)


def draft_slots(req: Request) -> int:
    """Slots held between rounds: committed tokens plus the k-1 speculative MTP entries."""
    return req.num_computed_tokens + max(req.num_speculative_tokens - 1, 0)


@dataclass
class PrefillChunk:
    request: Request
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.end == self.request.prefill_target


@dataclass
class SchedulerOutput:
    prefill: list[PrefillChunk]
    decode: list[Request]
    preempted: list[Request]


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        mixed_prefill_tokens: int = 0,
    ) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.mixed_prefill_tokens = mixed_prefill_tokens  # 0: prefill and decode alternate
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.awaiting_kv: deque[tuple[Request, int]] = deque()  # (request, KV slots it needs)
        self.receiving: list[Request] = []  # blocks allocated, KV arriving on other threads
        self.cancelled: set[str] = set()  # receiving requests aborted: free once KV landed
        self.idle = False  # the last schedule() found nothing it could run
        self._last_was_prefill = False

    # Queue management ----------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = RequestStatus.WAITING
        req.prefill_target = req.recompute_target
        self.waiting.append(req)

    def add_transferred(self, req: Request, num_slots: int) -> None:
        """Queue a request whose KV will arrive from a prefill replica (no blocks yet)."""
        req.status = RequestStatus.WAITING
        self.awaiting_kv.append((req, num_slots))

    def can_admit_transferred(self) -> bool:
        if not self.awaiting_kv or self.num_seqs >= self.max_num_seqs or not self.bm.can_admit():
            return False
        req, slots = self.awaiting_kv[0]
        hit = self.bm.cached_prefix(req, req.num_computed_tokens)
        return self.bm.can_allocate(self._blocks_to_take(hit, slots))

    def admit_transferred(self) -> list[Request]:
        """FIFO: give queued transferred requests their blocks while slots and blocks last,
        starting with the blocks of their prefix this replica already caches (only the rest
        is pulled: `req.num_registered_blocks` after this call). The caller starts their
        pulls; they stay in `receiving` until `finish_transfer`."""
        admitted = []
        while self.can_admit_transferred():
            req, slots = self.awaiting_kv.popleft()
            hit = self.bm.cached_prefix(req, req.num_computed_tokens)
            self.bm.count_lookup(req.num_computed_tokens, len(hit) * self.bm.block_size)
            self.bm.reuse(req, hit)
            assert self.bm.ensure_capacity(req, slots)
            self.receiving.append(req)
            admitted.append(req)
        return admitted

    def _blocks_to_take(self, hit: list[int], num_slots: int) -> int:
        """Blocks an admission removes from the free pool: the new ones, plus the cached hits
        that nobody references (they leave the evictable pool)."""
        idle_hits = sum(1 for b in hit if self.bm.ref_counts[b] == 0)
        return blocks_for(num_slots, self.bm.block_size) - len(hit) + idle_hits

    def finish_transfer(self, req: Request) -> None:
        """Every rank has the request's KV: schedule it."""
        self.receiving.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def drop_transfer(self, req: Request) -> None:
        """Forget a receiving request (failed or aborted) once no rank writes its blocks."""
        self.receiving.remove(req)
        self.cancelled.discard(req.request_id)
        self.bm.free(req)

    def remove(self, req: Request) -> None:
        if req in self.receiving:
            # Transfer threads may still write its blocks: freed by drop_transfer later.
            self.cancelled.add(req.request_id)
            return
        for q in (self.prefilling, self.running):
            if req in q:
                q.remove(req)
        if req in self.waiting:
            self.waiting.remove(req)
        for i, (r, _) in enumerate(self.awaiting_kv):
            if r is req:
                del self.awaiting_kv[i]
                break
        self.bm.free(req)

    @property
    def num_seqs(self) -> int:
        """Requests holding a sequence slot (bounded by max_num_seqs)."""
        return len(self.running) + len(self.prefilling) + len(self.receiving)

    @property
    def num_unfinished(self) -> int:
        """Requests a step can work on (not those queued for or receiving KV)."""
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    # Scheduling ----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        want_prefill = bool(self.prefilling) or (
            bool(self.waiting) and self.num_seqs < self.max_num_seqs
        )
        self.idle = False
        if want_prefill and self.running and self.mixed_prefill_tokens > 0:
            # Decode claims its blocks first, so a prefill admitted alongside cannot cause a
            # preemption this step; under block pressure (something was preempted) the round
            # runs alone and the preempted request is re-admitted by a later step.
            decode, preempted = self._schedule_decode()
            chunks = [] if preempted else self._schedule_prefill(self.mixed_prefill_tokens)
            self.idle = not decode and not chunks and not preempted
            return SchedulerOutput(chunks, decode, preempted)
        if want_prefill and (not self.running or not self._last_was_prefill):
            chunks = self._schedule_prefill()
            if chunks:
                self._last_was_prefill = True
                return SchedulerOutput(chunks, [], [])
        self._last_was_prefill = False
        decode, preempted = self._schedule_decode()
        # Nothing runnable (e.g. waiting for blocks that held KV pins): the engine loop
        # should sleep until something changes instead of spinning.
        self.idle = not decode
        return SchedulerOutput([], decode, preempted)

    def _schedule_prefill(self, budget: int | None = None) -> list[PrefillChunk]:
        budget = self.max_num_batched_tokens if budget is None else budget
        chunks: list[PrefillChunk] = []
        for req in self.prefilling:
            if budget <= 0:
                break
            chunks.append(self._chunk(req, budget))
            budget -= chunks[-1].end - chunks[-1].start
        deferred: list[Request] = []
        in_flight = self._prefixes_in_flight()
        while (self.waiting and budget > 0 and self.num_seqs < self.max_num_seqs
               and self.bm.can_admit()):
            req = self.waiting[0]
            # The last prompt token is always computed: its logits give the first token.
            hit = self.bm.cached_prefix(req, req.prefill_target - 1)
            usable = req.block_hashes[: (req.prefill_target - 1) // self.bm.block_size]
            if len(hit) < len(usable) and usable[len(hit)] in in_flight:
                # A request prefilling now (an n > 1 sibling, the same system prompt) is
                # computing this prompt's next blocks: wait for them instead of repeating them.
                deferred.append(self.waiting.popleft())
                continue
            if chunks and budget < min(MIN_NEW_CHUNK,
                                       req.prefill_target - len(hit) * self.bm.block_size):
                # A budget's last few tokens would start this prompt with a sliver chunk
                # (a 1-token row next to a 127-token one pads the forward, and the prompt
                # then spans one more step): it starts next step.
                break
            # Admit only when the whole prompt plus one round fits, so a prefill never stalls
            # half way; decode growth beyond that is handled by preemption.
            slots = req.prefill_target + 2 * req.num_speculative_tokens + 1
            if not self.bm.can_allocate(self._blocks_to_take(hit, slots)):
                break
            cached = len(hit) * self.bm.block_size
            self.bm.count_lookup(req.prefill_target, cached)
            if not req.output_token_ids:
                req.num_cached_tokens = cached
            self.bm.reuse(req, hit)
            # Reserve every prefill block now so later chunks cannot be starved by decode.
            self.bm.ensure_capacity(req, self._prefill_slots(req))
            self.waiting.popleft()
            req.status = RequestStatus.PREFILLING
            req.num_computed_tokens = cached
            self.prefilling.append(req)
            in_flight.update(self._pending_hashes(req))
            chunks.append(self._chunk(req, budget))
            budget -= chunks[-1].end - chunks[-1].start
        self.waiting.extendleft(reversed(deferred))
        return chunks

    def _pending_hashes(self, req: Request) -> list[bytes]:
        """Hashes of the blocks a prefilling request will name when its chunks are done."""
        if not self.bm.prefix_caching:
            return []
        n = (req.prefill_target - 1) // self.bm.block_size
        return self.bm.hashes(req)[req.num_registered_blocks : n]

    def _prefixes_in_flight(self) -> set[bytes]:
        return {h for r in self.prefilling for h in self._pending_hashes(r)}

    @staticmethod
    def _prefill_slots(req: Request) -> int:
        """The prompt plus the k-1 MTP entries drafting writes after the last chunk."""
        return req.prefill_target + max(req.num_speculative_tokens - 1, 0)

    @staticmethod
    def _chunk(req: Request, budget: int) -> PrefillChunk:
        start = req.num_computed_tokens
        return PrefillChunk(req, start, min(req.prefill_target, start + budget))

    def finish_prefill(self, req: Request) -> None:
        self.prefilling.remove(req)
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    def _schedule_decode(self) -> tuple[list[Request], list[Request]]:
        scheduled: list[Request] = []
        preempted: list[Request] = []
        queue = list(self.running)
        while queue:
            req = queue.pop(0)
            while not self.bm.ensure_capacity(req, decode_slots(req)):
                # Out of blocks: recompute the newest request later (vLLM's policy).
                victim = queue.pop() if queue else req
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                scheduled.append(req)
        return scheduled, preempted

    def requeue(self, req: Request) -> None:
        """Send a prefilling or running request back to the waiting queue to be recomputed
        (its KV freed), as a preemption does."""
        if req in self.prefilling:
            self.prefilling.remove(req)
            self.running.append(req)  # _preempt takes it from `running`
        self._preempt(req)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free(req)
        req.num_computed_tokens = 0
        req.draft_token_ids = []
        req.draft_probs = None
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        req.prefill_target = req.recompute_target
        self.waiting.appendleft(req)
