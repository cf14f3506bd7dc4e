"""The paged KV cache tensors of one rank: main layers, then one layer per MTP module."""

from __future__ import annotations

import torch

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.parallel import get_tp


class KVCache:
    """`layers[i]` is [2, num_blocks, block_size, kv_heads_local, head_dim] (K, V); zeroed so
    masked-out padding never contributes NaNs.

    Each layer's storage `buffers[i]` holds one extra block after the `num_blocks` that the
    block manager hands out: `scratch_block`, where the fixed-shape decode graphs write the K/V
    of padding query slots and point padding block-table entries. It is never allocated to a
    request, so padding never touches real KV. `layers[i]` is a view without it (KV transfer
    and accounting see only real blocks)."""

    def __init__(
        self,
        cfg: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        kv_heads, head_dim = cfg.kv_cache_layout(get_tp().size)  # GQA heads or MLA latent
        shape = (2, num_blocks + 1, block_size, kv_heads, head_dim)
        # A hybrid model's linear-attention layers keep no KV (their state lives in the state
        # pool, workers/state_pool.py): a one-element placeholder keeps layer indices aligned.
        self.buffers = [
            torch.zeros(shape if cfg.layer(i).attention != "linear" else (2, 1, 1, 1, 1),
                        dtype=dtype, device=device)
            for i in range(cfg.num_attention_layers)
        ]
        self.layers = [b[:, :num_blocks] for b in self.buffers]
        # What KV transfer packs and scatters: the layers that hold KV (all but a hybrid
        # model's linear-attention placeholders, whose state travels apart).
        self.transfer_layers = [lay for i, lay in enumerate(self.layers)
                                if cfg.layer(i).attention != "linear"]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.scratch_block = num_blocks
