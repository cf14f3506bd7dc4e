"""Per-request matchers: which tokens may come next, advanced token by token, rolled back.

`GrammarConstraint` wraps an xgrammar `GrammarMatcher` (JSON schema, regex, choice, EBNF, tool
calls). `PrefixConstraint` serves token healing: the next tokens must spell out a given byte
prefix (a token may cover the rest of it and go on), after which nothing is constrained. Both
write the same packed bitmask (int32 words, bit i of word j = token 32 j + i allowed), so the
engine applies either the same way.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict

import numpy as np
import torch
import xgrammar as xgr


class Constraint:
    """Interface: `fill` writes the mask of the next token into `bitmask[row]` (False: no
    constraint now, the row is left as it is), `accept` advances by one token (False: the
    token is not allowed, nothing changed), `rollback` undoes the last n accepted tokens."""

    num_tokens: int = 0  # output tokens of the request accepted (engine bookkeeping)
    draft_len: int = 0  # tokens accepted on top while drafting, rolled back after
    draft_cut: int | None = None  # drafts past this many are invalid under the constraint

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        raise NotImplementedError

    def accept(self, token: int) -> bool:
        raise NotImplementedError

    def rollback(self, n: int) -> None:
        raise NotImplementedError

    @property
    def terminated(self) -> bool:
        """The constraint ended (a stop token was accepted): nothing may follow."""
        return False


class GrammarConstraint(Constraint):
    def __init__(self, compiled: xgr.CompiledGrammar, stop_token_ids: list[int]) -> None:
        # Stop tokens are the engine's EOS ids: the grammar allows them only once complete.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=stop_token_ids or None)

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        if self.matcher.is_terminated():
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def accept(self, token: int) -> bool:
        if self.matcher.is_terminated():
            return False
        return bool(self.matcher.accept_token(token))

    def rollback(self, n: int) -> None:
        if n:
            self.matcher.rollback(n)

    @property
    def terminated(self) -> bool:
        return bool(self.matcher.is_terminated())


class PrefixMasks:
    """Packed masks of the tokens allowed while `rest` bytes are left to spell, for one
    vocabulary, built from a table sorted once (not a scan of the vocabulary per prompt
    tail): the tokens whose bytes start with `rest` are one contiguous run of the sorted
    table (two bisections), the tokens that are a start of `rest` at most len(rest) exact
    look-ups. Built masks are kept in a bounded LRU, so a stream of prompts with distinct
    tails neither rescans nor grows memory. Special tokens (no bytes) are never allowed."""

    def __init__(self, token_bytes: list[bytes], max_cached: int = 1024) -> None:
        ids = sorted((i for i, b in enumerate(token_bytes) if b), key=token_bytes.__getitem__)
        self._sorted = [token_bytes[i] for i in ids]
        self._ids = np.asarray(ids, dtype=np.int64)
        self._exact: dict[bytes, list[int]] = {}
        for i in ids:
            self._exact.setdefault(token_bytes[i], []).append(i)
        self.token_bytes = token_bytes
        self._words = -(-len(token_bytes) // 32)
        self._lru: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self.max_cached = max_cached

    def packed(self, rest: bytes) -> np.ndarray:
        m = self._lru.get(rest)
        if m is not None:
            self._lru.move_to_end(rest)
            return m
        ok = np.zeros(self._words * 32, dtype=bool)
        lo = bisect.bisect_left(self._sorted, rest)
        end = _past_prefix(rest)
        hi = len(self._sorted) if end is None else bisect.bisect_left(self._sorted, end, lo)
        ok[self._ids[lo:hi]] = True  # b.startswith(rest)
        for i in range(1, len(rest)):  # rest.startswith(b), b shorter
            ok[self._exact.get(rest[:i], [])] = True
        m = np.packbits(ok, bitorder="little").view(np.int32)
        self._lru[rest] = m
        if len(self._lru) > self.max_cached:
            self._lru.popitem(last=False)
        return m


def _past_prefix(prefix: bytes) -> bytes | None:
    """The least byte string above every string that starts with `prefix` (None: none)."""
    b = bytearray(prefix)
    while b and b[-1] == 0xFF:
        b.pop()
    if not b:
        return None
    b[-1] += 1
    return bytes(b)


class PrefixConstraint(Constraint):
    """The output begins with `prefix` (bytes). A token is allowed while the prefix is not
    spelled out yet if its bytes start with what is left of it, or are a start of that rest
    (special tokens have no bytes and so never are: no end of text before the prefix)."""

    def __init__(self, prefix: bytes, masks: PrefixMasks) -> None:
        self.rest = [prefix]  # what is left after each accepted token (a stack for rollback)
        self.token_bytes = masks.token_bytes
        self.masks = masks  # shared per tokenizer

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        rest = self.rest[-1]
        if not rest:
            return False
        m = self.masks.packed(rest)
        bitmask[row, : len(m)] = torch.from_numpy(m)
        return True

    def accept(self, token: int) -> bool:
        rest = self.rest[-1]
        b = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b""
        if rest and not (b and (b.startswith(rest) or rest.startswith(b))):
            return False
        self.rest.append(rest[len(b):] if rest.startswith(b) else b"")
        return True

    def rollback(self, n: int) -> None:
        if n:
            del self.rest[-n:]


class AfterMarker(Constraint):
    """`inner` applies once the output has spelled `marker`: a reasoning model writes its
    reasoning freely and the grammar starts after `</think>`. The marker is matched as one
    token id where the tokenizer has it as a single (special) token, and on the output's
    bytes across token boundaries otherwise. Bytes that the marker's last token carries past
    the marker are not fed to the grammar (a template's `</think>` token stands alone). Each
    accepted token is recorded, so `rollback` (speculative rounds) undoes the gate exactly."""

    def __init__(self, inner: Constraint, marker_id: int | None, marker: bytes,
                 token_bytes: list[bytes], opener_id: int | None = None) -> None:
        """`opener_id`: the output may open the block with this token (the gate then waits
        for the marker); any other first token goes to `inner` at once (a model that did
        not think): the first mask allows the opener beside inner's tokens."""
        self.inner = inner
        self.opener_id = opener_id
        self.marker_id = marker_id
        self.marker = marker
        self.token_bytes = token_bytes
        # Per accepted token: None once it went to the open grammar, else the tail of bytes
        # (up to len(marker) - 1) still able to start the marker, or OPEN for the token that
        # completed it.
        self._hist: list[bytes | None | object] = []

    _OPEN = object()

    @property
    def open(self) -> bool:
        return bool(self._hist) and (self._hist[-1] is None or self._hist[-1] is self._OPEN)

    @property
    def undecided(self) -> bool:
        return not self._hist and self.opener_id is not None

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        if self.undecided:
            if not self.inner.fill(bitmask, row):
                return False
            word, bit = divmod(self.opener_id, 32)
            bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)  # int32 words
            return True
        return self.inner.fill(bitmask, row) if self.open else False

    def accept(self, token: int) -> bool:
        if self.undecided and token == self.opener_id:
            self._hist.append(b"")  # inside the block now: wait for the marker
            return True
        if self.open or self.undecided:
            if not self.inner.accept(token):
                return False
            self._hist.append(None)
            return True
        tail = self._hist[-1] if self._hist else b""
        if self.marker_id is not None and token == self.marker_id:
            self._hist.append(self._OPEN)
            return True
        b = self.token_bytes[token] if 0 <= token < len(self.token_bytes) else b""
        seen = tail + b
        if self.marker and self.marker in seen:
            self._hist.append(self._OPEN)
        else:
            self._hist.append(seen[-(len(self.marker) - 1):] if len(self.marker) > 1 else b"")
        return True

    def rollback(self, n: int) -> None:
        if not n:
            return
        undone = self._hist[-n:]
        del self._hist[-n:]
        self.inner.rollback(sum(1 for h in undone if h is None))

    @property
    def terminated(self) -> bool:
        return self.open and self.inner.terminated
