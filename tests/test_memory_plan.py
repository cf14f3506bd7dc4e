"""The memory plan from config.json alone (workers/memory_plan.py, `mtpserve check --tp-size
--gpu-memory-gib`): numbers against hand-computed sizes, against a real tiny engine, and the
verdicts for the big models of tests/data/configs/."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import make_engine
from tiny_models import make_hf_checkpoint

from mtpserve.cluster.cli import main
from mtpserve.workers.memory_plan import GIB, PlanSettings, plan_memory
from mtpserve.workers.model_runner import ModelRunner

CONFIGS = Path(__file__).parent / "data" / "configs"

TINY_QWEN3 = dict(
    model_type="qwen3", vocab_size=256, hidden_size=64, intermediate_size=128,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    max_position_embeddings=512, tie_word_embeddings=True, rms_norm_eps=1e-6,
    rope_theta=10000.0, num_nextn_predict_layers=1)
TINY_MLA = dict(
    model_type="deepseek_v3", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_group=2,
    topk_group=1, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
    norm_topk_prob=True, max_position_embeddings=512, num_nextn_predict_layers=1)
TINY_NEXT = dict(
    model_type="qwen3_next", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
    max_position_embeddings=512, mtp_num_hidden_layers=1, full_attention_interval=4)


def _config_dir(tmp_path: Path, cfg: dict, name: str) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_weight_bytes_of_a_tiny_gqa_config_by_hand(tmp_path) -> None:
    d = _config_dir(tmp_path, TINY_QWEN3, "qwen3")
    h, inter, vocab, pos = 64, 128, 256, 512
    for tp in (1, 2):
        p = plan_memory(d, PlanSettings(tp_size=tp)).per_rank
        qkv = (4 * 16 + 2 * 2 * 16) * h // tp
        layer = qkv + h * h // tp + 2 * 16 + 2 * h + 2 * inter * h // tp + h * inter // tp
        main = vocab * h // tp + 2 * layer + h  # tied head: the embedding once
        mtp = 2 * h + 2 * h * h + layer + h  # enorm, hnorm, eh_proj (replicated), block, norm
        rope = 2 * pos * 16 * 4  # cos, sin [positions, rotary dim] fp32
        assert p.main_weight_bytes_by_dtype == {"bfloat16": 2 * main, "float32": rope}
        assert p.mtp_weight_bytes_by_dtype == {"bfloat16": 2 * mtp}
        assert p.weight_bytes == 2 * (main + mtp) + rope
        assert p.weight_bytes_by_dtype == {"bfloat16": 2 * (main + mtp), "float32": rope}


def test_kv_bytes_per_token_gqa_and_mla(tmp_path) -> None:
    gqa = _config_dir(tmp_path, TINY_QWEN3, "gqa")
    mla = _config_dir(tmp_path, TINY_MLA, "mla")
    for tp in (1, 2):
        # K and V of the rank's KV heads, 2 main layers + 1 MTP layer, bf16.
        p = plan_memory(gqa, PlanSettings(tp_size=tp)).per_rank
        assert p.kv_bytes_per_token == 2 * (2 // tp) * 16 * 2 * 3
        assert p.kv_bytes_per_block == 16 * p.kv_bytes_per_token
        # MLA: the whole latent (kv_lora_rank + rope dim) on every rank.
        p = plan_memory(mla, PlanSettings(tp_size=tp)).per_rank
        assert p.kv_bytes_per_token == (32 + 8) * 2 * 3


def test_hybrid_state_and_verify_state_bytes(tmp_path) -> None:
    d = _config_dir(tmp_path, TINY_NEXT, "next")
    seqs, k = 4, 2
    for tp in (1, 2):
        p = plan_memory(d, PlanSettings(tp_size=tp, max_num_seqs=seqs,
                                        num_speculative_tokens=k)).per_rank
        conv_dim = 2 * 2 * 8 + 4 * 8  # q, k (key heads) + v (value heads)
        slots = seqs + 1  # + the scratch slot
        per_layer = (slots * conv_dim // tp * 3 * 2  # conv window (K - 1), bf16
                     + slots * 4 // tp * 8 * 8 * 4)  # recurrent state, fp32
        assert p.state_slots == seqs and p.state_bytes == 3 * per_layer  # 3 linear layers
        # The state after every position but the last (the slot holds that one), and the
        # conv inputs up to the last position's window.
        verify = (seqs * k * 4 // tp * 8 * 8 * 4 + seqs * conv_dim // tp * (3 + k) * 2)
        assert p.verify_state_bytes == 3 * verify
        assert p.kv_bytes_per_token == 2 * (2 // tp) * 16 * 2 * 2  # 1 full + 1 MTP layer
        assert p.graph_reserve_bytes == 0  # hybrids run eagerly


def _allocated_kv_per_block(kv) -> int:  # noqa: ANN001 - a KVCache
    real = [b for b in kv.buffers if b.numel() > 4]  # linear layers: placeholders
    return sum(b.numel() * b.element_size() for b in real) // (kv.num_blocks + 1)


def _model_bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def test_plan_equals_what_a_tiny_engine_allocates(tiny_qwen3, tmp_path_factory) -> None:
    eng = make_engine(tiny_qwen3)
    plan = plan_memory(tiny_qwen3, PlanSettings(dtype="float32")).per_rank
    assert plan.kv_bytes_per_block == _allocated_kv_per_block(eng.runner.kv_cache)
    assert plan.weight_bytes == _model_bytes(eng.runner.model)
    # MLA, MTP module with its own embedding and head (as DeepSeek-V3 checkpoints ship it).
    ds = make_hf_checkpoint(tmp_path_factory.mktemp("ckpt") / "ds", "deepseek_v3", num_mtp=1)
    runner = ModelRunner(ds, num_blocks=8)
    plan = plan_memory(ds, PlanSettings(dtype="float32")).per_rank
    assert plan.kv_bytes_per_block == _allocated_kv_per_block(runner.kv_cache)
    assert plan.weight_bytes == _model_bytes(runner.model)
    assert plan.mtp_weight_bytes_by_dtype["float32"] > 2 * 256 * 64 * 4  # own head + embed


def _check_json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main(["check", *argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


def test_deepseek_v3_fp8_tp8_on_141_gib(capsys) -> None:
    rc, out = _check_json(capsys, str(CONFIGS / "deepseek-v3"), "--tp-size", "8",
                          "--gpu-memory-gib", "141")
    r = out["per_rank"]
    for key in ("weight_bytes", "weight_bytes_by_dtype", "kv_bytes_per_token",
                "kv_capacity_tokens"):
        assert key in r
    assert {"fits", "message", "suggestions"} <= set(out)
    assert r["kv_bytes_per_token"] == (512 + 64) * 2 * 62  # MLA latent, 61 + 1 MTP layers
    assert r["weight_bytes_by_dtype"]["float8_e4m3fn"] > 0  # the plain linears stay fp8
    # Routed experts stay FP8 (fp8.keep_experts_fp8, applied when Experts is built): ~82 GiB
    # of weights per rank, ~44 GiB of KV, four requests of the full 163840-token context.
    assert "routed experts kept fp8" in out["fp8"]
    assert rc == 0 and out["fits"]
    assert 75 * GIB < r["weight_bytes"] < 90 * GIB
    assert r["kv_capacity_tokens"] >= 4 * 163840


def test_deepseek_v3_bf16_is_refused_with_the_numbers_and_what_would_fit(capsys) -> None:
    rc, out = _check_json(capsys, str(CONFIGS / "deepseek-v3-bf16"), "--tp-size", "8",
                          "--gpu-memory-gib", "141")
    assert rc == 1 and out["fits"] is False
    assert out["per_rank"]["weight_bytes"] > 141 * GIB
    assert "126.90 GiB" in out["message"] and "weights 161" in out["message"]
    assert out["suggestions"][0].startswith("TP 16:")


def test_qwen3_next_80b(capsys) -> None:
    # TP 8 > its 2 KV heads: each rank holds one replicated KV head (kv_head_split), so its
    # KV per token is TP 2's; the Gated DeltaNet layers split their own 16 key / 32 value
    # heads 8 ways, so the state shrinks by 4 from TP 2.
    plans = {}
    for tp in (2, 8):
        rc, out = _check_json(capsys, str(CONFIGS / "qwen3-next-80b-a3b"), "--tp-size",
                              str(tp), "--gpu-memory-gib", "141")
        assert rc == 0 and out["fits"], out["message"]
        assert out["per_rank"]["state_bytes"] > 0 and out["per_rank"]["verify_state_bytes"] > 0
        plans[tp] = out["per_rank"]
    # 12 full-attention layers + 1 MTP layer, K and V of one 256-dim head, bf16.
    assert plans[8]["kv_bytes_per_token"] == plans[2]["kv_bytes_per_token"] == 13 * 2 * 256 * 2
    assert plans[8]["weight_bytes"] < plans[2]["weight_bytes"] / 3
    assert plans[2]["state_bytes"] // 33 == 4 * (plans[8]["state_bytes"] // 33)


def test_qwen3_235b_at_tp8_replicates_its_4_kv_heads(capsys) -> None:
    plans = {}
    for tp in (4, 8):
        rc, out = _check_json(capsys, str(CONFIGS / "qwen3-235b-a22b"), "--tp-size", str(tp),
                              "--gpu-memory-gib", "141")
        assert rc == 0 and out["fits"], out["message"]
        plans[tp] = out["per_rank"]
    # 94 layers, K and V of one 128-dim head per rank at TP 4 and (replicated) at TP 8.
    assert plans[8]["kv_bytes_per_token"] == plans[4]["kv_bytes_per_token"] == 94 * 2 * 128 * 2
    assert plans[8]["kv_capacity_tokens"] > 2 * plans[4]["kv_capacity_tokens"]


def test_check_prints_inventory_and_plan_when_weights_are_there(tiny_qwen3, capsys) -> None:
    assert main(["check", str(tiny_qwen3)]) == 0
    text = capsys.readouterr().out
    assert "0 problem(s)" in text and "memory plan" not in text
    assert main(["check", str(tiny_qwen3), "--tp-size", "2", "--gpu-memory-gib", "4"]) == 0
    text = capsys.readouterr().out
    assert "0 problem(s)" in text and "memory plan" in text and "\nfits:" in text


@pytest.mark.parametrize("name", ["qwen3-235b-a22b"])
def test_config_only_plan_text(name, capsys) -> None:
    assert main(["check", str(CONFIGS / name), "--tp-size", "4", "--gpu-memory-gib", "141"]) == 0
    text = capsys.readouterr().out
    assert "weights: none here" in text and "KV per token" in text


def _cuda_cluster(model: Path, tp: int, **engine) -> object:
    from mtpserve.cluster.config import ClusterConfig

    side = {"tp_size": tp, "gpus_per_rank": 1}
    return ClusterConfig(model=str(model), device="cuda", prefill=side, decode=side,
                         engine={"gpu_memory_gib": 141, **engine})


def test_serve_app_refuses_a_cuda_layout_that_does_not_fit() -> None:
    from mtpserve.cluster.app import build_app, memory_refusal

    cfg = _cuda_cluster(CONFIGS / "deepseek-v3-bf16", 8)
    why = memory_refusal(cfg)
    assert why.startswith("prefill replicas (TP 8) do not fit the GPU: a rank's budget is "
                          "126.90 GiB") and "Would fit: TP 16" in why
    with pytest.raises(ValueError, match="do not fit the GPU"):
        build_app(cfg)
    assert memory_refusal(_cuda_cluster(CONFIGS / "deepseek-v3-bf16", 8,
                                        memory_check=False)) is None
    assert memory_refusal(_cuda_cluster(CONFIGS / "qwen3-next-80b-a3b", 2)) is None
    cpu = cfg.model_copy(update={"device": "cpu"})  # no device memory limit to check on CPU
    assert memory_refusal(cpu) is None


def test_simulator_takes_a_replicas_weight_bytes_from_the_plan() -> None:
    from mtpserve.cluster.sim.hardware import DATA_DIR, load_hardware
    from mtpserve.cluster.sim.model_arch import load_arch
    from mtpserve.cluster.sim.replica_models import RooflineReplicaModel
    from mtpserve.workers.model.config import ModelConfig

    cfg = ModelConfig.from_dict(json.loads((DATA_DIR / "qwen3-32b-like.json").read_text()))
    per_rank = plan_memory(DATA_DIR, PlanSettings(tp_size=2), cfg).per_rank.weight_bytes
    model = RooflineReplicaModel(load_hardware("h200"), load_arch("qwen3-32b-like"), tp=2,
                                 k_max=2, max_num_seqs=8)
    assert model.weight_bytes == 2 * per_rank
