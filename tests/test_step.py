"""Step-3.5 / Step-3.7-Flash (`step3p7` checkpoints, served by their `step3p5` text model)
against transformers' `Step3p7ForConditionalGeneration` on tiny random checkpoints it saved:
full and sliding layers with their own query-head counts and ropes, the per-head sigmoid
output gate, (1 + w) norms, SwiGLU clamps, the sigmoid MoE with its shared expert, and MTP
layers with their own heads. Paged prefill + decode logits within 1e-4 (fp32), MTP draft
logits == transformers' MtpModel, greedy k = 0..3 == transformers, TP 2 == TP 1, the hub's
legacy config layout read as transformers reads it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    assert_graphs_match_eager,
    assert_greedy_with_drafts_equals,
    assert_mtp_steps_match_reference,
    assert_tp2_engine_equals_tp1,
    hf_greedy,
    paged_mtp_logits,
)
from test_model_families import _check_paged_logits
from tiny_models import make_step_checkpoint
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.loader import load_model


class _Reference(torch.nn.Module):
    """transformers' model with the text config where `_check_paged_logits` reads it."""

    def __init__(self, model) -> None:
        super().__init__()
        self.inner, self.config = model, model.config.text_config

    def forward(self, ids):
        return self.inner(input_ids=ids)


@pytest.fixture(scope="module")
def step(tmp_path_factory) -> Path:
    path = make_step_checkpoint(tmp_path_factory.mktemp("step") / "step37", num_mtp=1,
                                vocab_size=VOCAB_SIZE)
    make_tokenizer(path)
    return path


def _reference(path: Path):
    return transformers.Step3p7ForConditionalGeneration.from_pretrained(path).eval()


def test_step_config(step) -> None:
    cfg = ModelConfig.from_pretrained(step)
    assert [cfg.attention_heads(i) for i in range(5)] == [4, 6, 6, 6, 4]
    assert [s.sliding_window for s in cfg.layers] == [None, 6, 6, 6, None]
    assert [s.rope for s in cfg.layers] == [0, 1, 1, 1, 0]
    assert cfg.ropes[0].partial_rotary_factor == 0.5 and cfg.ropes[1].theta == 1e4
    assert [s.swiglu_limit for s in cfg.layers] == [None, None, 0.3, 0.3, None]
    assert cfg.mtp_naming == "step3p5" and cfg.num_mtp_modules == 1
    lines = "\n".join(cfg.describe())
    assert "4 heads (6 in windowed layers)" in lines and "output gate per head" in lines


