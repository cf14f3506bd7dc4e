"""A frequency-ranked draft vocabulary for the MTP head (FR-Spec style).

The MTP head is a [V, hidden] projection that every draft step runs; on a small model it is
over half of the MTP module's weight bytes. Drafting only over the N most frequent tokens
makes each draft step cheaper; exactness is kept because the drafts' distribution q is the
subset's softmax with zero mass elsewhere, and that q is what rejection sampling uses (greedy
drafts are the subset's argmax; the main model verifies every draft either way). A token
outside the subset is never drafted: the cost is acceptance, never correctness.

The ranking lives next to the checkpoint as `draft_vocab.json` ({"token_ids": [...]}, most
frequent first), built by `mtpserve draft-vocab` from a text corpus.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

FILE_NAME = "draft_vocab.json"


class DraftVocabError(ValueError):
    pass


def rank_tokens(token_streams: Iterable[list[int]], vocab_size: int) -> list[int]:
    """Every token id in [0, vocab_size), most frequent first (ties: lower id first)."""
    counts: Counter[int] = Counter()
    for ids in token_streams:
        counts.update(ids)
    return sorted(range(vocab_size), key=lambda t: (-counts.get(t, 0), t))


def write_ranking(model_dir: str | Path, ranking: list[int], source: str) -> Path:
    path = Path(model_dir) / FILE_NAME
    path.write_text(json.dumps({"source": source, "token_ids": ranking}) + "\n")
    return path


def draft_token_ids(model_dir: str | Path, size: int, vocab_size: int,
                    always: Iterable[int] = ()) -> list[int]:
    """The `size` draft tokens of the checkpoint in `model_dir`: the top of its ranking, plus
    the `always` ids (EOS), sorted. Raises DraftVocabError with the fix when it can't."""
    if not 1 <= size <= vocab_size:
        raise DraftVocabError(f"draft_vocab_size must be in [1, {vocab_size}], got {size}")
    path = Path(model_dir) / FILE_NAME
    if not path.is_file():
        raise DraftVocabError(f"draft_vocab_size needs {path}; build it with "
                              f"`mtpserve draft-vocab --model {model_dir} --corpus DIR`")
    ranking = json.loads(path.read_text())["token_ids"]
    if sorted(ranking) != list(range(vocab_size)):
        raise DraftVocabError(f"{path} must rank every token id in [0, {vocab_size}) once")
    chosen = set(ranking[:size])
    always = [t for t in always if 0 <= t < vocab_size]
    # EOS stays draftable (a draft run would otherwise overshoot every stop), in place of
    # the least frequent others.
    extra = [t for t in always if t not in chosen]
    if extra:
        keep = [t for t in ranking[:size] if t not in always][: max(size - len(always), 0)]
        chosen = set(keep) | set(always)
    return sorted(chosen)


def corpus_token_streams(tokenizer, files: Iterable[Path]) -> Iterable[list[int]]:
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield tokenizer(text, add_special_tokens=False)["input_ids"]
