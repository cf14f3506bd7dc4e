"""A tiny byte-level BPE tokenizer (with multi-byte characters) and a checkpoint to match."""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import make_tiny_checkpoint

from mtpserve.workers.training.tokenizer import save_tokenizer, train_tokenizer

WORDS = ["def", "return", "self", "import", "class", "for", "in", "print", "value", "hello",
         "world", "café", "naïve", "€uro", "日本語", "テスト", "😀 emoji"]
VOCAB_SIZE = 320  # 256 bytes + EOS + merges; merges include whole multi-byte characters


def make_tokenizer(path: Path) -> Path:
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(12)) + "\n"
             for i in range(200)]
    path.mkdir(parents=True, exist_ok=True)
    save_tokenizer(train_tokenizer(texts, VOCAB_SIZE), path)
    return path


def make_checkpoint_with_tokenizer(path: Path, max_positions: int = 2048) -> Path:
    """Tiny random Qwen3 + MTP whose vocabulary is the tokenizer's, EOS included."""
    make_tiny_checkpoint(path, "qwen3", vocab_size=VOCAB_SIZE, max_positions=max_positions)
    make_tokenizer(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = 0  # the tokenizer's <|endoftext|>
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    return path
