"""Qwen3-Next: a hybrid of Gated DeltaNet (linear attention) and gated full attention.

`layer_types` lists "linear_attention" / "full_attention" per main layer (default: every
`full_attention_interval`-th layer is full); the MTP layer (`mtp.layers.0`) is a full-attention
block. Full attention: qk-norm, an output gate (q_proj holds [q | gate] per head), partial
rotary (0.25). Every RMSNorm but the DeltaNet's gated output norm scales by (1 + w). MLP: MoE
(softmax top-k) with one gated shared expert where transformers' `Qwen3NextDecoderLayer` puts
it (`i not in mlp_only_layers`, `(i + 1) % decoder_sparse_step == 0`), dense elsewhere.
"""

from __future__ import annotations

from typing import Any

from mtpserve.workers.model.families.base import (
    FamilyFields,
    LayerSpec,
    LinearAttentionConfig,
    MoEConfig,
    num_experts,
    num_layers_with_mtp,
)
from mtpserve.workers.model.rope import UnsupportedConfig

MODEL_TYPES = ("qwen3_next",)


def layer_types(cfg: dict[str, Any]) -> list[str]:
    """Main layers' token mixers, as transformers' `Qwen3NextConfig` derives them."""
    n = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types")
    if types is None:
        interval = int(cfg.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(n)]
    if len(types) != n:
        raise UnsupportedConfig(f"layer_types lists {len(types)} layers, the model has {n}")
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        raise UnsupportedConfig(f"layer_types {bad} are not supported in qwen3_next")
    return list(types)


_REQUIRED = ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
             "linear_value_head_dim")


def fields(cfg: dict[str, Any]) -> FamilyFields:
    missing = [k for k in _REQUIRED if k not in cfg]
    if missing:
        raise UnsupportedConfig(f"qwen3_next config without {missing}")
    n_main = int(cfg["num_hidden_layers"])
    types = layer_types(cfg)
    n_exp = num_experts(cfg)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])

    def mlp(i: int) -> str:
        # MTP blocks (i >= n_main) are MoE whenever the model has experts (transformers'
        # MtpModel builds them with the main class at MTP index 0: (0 + 1) % step == 0).
        j = i if i < n_main else i - n_main
        return ("moe" if n_exp > 0 and j not in dense_only and (j + 1) % step == 0
                else "dense")

    layers = tuple(
        LayerSpec(attention="linear" if i < n_main and types[i] == "linear_attention"
                  else "gqa", mlp=mlp(i))  # type: ignore[arg-type]
        for i in range(num_layers_with_mtp(cfg)))
    moe = MoEConfig(
        num_experts=n_exp, top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]), scoring="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        shared_expert_gate=bool(cfg.get("shared_expert_intermediate_size")),
    ) if n_exp else None
    linear = LinearAttentionConfig(
        num_key_heads=int(cfg["linear_num_key_heads"]),
        num_value_heads=int(cfg["linear_num_value_heads"]),
        key_head_dim=int(cfg["linear_key_head_dim"]),
        value_head_dim=int(cfg["linear_value_head_dim"]),
        conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
    )
    if linear.num_value_heads % linear.num_key_heads:
        raise UnsupportedConfig("linear_num_value_heads must be a multiple of "
                                "linear_num_key_heads")
    return FamilyFields(attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
                        layers=layers, moe=moe, linear=linear, attn_output_gate=True,
                        zero_centred_norm=True)
