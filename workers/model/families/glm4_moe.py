"""GLM-4.5 / 4.6 / 4.7 (`glm4_moe`): GQA with partial rotary (`partial_rotary_factor`, read by
the rope config) and optional qk-norm (`use_qk_norm`); DeepSeek-V3-style MoE: sigmoid scores,
`e_score_correction_bias` for the choice, grouped top-k, `routed_scaling_factor`, shared
experts. Layers below `first_k_dense_replace` are dense; every later one, MTP layers included,
is MoE (transformers' `Glm4MoeDecoderLayer`; `get_mtp_config` makes MTP layers MoE too).
"""

from __future__ import annotations

from typing import Any

from mtpserve.workers.model.families.base import (
    FamilyFields,
    LayerSpec,
    MoEConfig,
    num_experts,
    num_layers_with_mtp,
)
from mtpserve.workers.model.rope import UnsupportedConfig

MODEL_TYPES = ("glm4_moe",)


def sigmoid_moe(cfg: dict[str, Any]) -> MoEConfig:
    """The DeepSeek-V3 / GLM router settings (shared with the DeepSeek family)."""
    if cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise UnsupportedConfig(
            f"topk_method {cfg['topk_method']!r} is not supported (noaux_tc only)")
    if (cfg.get("moe_layer_freq") or 1) != 1:
        raise UnsupportedConfig(f"moe_layer_freq {cfg['moe_layer_freq']} is not supported (1 only)")
    if cfg.get("scoring_func", "sigmoid") != "sigmoid":
        raise UnsupportedConfig(
            f"scoring_func {cfg['scoring_func']!r} is not supported (sigmoid only)")
    return MoEConfig(
        num_experts=num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]), scoring="sigmoid",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        n_group=int(cfg.get("n_group", 1) or 1), topk_group=int(cfg.get("topk_group", 1) or 1),
        routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0)),
        num_shared_experts=int(cfg.get("n_shared_experts", 0) or 0), correction_bias=True,
    )


def fields(cfg: dict[str, Any]) -> FamilyFields:
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    layers = tuple(LayerSpec(mlp="moe" if i >= first_dense else "dense")
                   for i in range(num_layers_with_mtp(cfg)))
    return FamilyFields(attention_bias=bool(cfg.get("attention_bias", False)),
                        qk_norm=bool(cfg.get("use_qk_norm", False)), layers=layers,
                        moe=sigmoid_moe(cfg))
