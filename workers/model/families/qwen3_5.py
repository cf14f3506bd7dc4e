"""Qwen3.5 and Qwen3.5-MoE: the text part of a Qwen3.5 checkpoint, a Qwen3-Next-style hybrid.

The same layers as Qwen3-Next (`families/qwen3_next.py`): Gated DeltaNet in three of four
layers, gated full attention with partial rotary, (1 + w) norms, one MTP layer under `mtp.*`;
the DeltaNet's projections are unfused (`in_proj_qkv` holding q | k | v, `in_proj_z`,
`in_proj_b`, `in_proj_a`). Qwen3.5's MLPs are dense; Qwen3.5-MoE's are MoE in every layer
(MTP included): softmax top-k with renormalised weights plus one shared expert scaled by
sigmoid(`shared_expert_gate`), as transformers' `Qwen3_5MoeSparseMoeBlock`; its routed experts
load from per-expert tensors or the fused `experts.gate_up_proj` / `experts.down_proj`
(`workers/model/checkpoint.py`). `ModelConfig.from_dict` unwraps the multimodal config
(`text_config`; weights under `model.language_model.*`, the vision tower ignored) before this
module reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mtpserve.workers.model.families import qwen3_next
from mtpserve.workers.model.families.base import FamilyFields
from mtpserve.workers.model.rope import UnsupportedConfig

MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")


def fields(cfg: dict[str, Any]) -> FamilyFields:
    moe = cfg.get("model_type") == "qwen3_5_moe_text"
    if bool(cfg.get("num_experts")) != moe:
        raise UnsupportedConfig(f"{cfg.get('model_type')} with num_experts="
                                f"{cfg.get('num_experts')}: experts are qwen3_5_moe's")
    if moe and (cfg.get("mlp_only_layers") or int(cfg.get("decoder_sparse_step") or 1) != 1
                or cfg.get("norm_topk_prob") is False):
        # transformers' Qwen3.5-MoE: every layer MoE, weights renormalised over the top k.
        raise UnsupportedConfig("qwen3_5_moe with dense layers or unnormalised top-k weights "
                                "is not transformers' Qwen3.5-MoE")
    f = qwen3_next.fields(cfg)
    assert f.linear is not None
    return dataclasses.replace(
        f, linear=dataclasses.replace(f.linear, fused_projections=False))
