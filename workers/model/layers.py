"""Building blocks of the dense decoder: RMSNorm, RoPE, SwiGLU MLP, attention, decoder layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workers.model.attention_metadata import AttentionMetadata
from workers.model.config import ModelConfig
from workers.model.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _plain_loader,
    get_tp,
)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.weight_loader = _plain_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 like the HF reference, so bf16 runs round the same way.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (rotate_half), as in Llama/Qwen; cos/sin cached up to max positions."""

    def __init__(self, head_dim: int, max_positions: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [B, S]; q [B, S, Hq, D]; k [B, S, Hk, D]
        cos = self.cos[positions].unsqueeze(2)  # [B, S, 1, D]
        sin = self.sin[positions].unsqueeze(2)
        return _rope(q, cos, sin), _rope(k, cos, sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up fused in one column-parallel matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Attention(nn.Module):
    """GQA attention over a paged KV cache (or plain causal attention when training)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        tp = get_tp().size
        self.head_dim = cfg.head_dim
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = cfg.num_key_value_heads // tp
        if cfg.num_key_value_heads % tp or cfg.num_attention_heads % tp:
            raise ValueError(
                f"TP size {tp} must divide {cfg.num_attention_heads} heads and "
                f"{cfg.num_key_value_heads} KV heads"
            )
        self.scale = cfg.head_dim**-0.5
        d = cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d],
            bias=cfg.attention_bias,
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, cfg.hidden_size)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.rotary = RotaryEmbedding(d, cfg.max_position_embeddings, cfg.rope_theta)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        positions: torch.Tensor,  # [B, S]
        attn: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, Hk, D]
    ) -> torch.Tensor:
        B, S, _ = x.shape
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(B, S, self.num_heads, self.head_dim)
        k = k.view(B, S, self.num_kv_heads, self.head_dim)
        v = v.view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(positions, q, k)
        if attn is None:  # training / reference: full causal attention over the sequence
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=True, scale=self.scale, enable_gqa=True,
            )
        else:
            assert kv_cache is not None
            flat_k = kv_cache[0].view(-1, self.num_kv_heads, self.head_dim)
            flat_v = kv_cache[1].view(-1, self.num_kv_heads, self.head_dim)
            valid = attn.write_mask  # [B*S] padded query slots write nowhere
            flat_k[attn.slot_mapping[valid]] = k.reshape(-1, self.num_kv_heads, self.head_dim)[valid]
            flat_v[attn.slot_mapping[valid]] = v.reshape(-1, self.num_kv_heads, self.head_dim)[valid]
            # Gather each sequence's context through its block table: [B, L, Hk, D].
            k_ctx = kv_cache[0][attn.block_tables].flatten(1, 2)[:, : attn.max_context_len]
            v_ctx = kv_cache[1][attn.block_tables].flatten(1, 2)[:, : attn.max_context_len]
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2), k_ctx.transpose(1, 2), v_ctx.transpose(1, 2),
                attn_mask=attn.mask, scale=self.scale, enable_gqa=True,
            )
        return self.o_proj(out.transpose(1, 2).reshape(B, S, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), positions, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))