def test_step_logits_match_transformers_and_the_clamps_matter(step, tmp_path) -> None:
    _check_paged_logits(step, _Reference(_reference(step)), 24, 6)
    loose = tmp_path / "loose"
    loose.mkdir()
    for f in step.iterdir():
        (loose / f.name).symlink_to(f)
    (loose / "config.json").unlink()
    cfg = json.loads((step / "config.json").read_text())
    cfg["text_config"]["swiglu_limits"] = cfg["text_config"]["swiglu_limits_shared"] = None
    (loose / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(16).unsqueeze(0)
    with torch.no_grad():
        a, b = (m.compute_logits(m(ids, pos)) for m in (load_model(step), load_model(loose)))
    assert (a - b).abs().max().item() > 1e-3


def test_step_mtp_draft_logits_match_transformers_mtp_model(step) -> None:
    from transformers.modeling_layers import MtpModel

    ref = _reference(step)
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    ours = load_model(step)
    assert ours.mtp[0].head is not None  # shared_head.output (here equal to lm_head)

    class Main(torch.nn.Module):  # `ref.model(ids).last_hidden_state`, as the helper reads
        def __init__(self) -> None:
            super().__init__()
            self.model = ref.model

    ids = torch.randint(0, VOCAB_SIZE, (1, 21), generator=torch.Generator().manual_seed(2))
    n = 19
    logits_ref = assert_mtp_steps_match_reference(Main(), mtp_ref, ours, ids, n)
    paged = paged_mtp_logits(step, ids, n, block_size=4)
    assert (paged - logits_ref[0]).abs().max().item() <= 1e-4


def test_step_greedy_with_drafts_equals_transformers(step) -> None:
    assert_greedy_with_drafts_equals(step, _Reference(_reference(step)), VOCAB_SIZE,
                                     lens=(7, 19))


def test_step_tp2_engine_with_prefix_caching_equals_tp1(step) -> None:
    """Two gloo ranks: 2 / 3 query heads and their gates per rank in full / sliding layers,
    one KV head each, experts split; k = 2 and prefix caching == one process."""
    assert_tp2_engine_equals_tp1(str(step))


def test_step_legacy_hub_config_reads_as_transformers_saves_it(step) -> None:
    """The released config.json's layout (per-layer lists padded with the MTP layer,
    `rope_theta` / `partial_rotary_factors` lists, `attention_other_setting`, `moe_layers_enum`,
    legacy key names) gives the same model config as the one transformers saved."""
    saved = json.loads((step / "config.json").read_text())
    t = saved["text_config"]
    legacy = {k: v for k, v in t.items() if k not in (
        "layer_types", "mtp_layer_types", "mlp_layer_types", "mtp_mlp_layer_types",
        "rope_parameters", "per_layer_config", "num_sliding_attention_heads",
        "num_key_value_heads", "n_routed_experts", "num_experts_per_tok")}
    legacy.update(
        layer_types=t["layer_types"] + t["mtp_layer_types"],
        rope_theta=[5e6, 1e4, 1e4, 1e4, 5e6], partial_rotary_factors=[0.5, 1, 1, 1, 0.5],
        attention_other_setting={"num_attention_heads": 6, "num_attention_groups": 2},
        num_attention_groups=2, moe_num_experts=4, moe_top_k=2, moe_layers_enum="2,3,4",
        hidden_act="swigluoai")
    a = ModelConfig.from_dict(saved)
    b = ModelConfig.from_dict({**saved, "text_config": legacy})
    assert a.layers == b.layers and a.ropes == b.ropes and a.moe == b.moe
    assert a.num_key_value_heads == b.num_key_value_heads == 2


def test_step_sliding_mtp_layer(tmp_path) -> None:
    """A sliding-window MTP layer with the sliding layers' 6 query heads (transformers'
    MtpModel builds it with the full layers' 4 and fails to load it): it loads, drafts at its
    own window, and greedy k = 2 == transformers."""
    from mtpserve.workers import LLM, SamplingParams

    path = make_step_checkpoint(tmp_path / "step-swa-mtp", num_mtp=1, vocab_size=VOCAB_SIZE,
                                mtp_sliding=True)
    make_tokenizer(path)
    ours = load_model(path)
    attn = ours.mtp[0].block.self_attn
    assert attn.window == 6 and attn.num_heads == 6
    prompt = torch.randint(3, VOCAB_SIZE, (17,), generator=torch.Generator().manual_seed(5))
    want = hf_greedy(_Reference(_reference(path)), prompt.tolist(), 10)
    llm = LLM(str(path), num_speculative_tokens=2, num_kv_blocks=64, block_size=4)
    got = llm.generate([prompt.tolist()], SamplingParams(max_tokens=10, temperature=0,
                                                         ignore_eos=True))
    assert got[0].output_token_ids == want
    assert llm.engine.stats()["total_drafted"] > 0


@pytest.mark.slow
def test_step_graph_forwards_match_eager(step) -> None:
    """The compiled decode graphs cover Step's layers (per-layer heads and ropes, gates,
    clamps, windows) with the eager logits."""
    assert_graphs_match_eager(step)


def test_step_seeded_sampling_batch_independent_and_resumable(step) -> None:
    """A seeded sampled request (k = 3) gives the same tokens alone, batched, under
    preemption, and resumed after a migration at round ends."""
    import test_seeded_reproducibility as seeded

    seeded.test_batched_and_preempted_equal_alone(step)
    seeded.test_resume_after_migration_equals_alone(step)
