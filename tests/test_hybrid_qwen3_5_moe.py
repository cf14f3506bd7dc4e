"""Qwen3.5-MoE (`model_type: qwen3_5_moe`): the text part of a multimodal checkpoint, a
Qwen3-Next-style hybrid with MoE in every layer (MTP included), against transformers'
`Qwen3_5MoeForCausalLM` and its `MtpModel` on a tiny random checkpoint, with the routed
experts stored per expert (as `save_pretrained` writes them) or stacked in
`experts.gate_up_proj` / `experts.down_proj` (as the published checkpoints do): logits
through the state slots (chunked prefill past 64 tokens, decode steps), MTP draft logits,
greedy k = 2 == transformers; dense layers or unnormalised top-k weights refused by name.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers
from helpers import assert_mtp_steps_match_reference, hf_greedy
from safetensors.torch import load_file, save_file
from test_qwen3_next import CONFIG, _mtp_checkpoint_tensors, _randomise
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.rope import UnsupportedConfig
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_value_heads", "linear_num_key_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
        "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "max_position_embeddings", "tie_word_embeddings", "rms_norm_eps", "bos_token_id",
        "eos_token_id")
_PER_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors -> `experts.gate_up_proj` [E, 2 I, H] and `experts.down_proj`
    [E, H, I] (transformers' parameter layout, which the published checkpoints keep)."""
    out, parts = {}, {}
    for name, t in tensors.items():
        m = _PER_EXPERT.match(name)
        if m is None:
            out[name] = t
        else:
            parts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for prefix, p in parts.items():
        n = 1 + max(e for e, _ in p)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([p[(e, "gate_proj")], p[(e, "up_proj")]]) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([p[(e, "down_proj")] for e in range(n)])
    return out


def make_checkpoint(path: Path, stacked: bool):
    """(multimodal checkpoint folder, transformers' text model, its MtpModel)."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(5)
    text_dir = path / "text"
    ref = transformers.Qwen3_5MoeForCausalLM(
        transformers.Qwen3_5MoeTextConfig(**{k: CONFIG[k] for k in KEYS})).eval()
    _randomise(ref)
    ref.save_pretrained(text_dir)
    ref.config.num_mtp_layers = 1
    ref.config.mtp_layer_types = ["full_attention"]
    mtp = MtpModel(ref, 1).eval()
    with torch.no_grad():  # MtpModel leaves the experts uninitialised
        for p in mtp.layers.parameters():
            p.normal_(0, 0.05)
    _randomise(mtp)
    text_cfg = json.loads((text_dir / "config.json").read_text())
    text_cfg["mtp_num_hidden_layers"] = 1
    text_cfg["rope_parameters"].update(mrope_section=[1, 1, 0], mrope_interleaved=True)
    (path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "text_config": text_cfg, "vision_config": {"model_type": "qwen3_5_moe", "depth": 1},
        "tie_word_embeddings": False}))
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k):
               v for k, v in load_file(text_dir / "model.safetensors").items()}
    tensors.update(_mtp_checkpoint_tensors(mtp))
    if stacked:
        tensors = _stack_experts(tensors)
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(8, 8)
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    make_tokenizer(path)
    return path, ref, mtp


@pytest.fixture(scope="module", params=[False, True], ids=["per-expert", "stacked"])
def moe35(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3_5_moe"), request.param)


def test_config_reads_the_moe_text_part(moe35) -> None:
    path, _, _ = moe35
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.model_type == "qwen3_5_moe_text" and cfg.weights_prefix == "model.language_model."
    assert cfg.linear is not None and not cfg.linear.fused_projections
    assert [s.mlp for s in cfg.layers] == ["moe"] * 5  # 4 main layers + the MTP block
    assert cfg.moe.shared_expert_gate and cfg.moe.norm_topk_prob
    assert cfg.num_mtp_modules == 1 and cfg.rotary_dim == 4


def test_logits_and_mtp_drafts_match_transformers(moe35) -> None:
    from transformers.modeling_layers import MtpModel

    from mtpserve.workers.model.loader import load_model

    path, ref, mtp_ref = moe35
    assert isinstance(mtp_ref, MtpModel)
    runner = ModelRunner(path, num_blocks=32, block_size=8, num_state_slots=2)
    tokens = torch.randint(0, VOCAB_SIZE, (100,), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = ref(tokens.unsqueeze(0)).logits[0]
    ids = tokens.tolist()
    table = [list(range(16))]
    ours = runner.execute(ForwardBatch("main", [ids[:96]], [0], table, list(range(96)),
                                       state_slots=[0]))
    assert (ours - full[:96]).abs().max().item() <= 1e-4
    for pos in range(96, 100):
        step = runner.execute(ForwardBatch("main", [[ids[pos]]], [pos], table, [0],
                                           state_slots=[0]))
        assert (step[0] - full[pos]).abs().max().item() <= 1e-4, pos
    assert_mtp_steps_match_reference(ref, mtp_ref, load_model(path), tokens.unsqueeze(0)[:, :90],
                                     88)


def test_greedy_with_drafts_equals_transformers(moe35) -> None:
    from mtpserve.workers import LLM, SamplingParams

    path, ref, _ = moe35
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (7, 75)]
    want = [hf_greedy(ref, p, 10) for p in prompts]
    llm = LLM(str(path), num_speculative_tokens=2, num_kv_blocks=96, block_size=4,
              max_num_batched_tokens=40)
    got = [r.output_token_ids for r in llm.generate(prompts, SamplingParams(
        max_tokens=10, temperature=0, ignore_eos=True))]
    assert got == want
    assert llm.engine.stats()["state_slots_used"] == 0


@pytest.mark.parametrize("extra", [{"mlp_only_layers": [1]}, {"decoder_sparse_step": 2},
                                   {"norm_topk_prob": False}, {"num_experts": 0}])
def test_what_transformers_qwen3_5_moe_is_not_is_refused(extra) -> None:
    text = {k: CONFIG[k] for k in KEYS} | {"model_type": "qwen3_5_moe_text"} | extra
    with pytest.raises(UnsupportedConfig):
        ModelConfig.from_dict({"model_type": "qwen3_5_moe", "text_config": text})
