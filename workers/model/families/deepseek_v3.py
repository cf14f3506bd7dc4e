"""DeepSeek-V3 / V3.1 / R1 (`deepseek_v3`) and GLM-4.7-Flash (`glm4_moe_lite`): MLA attention in
every layer, the sigmoid grouped-top-k MoE of `glm4_moe` past the first dense layers.
DeepSeek-V3.2 (`deepseek_v32`) and GLM-5 (`glm_moe_dsa`): the same, with DeepSeek Sparse
Attention (an indexer per layer, workers/model/dsa.py).

Layer kinds as transformers builds them: `DeepseekV3DecoderLayer` is MoE from
`first_k_dense_replace` on; `Glm4MoeLiteDecoderLayer` reads `mlp_layer_types` ("dense" /
"sparse") when the config lists them. MTP layers are MoE (transformers' `get_mtp_config`
sets `first_k_dense_replace = 0`; `mtp_mlp_layer_types` when listed).
"""

from __future__ import annotations

from typing import Any

from mtpserve.workers.model.families.base import (
    DSAConfig,
    FamilyFields,
    LayerSpec,
    MLAConfig,
    num_layers_with_mtp,
)
from mtpserve.workers.model.families.glm4_moe import sigmoid_moe
from mtpserve.workers.model.rope import UnsupportedConfig

MODEL_TYPES = ("deepseek_v3", "glm4_moe_lite", "deepseek_v32", "glm_moe_dsa")
# DeepSeek Sparse Attention families: the V3 layout plus an indexer in every layer.
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")


def dsa_config(cfg: dict[str, Any]) -> DSAConfig:
    """The indexer of DeepSeek-V3.2 (half-split rope) or GLM-5 (interleaved rope, and layers
    whose `indexer_types` entry is "shared" reuse the previous full layer's top-k)."""
    if not cfg.get("q_lora_rank"):
        raise UnsupportedConfig("DSA without q_lora_rank: the indexer's query reads the "
                                "q_a_proj latent")
    types = cfg.get("indexer_types") or _indexer_schedule(cfg)
    bad = sorted({t for t in types if t not in ("full", "shared")})
    if bad:
        raise UnsupportedConfig(f"indexer_types {bad} are not supported (full / shared)")
    shared = tuple(i for i, t in enumerate(types) if t == "shared")
    if 0 in shared:
        raise UnsupportedConfig("indexer_types: layer 0 is 'shared' but has no earlier "
                                "full layer to share")
    return DSAConfig(
        index_n_heads=int(cfg["index_n_heads"]), index_head_dim=int(cfg["index_head_dim"]),
        index_topk=int(cfg["index_topk"]),
        rope_interleave=cfg["model_type"] == "glm_moe_dsa", shared_layers=shared)


def _indexer_schedule(cfg: dict[str, Any]) -> list[str]:
    """GLM-5's per-layer indexer types when `indexer_types` is absent, as transformers'
    GlmMoeDsaConfig derives them: `index_topk_pattern` ("FSSF...": full / shared), else every
    `index_topk_freq`-th layer from `index_skip_topk_offset` (default 2) runs its own."""
    if cfg.get("model_type") != "glm_moe_dsa":
        return []
    pattern = cfg.get("index_topk_pattern")
    if pattern is not None:
        return ([{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str)
                else list(pattern))
    freq = max(int(cfg.get("index_topk_freq", 1) or 1), 1)
    offset = int(cfg.get("index_skip_topk_offset", 2))
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared"
            for i in range(int(cfg["num_hidden_layers"]))]


def mla_config(cfg: dict[str, Any]) -> MLAConfig:
    q_lora = cfg.get("q_lora_rank")
    return MLAConfig(
        q_lora_rank=int(q_lora) if q_lora else None, kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]), v_head_dim=int(cfg["v_head_dim"]),
        rope_interleave=bool(cfg.get("rope_interleave", True)),
        dsa=dsa_config(cfg) if cfg.get("model_type") in DSA_TYPES else None,
    )


def fields(cfg: dict[str, Any]) -> FamilyFields:
    if cfg.get("attention_bias"):
        raise UnsupportedConfig("attention_bias with MLA is not supported")
    n_main = int(cfg["num_hidden_layers"])
    first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
    main_types = cfg.get("mlp_layer_types")
    mtp_types = cfg.get("mtp_mlp_layer_types") or []
    kinds: list[str] = []
    for i in range(num_layers_with_mtp(cfg)):
        if i < n_main:
            sparse = main_types[i] == "sparse" if main_types else i >= first_dense
        else:
            m = i - n_main
            sparse = mtp_types[m] == "sparse" if m < len(mtp_types) else True
        kinds.append("moe" if sparse else "dense")
    layers = tuple(LayerSpec(attention="mla", mlp=k) for k in kinds)  # type: ignore[arg-type]
    return FamilyFields(attention_bias=False, qk_norm=False, layers=layers,
                        moe=sigmoid_moe(cfg), mla=mla_config(cfg))
