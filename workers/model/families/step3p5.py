"""Step-3.5-Flash / Step-3.7-Flash (`step3p5`, the text model of the `step3p7` checkpoint).

As transformers' `Step3p7TextModel` computes it:
- GQA with per-head q/k RMSNorm, a sigmoid output gate from its own `g_proj` (one scalar per
  head, or per channel when `gating` is not per-head), scale `query_pre_attn_scalar ** -0.5`;
- "full_attention" and "sliding_attention" layers (a window of `sliding_window`), sliding layers
  with their own query-head count (`num_sliding_attention_heads`; KV heads and head dim shared)
  and their own rope (`rope_parameters` per layer type: theta, partial rotary factor);
- every RMSNorm scales by (1 + w) (Gemma style);
- SwiGLU with clamps where a layer lists one: silu(gate) <= L, |up| <= L (`swiglu_limits`
  for routed experts, `swiglu_limits_shared` for dense MLPs and the shared expert);
- MoE past the dense layers: sigmoid router, `router_bias` choosing (not weighting), always
  renormalised, times `moe_router_scaling_factor`, plus one ungated shared expert of
  `share_expert_dim`;
- MTP layers at `model.layers.{L + i}` with their own `shared_head.{norm, output}`.

Both the layout transformers saves (split `layer_types` / `mtp_layer_types`, `rope_parameters`
per type) and the hub's legacy one (lists padded with the MTP layers, `rope_theta` /
`partial_rotary_factors` lists, `attention_other_setting`, `moe_layers_enum`,
`num_attention_groups`, `moe_num_experts`, `moe_top_k`) are read.
"""

from __future__ import annotations

from typing import Any

from mtpserve.workers.model.families.base import FamilyFields, LayerSpec, MoEConfig
from mtpserve.workers.model.rope import UnsupportedConfig

MODEL_TYPES = ("step3p5",)
_TYPES = ("full_attention", "sliding_attention")


def normalise(cfg: dict[str, Any]) -> dict[str, Any]:
    """The legacy hub keys under the names transformers' Step3p7TextConfig uses; the hub's
    `hidden_act` ("swigluoai") names the clamped SwiGLU, which is silu (as transformers sets)."""
    out = dict(cfg, hidden_act="silu")
    for old, new in (("num_attention_groups", "num_key_value_heads"),
                     ("moe_num_experts", "n_routed_experts"), ("moe_top_k", "num_experts_per_tok"),
                     ("share_expert_dims", "share_expert_dim"),
                     ("num_mtp_layers", "num_nextn_predict_layers")):
        if old in out and new not in out:
            out[new] = out[old]
    return out


def _split(cfg: dict[str, Any], key: str, mtp_key: str | None, n: int, n_mtp: int
           ) -> tuple[list, list]:
    """(main, MTP) entries of a per-layer list that may be padded with the MTP layers."""
    value = list(cfg.get(key) or [])
    if len(value) == n + n_mtp and n_mtp:
        return value[:n], value[n:]
    tail = list(cfg.get(mtp_key) or []) if mtp_key else []
    return value[:n], tail


def _layer_types(cfg: dict[str, Any], n: int, n_mtp: int) -> list[str]:
    main, mtp = _split(cfg, "layer_types", "mtp_layer_types", n, n_mtp)
    main = main or ["full_attention"] * n
    mtp = (mtp + ["full_attention"] * n_mtp)[:n_mtp]
    bad = sorted({t for t in main + mtp if t not in _TYPES})
    if bad:
        raise UnsupportedConfig(f"Step layer_types {bad} are not supported (full / sliding "
                                "attention; the MiniMax-M3 sparse indexer is not built)")
    return main + mtp


def _mlp_kinds(cfg: dict[str, Any], n: int, n_mtp: int) -> list[str]:
    main, mtp = _split(cfg, "mlp_layer_types", "mtp_mlp_layer_types", n, n_mtp)
    if not main:
        enum = cfg.get("moe_layers_enum")
        if enum is not None:
            items = enum.split(",") if isinstance(enum, str) else enum
            moe = {int(i) for i in items if str(i).strip()}
        else:
            moe = set(range(3, n))  # transformers: MTP layers dense without the enum
        kinds = ["sparse" if i in moe else "dense" for i in range(n + n_mtp)]
        main, mtp = kinds[:n], kinds[n:]
    mtp = (mtp + ["dense"] * n_mtp)[:n_mtp]
    return ["moe" if k == "sparse" else "dense" for k in main + mtp]


