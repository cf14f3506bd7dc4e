"""The paged KV cache tensors of one rank: main layers, then one layer per MTP module."""

from __future__ import annotations

import torch

from workers.model.config import ModelConfig
from workers.model.parallel import get_tp


class KVCache:
    """`layers[i]` is [2, num_blocks, block_size, kv_heads_local, head_dim] (K, V); zeroed so
    masked-out padding never contributes NaNs."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        kv_heads = cfg.num_key_value_heads // get_tp().size
        shape = (2, num_blocks, block_size, kv_heads, cfg.head_dim)
        self.layers = [
            torch.zeros(shape, dtype=dtype, device=device)
            for _ in range(cfg.num_attention_layers)
        ]
        self.num_blocks = num_blocks
        self.block_size = block_size
