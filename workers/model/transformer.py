"""Decoder-only causal LM (dense or MoE layers, per `ModelConfig.layers`) with DeepSeek-V3-style
MTP module(s). Families: `workers/model/families/`."""

from __future__ import annotations

import copy

import torch
from torch import nn

from mtpserve.workers.model.attention_metadata import AttentionMetadata
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.layers import DecoderLayer, RMSNorm, RotaryEmbedding
from mtpserve.workers.model.mtp import MTPModule
from mtpserve.workers.model.parallel import (
    ParallelLMHead,
    SubsetLMHead,
    VocabParallelEmbedding,
    full_head_weight,
)


class DecoderBody(nn.Module):
    """`model.*` in HF naming: embeddings, layers, final norm."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        dsa = cfg.mla.dsa if cfg.mla is not None else None
        for i in dsa.shared_layers if dsa is not None else ():
            # GLM-5 "shared" layers reuse the closest earlier layer with an indexer.
            src = max(j for j in range(i) if j not in dsa.shared_layers)
            self.layers[i].self_attn.share_selection_from(self.layers[src].self_attn)


class CausalLM(nn.Module):
    """Main model plus MTP modules.

    Attention layer i < L is main layer i; L + m is the decoder block of MTP module m. Each has
    its own slice of the KV cache, indexed by the same block tables.
    """

    # Attention over the paged cache in compiled graphs: "gather" | "flex" (set by ModelRunner;
    # the graphs read it, so each backend compiles its own).
    attention_backend: str = "gather"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderBody(cfg)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.mtp = nn.ModuleList(MTPModule(cfg, m) for m in range(cfg.num_mtp_modules))
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope)
        # Step ropes each layer type its own way (`LayerSpec.rope`): index 0 is `rotary`.
        self.extra_rotary = nn.ModuleList(
            RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, r) for r in cfg.ropes[1:])
        if cfg.zero_centred_norm:  # Qwen3-Next: every RMSNorm (main and MTP) scales by 1 + w
            for mod in self.modules():
                if isinstance(mod, RMSNorm):
                    mod.zero_centred = True

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, S]
        positions: torch.Tensor,  # [B, S]
        attn: AttentionMetadata | None = None,
        kv_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Main-model hidden states after the final norm, [B, S, hidden] (what MTP consumes).
        Hybrid models: `kv_caches[i]` of a linear layer is its `LinearState` (state slots)."""
        x = self.model.embed_tokens(input_ids)
        ropes = self.ropes(positions)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, ropes[self.config.layer(i).rope], attn,
                      None if kv_caches is None else kv_caches[i])
        return self.model.norm(x)

    def ropes(self, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin at `positions` of each of the model's ropes (one unless layer types rope
        differently), computed once per forward."""
        return [r.cos_sin(positions) for r in (self.rotary, *self.extra_rotary)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.logits(hidden).float()

    def forward_mtp(
        self,
        module: int,
        input_ids: torch.Tensor,  # [B, S] token t+1 for entry t
        prev_hidden: torch.Tensor,  # [B, S, hidden] hidden of entry t from the previous depth
        positions: torch.Tensor,  # [B, S] position t
        attn: AttentionMetadata | None = None,
        kv_caches: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """MTP module `module`'s hidden after its shared-head norm, [B, S, hidden]."""
        mtp = self.mtp[module]
        embed = mtp.embed_tokens if mtp.embed_tokens is not None else self.model.embed_tokens
        kv = None if kv_caches is None else kv_caches[self.config.num_hidden_layers + module]
        # The MTP module may run in a cheaper dtype than the main model (`lower_mtp_precision`):
        # its inputs follow its weights (no-ops when they match).
        dt = mtp.eh_proj.weight.dtype
        spec = self.config.layer(self.config.num_hidden_layers + module)
        rotary = self.rotary if spec.rope == 0 else self.extra_rotary[spec.rope - 1]
        return mtp(embed(input_ids).to(dt), prev_hidden.to(dt), rotary.cos_sin(positions),
                   attn, kv)

    def compute_mtp_logits(self, module: int, hidden: torch.Tensor) -> torch.Tensor:
        head = self.mtp[module].head
        return (head or self.lm_head).logits(hidden).float()

    def lower_mtp_precision(self, dtype: torch.dtype) -> None:
        """Run the MTP module(s) and their LM head in `dtype` (e.g. bf16: half the bytes per
        draft step). Drafts come from this cheaper head; exactness is unaffected because the
        main model verifies every draft and the rejection sampler uses the q these logits
        give. A shared head gets its own low-precision copy; the main head is untouched."""
        for mtp in self.mtp:
            if mtp.head is None:
                mtp.head = copy.deepcopy(self.lm_head)
            mtp.to(dtype)

    def restrict_draft_vocab(self, token_ids: list[int]) -> None:
        """Draft over `token_ids` only (workers.spec_decode.draft_vocab): each MTP module gets a
        head holding just those rows. Call before `lower_mtp_precision`. Under TP every rank
        calls it (the full head is gathered once)."""
        for mtp in self.mtp:
            mtp.head = SubsetLMHead(full_head_weight(mtp.head or self.lm_head), token_ids)
