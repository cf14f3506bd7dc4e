"""What a family contributes to `ModelConfig`: attention flavour, MoE routing, layer kinds.

Pure data (no torch), so `config.py` can read any family without importing the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["gqa", "mla"]
MLPKind = Literal["dense", "moe"]


@dataclass(frozen=True)
class MoEConfig:
    """Routed experts of one MoE layer (the same in every MoE layer of a model)."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    scoring: Literal["softmax", "sigmoid"]
    norm_topk_prob: bool
    n_group: int = 1  # grouped top-k (DeepSeek-V3 / GLM): keep the best `topk_group` groups
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    num_shared_experts: int = 0  # one dense MLP of num_shared * intermediate_size, always on
    correction_bias: bool = False  # `e_score_correction_bias`: biases the choice, not the weight

    def describe(self) -> str:
        s = f"{self.num_experts} experts, top-{self.top_k} ({self.scoring}"
        if self.n_group > 1:
            s += f", {self.topk_group} of {self.n_group} groups"
        if self.norm_topk_prob:
            s += ", normalised"
        if self.routed_scaling_factor != 1.0:
            s += f", x{self.routed_scaling_factor:g}"
        s += f"), expert intermediate {self.intermediate_size}"
        if self.num_shared_experts:
            s += f", {self.num_shared_experts} shared"
        return s


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash)."""

    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek lays out

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the normed latent + the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def describe(self) -> str:
        return (f"MLA: q_lora_rank {self.q_lora_rank}, kv_lora_rank {self.kv_lora_rank}, "
                f"qk nope {self.qk_nope_head_dim} + rope {self.qk_rope_head_dim}, "
                f"v {self.v_head_dim}; cache {self.latent_dim} values/token/layer"
                + (", interleaved rope" if self.rope_interleave else ""))


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: which attention and which MLP."""

    attention: AttentionKind = "gqa"
    mlp: MLPKind = "dense"


@dataclass(frozen=True)
class FamilyFields:
    """The family-specific part of `ModelConfig`; `layers` covers main + MTP layer indices."""

    attention_bias: bool
    qk_norm: bool
    layers: tuple[LayerSpec, ...]
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed expert count under its three spellings."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


def num_layers_with_mtp(cfg: dict[str, Any]) -> int:
    n_mtp = cfg.get("mtp_num_hidden_layers", cfg.get("num_nextn_predict_layers", 0)) or 0
    return int(cfg["num_hidden_layers"]) + int(n_mtp)
