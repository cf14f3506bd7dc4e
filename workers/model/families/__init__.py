"""Model families, one module each (the way vLLM's `models/` is laid out): each reads its
`config.json` keys into `FamilyFields` (attention flavour, MoE router, per-layer kinds). The
layers themselves are shared (`layers.py`, `moe.py`) wherever the math is the same."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mtpserve.workers.model.families import (
    deepseek_v3,
    dense,
    glm4_moe,
    mimo_v2_flash,
    qwen3_5,
    qwen3_moe,
    qwen3_next,
    step3p5,
)
from mtpserve.workers.model.families.base import FamilyFields, LayerSpec, MLAConfig, MoEConfig

FAMILIES: dict[str, Callable[[dict[str, Any]], FamilyFields]] = {
    **{t: dense.fields for t in dense.MODEL_TYPES},
    **{t: qwen3_moe.fields for t in qwen3_moe.MODEL_TYPES},
    **{t: glm4_moe.fields for t in glm4_moe.MODEL_TYPES},
    **{t: deepseek_v3.fields for t in deepseek_v3.MODEL_TYPES},
    **{t: qwen3_next.fields for t in qwen3_next.MODEL_TYPES},
    **{t: qwen3_5.fields for t in qwen3_5.MODEL_TYPES},
    **{t: step3p5.fields for t in step3p5.MODEL_TYPES},
    **{t: mimo_v2_flash.fields for t in mimo_v2_flash.MODEL_TYPES},
}
# Families whose config.json spellings are first brought to the names the rest of the config
# reader uses (legacy hub keys, transformers' derived defaults), before any key is read.
NORMALISE: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    **{t: step3p5.normalise for t in step3p5.MODEL_TYPES},
    **{t: mimo_v2_flash.normalise for t in mimo_v2_flash.MODEL_TYPES},
}

__all__ = ["FAMILIES", "NORMALISE", "FamilyFields", "LayerSpec", "MLAConfig", "MoEConfig"]