def _limits(cfg: dict[str, Any], key: str, n: int, n_mtp: int) -> list[float | None]:
    """Per-layer SwiGLU clamp (None: off); the MTP layers take the padded tail when listed."""
    main, mtp = _split(cfg, key, None, n, n_mtp)
    vals = (main + [0] * n)[:n] + (mtp + [0] * n_mtp)[:n_mtp]
    return [float(v) if v else None for v in vals]


def rope_parameters(cfg: dict[str, Any], types: list[str]) -> dict[str, dict[str, Any]]:
    """Each layer type's rope dict: `rope_parameters` keyed by type (what transformers saves),
    or the legacy per-layer `rope_theta` / `partial_rotary_factors` lists (the value of the
    type's first layer), with `rope_scaling` on the full layers."""
    rp = cfg.get("rope_parameters") or {}
    present = sorted(set(types))
    if rp and all(isinstance(rp.get(t), dict) for t in present):
        return {t: dict(rp[t]) for t in present}
    theta = cfg.get("rope_theta", 10000.0)
    prf = cfg.get("partial_rotary_factors")
    out: dict[str, dict[str, Any]] = {}
    for t in present:
        i = types.index(t)
        params: dict[str, Any] = {"rope_type": "default",
                                  "rope_theta": theta[i] if isinstance(theta, list) else theta}
        if prf:
            params["partial_rotary_factor"] = prf[i]
        out[t] = params
    scaling = cfg.get("rope_scaling")
    if isinstance(scaling, dict) and "full_attention" in out:
        out["full_attention"].update(scaling)
    return out


def fields(cfg: dict[str, Any]) -> FamilyFields:
    if cfg.get("use_bidirectional_attention"):
        raise UnsupportedConfig("use_bidirectional_attention is not supported (causal only)")
    if cfg.get("sparse_attention_config"):
        raise UnsupportedConfig("sparse_attention_config (the MiniMax-M3 sparse indexer) is "
                                "not supported")
    n = int(cfg["num_hidden_layers"])
    n_mtp = int(cfg.get("num_nextn_predict_layers") or 0)
    types = _layer_types(cfg, n, n_mtp)
    kinds = _mlp_kinds(cfg, n, n_mtp)
    routed, shared = (_limits(cfg, k, n, n_mtp) for k in ("swiglu_limits",
                                                          "swiglu_limits_shared"))
    heads = int(cfg["num_attention_heads"])
    swa_heads = cfg.get("num_sliding_attention_heads") or (
        cfg.get("attention_other_setting") or {}).get("num_attention_heads") or heads
    window = cfg.get("sliding_window")
    if "sliding_attention" in types and not window:
        raise UnsupportedConfig("sliding_attention layers without a sliding_window")
    rope_of = {t: i for i, t in enumerate(sorted(set(types)))}
    layers = tuple(
        LayerSpec(attention="gqa", mlp=kinds[i],  # type: ignore[arg-type]
                  sliding_window=int(window) if types[i] == "sliding_attention" else None,
                  num_heads=int(swa_heads) if types[i] == "sliding_attention" else heads,
                  rope=rope_of[types[i]], swiglu_limit=routed[i] if kinds[i] == "moe"
                  else shared[i], shared_swiglu_limit=shared[i])
        for i in range(n + n_mtp))
    moe = None
    if "moe" in kinds:
        moe = MoEConfig(
            num_experts=int(cfg["n_routed_experts"]), top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]), scoring="sigmoid",
            norm_topk_prob=True, routed_scaling_factor=float(
                cfg.get("moe_router_scaling_factor") or 1.0),
            num_shared_experts=1, correction_bias=True,
            shared_intermediate_size=int(cfg.get("share_expert_dim") or
                                         cfg["moe_intermediate_size"]))
    gating = cfg.get("gating", True)
    return FamilyFields(
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=True, layers=layers,
        moe=moe, zero_centred_norm=True,
        head_gate="head" if gating is True or gating == "per-head" else "channel",
        attention_scale=float(cfg.get("query_pre_attn_scalar") or cfg["head_dim"]) ** -0.5,
        ropes=tuple(rope_parameters(cfg, types)[t] for t in sorted(set(types))))
