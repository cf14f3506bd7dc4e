"""DeepSeek-V3 multi-token prediction module.

Entry t of module m combines the previous depth's hidden state at t (the main model's
post-norm hidden for m = 0) with the embedding of token t+1+m:

    h' = eh_proj(concat(enorm(emb), hnorm(h)))   # MiMo orders the halves (h, emb)
    h' = DecoderLayer(h')                        # own KV cache, RoPE position t
    out = shared_head.norm(h')                   # -> shared LM head predicts token t+2+m

`out` is also what the next draft step feeds back as `h` (post-norm, like the main model's).
"""

from __future__ import annotations

import torch
from torch import nn

from mtpserve.workers.model.attention_metadata import AttentionMetadata
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.layers import DecoderLayer, RMSNorm
from mtpserve.workers.model.parallel import (
    ParallelLMHead,
    ReplicatedLinear,
    SubsetLMHead,
    VocabParallelEmbedding,
)


class MTPModule(nn.Module):
    def __init__(self, cfg: ModelConfig, own_head: bool = False, own_embed: bool = False) -> None:
        super().__init__()
        self.hidden_first = cfg.mtp_naming == "mimo"
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size)
        self.block = DecoderLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # DeepSeek-V3 checkpoints repeat the embedding and head per module; when a checkpoint
        # omits them the main model's are shared (the loader attaches them on demand).
        # A draft vocabulary replaces it with a SubsetLMHead (restrict_draft_vocab).
        self.head: ParallelLMHead | SubsetLMHead | None = (
            ParallelLMHead(cfg.vocab_size, cfg.hidden_size) if own_head else None
        )
        self.embed_tokens: VocabParallelEmbedding | None = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if own_embed else None
        )

    def forward(
        self,
        emb: torch.Tensor,  # [B, S, hidden]
        prev_hidden: torch.Tensor,  # [B, S, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin at the entries' positions
        attn: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        e, h = self.enorm(emb), self.hnorm(prev_hidden)
        x = self.eh_proj(torch.cat([h, e] if self.hidden_first else [e, h], dim=-1))
        return self.norm(self.block(x, rope, attn, kv_cache))
