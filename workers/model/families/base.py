"""What a family contributes to `ModelConfig`: attention flavour, MoE routing, layer kinds.

Pure data (no torch), so `config.py` can read any family without importing the layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

AttentionKind = Literal["gqa", "mla", "linear"]  # linear: Gated DeltaNet (Qwen3-Next)
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
    # Qwen3-Next: one `shared_expert` of its own width, scaled by sigmoid(shared_expert_gate(x)).
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False

    @property
    def shared_experts_width(self) -> int:
        """Intermediate size of the ungated shared experts (`shared_experts.*`): their count
        times the expert width, or (Step) a width of their own."""
        if self.shared_intermediate_size and not self.shared_expert_gate:
            return self.shared_intermediate_size
        return self.intermediate_size * self.num_shared_experts

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
        if self.shared_expert_gate:
            s += f", gated shared expert {self.shared_intermediate_size}"
        elif self.shared_intermediate_size and self.num_shared_experts:
            s += f" of width {self.shared_intermediate_size}"
        return s


@dataclass(frozen=True)
class DSAConfig:
    """DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer scores every cached
    token per query (`index_n_heads` heads of `index_head_dim`, ReLU, summed with per-head
    weights) and each query attends to its `index_topk` best only."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rope_interleave: bool  # the indexer's rope: interleaved pairs (GLM-5) or half-split (V3.2)
    # Layers without an indexer of their own that reuse the previous full layer's selection
    # (GLM-5's `indexer_types` "shared"); main-layer indices.
    shared_layers: tuple[int, ...] = ()

    def describe(self) -> str:
        s = (f"DSA: indexer {self.index_n_heads} heads x {self.index_head_dim}, top-"
             f"{self.index_topk} tokens per query"
             + (", interleaved rope" if self.rope_interleave else ", half-split rope"))
        if self.shared_layers:
            s += f", {len(self.shared_layers)} layers reuse the previous layer's selection"
        return s


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash; with `dsa`, V3.2 / GLM-5)."""

    q_lora_rank: int | None  # None: one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # rotary pairs (x0, x1), (x2, x3), ... as DeepSeek lays out
    dsa: DSAConfig | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values cached per token and layer: the normed latent + the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def cache_dim(self) -> int:
        """Values one cache slot holds per token and layer: the latent, then (DSA) the
        indexer's key, padded to an even count (the cache's two planes hold one half each).
        The indexer's key pages with the latent, so the block manager, KV transfer, prefix
        caching and the memory plan all count it without knowing it is there."""
        if self.dsa is None:  # the latent alone (an odd one is refused by kv_cache_layout)
            return self.latent_dim
        n = self.latent_dim + self.dsa.index_head_dim
        return n + n % 2

    def describe(self) -> str:
        return (f"MLA: q_lora_rank {self.q_lora_rank}, kv_lora_rank {self.kv_lora_rank}, "
                f"qk nope {self.qk_nope_head_dim} + rope {self.qk_rope_head_dim}, "
                f"v {self.v_head_dim}; cache {self.cache_dim} values/token/layer"
                + (f" (latent {self.latent_dim} + indexer key {self.dsa.index_head_dim})"
                   if self.dsa else "")
                + (", interleaved rope" if self.rope_interleave else ""))


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers (Qwen3-Next): a causal depthwise conv over q|k|v, then the gated
    delta rule with one [key_head_dim, value_head_dim] state per value head."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Qwen3-Next: in_proj_qkvz / in_proj_ba, interleaved per key head; Qwen3.5: in_proj_qkv
    # (q | k | v), in_proj_z, in_proj_b, in_proj_a.
    fused_projections: bool = True

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * \
            self.value_head_dim

    def state_numel(self) -> int:
        """Values one request holds per linear layer: conv window + recurrent state."""
        return (self.conv_dim * (self.conv_kernel - 1)
                + self.num_value_heads * self.key_head_dim * self.value_head_dim)

    def describe(self) -> str:
        return (f"Gated DeltaNet: {self.num_key_heads} key / {self.num_value_heads} value "
                f"heads, dims {self.key_head_dim}/{self.value_head_dim}, conv "
                f"{self.conv_kernel}")


@dataclass(frozen=True)
class LayerSpec:
    """One decoder layer: which attention and which MLP."""

    attention: AttentionKind = "gqa"
    mlp: MLPKind = "dense"
    # Sliding-window attention: a query at position p attends to (p - W, p], the last W
    # tokens including itself (transformers' `sliding_window` convention). None: full.
    sliding_window: int | None = None
    num_heads: int | None = None  # query heads of this layer (None: the model's)
    # KV heads of this layer when fewer than the model's (MiMo-V2-Flash's full layers): each
    # is repeated into the cache's `num_key_value_heads` (the same attention).
    num_kv_heads: int | None = None
    attention_sinks: bool = False  # a learned per-head logit in the softmax (MiMo-V2-Flash)
    rope: int = 0  # which of the model's ropes (`ModelConfig.ropes`; 0: `rope`)
    # SwiGLU clamps (Step): silu(gate) <= L and |up| <= L; the layer's MLP or routed experts,
    # and its shared expert. None: no clamp.
    swiglu_limit: float | None = None
    shared_swiglu_limit: float | None = None


@dataclass(frozen=True)
class FamilyFields:
    """The family-specific part of `ModelConfig`; `layers` covers main + MTP layer indices."""

    attention_bias: bool
    qk_norm: bool
    layers: tuple[LayerSpec, ...]
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None
    linear: LinearAttentionConfig | None = None  # hybrid models: their linear layers
    attn_output_gate: bool = False  # full attention: o_proj(attn * sigmoid(gate)), Qwen3-Next
    zero_centred_norm: bool = False  # RMSNorm scales by (1 + w)
    # Step: the output gate from its own g_proj, one scalar per "head" or per "channel".
    head_gate: str | None = None
    attention_scale: float | None = None  # softmax scale (None: head_dim ** -0.5)
    v_head_dim: int | None = None  # value head dim when not head_dim (MiMo-V2-Flash)
    value_scale: float = 1.0  # values scaled before the cache (MiMo-V2-Flash)
    # Rope dicts per `LayerSpec.rope` index when layer types rope differently (Step).
    ropes: tuple[dict[str, Any], ...] = ()


def num_experts(cfg: dict[str, Any]) -> int:
    """Routed expert count under its three spellings."""
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key])
    return 0


# The MTP module count under each published spelling, in precedence order: Qwen3-Next /
# Qwen3.5 (`mtp.*` names), DeepSeek-V3 and most families, and the alias transformers maps to
# the latter (`num_mtp_layers`). `ModelConfig.from_dict` lifts them (and `MTP_SIZE_KEYS`) out
# of `text_config` first, so a family reads them at the top level.
MTP_DEPTH_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_layers")
# MTP-specific MoE sizes, read beside the depth.
MTP_SIZE_KEYS = ("mtp_num_experts",)


def mtp_depth(cfg: dict[str, Any]) -> tuple[int, str | None]:
    """(MTP modules, the key that gave the count; None when no key is set)."""
    for key in MTP_DEPTH_KEYS:
        if cfg.get(key) is not None:
            return int(cfg[key]), key
    return 0, None


def num_layers_with_mtp(cfg: dict[str, Any]) -> int:
    return int(cfg["num_hidden_layers"]) + mtp_depth(cfg)[0]
