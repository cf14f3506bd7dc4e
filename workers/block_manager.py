"""Paged KV block allocation: free list, reference counts, per-request block tables.

Main and MTP layers share one block table per request (MTP entry t lives at position t), so
one allocation covers both caches. Blocks are reference-counted so that a block can be held by
an in-flight KV transfer and a request at the same time, and, with prefix caching, by several
requests whose prompts share it (workers/prefix_cache.py).

With prefix caching a full, computed block is named by its chained hash when the request that
wrote it has moved past it (`register`); when its last reference goes it stays cached
(evictable) instead of free, and is evicted least-recently-released first only when no free
block is left. Writes only ever happen at positions >= a request's `num_computed_tokens`, and a
request shares only blocks below that, so a shared block is never overwritten or rolled back.
"""

from __future__ import annotations

from collections import deque

from mtpserve.workers.prefix_cache import (
    BlockHash,
    PrefixIndex,
    cache_salt,
    extend_block_hashes,
    short_hash,
)
from mtpserve.workers.request import Request


def blocks_for(num_slots: int, block_size: int) -> int:
    return -(-num_slots // block_size)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = False,
                 salt: bytes = b"", has_mtp: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.prefix_caching = prefix_caching
        self.salt = salt
        # A request at k = 0 never writes MTP entries: on a model with MTP layers its blocks
        # hold main KV only and are named in a chain of their own, which k = 0 requests
        # look up (besides the whole blocks of the main chain) and k > 0 requests never see.
        self.has_mtp = has_mtp
        self.main_only_salt = cache_salt(salt, "main KV only") if has_mtp else salt
        self.cache = PrefixIndex()
        # Token counts of prefix lookups, for vllm:prefix_cache_{queries,hits}_total.
        self.cache_queries = 0
        self.cache_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones plus cached ones nobody references."""
        return len(self.free_ids) + len(self.cache.evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cache)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def can_admit(self) -> bool:
        """Whether a new request can take its per-request resources besides blocks (always,
        here; a hybrid model's state slot: `workers/state_pool.py`)."""
        return True

    def allocate(self, num_blocks: int) -> list[int]:
        """Take `num_blocks` blocks (ref count 1): free ones first, then the least recently
        released cached ones. Caller checks `can_allocate` first."""
        if num_blocks > self.num_free_blocks:
            raise MemoryError(f"need {num_blocks} KV blocks, {self.num_free_blocks} free")
        ids = [self.free_ids.popleft() if self.free_ids else self.cache.pop_lru()
               for _ in range(num_blocks)]
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
                if b in self.cache.hash_of:
                    self.cache.evictable[b] = None  # most recently released: evicted last
                else:
                    self.free_ids.append(b)

    # Prefix caching ------------------------------------------------------------------------
    def main_only(self, req: Request) -> bool:
        """Its blocks hold no MTP entries (k = 0 on a model with MTP layers)."""
        return self.has_mtp and req.num_speculative_tokens == 0

    def hashes(self, req: Request) -> list[BlockHash]:
        """The request's block hashes as far as its tokens are known (kept on the request),
        in its chain (`main_only`)."""
        salt = self.main_only_salt if self.main_only(req) else self.salt
        return extend_block_hashes(req.block_hashes, req.all_token_ids, self.block_size, salt)

    def cached_prefix(self, req: Request, max_tokens: int) -> list[int]:
        """Cached blocks holding the request's first tokens, at most `max_tokens` of them
        (the caller keeps at least the last prompt token to compute). No references taken.
        A main-only request takes the longer of its own chain's hit and the main chain's
        (whole blocks hold its main KV too)."""
        if not self.prefix_caching:
            return []
        n = max_tokens // self.block_size
        hit = self.cache.longest_prefix(self.hashes(req)[:n])
        if self.main_only(req) and len(hit) < n:
            whole = extend_block_hashes([], req.all_token_ids, self.block_size, self.salt)
            hit = max(hit, self.cache.longest_prefix(whole[:n]), key=len)
        return hit

    def reuse(self, req: Request, blocks: list[int]) -> None:
        """Start `req`'s (empty) block table with the cached `blocks`, taking a reference."""
        assert not req.block_ids, "reuse starts a block table"
        for b in blocks:
            if self.ref_counts[b] == 0:
                del self.cache.evictable[b]
            self.ref_counts[b] += 1
        req.block_ids = list(blocks)
        req.num_registered_blocks = len(blocks)

    def count_lookup(self, queried: int, hit: int) -> None:
        self.cache_queries += queried
        self.cache_hits += hit

    def register(self, req: Request, num_valid: int) -> None:
        """Name the request's full blocks whose KV is final: positions below `num_valid` (its
        computed tokens; their MTP entries are exact too, unless it is main-only)."""
        if not self.prefix_caching:
            return
        full = min(num_valid // self.block_size, len(req.block_ids))
        if full <= req.num_registered_blocks:
            return
        hashes = self.hashes(req)
        for j in range(req.num_registered_blocks, min(full, len(hashes))):
            self.cache.insert(hashes[j], req.block_ids[j])
            req.num_registered_blocks = j + 1

    def summary(self, limit: int) -> dict:
        """What a replica publishes for cache-aware routing: the chain's root, the block size
        and the 8-byte heads of (at most `limit`, the newest) cached block hashes."""
        names = list(self.cache.by_hash)[-limit:] if limit > 0 else []
        return {"salt": self.salt.hex(), "block_size": self.block_size,
                "version": self.cache.version, "hashes": [short_hash(h) for h in names]}

    def flush(self) -> int:
        """Forget every cached prefix (blocks in use stay with their requests, uncached);
        returns how many blocks were named."""
        n = len(self.cache)
        self.free_ids.extend(self.cache.evictable)
        version = self.cache.version + 1
        self.cache = PrefixIndex()
        self.cache.version = version  # routers must not mistake the empty cache for the old
        return n

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
        assert keep >= req.num_registered_blocks, "rollback into a cached (shared) block"
        extra = req.block_ids[keep:]
        if extra:
            del req.block_ids[keep:]
            self.release(extra)
        return len(extra)

    def free(self, req: Request) -> None:
        # Tail first: a prompt's last blocks are evicted before its (more shared) head.
        self.release(req.block_ids[::-1])
        req.block_ids = []
        req.num_registered_blocks = 0

    def check_integrity(self, live: list[Request]) -> None:
        """Assert the free list and ref counts agree with the live requests' block tables."""
        counts = [0] * self.num_blocks
        for r in live:
            for b in r.block_ids:
                counts[b] += 1
        free = set(self.free_ids)
        assert len(free) == len(self.free_ids), "duplicate ids in the free list"
        evictable = set(self.cache.evictable)
        assert not free & evictable, "a block is both free and cached"
        for b in range(self.num_blocks):
            assert counts[b] <= self.ref_counts[b], f"block {b}: {counts[b]} owners, ref " \
                f"{self.ref_counts[b]}"
            assert (self.ref_counts[b] == 0) == (b in free or b in evictable), \
                f"block {b} free-list mismatch"
            assert b not in evictable or b in self.cache.hash_of, f"block {b} evictable, unnamed"

    def stats(self) -> dict[str, int]:
        return {"num_blocks": self.num_blocks, "used_blocks": self.num_used_blocks,
                "free_blocks": self.num_free_blocks, "block_size": self.block_size,
                "cached_blocks": self.num_cached_blocks,
                "prefix_cache_queries": self.cache_queries,
                "prefix_cache_hits": self.cache_hits}
