"""Dense decoders: Llama, Qwen2, Qwen3, MiMo (Qwen2-shaped). GQA + SwiGLU in every layer;
Qwen2 / Qwen3 with sliding-window layers where the config asks for them."""

from __future__ import annotations

from typing import Any

from mtpserve.workers.model.families.base import FamilyFields, LayerSpec, num_layers_with_mtp

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
        layers=tuple(LayerSpec(sliding_window=w) for w in _windows(cfg)),
    )


def _windows(cfg: dict[str, Any]) -> list[int | None]:
    """Each layer's sliding window (main layers, then MTP layers; None: full). Qwen2 / Qwen3
    / MiMo (Qwen2-shaped) window only under `use_sliding_window` (their configs carry
    `sliding_window` either way; transformers sets it to None without the flag): the layers
    `layer_types` names "sliding_attention", or from `max_window_layers` on; the MTP layers
    per `mtp_layer_types`. Llama has no window."""
    n = int(cfg["num_hidden_layers"])
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if window is None or cfg.get("model_type", "llama") == "llama":
        return [None] * num_layers_with_mtp(cfg)
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg.get("max_window_layers", 0) or 0)
        else "full_attention" for i in range(n)]
    types = list(types)[:n] + list(cfg.get("mtp_layer_types") or [])
    return [int(window) if i < len(types) and types[i] == "sliding_attention" else None
            for i in range(num_layers_with_mtp(cfg))]
