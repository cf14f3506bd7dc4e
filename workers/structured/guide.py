"""The engine's side of structured outputs: matchers per request, masks on the logits.

Every place where logits become tokens asks the guide for a mask (`mask_rows` for first
tokens, `mask_verify` for the k + 1 rows of a speculative round, `mask_drafts` for each MTP
draft step), so the target distribution p and the draft distribution q are masked alike and
rejection sampling keeps the masked target exactly (as `suppress_tokens` does for min_tokens).

Matcher state is derived from the request's tokens: `sync` makes the matcher have accepted
exactly `output_token_ids` (catching up tokens emitted elsewhere, or rebuilding after a roll
back), so a resumed or migrated request, the decode side of P/D (the prefill's first token) and
a request restored after a failed step all continue from the right state, with nothing shipped.
Verification advances the matcher along the drafts to mask each position and rolls it back
afterwards; drafting does the same along the draft chain.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from mtpserve.workers.spec_decode.sampling import suppress_tokens
from mtpserve.workers.structured.spec import StructuredSpec

if TYPE_CHECKING:  # xgrammar (~2 s to import) loads with the first constrained request
    from mtpserve.workers.structured.constraint import Constraint, PrefixMasks
    from mtpserve.workers.structured.grammars import GrammarCache

logger = logging.getLogger(__name__)


COMPILE_NICENESS = 10


def _lower_priority() -> None:
    """A compile thread yields the CPU to the engine thread (Linux nice is per thread): on a
    small machine the streams' next round should not wait behind a compile."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: same priority
        pass


