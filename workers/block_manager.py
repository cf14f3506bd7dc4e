"""Paged KV block allocation: free list, reference counts, per-request block tables.

Main and MTP layers share one block table per request (MTP entry t lives at position t), so
one allocation covers both caches. Blocks are reference-counted so that a block can be held by
an in-flight KV transfer and a request at the same time.
"""

from __future__ import annotations

from collections import deque

from mtpserve.workers.request import Request


def blocks_for(num_slots: int, block_size: int) -> int:
    return -(-num_slots // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_ids)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_ids)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` free blocks (ref count 1). Caller checks `can_allocate` first."""
        if num_blocks > len(self.free_ids):
            raise MemoryError(f"need {num_blocks} KV blocks, {len(self.free_ids)} free")
        ids = [self.free_ids.popleft() for _ in range(num_blocks)]
        for b in ids:
            self.ref_counts[b] = 1
        return ids

    def incref(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"incref of free block {b}"
            self.ref_counts[b] += 1

    def release(self, block_ids: list[int]) -> None:
        for b in block_ids:
            assert self.ref_counts[b] > 0, f"double free of block {b}"
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_ids.append(b)

    # Per-request helpers -------------------------------------------------------------------
    def blocks_needed(self, req: Request, num_slots: int) -> int:
        return max(0, blocks_for(num_slots, self.block_size) - len(req.block_ids))

    def ensure_capacity(self, req: Request, num_slots: int) -> bool:
        """Grow `req`'s block table to hold `num_slots` slots; False (nothing taken) if full."""
        need = self.blocks_needed(req, num_slots)
        if not self.can_allocate(need):
            return False
        req.block_ids.extend(self.allocate(need))
        return True

    def truncate(self, req: Request, num_slots: int) -> int:
        """Free the blocks past the first `num_slots` slots (rollback); returns blocks freed."""
        keep = blocks_for(num_slots, self.block_size)
        extra = req.block_ids[keep:]
        if extra:
            del req.block_ids[keep:]
            self.release(extra)
        return len(extra)

    def free(self, req: Request) -> None:
        self.release(req.block_ids)
        req.block_ids = []

    def check_integrity(self, live: list[Request]) -> None:
        """Assert the free list and ref counts agree with the live requests' block tables."""
        counts = [0] * self.num_blocks
        for r in live:
            for b in r.block_ids:
                counts[b] += 1
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "duplicate ids in the free list"
        for b in range(self.num_blocks):
            assert counts[b] <= self.ref_counts[b], f"block {b}: {counts[b]} owners, ref " \
                f"{self.ref_counts[b]}"
            assert (self.ref_counts[b] == 0) == (b in free), f"block {b} free-list mismatch"

    def stats(self) -> dict[str, int]:
        return {"num_blocks": self.num_blocks, "used_blocks": self.num_used_blocks,
                "free_blocks": self.num_free_blocks, "block_size": self.block_size}
