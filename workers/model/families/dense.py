"""Dense decoders: Llama, Qwen2, Qwen3, MiMo (Qwen2-shaped). GQA + SwiGLU in every layer;
Qwen2 / Qwen3 with sliding-window layers where the config asks for them."""

from __future__ import annotations

from typing import Any

from mtpserve.workers.model.families.base import (
    FamilyFields,
    LayerSpec,
    num_layers_with_mtp,
    sliding_windows,
)

_DEFAULTS = {
    "llama": dict(attention_bias=False, qk_norm=False),
    "qwen2": dict(attention_bias=True, qk_norm=False),
    "qwen3": dict(attention_bias=False, qk_norm=True),
    "mimo": dict(attention_bias=True, qk_norm=False),
}
MODEL_TYPES = tuple(_DEFAULTS)


def fields(cfg: dict[str, Any]) -> FamilyFields:
    d = _DEFAULTS[cfg.get("model_type", "llama")]
    return FamilyFields(
        attention_bias=bool(cfg.get("attention_bias", d["attention_bias"])),
        qk_norm=d["qk_norm"],
        # Qwen2 / Qwen3 / MiMo (Qwen2-shaped) window layers only under `use_sliding_window`
        # (`layer_types`, or from `max_window_layers`); Llama has no window.
        layers=tuple(LayerSpec(sliding_window=w) for w in sliding_windows(cfg, gated=True))
        if cfg.get("model_type", "llama") != "llama"
        else (LayerSpec(),) * num_layers_with_mtp(cfg),
    )
