"""Streaming text from token ids: incremental detokenization and stop strings.

`IncrementalDetokenizer` turns tokens into text deltas without ever splitting a multi-byte
character (a byte-level BPE token can hold half of one): vLLM's prefix/read-offset technique
decodes a short window ending at the new tokens and emits only the part past the previously
decoded window, holding everything back while the text ends in U+FFFD (an incomplete UTF-8
sequence). The concatenated deltas equal `tokenizer.decode(all_output_ids)`.

Markers decoded as text (`skip_ids`): real checkpoints often register their tool-call and
reasoning markers as *special* added tokens, which `skip_special_tokens=True` would drop before
any parser saw them. With `skip_ids` (`marker_skip_ids`: the tokenizer's special ids minus the
markers to keep), decoding drops exactly those ids and decodes every other token, the kept
special markers included, as its text; without it, plain `skip_special_tokens` decoding.

`StopStringMatcher` cuts a text stream at the first stop string: the stop string and everything
after it are never emitted, and text that could be the start of a stop string is held back
until the next delta proves it is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded with the output, so tokenizers whose decoding depends on the left
# context (SentencePiece's leading space) produce the same text as a full decode.
NUM_CONTEXT_TOKENS = 5
# A UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens: text still ending
# in U+FFFD after this many held tokens is invalid bytes, emitted as U+FFFD rather than held
# (holding forever would re-decode an ever-growing window on every token: quadratic).
MAX_HELD_TOKENS = 8


def special_token_ids(tokenizer: Any) -> frozenset[int]:
    """The ids `decode(..., skip_special_tokens=True)` drops: added tokens marked special and
    the special-token map's (EOS, BOS, pad, ...)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {i for i, t in added.items() if getattr(t, "special", False)}
    return frozenset(ids | set(getattr(tokenizer, "all_special_ids", None) or ()))


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of `text` when it is one token of the vocabulary (special or not) that decodes
    back to exactly `text`; None otherwise."""
    try:
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    except Exception:
        return None
    if len(ids) != 1 or tokenizer.decode(ids, skip_special_tokens=False) != text:
        return None
    return ids[0]


def marker_skip_ids(tokenizer: Any, markers: Iterable[str]) -> frozenset[int] | None:
    """`skip_ids` that keep `markers` (texts; those that are single tokens) in decoded text:
    the special ids minus the markers'. None when no marker is a special token (plain
    `skip_special_tokens` decoding keeps them already)."""
    special = special_token_ids(tokenizer)
    keep = {i for m in markers if (i := single_token_id(tokenizer, m)) is not None}
    return special - keep if keep & special else None


def decode(tokenizer: Any, ids: Sequence[int], skip_ids: frozenset[int] | None = None,
           skip_special_tokens: bool = True) -> str:
    """`tokenizer.decode`, or with `skip_ids`: those ids dropped, every other token as its
    text (the special markers kept, see the module docstring)."""
    if skip_ids is None:
        return tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
    return tokenizer.decode([t for t in ids if t not in skip_ids], skip_special_tokens=False)


class IncrementalDetokenizer:
    """Token ids in, text deltas out. Mutates only itself. `skip_ids`: see the module
    docstring (it replaces `skip_special_tokens`)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True,
                 skip_ids: frozenset[int] | None = None) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.skip_ids = skip_ids
        context = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # a prompt ending mid-character would swallow the output's first bytes
        self.token_ids: list[int] = context
        self.prefix_offset = 0  # start of the window decoded for context
        self.read_offset = len(context)  # tokens before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        return decode(self.tokenizer, ids, self.skip_ids, self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        text = self._decode(self.token_ids[self.prefix_offset :])
        held = len(self.token_ids) - self.read_offset
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT_CHAR) and not final
                                        and held < MAX_HELD_TOKENS):
            return ""  # nothing new, or an incomplete character: wait for more bytes
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return text[len(prefix) :]

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the text that is now complete."""
        self.token_ids.extend(token_ids)
        return self._delta(final=False) if token_ids else ""

    def flush(self) -> str:
        """The held-back text, when no more tokens will come (invalid bytes become U+FFFD)."""
        return self._delta(final=True)


class StopStringMatcher:
    """Cuts a text stream before the first occurrence of any stop string. Mutates itself."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self.held = ""
        self.stopped = False

    def _partial_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string.
        Only lengths where the stop string holds `text`'s last character are tried, and stop
        strings are capped in length (router.protocol.MAX_STOP_CHARS), so this stays cheap
        per delta: the whole stream is linear in its length."""
        best = 0
        last = text[-1:] if text else ""
        for s in self.stop:
            k = min(len(s) - 1, len(text))
            while k > best:
                k = s.rfind(last, 0, k) + 1  # the longest candidate ending in `last`
                if k <= best:
                    break
                if text.endswith(s[:k]):
                    best = k
                    break
                k -= 1
        return best

    def feed(self, text: str) -> str:
        """Add text; returns what is safe to emit. After a stop string, returns '' forever."""
        if self.stopped:
            return ""
        if not self.stop:
            return text
        text = self.held + text
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped, self.held = True, ""
            return text[: min(hits)]
        keep = self._partial_len(text)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def flush(self) -> str:
        """The held text, when the stream ended without a stop string."""
        held, self.held = self.held, ""
        return "" if self.stopped else held