class StructuredGuide:
    """Matchers of one engine's constrained requests (`req.constraint`), built on demand: an
    engine that never sees a constrained request never loads the tokenizer."""

    def __init__(self, tokenizer_path: str, vocab_size: int, eos_ids: list[int],
                 compile_workers: int = 2) -> None:
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)
        self._cache: GrammarCache | None = None
        self._cache_lock = threading.Lock()  # the engine thread and the compile pool build it
        # Grammars that are not cached compile here, off the engine thread (xgrammar releases
        # the GIL): a slow grammar delays only its own request. The pool's size is the
        # replica's cap on concurrent compiles; later ones queue.
        self.compile_workers = compile_workers
        self._pool: ThreadPoolExecutor | None = None
        self._prefix_masks: PrefixMasks | None = None  # token healing, built on first use

    @property
    def cache(self) -> GrammarCache:
        with self._cache_lock:
            if self._cache is None:
                from mtpserve.workers.structured.grammars import GrammarCache
                from mtpserve.workers.tokenizer import load_tokenizer

                self._cache = GrammarCache.of_tokenizer(load_tokenizer(self.tokenizer_path),
                                                        self.vocab_size, self.eos_ids)
            return self._cache

    def warm(self) -> None:
        """Load now what the first constrained request would load: xgrammar (~1-2 s to
        import), the tokenizer's token table and the token-healing masks. A served replica
        calls it before it reports ready, so a client's first healed or structured request
        does not stall every stream of the batch behind that load (measured: a 2.4 s TTFT
        on the first guidellm request, whose prompt ends mid-word)."""
        from mtpserve.workers.structured.constraint import PrefixMasks

        try:
            if self._prefix_masks is None:
                self._prefix_masks = PrefixMasks(self.cache.token_bytes)
        except Exception as e:  # a model without a usable tokenizer: loads on first use
            logger.info("structured outputs not preloaded: %s", e)

    def gated(self, req: Any, inner: Constraint) -> Constraint:
        """`inner`, applying only after the request's `structured_after` marker if it has
        one (a reasoning block's end)."""
        after = getattr(req.params, "structured_after", None)
        if not after:
            return inner
        from mtpserve.workers.structured.constraint import AfterMarker
        from mtpserve.workers.tokenizer import load_tokenizer

        tok = load_tokenizer(self.tokenizer_path)

        def single(text: str | None) -> int | None:
            ids = tok.encode(text, add_special_tokens=False) if text else []
            return ids[0] if len(ids) == 1 else None

        opener = getattr(req.params, "structured_opener", None)
        return AfterMarker(inner, single(after), after.encode(), self.cache.token_bytes,
                           opener_id=single(opener))

    def new_constraint(self, spec: StructuredSpec) -> Constraint:
        """A fresh matcher; raises `GrammarError` when the spec does not compile."""
        from mtpserve.workers.structured.constraint import (
            GrammarConstraint,
            PrefixConstraint,
            PrefixMasks,
        )

        if spec.kind == "prefix":
            if self._prefix_masks is None:
                self._prefix_masks = PrefixMasks(self.cache.token_bytes)
            return PrefixConstraint(spec.prefix_bytes, self._prefix_masks)
        return GrammarConstraint(self.cache.compile(spec), self.eos_ids)

    # Lifecycle ---------------------------------------------------------------------------
    def begin(self, req: Any, on_done: Callable[[], None] | None = None) -> bool:
        """At admission, without blocking on a compile: True when the matcher is installed
        now (token healing, a grammar compiled before); False when its grammar compiles on
        the pool (`req.grammar` is the future; `on_done` is called from the pool thread
        when it is ready) and `finish` installs it. Raises `GrammarError` for a spec that
        fails at once."""
        spec = req.params.structured
        if spec.kind == "prefix" or (self._cache is not None and self._cache.cached(spec)):
            self.admit(req)
            return True
        from mtpserve.workers.structured.grammars import spec_grammar

        spec_grammar(spec)  # a spec that cannot be built fails now, at admission (cheap)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.compile_workers,
                                            thread_name_prefix="grammar-compile",
                                            initializer=_lower_priority)
        req.grammar = self._pool.submit(lambda: self.cache.compile(spec))
        if on_done is not None:
            req.grammar.add_done_callback(lambda _: on_done())
        return False

    def finish(self, req: Any) -> None:
        """Install the matcher `begin` compiled (its future done); raises its `GrammarError`."""
        from mtpserve.workers.structured.constraint import GrammarConstraint

        future, req.grammar = req.grammar, None
        req.constraint = self.gated(req, GrammarConstraint(future.result(), self.eos_ids))
        self.sync(req)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def admit(self, req: Any) -> None:
        """At admission: the request's matcher, advanced over the tokens it already has."""
        spec = req.params.structured
        req.constraint = None if spec is None else self.gated(req, self.new_constraint(spec))
        if req.constraint is not None:
            self.sync(req)

    @staticmethod
    def release(req: Any) -> None:
        req.constraint = None
        if getattr(req, "grammar", None) is not None:  # its compile may finish: unused
            req.grammar.cancel()
            req.grammar = None

    def sync(self, req: Any) -> Constraint | None:
        """The request's matcher, having accepted exactly its output tokens."""
        c = req.constraint
        if c is None:
            return None
        out = req.output_token_ids
        if c.num_tokens > len(out):  # tokens were taken back (a failed step): rebuild
            c = req.constraint = self.gated(req, self.new_constraint(req.params.structured))
        for t in out[c.num_tokens:]:
            if not c.accept(t):
                # Only tokens the mask allowed are emitted; this is a resumed request whose
                # earlier tokens were not made under this constraint. Leave it unconstrained.
                logger.warning("request %s: token %d breaks its constraint; constraint "
                               "dropped", req.request_id, t)
                req.constraint = None
                return None
            c.num_tokens += 1
        c.draft_len, c.draft_cut = 0, None
        return c

    # Masks -------------------------------------------------------------------------------
    def _bitmask(self, n: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(n, self.vocab_size)  # all allowed (-1)

    @staticmethod
    def _apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """A copy of logits with the bitmask's rows applied (-inf where a bit is 0); on the
        logits' device (xgrammar's CPU kernel on the host, its CUDA / Triton one on GPU)."""
        if not rows:
            return logits
        import xgrammar as xgr

        out = logits.float().clone() if logits.dtype != torch.float32 else logits.clone()
        xgr.apply_token_bitmask_inplace(out, bitmask.to(out.device, non_blocking=True),
                                        vocab_size=out.shape[-1], indices=rows)
        return out

    @staticmethod
    def _only(bm: torch.Tensor, row: int, tokens: list[int]) -> bool:
        """Whether row `row` of the packed bitmask allows nothing but `tokens`."""
        if not tokens:
            return False
        words = bm[row].clone()
        for t in tokens:
            word, bit = divmod(t, 32)
            if word < words.shape[0]:
                words[word] &= ~((1 << bit) - (1 << 32 if bit == 31 else 0))
        return not bool(words.any())

    def _suppress(self, logits: torch.Tensor, bm: torch.Tensor, rows: list[int],
                  banned: list[list[int]] | None) -> torch.Tensor:
        """min_tokens' bans (`banned[i]`: ids row i may not be), except on a masked row whose
        grammar allows nothing but banned ids: the output is complete, the grammar's end wins
        over min_tokens (banning it would leave no token at all)."""
        if banned is None:
            return logits
        masked = set(rows)
        keep = [[] if i in masked and self._only(bm, i, b) else b
                for i, b in enumerate(banned)]
        return suppress_tokens(logits, keep)

    def mask_rows(self, logits: torch.Tensor, reqs: list[Any],
                  banned: list[list[int]] | None = None) -> torch.Tensor:
        """logits [len(reqs), V], row i deciding request i's next token; `banned`: the
        min_tokens bans, applied here (`_suppress`)."""
        if not any(r.constraint is not None for r in reqs):
            return logits if banned is None else suppress_tokens(logits, banned)
        bm = self._bitmask(len(reqs))
        rows = [i for i, r in enumerate(reqs)
                if (c := self.sync(r)) is not None and c.fill(bm, i)]
        return self._apply(self._suppress(logits, bm, rows, banned), bm, rows)

    def mask_verify(self, logits: torch.Tensor, reqs: list[Any], S: int,
                    banned: list[list[int]] | None = None) -> torch.Tensor:
        """logits [R * S, V] of a speculative round: row b * S + s decides the token after
        request b's last token and its first s drafts. Each row gets the mask of the state
        after those drafts; the matcher is rolled back afterwards. Rows after a draft the
        grammar rejects need no mask: that draft is rejected (its row masks it out)."""
        if not any(r.constraint is not None for r in reqs):
            return logits if banned is None else suppress_tokens(logits, banned)
        bm = self._bitmask(len(reqs) * S)
        rows: list[int] = []
        for b, r in enumerate(reqs):
            c = self.sync(r)
            if c is None or not c.fill(bm, b * S):
                continue
            rows.append(b * S)
            advanced = 0
            for s, d in enumerate(r.draft_token_ids, start=1):
                if not c.accept(d):
                    break
                advanced += 1
                if not c.fill(bm, b * S + s):
                    break
                rows.append(b * S + s)
            c.rollback(advanced)
        return self._apply(self._suppress(logits, bm, rows, banned), bm, rows)

    # Drafting ----------------------------------------------------------------------------
    def mask_drafts(self, reqs: list[Any], logits: torch.Tensor, depth: int) -> torch.Tensor:
        """Draft logits [len(reqs), V] at `depth` (1 = first draft): each constrained row
        masked by its matcher advanced along this chain's earlier drafts."""
        if not any(r.constraint is not None for r in reqs):
            return logits
        bm = self._bitmask(len(reqs))
        rows = []
        for i, r in enumerate(reqs):
            c = self.sync(r) if depth == 1 else r.constraint
            if c is None or c.draft_cut is not None:
                continue
            if c.fill(bm, i):
                rows.append(i)
        return self._apply(logits, bm, rows)

    def advance_drafts(self, reqs: list[Any], tokens: torch.Tensor, logits: torch.Tensor,
                       depth: int) -> None:
        """Advance each constrained request's matcher by its draft at `depth` (tokens [n] on
        the device: one host copy, only when a row is constrained). A draft the matcher
        refuses (the draft head had no allowed token: a draft vocabulary) cuts the chain."""
        idx = [i for i, r in enumerate(reqs)
               if r.constraint is not None and r.constraint.draft_cut is None]
        if not idx:
            return
        sel = torch.tensor(idx, device=tokens.device)
        host = torch.stack([tokens[sel].to(torch.float64),
                            logits[sel].amax(dim=-1).to(torch.float64)], dim=1).tolist()
        for i, (tok, top) in zip(idx, host, strict=True):
            c = reqs[i].constraint
            if top == float("-inf") or not c.accept(int(tok)):
                c.draft_cut = depth - 1
                continue
            c.draft_len += 1
            if c.terminated:  # a stop token: nothing after it can be emitted
                c.draft_cut = depth

    @staticmethod
    def end_drafts(reqs: list[Any]) -> None:
        """After the chain: matchers back at the request's tokens, invalid drafts dropped."""
        for r in reqs:
            c = r.constraint
            if c is None:
                continue
            c.rollback(c.draft_len)
            if c.draft_cut is not None:
                del r.draft_token_ids[c.draft_cut:]
                if r.draft_probs is not None:
                    r.draft_probs = r.draft_probs[: c.draft_cut] if c.draft_cut else None
            c.draft_len, c.draft_cut = 0, None
