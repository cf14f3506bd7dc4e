"""Token healing's prefix masks (workers/structured/constraint.py `PrefixMasks`): the sorted
table gives exactly the tokens the per-tail vocabulary scan allowed, on the embedded model's
vocabulary and on edge-case byte strings, and its cache is bounded."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from mtpserve.workers.structured.constraint import PrefixConstraint, PrefixMasks, _past_prefix


def _scan(token_bytes: list[bytes], rest: bytes) -> np.ndarray:
    """The rule by definition: every token, one by one."""
    return np.array([b != b"" and (b.startswith(rest) or rest.startswith(b))
                     for b in token_bytes], dtype=bool)


def _unpacked(m: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(m.view(np.uint8), bitorder="little")[:n].astype(bool)


@pytest.fixture(scope="module")
def vocab(default_model) -> list[bytes]:
    from mtpserve.workers.structured.grammars import GrammarCache
    from mtpserve.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(str(default_model))
    cache = GrammarCache.of_tokenizer(tok, len(tok), [tok.eos_token_id or 0], disk_dir=None)
    return cache.token_bytes


def test_sorted_table_equals_the_scan(vocab: list[bytes]) -> None:
    masks = PrefixMasks(vocab)
    g = np.random.default_rng(0)
    rests = [b"\n", b"\n    ", b" ", b"de", b"def ", b"\xff", b"\xff\xff", b"\x00", b"zzzz",
             b"\n\n\n\n\n\n\n\n", *(b for b in vocab[:400:7] if b)]
    rests += [bytes(g.integers(0, 256, g.integers(1, 4))) for _ in range(40)]
    for rest in rests:
        want = _scan(vocab, rest)
        got = _unpacked(masks.packed(rest), len(vocab))
        assert (got == want).all(), rest


def test_edges_and_bounded_cache() -> None:
    vocab = [b"", b"a", b"ab", b"abc", b"b", b"\xff", b"\xff\x00", b"a\xff", b"a\xff\xff"]
    masks = PrefixMasks(vocab, max_cached=3)
    for rest in (b"a", b"ab", b"abcd", b"\xff", b"a\xff", b"c", b"a\xff\xff\xff"):
        assert (_unpacked(masks.packed(rest), len(vocab)) == _scan(vocab, rest)).all(), rest
    assert len(masks._lru) == 3
    assert _past_prefix(b"a\xff") == b"b" and _past_prefix(b"\xff\xff") is None


def test_prefix_constraint_spells_the_prefix(vocab: list[bytes]) -> None:
    """The constraint's mask over the engine's packed bitmask, advanced token by token."""
    masks = PrefixMasks(vocab)
    c = PrefixConstraint(b"\n    ", masks)
    bitmask = torch.zeros(1, masks._words, dtype=torch.int32)
    assert c.fill(bitmask, 0)
    allowed = _unpacked(bitmask[0].numpy(), len(vocab))
    nl = vocab.index(b"\n")
    assert allowed[nl] and allowed.sum() == _scan(vocab, b"\n    ").sum()
    assert c.accept(nl) and c.rest[-1] == b"    "
    c.rollback(1)
    assert c.rest[-1] == b"\n    "


def test_after_marker_gates_its_grammar_and_rolls_back() -> None:
    """A reasoning block stays free: the inner constraint (here token healing's prefix) applies
    only after the marker, matched as one token id or across token bytes; rolling back over
    the marker closes the gate again."""
    from mtpserve.workers.structured.constraint import AfterMarker

    vocab = [b"", b"a", b"b", b"ab", b"</", b"think>", b"</think>", b"x", b""]  # 8: special
    masks = PrefixMasks(vocab)
    bitmask = torch.zeros(1, masks._words, dtype=torch.int32)
    for marker_id, spell in ((8, [8]), (None, [4, 5]), (None, [6])):
        c = AfterMarker(PrefixConstraint(b"ab", masks), marker_id, b"</think>", vocab)
        assert not c.fill(bitmask, 0) and c.accept(7) and c.accept(2)  # free before it
        for t in spell:
            assert not c.open and c.accept(t)
        assert c.open and c.fill(bitmask, 0)
        assert _unpacked(bitmask[0].numpy(), len(vocab)).tolist() == [
            False, True, False, True, False, False, False, False, False]
        assert not c.accept(2) and c.accept(1)  # the grammar holds now
        c.rollback(1 + len(spell))  # back before the marker: free again
        assert not c.open and c.accept(2)
        assert c.inner.rest[-1] == b"ab"  # the inner constraint was rolled back too
