"""Per-request matchers: which tokens may come next, advanced token by token, rolled back.

`GrammarConstraint` wraps an xgrammar `GrammarMatcher` (JSON schema, regex, choice, EBNF, tool
calls). `PrefixConstraint` serves token healing: the next tokens must spell out a given byte
prefix (a token may cover the rest of it and go on), after which nothing is constrained. Both
write the same packed bitmask (int32 words, bit i of word j = token 32 j + i allowed), so the
engine applies either the same way.
"""

from __future__ import annotations

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


class PrefixConstraint(Constraint):
    """The output begins with `prefix` (bytes). A token is allowed while the prefix is not
    spelled out yet if its bytes start with what is left of it, or are a start of that rest
    (special tokens have no bytes and so never are: no end of text before the prefix)."""

    def __init__(self, prefix: bytes, token_bytes: list[bytes],
                 masks: dict[bytes, np.ndarray]) -> None:
        self.rest = [prefix]  # what is left after each accepted token (a stack for rollback)
        self.token_bytes = token_bytes
        self.masks = masks  # shared per tokenizer: packed masks by remaining prefix

    def _packed(self, rest: bytes) -> np.ndarray:
        m = self.masks.get(rest)
        if m is None:
            ok = np.fromiter(((b != b"" and (b.startswith(rest) or rest.startswith(b)))
                              for b in self.token_bytes), dtype=bool,
                             count=len(self.token_bytes))
            pad = (-len(ok)) % 32
            m = np.packbits(np.concatenate([ok, np.zeros(pad, dtype=bool)]),
                            bitorder="little").view(np.int32)
            self.masks[rest] = m
        return m

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        rest = self.rest[-1]
        if not rest:
            return False
        m = self._packed(rest)
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
