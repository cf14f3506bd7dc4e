"""Automatic prefix caching: the chained block hashes that name a full KV block's contents, and
the index of computed blocks that later requests may share.

A block holds the main KV of positions [jB, (j+1)B) and the MTP KV of the same positions. The
MTP entry of position t embeds token t + 1, so the block's last MTP entry depends on the first
token of the next block: the hash of block j covers tokens [jB, (j+1)B] (one token of
lookahead), chained over the parent's hash and salted with what else changes the KV (model,
dtype, MTP precision). A block is hashable once the token after it is known, and a hit means
both its main and its MTP KV are valid for the new request.

Hashes are blake2b digests of the token ids, not Python's `hash`, so that every process (prefill
and decode replicas, the router) names the same prefix with the same bytes.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

BlockHash = bytes
_DIGEST = 16


def cache_salt(*parts: object) -> bytes:
    """A root for the hash chain from whatever makes KV differ between engines."""
    return hashlib.blake2b(repr(parts).encode(), digest_size=_DIGEST).digest()


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        salt: bytes) -> list[BlockHash]:
    """Append to `hashes` the hash of every further block whose lookahead token is known
    (block j needs token (j+1) * block_size); returns `hashes`."""
    j = len(hashes)
    while (j + 1) * block_size < len(token_ids):
        parent = hashes[-1] if hashes else salt
        tokens = array("q", token_ids[j * block_size : (j + 1) * block_size + 1]).tobytes()
        hashes.append(hashlib.blake2b(parent + tokens, digest_size=_DIGEST).digest())
        j += 1
    return hashes


def short_hash(h: BlockHash) -> int:
    """The first 8 bytes of a block hash as an int: what replicas publish for routing (a
    collision only misroutes a request; the engine checks full hashes)."""
    return int.from_bytes(h[:8], "little")


def block_hashes(token_ids: Sequence[int], block_size: int, salt: bytes) -> list[BlockHash]:
    return extend_block_hashes([], token_ids, block_size, salt)


class PrefixIndex:
    """Computed blocks by hash, and the LRU order of those no request references.

    The block manager owns reference counts; this only knows which blocks hold a named prefix
    and which of them could be evicted (reference count 0, oldest release first)."""

    def __init__(self) -> None:
        self.by_hash: dict[BlockHash, int] = {}
        self.hash_of: dict[int, BlockHash] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.version = 0  # bumped whenever the set of named blocks changes (routing caches)

    def __len__(self) -> int:
        return len(self.by_hash)

    def longest_prefix(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Block ids of the longest run of `hashes`, from the first, that is cached."""
        out = []
        for h in hashes:
            b = self.by_hash.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def insert(self, h: BlockHash, block: int) -> bool:
        """Name `block` by `h`; False if another block already holds that prefix (the caller's
        copy then stays private and is freed normally) or `block` is already named."""
        if h in self.by_hash or block in self.hash_of:
            return False
        self.by_hash[h] = block
        self.hash_of[block] = h
        self.version += 1
        return True

    def forget(self, block: int) -> None:
        h = self.hash_of.pop(block, None)
        if h is not None:
            del self.by_hash[h]
            self.version += 1
        self.evictable.pop(block, None)

    def pop_lru(self) -> int:
        """Evict the least recently released unreferenced block; returns its id."""
        block, _ = self.evictable.popitem(last=False)
        self.forget(block)
        return block
