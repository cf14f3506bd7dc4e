"""Held-out code prompts (files the default model never saw), for tests and benchmarks."""

from __future__ import annotations

from mtpserve.workers.training.data import read_texts, split_files


def held_out_prompts(n: int, num_chars: int = 400, skip_chars: int = 0) -> list[str]:
    """`n` prompts: up to `num_chars` characters from the start of distinct held-out files,
    cut at a line end so the continuation starts on a fresh line."""
    _, held = split_files()
    out = []
    for text in read_texts(held):
        text = text[skip_chars:]
        if len(text) < num_chars:
            continue
        cut = text.rfind("\n", 0, num_chars)
        out.append(text[: cut + 1 if cut > 0 else num_chars])
        if len(out) == n:
            break
    if len(out) < n:  # tiny stdlib: reuse files at later offsets
        out += held_out_prompts(n - len(out), num_chars, skip_chars + num_chars)
    return out
