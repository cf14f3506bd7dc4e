from __future__ import annotations

import random

import pytest
from tiny_tokenizer import make_tokenizer

from mtpserve.workers.detokenizer import (
    IncrementalDetokenizer,
    StopStringMatcher,
    marker_skip_ids,
    special_token_ids,
)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer(tmp_path_factory.mktemp("tok"))))


def stream(detok: IncrementalDetokenizer, ids: list[int], sizes: list[int]) -> list[str]:
    out, i = [], 0
    for n in sizes:
        out.append(detok.add(ids[i : i + n]))
        i += n
    out.append(detok.add(ids[i:]))
    out.append(detok.flush())
    return out


def test_multibyte_characters_are_never_split(tokenizer):
    text = "café 😀 日本語 €"
    byte_ids = [tokenizer.convert_tokens_to_ids(t) for t in tokenizer.tokenize(text)]
    # One token per byte: each multi-byte character arrives in pieces.
    ids = [i for t in byte_ids for i in _byte_tokens(tokenizer, t)]
    assert len(ids) == len(text.encode())
    deltas = stream(IncrementalDetokenizer(tokenizer), ids, [1] * len(ids))
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "😀" in deltas  # the 4-byte emoji came out whole, in one delta


def _byte_tokens(tokenizer, token_id: int) -> list[int]:
    """Split a byte-level token into single-byte tokens (their byte-alphabet symbols)."""
    token = tokenizer.convert_ids_to_tokens(token_id)
    return [tokenizer.convert_tokens_to_ids(ch) for ch in token]


@pytest.mark.parametrize("seed", range(5))
def test_concatenated_deltas_equal_full_decode(tokenizer, seed):
    rng = random.Random(seed)
    ids = [rng.randrange(1, len(tokenizer)) for _ in range(60)]  # includes invalid UTF-8
    prompt = tokenizer.encode("hello world")
    sizes = [rng.randint(1, 4) for _ in range(20)]
    deltas = stream(IncrementalDetokenizer(tokenizer, prompt), ids, sizes)
    assert "".join(deltas) == tokenizer.decode(ids)


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("hello") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.add(ids) + detok.flush() == "hello"


@pytest.mark.parametrize("seed", range(3))
def test_special_markers_kept_as_text_other_special_tokens_skipped(tmp_path_factory, seed):
    """A GLM-style tokenizer whose markers are special added tokens: with `marker_skip_ids`
    the markers decode as their text (streamed in any chunking == whole), every other special
    token (EOS, role tokens) is skipped; skipping all special ids == skip_special_tokens."""
    from chat_models import GLM_MARKERS, make_chat_tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(make_chat_tokenizer(
        tmp_path_factory.mktemp("glm"), "glm45", special_markers=True)))
    kept = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>"]
    skip = marker_skip_ids(tok, kept)
    kept_ids = {tok.convert_tokens_to_ids(m) for m in kept}
    assert skip is not None and kept_ids <= special_token_ids(tok) and not kept_ids & skip
    assert marker_skip_ids(tok, ["<tool_call>x", "plain"]) is None  # no special marker
    rng = random.Random(seed)
    pieces = ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<|user|>", "[gMASK]",
              "<arg_value>", "café", " city", "\n", "日本語", "<|endoftext|>"]
    text = "".join(rng.choice(pieces) for _ in range(30))
    ids = tok.encode(text, add_special_tokens=False)
    sizes = [rng.randint(1, 4) for _ in range(20)]
    got = "".join(stream(IncrementalDetokenizer(tok, skip_ids=skip), ids, sizes))
    special = {t for t in pieces if t in GLM_MARKERS or t.startswith(("<|", "[gM"))}
    want = text
    for t in special - set(kept):
        want = want.replace(t, "")
    assert got == want
    everything = special_token_ids(tok)
    assert "".join(stream(IncrementalDetokenizer(tok, skip_ids=everything), ids, sizes)) == \
        tok.decode(ids, skip_special_tokens=True)


def test_prompt_ending_mid_character_does_not_eat_output(tokenizer):
    emoji = [i for t in tokenizer.encode("😀") for i in _byte_tokens(tokenizer, t)]
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("hi") + emoji[:2])
    assert detok.add(tokenizer.encode(" world")) == " world"


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> str:
    return "".join(matcher.feed(p) for p in pieces) + matcher.flush()


def test_stop_string_cuts_before_it():
    m = StopStringMatcher(["STOP"])
    assert feed_all(m, ["abc ST", "OP def"]) == "abc "
    assert m.stopped


def test_partial_stop_prefix_is_held_then_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "  # "ST" might begin the stop string
    assert m.feed("AR") == "STAR"
    assert not m.stopped
    assert m.feed("xS") == "x"
    assert m.flush() == "S"  # the stream ended: what was held is text after all


def test_earliest_of_several_stop_strings_wins():
    m = StopStringMatcher(["world", "lo"])
    assert feed_all(m, ["hel", "lo world"]) == "hel"


def test_stop_spanning_many_single_char_pieces():
    m = StopStringMatcher(["\n\n"])
    assert feed_all(m, list("line one\n\nline two")) == "line one"


def test_after_stop_nothing_more_is_emitted():
    m = StopStringMatcher(["x"])
    assert m.feed("axb") == "a"
    assert m.feed("more") == ""
    assert m.flush() == ""


def test_no_stop_strings_passes_through():
    m = StopStringMatcher(["", ""])
    assert m.feed("abc") == "abc"
    assert not m.stopped
