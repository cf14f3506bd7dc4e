"""Model configuration read from a Hugging Face `config.json` (frozen, engine-side)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

MTPNaming = Literal["deepseek_v3", "mimo", "qwen3_next"]

_FAMILIES = {
    "llama": dict(attention_bias=False, qk_norm=False),
    "qwen2": dict(attention_bias=True, qk_norm=False),
    "qwen3": dict(attention_bias=False, qk_norm=True),
    "mimo": dict(attention_bias=True, qk_norm=False),  # MiMo is Qwen2-shaped
}


@dataclass(frozen=True)
class ModelConfig:
    """What the dense decoder and its MTP module(s) need; derived from `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    num_mtp_modules: int = 0
    mtp_naming: MTPNaming = "deepseek_v3"
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_attention_layers(self) -> int:
        """Main layers plus one decoder block per MTP module, each with its own KV cache."""
        return self.num_hidden_layers + self.num_mtp_modules

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        family = _FAMILIES.get(model_type)
        if family is None:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(_FAMILIES)}"
            )
        scaling = cfg.get("rope_scaling")
        if scaling and scaling.get("rope_type", scaling.get("type")) not in (None, "default"):
            raise NotImplementedError(f"rope_scaling {scaling} is not supported")
        heads = cfg["num_attention_heads"]
        # MTP module count under each published convention.
        if "mtp_num_hidden_layers" in cfg:
            n_mtp, naming = int(cfg["mtp_num_hidden_layers"]), "qwen3_next"
        else:
            n_mtp = int(cfg.get("num_nextn_predict_layers", 0) or 0)
            naming = "mimo" if model_type == "mimo" else "deepseek_v3"
        naming = cfg.get("mtp_naming", naming)
        eos_ids = _eos_ids(cfg.get("eos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=cfg.get("rope_theta", 10000.0),
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=cfg.get("attention_bias", family["attention_bias"]),
            qk_norm=family["qk_norm"],
            num_mtp_modules=n_mtp,
            mtp_naming=naming,
            eos_token_ids=eos_ids,
            raw=cfg,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face checkpoint folder")
        cfg = cls.from_dict(json.loads(cfg_file.read_text()))
        # Chat models often list their end-of-turn token(s) only in generation_config.json.
        gen_file = Path(path) / "generation_config.json"
        if gen_file.is_file():
            extra = _eos_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
            merged = cfg.eos_token_ids + tuple(t for t in extra if t not in cfg.eos_token_ids)
            cfg = replace(cfg, eos_token_ids=merged)
        return cfg


def _eos_ids(eos: Any) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: HF configs hold one id, a list, or null."""
    if eos is None:
        return ()
    return tuple(int(t) for t in eos) if isinstance(eos, list) else (int(eos),)
