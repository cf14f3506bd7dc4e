"""Qwen3.5 (dense): the text part of a Qwen3.5 checkpoint, a Qwen3-Next-style hybrid.

The same layers as Qwen3-Next (`families/qwen3_next.py`): Gated DeltaNet in three of four
layers, gated full attention with partial rotary, (1 + w) norms, one MTP layer under `mtp.*`;
the DeltaNet's projections are unfused (`in_proj_qkv` holding q | k | v, `in_proj_z`,
`in_proj_b`, `in_proj_a`) and the MLPs dense. `ModelConfig.from_dict` unwraps the
multimodal config (`text_config`; weights under `model.language_model.*`, the vision tower
ignored) before this module reads it. Qwen3.5-MoE is refused by name (its expert tensors are
not tested here).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from mtpserve.workers.model.families import qwen3_next
from mtpserve.workers.model.families.base import FamilyFields
from mtpserve.workers.model.rope import UnsupportedConfig

MODEL_TYPES = ("qwen3_5_text",)


def fields(cfg: dict[str, Any]) -> FamilyFields:
    if cfg.get("num_experts"):
        raise UnsupportedConfig("qwen3_5 with experts: use model_type qwen3_5_moe (refused)")
    f = qwen3_next.fields(cfg)
    assert f.linear is not None
    return dataclasses.replace(
        f, linear=dataclasses.replace(f.linear, fused_projections=False))
