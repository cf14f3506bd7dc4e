"""Rotary position embeddings as `config.json` describes them: `default`, `yarn`, `llama3`.

transformers 5.x writes the rope settings into `rope_parameters` (`rope_theta`, `rope_type`,
the scaling keys, `partial_rotary_factor`); older configs (and most of the hub) hold
`rope_theta` / `partial_rotary_factor` at the top level and the scaling in `rope_scaling`.
Both are read here, with transformers' precedence (`modeling_rope_utils.
convert_rope_params_to_dict` / `standardize_rope_params`): keys inside the rope dict first, then
the top-level ones, then the defaults. The inverse frequencies and the cos/sin scale are the
formulas of `_compute_yarn_parameters` / `_compute_llama3_parameters`, in fp32 like them, so
our logits match transformers' to float rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

ROPE_TYPES = ("default", "yarn", "llama3")

# Keys each rope type understands; any other key in the rope dict changes math we do not do.
_COMMON = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
_KEYS = {
    "default": _COMMON,
    "yarn": _COMMON | {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                       "mscale", "mscale_all_dim", "attention_factor", "truncate"},
    "llama3": _COMMON | {"factor", "original_max_position_embeddings", "low_freq_factor",
                         "high_freq_factor"},
}


class UnsupportedConfig(ValueError):
    """A config key or value that changes the model's math in a way we do not implement."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)

    def describe(self) -> str:
        s = f"{self.rope_type}, theta {self.theta:g}"
        if self.partial_rotary_factor != 1.0:
            s += f", partial rotary {self.partial_rotary_factor:g}"
        if self.rope_type != "default":
            s += f", factor {self.factor:g} over {self.original_max_position_embeddings}"
        return s


def parse_rope(cfg: dict[str, Any], default_theta: float = 10000.0) -> RopeConfig:
    """The rope settings of an HF `config.json` dict; refuses types and keys we do not do."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedConfig(f"rope_parameters {params!r} is not a dict")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise UnsupportedConfig(
            f"per-layer-type rope_parameters ({sorted(params)}) are not supported"
        )
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedConfig(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    unknown = sorted(set(params) - _KEYS[rope_type])
    if unknown:
        raise UnsupportedConfig(f"rope key(s) {unknown} not understood for rope type "
                                f"{rope_type!r}")
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    prf = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    kw: dict[str, Any] = dict(rope_type=rope_type, theta=float(theta),
                              partial_rotary_factor=float(prf))
    if rope_type in ("yarn", "llama3"):
        # transformers gives a top-level original_max_position_embeddings priority (Phi3).
        omax = cfg.get("original_max_position_embeddings",
                       params.get("original_max_position_embeddings",
                                  cfg.get("max_position_embeddings")))
        kw["original_max_position_embeddings"] = int(omax)
        factor = params.get("factor")
        if factor is None:
            if rope_type == "llama3":
                raise UnsupportedConfig("llama3 rope without 'factor'")
            factor = cfg.get("max_position_embeddings", omax) / omax
        kw["factor"] = float(factor)
    if rope_type == "yarn":
        for key in ("mscale", "mscale_all_dim", "attention_factor"):
            if params.get(key) is not None:
                kw[key] = float(params[key])
        kw["beta_fast"] = float(params.get("beta_fast") or 32)
        kw["beta_slow"] = float(params.get("beta_slow") or 1)
        kw["truncate"] = bool(params.get("truncate", True))
    if rope_type == "llama3":
        kw["low_freq_factor"] = float(params["low_freq_factor"])
        kw["high_freq_factor"] = float(params["high_freq_factor"])
    return RopeConfig(**kw)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def inv_freq_and_scale(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [rotary_dim / 2], factor on cos/sin), as transformers computes."""
    dim = rope.rotary_dim(head_dim)
    base = rope.theta
    if rope.rope_type == "default":
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        return inv, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(rope, dim), 1.0
    return _yarn_inv_freq(rope, dim)


def _yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    base, factor = rope.theta, rope.factor
    assert factor is not None and rope.original_max_position_embeddings is not None
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(yarn_get_mscale(factor, rope.mscale)
                                     / yarn_get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = yarn_get_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                ) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_factor = 1 - ramp
    inv = interpolation * (1 - extra_factor) + extrapolation * extra_factor
    return inv, attention_factor


def _llama3_inv_freq(rope: RopeConfig, dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    factor, lo, hi = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old = rope.original_max_position_embeddings
    assert factor is not None and lo is not None and hi is not None and old is not None
    low_wavelen, high_wavelen = old / lo, old / hi
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
