"""Tokenizer loading (offline, from the checkpoint folder)."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=8)
def load_tokenizer(path: str):
    """The checkpoint's `transformers` tokenizer; never touches the network."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)
