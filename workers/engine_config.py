"""Engine settings and the error for requests the engine cannot take."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "float32"
    device: str = "cpu"
    num_speculative_tokens: int = 2
    adaptive_k: bool = False
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    role: Literal["both", "prefill", "decode"] = "both"
    # Mixed batches: while requests are running, prefill chunks of up to
    # `mixed_prefill_tokens` tokens per step ride along their decode rounds in the same
    # forward instead of taking turns with them (running requests keep emitting every step).
    # Measured (benchmarks/prefill_burst.py): running requests' TPOT during a 2x1024-token
    # burst 30.9 -> 14.2 ms, steady TPOT unchanged; the burst's own TTFT 271 -> 678 ms.
    mixed_batches: bool = True
    mixed_prefill_tokens: int = 128
    # Draft over the N most frequent tokens only (workers.spec.draft_vocab); None: all.
    draft_vocab_size: int | None = None


class EngineError(ValueError):
    """A request the engine cannot take (too long, bad parameters)."""
