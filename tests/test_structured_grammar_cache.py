"""Compiled grammars cached on disk across processes: a grammar one process compiled is loaded
by another (not compiled again) and masks exactly as a fresh compile does; the key covers the
spec and the tokenizer; a damaged entry is compiled again; `off` keeps memory only."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from mtpserve.workers.structured.grammars import GrammarCache
from mtpserve.workers.structured.spec import StructuredSpec
from mtpserve.workers.tokenizer import load_tokenizer

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99},
                         "tag": {"enum": ["a", "bc"]}},
          "required": ["id", "tag"], "additionalProperties": False}
SPEC = StructuredSpec.json_schema(SCHEMA)
TEXT = '{"id": 42, "tag": "bc"}'  # xgrammar's separators


@pytest.fixture(scope="module")
def tok(default_model):
    return load_tokenizer(str(default_model))


def cache_of(tok, folder) -> GrammarCache:
    """A fresh cache, as a new process would build it (nothing in memory)."""
    return GrammarCache.of_tokenizer(tok, len(tok), [tok.eos_token_id], disk_dir=folder)


def masks(cache: GrammarCache, compiled, ids: list[int]) -> list[torch.Tensor]:
    """The bitmask before each token of `ids` and after the last, for one matcher."""
    import xgrammar as xgr

    m = xgr.GrammarMatcher(compiled, override_stop_tokens=cache.stop_token_ids)
    out = []
    for t in [*ids, None]:
        bm = xgr.allocate_token_bitmask(1, cache.vocab_size)
        m.fill_next_token_bitmask(bm, 0)
        out.append(bm.clone())
        if t is not None:
            assert m.accept_token(t), t
    return out


def test_a_second_cache_loads_what_the_first_compiled(tok, tmp_path) -> None:
    first = cache_of(tok, tmp_path)
    compiled = first.compile(SPEC)
    assert (first.num_compiled, first.num_loaded) == (1, 0)
    assert len(list(tmp_path.glob("*.json"))) == 1
    second = cache_of(tok, tmp_path)
    loaded = second.compile(SPEC)
    assert (second.num_compiled, second.num_loaded) == (0, 1)
    ids = tok.encode(TEXT)
    assert all(torch.equal(a, b) for a, b in zip(masks(first, compiled, ids),
                                                 masks(second, loaded, ids), strict=True))
    # Another spec is another entry; the same spec again is the memory cache's.
    second.compile(StructuredSpec("regex", "[0-9]{2}"))
    second.compile(SPEC)
    assert (second.num_compiled, second.num_loaded) == (1, 1)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_another_process_loads_it(tok, default_model, tmp_path) -> None:
    """The real thing: a subprocess (an ingress, say) compiles; this process loads."""
    code = textwrap.dedent(f"""
        import json
        from mtpserve.workers.structured.grammars import GrammarCache
        from mtpserve.workers.structured.spec import StructuredSpec
        from mtpserve.workers.tokenizer import load_tokenizer
        tok = load_tokenizer({str(default_model)!r})
        c = GrammarCache.of_tokenizer(tok, len(tok), [tok.eos_token_id])
        c.compile(StructuredSpec.json_schema(json.loads({SPEC.value!r})))
        print(c.num_compiled, c.num_loaded)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True,
                         env={**os.environ, "MTPSERVE_GRAMMAR_CACHE": str(tmp_path)})
    assert out.stdout.split() == ["1", "0"]
    here = cache_of(tok, tmp_path)
    here.compile(SPEC)
    assert (here.num_compiled, here.num_loaded) == (0, 1)


def test_the_key_covers_the_tokenizer(tmp_path) -> None:
    spec = StructuredSpec("regex", "ab")
    a = GrammarCache.of_vocab(["a", "b", "ab", "<eos>"], [3], disk_dir=tmp_path)
    a.compile(spec)
    b = GrammarCache.of_vocab(["a", "b", "ba", "<eos>"], [3], disk_dir=tmp_path)
    b.compile(spec)
    assert (b.num_compiled, b.num_loaded) == (1, 0)  # not a's entry
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_damaged_entry_is_compiled_again(tok, tmp_path) -> None:
    cache_of(tok, tmp_path).compile(SPEC)
    (entry,) = tmp_path.glob("*.json")
    entry.write_text(entry.read_text()[:100])
    again = cache_of(tok, tmp_path)
    compiled = again.compile(SPEC)
    assert (again.num_compiled, again.num_loaded) == (1, 0)
    masks(again, compiled, tok.encode(TEXT))  # a working grammar
    rewritten = cache_of(tok, tmp_path)
    rewritten.compile(SPEC)
    assert (rewritten.num_compiled, rewritten.num_loaded) == (0, 1)


def test_off_keeps_memory_only(tok, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MTPSERVE_GRAMMAR_CACHE", "off")
    c = GrammarCache.of_tokenizer(tok, len(tok), [tok.eos_token_id])
    assert c.disk_dir is None
    c.compile(SPEC)
    assert c.num_compiled == 1
