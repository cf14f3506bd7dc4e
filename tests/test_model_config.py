"""ModelConfig.from_dict (workers/model/config.py): the MTP depth and MTP-specific MoE sizes
read from `text_config` as well as the top level, for every family that has them."""

from __future__ import annotations

import pytest

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.rope import UnsupportedConfig

BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=512, tie_word_embeddings=False)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2, norm_topk_prob=True)
FAMILIES = {
    "qwen3": {},
    "mimo": {},
    "qwen3_moe": dict(MOE, num_experts=8, mlp_only_layers=[]),
    "glm4_moe": dict(MOE, n_routed_experts=8, n_group=2, topk_group=1, first_k_dense_replace=1,
                     n_shared_experts=1, routed_scaling_factor=2.5, use_qk_norm=True,
                     partial_rotary_factor=0.5),
    "deepseek_v3": dict(MOE, n_routed_experts=8, n_group=2, topk_group=1,
                        first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                        num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16),
}
DEPTH_KEYS = ("num_nextn_predict_layers", "num_mtp_layers", "mtp_num_hidden_layers")


def _cfg(family: str, **top) -> dict:
    return {"model_type": family, **BASE, **FAMILIES[family], **top}


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("key", DEPTH_KEYS)
def test_mtp_depth_under_text_config_equals_top_level(family: str, key: str) -> None:
    top = ModelConfig.from_dict(_cfg(family, **{key: 3}))
    nested = ModelConfig.from_dict(_cfg(family, text_config={key: 3}))
    assert top.num_mtp_modules == 3 and top.num_attention_layers == 5
    assert nested == top  # every field: count, naming, per-layer kinds of the MTP blocks
    assert len(nested.layers) == 5
    want = "qwen3_next" if key == "mtp_num_hidden_layers" else (
        "mimo" if family == "mimo" else "deepseek_v3")
    assert nested.mtp_naming == want


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_mtp_num_experts_nested_or_top_level(family: str) -> None:
    """An MTP expert count equal to the main layers' is served from either place; a different
    one is refused by name, wherever it is written."""
    plain = ModelConfig.from_dict(_cfg(family, num_nextn_predict_layers=1))
    for where in ("top", "text"):
        def cfg(n: int, where=where) -> dict:
            extra = {"mtp_num_experts": n}
            return _cfg(family, num_nextn_predict_layers=1,
                        **(extra if where == "top" else {"text_config": extra}))
        assert ModelConfig.from_dict(cfg(8)) == plain
        with pytest.raises(UnsupportedConfig, match="mtp_num_experts=4"):
            ModelConfig.from_dict(cfg(4))


def test_conflicting_depths_refused_by_name() -> None:
    with pytest.raises(UnsupportedConfig, match="num_nextn_predict_layers"):
        ModelConfig.from_dict(_cfg("qwen3", num_nextn_predict_layers=1,
                                   text_config={"num_nextn_predict_layers": 2}))
    same = _cfg("qwen3", num_nextn_predict_layers=2, text_config={"num_nextn_predict_layers": 2})
    assert ModelConfig.from_dict(same).num_mtp_modules == 2


def test_qwen3_5_multimodal_depth_at_either_level() -> None:
    """Qwen3.5 serves its text part: `text_config.mtp_num_hidden_layers` (what it writes) and
    the same key at the top level give the same config."""
    text = dict(BASE, model_type="qwen3_5_text", layer_types=["linear_attention",
                                                                "full_attention"],
                linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
                linear_value_head_dim=16, linear_conv_kernel_dim=4)
    nested = ModelConfig.from_dict({"model_type": "qwen3_5",
                                    "text_config": dict(text, mtp_num_hidden_layers=1)})
    top = ModelConfig.from_dict({"model_type": "qwen3_5", "mtp_num_hidden_layers": 1,
                                 "text_config": text})
    assert nested.num_mtp_modules == 1 and nested.mtp_naming == "qwen3_next"
    assert nested == top
    assert ModelConfig.from_dict({"model_type": "qwen3_5", "text_config": text}
                                 ).num_mtp_modules == 0
