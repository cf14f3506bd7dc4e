"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over the paged latent cache.

Per token and layer the cache holds only the latent: `kv_a_layernorm(c_kv)` (kv_lora_rank
values) and the rotated shared rope key (qk_rope_head_dim), no head axis
(`ModelConfig.kv_cache_layout`: the vector's two halves sit in the cache's two planes).

Two forms of the same attention:
- expanded (prefill, training): the context's latents go through `kv_b_proj` into per-head
  keys/values, as transformers' `DeepseekV3Attention.expand_kv` does;
- absorbed (decode, query length <= _ABSORB_MAX_QUERY): `kv_b_proj`'s key half is folded into
  the query (q_nope @ W_UK, per head) and its value half applied after attention, so attention
  runs in latent space against the cached [c_kv | k_rope] directly (one shared "KV head") and
  nothing is expanded per context token. Per step it saves L * kv_lora * heads * (nope + v)
  multiply-adds for L context tokens; it is chosen for short queries, where that dominates.

Softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN
(transformers' `yarn_apply_mscale`). Rope on the rope part only, interleaved pairs when
`rope_interleave` (DeepSeek's layout).

TP: heads split across ranks (q_b_proj / q_proj and kv_b_proj column-parallel, o_proj
row-parallel); q_a_proj and kv_a_proj_with_mqa replicated, so every rank computes and caches
the whole latent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.model.attention_metadata import AttentionMetadata
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.layers import RMSNorm, apply_rope
from mtpserve.workers.model.parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    get_tp,
)
from mtpserve.workers.model.rope import yarn_get_mscale

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not
# config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
# Query lengths up to this use the absorbed form (decode rounds are k + 1 <= 8 tokens; for
# DeepSeek-V3's ranks the absorbed form costs less per query token below ~170 tokens).
_ABSORB_MAX_QUERY = 16


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """Rotary on interleaved pairs (x0, x1), (x2, x3), ...; output de-interleaved
    [evens', odds'] as transformers' `apply_rotary_pos_emb_interleave` (q and k alike, so
    their dot products are those of the interleaved rotation)."""
    half = cos.shape[-1] // 2
    # In x's dtype, as transformers casts cos/sin to the activations' dtype.
    c, s = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        tp = get_tp().size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"TP size {tp} must divide {cfg.num_attention_heads} heads")
        self.mla = mla
        self.num_heads = cfg.num_attention_heads // tp
        H, h = cfg.num_attention_heads, cfg.hidden_size
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, [H * mla.qk_head_dim])
        else:
            self.q_a_proj = ReplicatedLinear(h, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [H * mla.qk_head_dim])
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, mla.latent_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, [H * (mla.qk_nope_head_dim + mla.v_head_dim)])
        self.o_proj = RowParallelLinear(H * mla.v_head_dim, h)
        self.scale = mla.qk_head_dim ** -0.5
        rope = cfg.rope
        if rope.rope_type != "default" and rope.mscale_all_dim:
            assert rope.factor is not None
            self.scale *= yarn_get_mscale(rope.factor, rope.mscale_all_dim) ** 2
        self.rotate = apply_rope_interleaved if mla.rope_interleave else apply_rope

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, S, 1, rope_dim]
        attn: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, 1, latent_dim / 2]
    ) -> torch.Tensor:
        B, S, _ = x.shape
        m, Hl = self.mla, self.num_heads
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, S, Hl, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                      dim=-1)
        # q and the shared k rotate together (one pass over [B, S, Hl + 1, rope_dim]).
        pe = self.rotate(torch.cat([q_pe, k_pe.unsqueeze(2)], dim=2), *rope)
        q = torch.cat([q_nope, pe[:, :, :Hl]], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), pe[:, :, Hl]], dim=-1)  # [B, S, Dl]
        mask, causal = None, True
        if attn is not None:
            assert kv_cache is not None
            half = m.latent_dim // 2
            flat = kv_cache.view(2, -1, 1, half)
            new = latent.reshape(B * S, 2, half).transpose(0, 1).unsqueeze(2)
            if attn.write_rows is not None:  # padded query slots write nowhere
                new = new[:, attn.write_rows]
            flat[:, attn.write_slots] = new.to(kv_cache.dtype)
            ctx = kv_cache.index_select(1, attn.block_index).view(
                2, B, -1, half)[:, :, : attn.max_context_len].to(q.dtype)
            latent = torch.cat([ctx[0], ctx[1]], dim=-1)  # [B, L, Dl]
            mask, causal = attn.mask, False
            if attn.flex is not None:
                # Flex reads GQA caches in place; the latent is one small vector per token,
                # so MLA gathers it under either backend, with the causal mask built here.
                ctx_pos = torch.arange(latent.shape[1], device=latent.device)
                mask = (ctx_pos <= attn.flex.positions.unsqueeze(-1)).unsqueeze(1)
        if attn is not None and S <= _ABSORB_MAX_QUERY:
            return self._absorbed(q_nope, pe[:, :, :Hl], latent, mask)
        c, k_rot = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        L = latent.shape[1]
        kv = self.kv_b_proj(c).view(B, L, Hl, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(2).expand(B, L, Hl, m.qk_rope_head_dim)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=causal and S > 1, scale=self.scale,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, S, Hl * m.v_head_dim))

    def _absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Attention in latent space: q_nope [B, S, Hl, nope], q_rot [B, S, Hl, rope],
        latent [B, L, kv_lora + rope] (the cache's rows), mask [B, 1, S, L]."""
        m, Hl = self.mla, self.num_heads
        B, S = q_nope.shape[:2]
        w = self.kv_b_proj.weight.unflatten(0, (Hl, m.qk_nope_head_dim + m.v_head_dim))
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)  # [Hl, *, kv_lora]
        q_lat = torch.einsum("bshn,hnr->bhsr", q_nope, w_uk)
        q = torch.cat([q_lat, q_rot.transpose(1, 2)], dim=-1)  # [B, Hl, S, kv_lora + rope]
        # Every local head attends the same single latent "head": fold the heads into query
        # rows (row h * S + s) against one KV head. SDPA's GQA form would repeat the latent
        # once per head (its math backend: the mask and head dim 576 rule out the fused
        # ones), Hl times the latent traffic; folded, the latent is read once per row block.
        kv = latent.unsqueeze(1)  # [B, 1, L, kv_lora + rope]
        rows = q.reshape(B, 1, Hl * S, q.shape[-1])
        fold_mask = None if mask is None else mask.repeat(1, 1, Hl, 1)  # [B, 1, Hl * S, L]
        out = F.scaled_dot_product_attention(
            rows, kv, kv[..., : m.kv_lora_rank], attn_mask=fold_mask, scale=self.scale,
        ).view(B, Hl, S, m.kv_lora_rank)
        out = torch.einsum("bhsr,hvr->bshv", out, w_uv)
        return self.o_proj(out.reshape(B, S, Hl * m.v_head_dim))
