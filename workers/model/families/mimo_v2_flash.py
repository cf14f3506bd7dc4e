"""MiMo-V2-Flash (`mimo_v2_flash`), as transformers' `MiMoV2FlashForCausalLM` computes it:

- "full_attention" layers (0 and every 6th) and "sliding_attention" layers (window
  `sliding_window`; the hub's `sliding_window_size` + 1), both with 192-dim query/key heads and
  128-dim value heads (`v_head_dim`), values scaled by `attention_value_scale` before the cache;
- sliding layers with twice the KV heads (8 against 4) and a learned per-head attention sink
  (`attention_sink_bias`: an extra logit in the softmax denominator that carries no value);
- rope per layer type (`rope_parameters` keyed by type; theta 5e6 full, 1e4 sliding), partial
  (0.334 of 192: 64 dims, rotate-half);
- layer 0 a dense MLP, the rest the DeepSeek-V3 sigmoid MoE (correction bias, normalised, no
  shared experts);
- MTP layers under `model.mtp.layers.{i}` (SGLang's layout: enorm / hnorm / eh_proj /
  final_layernorm around a sliding-window block with a sink and a dense MLP, its post-attention
  norm named `pre_mlp_layernorm`), counted by `num_nextn_predict_layers` when the config lists
  it (transformers' class builds no MTP; without the key the model serves without drafts).

One cache shape serves both layer types: `num_key_value_heads` is the sliding layers' count
(8) and a full layer repeats each of its 4 KV heads twice into it, which is the same attention
(query head h reads KV head h // 16 of 4, or h // 8 of the repeated 8), so paging, prefix
caching and TP re-sharding by head stay what they are; values are zero-padded from 128 to 192
in the cache (the padded channels carry zeros through attention and are dropped before o_proj).
The price: a full layer's KV takes the sliding layers' size (9 of 48 layers, 2x) and values
take 1.5x.
"""

from __future__ import annotations

from typing import Any

from mtpserve.workers.model.families.base import (
    FamilyFields,
    LayerSpec,
    MoEConfig,
    mtp_depth,
    num_experts,
)

MODEL_TYPES = ("mimo_v2_flash",)


def normalise(cfg: dict[str, Any]) -> dict[str, Any]:
    """The sliding layers' KV heads as the model's (the cache shape), the hub's
    `sliding_window_size` as transformers reads it, and per-type rope defaults."""
    out = dict(cfg)
    if cfg.get("sliding_window_size") is not None:
        out["sliding_window"] = int(cfg["sliding_window_size"]) + 1
    out.setdefault("sliding_window", 129)
    out["full_num_key_value_heads"] = int(cfg.get("full_num_key_value_heads")
                                          or cfg.get("num_key_value_heads", 4))
    out["num_key_value_heads"] = 2 * out["full_num_key_value_heads"]
    out.setdefault("head_dim", 192)
    out.setdefault("v_head_dim", 128)
    if not out.get("rope_parameters"):
        out["rope_parameters"] = {
            "full_attention": {"rope_type": "default", "rope_theta": 5e6,
                               "partial_rotary_factor": 0.334},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                  "partial_rotary_factor": 0.334}}
    if out.get("routed_scaling_factor") is None:
        out["routed_scaling_factor"] = 1.0
    return out


def fields(cfg: dict[str, Any]) -> FamilyFields:
    n = int(cfg["num_hidden_layers"])
    n_mtp = mtp_depth(cfg)[0]
    types = list(cfg.get("layer_types") or [
        "full_attention" if (i == 0 or not (i + 1) % 6) else "sliding_attention"
        for i in range(n)])[:n] + ["sliding_attention"] * n_mtp
    kinds = list(cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (n - 1))[:n]
    kinds = ["moe" if k == "sparse" else "dense" for k in kinds] + ["dense"] * n_mtp
    present = sorted(set(types))
    rp = cfg["rope_parameters"]
    window, full_kv = int(cfg["sliding_window"]), int(cfg["full_num_key_value_heads"])
    layers = tuple(
        LayerSpec(attention="gqa", mlp=kinds[i],  # type: ignore[arg-type]
                  sliding_window=window if types[i] == "sliding_attention" else None,
                  num_kv_heads=None if types[i] == "sliding_attention" else full_kv,
                  attention_sinks=types[i] == "sliding_attention",
                  rope=present.index(types[i]))
        for i in range(n + n_mtp))
    moe = None
    if "moe" in kinds:
        moe = MoEConfig(
            num_experts=num_experts(cfg), top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]), scoring="sigmoid",
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            n_group=int(cfg.get("n_group") or 1), topk_group=int(cfg.get("topk_group") or 1),
            routed_scaling_factor=float(cfg["routed_scaling_factor"]), correction_bias=True)
    return FamilyFields(
        attention_bias=bool(cfg.get("attention_bias", False)), qk_norm=False, layers=layers,
        moe=moe, v_head_dim=int(cfg["v_head_dim"]),
        # transformers: 0.707 when the key is absent, 1.0 when it is null
        value_scale=float(cfg.get("attention_value_scale", 0.707) or 1.0),
        ropes=tuple(dict(rp[t]) for t in present))
