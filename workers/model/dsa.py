"""DeepSeek Sparse Attention (DeepSeek-V3.2 `deepseek_v32`, GLM-5 `glm_moe_dsa`): the lightning
indexer and the per-query top-k selection MLA attends through.

Per query token s and context token t the indexer scores

    I[s, t] = sum_h  w[s, h] * relu(scale * q[s, h] . k[t])      (transformers' DeepseekV32Indexer)

with `index_n_heads` query heads of `index_head_dim` (q from the MLA query latent
`q_a_layernorm(q_a_proj(x))` through `wq_b`), ONE key per token (`k_norm(wk(x))`, LayerNorm with
bias), rope on the first `qk_rope_head_dim` dims of both (half-split in V3.2, interleaved in
GLM-5), per-head weights `weights_proj(x) / sqrt(heads)`. Each query then attends to the
`index_topk` best tokens of its causal context (all of them while the context is shorter).
The reference skips the Hadamard rotation and FP8 scoring of DeepSeek's kernels (orthogonal, and
a precision choice): so do we.

The indexer's key is cached per token and layer in the same paged slot as the MLA latent
(`MLAConfig.cache_dim`), so everything that pages, moves or counts the KV cache carries it.
TP: the indexer is replicated (small: index heads x head dim per token); every rank selects the
same tokens for its share of the attention heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.families.base import DSAConfig
from mtpserve.workers.model.layers import apply_rope
from mtpserve.workers.model.parallel import ReplicatedLinear, _plain_loader

# transformers builds the indexer's k_norm as nn.LayerNorm(head_dim, eps=1e-6).
_K_NORM_EPS = 1e-6
# Query rows scored at once: bounds the [rows, heads, context] fp32 score tensor of a long
# prefill chunk (2**26 floats = 256 MiB) without changing any value.
_SCORE_ELEMENTS = 1 << 26


@dataclass
class Selection:
    """Which context tokens each query attends to, in the two forms attention uses."""

    mask: torch.Tensor  # [B, 1, S, L] bool: selected and causally allowed
    index: torch.Tensor | None  # [B, S, k] context positions (None: every allowed one)
    valid: torch.Tensor | None  # [B, S, k] bool: index entries that are allowed


class Indexer(nn.Module):
    """`self_attn.indexer.*` of a DSA layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.mla is not None and cfg.mla.dsa is not None and cfg.mla.q_lora_rank
        d: DSAConfig = cfg.mla.dsa
        self.dsa, self.rope_dim = d, cfg.mla.qk_rope_head_dim
        self.wq_b = ReplicatedLinear(cfg.mla.q_lora_rank, d.index_n_heads * d.index_head_dim)
        self.wk = ReplicatedLinear(cfg.hidden_size, d.index_head_dim)
        self.k_norm = nn.LayerNorm(d.index_head_dim, eps=_K_NORM_EPS)
        for p in self.k_norm.parameters():
            p.weight_loader = _plain_loader  # type: ignore[attr-defined]
        self.weights_proj = ReplicatedLinear(cfg.hidden_size, d.index_n_heads)
        self.scale = d.index_head_dim ** -0.5

    def _rotate(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
                ) -> torch.Tensor:
        """Rope on the first rope_dim dims (x [B, S, H, D]), the rest passed through."""
        if not self.dsa.rope_interleave:
            return apply_rope(x, *rope)
        from mtpserve.workers.model.mla import apply_rope_interleaved

        rot, rest = x.split([self.rope_dim, x.shape[-1] - self.rope_dim], dim=-1)
        return torch.cat([apply_rope_interleaved(rot, *rope), rest], dim=-1)

    def key(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The per-token key the cache keeps, [B, S, index_head_dim]."""
        return self._rotate(self.k_norm(self.wk(x)).unsqueeze(2), rope).squeeze(2)

    def scores(self, x: torch.Tensor, q_latent: torch.Tensor,
               rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
        """Index scores [B, S, L] (fp32) of x's queries against `keys` [B, L, D]; the same
        matmuls in the same order as transformers, so the top-k sets agree."""
        B, S, _ = x.shape
        d = self.dsa
        q = self._rotate(self.wq_b(q_latent).view(B, S, d.index_n_heads, d.index_head_dim),
                         rope).float()
        k = keys.float().transpose(-1, -2).unsqueeze(1)  # [B, 1, D, L]
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (
            d.index_n_heads ** -0.5)
        step = max(1, _SCORE_ELEMENTS // max(1, d.index_n_heads * keys.shape[1] * B))
        out = []
        for s0 in range(0, S, step):
            sc = torch.relu(torch.matmul(q[:, s0:s0 + step], k) * self.scale)  # [B, s, H, L]
            out.append(torch.matmul(w[:, s0:s0 + step].unsqueeze(-2), sc).squeeze(-2))
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)


def select(scores: torch.Tensor | None, allowed: torch.Tensor, topk: int) -> Selection:
    """Each query's `topk` best allowed tokens. `allowed` [B | 1, 1, S, L] bool (causal and
    padding). With at most `topk` tokens of context everything allowed is selected (`scores`
    may then be None: the indexer need not run)."""
    L = allowed.shape[-1]
    if scores is None or L <= topk:
        return Selection(allowed, None, None)
    masked = scores.masked_fill(~allowed[:, 0], float("-inf"))
    index = masked.topk(topk, dim=-1).indices  # [B, S, k]
    picked = torch.zeros_like(masked, dtype=torch.bool).scatter_(-1, index, True)
    valid = allowed[:, 0].expand_as(picked).gather(-1, index)
    return Selection(picked.unsqueeze(1) & allowed, index, valid)


def sparse_attention_backend(device_type: str) -> tuple[str, str]:
    """(backend, why) of DSA's sparse attention on this host, for `check` and the replica log.
    The torch path (gathered top-k latents, absorbed attention) runs everywhere; on CUDA the
    libraries made for it are probed by import: FlashMLA's sparse kernels, FlashInfer's MLA.
    Neither is wired into the forward yet, so the answer is "torch" either way, with what was
    found (a GPU session would wire and check the one found)."""
    if device_type != "cuda":
        return "torch", f"{device_type}: gathered top-k latents, absorbed attention"
    import importlib.util

    found = [name for name in ("flash_mla", "flashinfer")
             if importlib.util.find_spec(name) is not None]
    return "torch", ("found " + ", ".join(found) + " (not wired yet)" if found
                     else "no flash_mla / flashinfer installed")
