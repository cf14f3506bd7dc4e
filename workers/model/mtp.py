"""DeepSeek-V3 multi-token prediction module.

Entry t of module m combines the previous depth's hidden state at t (the main model's
post-norm hidden for m = 0) with the embedding of token t+1+m:

    h' = eh_proj(concat(enorm(emb), hnorm(h)))   # MiMo orders the halves (h, emb)
    h' = DecoderLayer(h')                        # own KV cache, RoPE position t
    out = shared_head.norm(h')                   # -> shared LM head predicts token t+2+m

The hidden-state contract (the same for every family served: DeepSeek-V3/GLM naming, MiMo,
Qwen3-Next naming):
- `hnorm` takes the main model's hidden AFTER its final norm (`model.norm`), as transformers
  feeds `MtpModel` (`generation/candidate_generator.py`: `model_outputs.hidden_states[-1]`,
  which is the normed last hidden state) and vLLM feeds `DeepSeekMTP` (the main model's
  normed output).
- the next draft step (module m+1, or module 0 reused for k > 1) takes `out`, the output
  AFTER `shared_head.norm` — transformers' `MtpModel.forward` chains `forward_layer`, which
  returns `MtpLayer`'s post-norm (`shared_head.norm`) output, into the next layer's
  `last_hidden_states`. (vLLM's DeepSeekMTP feeds the pre-norm block output instead; greedy
  equality cannot tell the two apart, draft logits can: tests/test_model_families.py checks
  ours against `MtpModel.forward_layer`.)

The decoder block is the real layer type at index num_hidden_layers + m (an MoE block for
GLM-4.5 and DeepSeek-V3, whose layers past `first_k_dense_replace` are all MoE).
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
    def __init__(self, cfg: ModelConfig, module: int = 0, own_head: bool = False,
                 own_embed: bool = False) -> None:
        super().__init__()
        self.hidden_first = cfg.mtp_naming == "mimo"
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers + module)
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
