"""Qwen3-MoE: Qwen3 attention (qk-norm), softmax top-k routing with optional renormalisation.

Layer i is MoE when `i not in mlp_only_layers` and `(i + 1) % decoder_sparse_step == 0`
(transformers' `Qwen3MoeDecoderLayer`); the others are dense with `intermediate_size`.
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

MODEL_TYPES = ("qwen3_moe",)


def fields(cfg: dict[str, Any]) -> FamilyFields:
    n_exp = num_experts(cfg)
    step = int(cfg.get("decoder_sparse_step", 1) or 1)
    dense_only = set(cfg.get("mlp_only_layers") or [])
    layers = tuple(
        LayerSpec(mlp="moe" if n_exp > 0 and i not in dense_only and (i + 1) % step == 0
                  else "dense")
        for i in range(num_layers_with_mtp(cfg))
    )
    moe = MoEConfig(
        num_experts=n_exp, top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]), scoring="softmax",
        norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
    ) if n_exp else None
    return FamilyFields(attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=True,
                        layers=layers, moe=moe)
