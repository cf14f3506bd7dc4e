"""MiMo-V2-Flash against transformers' `MiMoV2FlashForCausalLM` on tiny random checkpoints it
saved: full and sliding layers with their own KV head counts, 24-dim keys over 16-dim scaled
values, attention sinks, per-type partial ropes, the sigmoid MoE; MTP layers under
`model.mtp.layers.{i}` (transformers builds none: the reference is its own decoder layer,
norms and LM head around the same weights). Paged logits within 1e-4 (fp32), the sinks matter,
MTP draft logits == the reference, greedy k = 0..3 == transformers, TP 2 == TP 1."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    assert_graphs_match_eager,
    assert_greedy_with_drafts_equals,
    assert_tp2_engine_equals_tp1,
    paged_mtp_logits,
)
from test_model_families import _check_paged_logits
from tiny_models import make_mimo_v2_flash_checkpoint, mimo_mtp_blocks
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.loader import load_model


@pytest.fixture(scope="module")
def mimo(tmp_path_factory) -> Path:
    path = make_mimo_v2_flash_checkpoint(tmp_path_factory.mktemp("mimo2") / "mimo", num_mtp=1,
                                         vocab_size=VOCAB_SIZE)
    make_tokenizer(path)
    return path


def _reference(path: Path):
    return transformers.MiMoV2FlashForCausalLM.from_pretrained(path).eval()


def test_mimo_config(mimo) -> None:
    cfg = ModelConfig.from_pretrained(mimo)
    assert cfg.num_key_value_heads == 2 and cfg.v_head_dim == 16 and cfg.value_scale == 0.707
    assert [s.num_kv_heads for s in cfg.layers] == [1, None, None, 1, None]
    assert [s.attention_sinks for s in cfg.layers] == [False, True, True, False, True]
    assert [s.sliding_window for s in cfg.layers] == [None, 5, 5, None, 5]
    assert cfg.rotary_dim == 8 and cfg.mtp_naming == "mimo_v2" and cfg.num_mtp_modules == 1
    lines = "\n".join(cfg.describe())
    assert "2 KV heads (1 in full layers, repeated into the cache)" in lines
    assert "attention sinks in windowed layers" in lines


def test_mimo_logits_match_transformers_and_the_sinks_matter(mimo) -> None:
    _check_paged_logits(mimo, _reference(mimo), 24, 6)
    ids = torch.randint(0, VOCAB_SIZE, (1, 16), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(16).unsqueeze(0)
    ours = load_model(mimo)
    with torch.no_grad():
        a = ours.compute_logits(ours(ids, pos))
        for layer in ours.model.layers:
            if layer.self_attn.sinks is not None:
                layer.self_attn.sinks.fill_(-1e4)  # a sink nobody attends to: plain softmax
        b = ours.compute_logits(ours(ids, pos))
    assert (a - b).abs().max().item() > 1e-3


def _reference_mtp(path: Path, ref, h: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Draft logits of MTP module 0 from transformers' parts: its decoder layer (layer 4 of
    the model saved beside the checkpoint, the same tensors), RMSNorms, eh_proj, LM head."""
    from safetensors.torch import load_file

    longer = transformers.MiMoV2FlashForCausalLM.from_pretrained(mimo_mtp_blocks(path)).eval()
    w = load_file(path / "model.safetensors")
    p = "model.mtp.layers.0."

    def norm(x, name):
        x32 = x.float()
        return w[p + name + ".weight"] * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True)
                                                            + 1e-6))

    n = tokens.shape[1]
    pos = torch.arange(n).unsqueeze(0)
    e = ref.model.embed_tokens(tokens)
    x = torch.nn.functional.linear(torch.cat([norm(e, "enorm"), norm(h, "hnorm")], -1),
                                   w[p + "eh_proj.weight"])
    d = pos[0].view(-1, 1) - pos[0].view(1, -1)
    mask = torch.zeros(n, n).masked_fill(~((d >= 0) & (d < 5)), float("-inf")).view(1, 1, n, n)
    rope = longer.model.rotary_emb(x, pos, "sliding_attention")
    y = longer.model.layers[4](x, attention_mask=mask, position_ids=pos, position_embeddings=rope)
    return ref.lm_head(norm(y, "final_layernorm"))


def test_mimo_mtp_draft_logits_match_the_reference(mimo) -> None:
    ref = _reference(mimo)
    ours = load_model(mimo)
    block = ours.mtp[0].block.self_attn
    assert block.window == 5 and block.sinks is not None
    ids = torch.randint(0, VOCAB_SIZE, (1, 21), generator=torch.Generator().manual_seed(2))
    n = 19
    pos = torch.arange(n).unsqueeze(0)
    with torch.no_grad():
        h_ref = ref.model(ids[:, :n]).last_hidden_state
        h = ours(ids[:, :n], pos)
        assert (h - h_ref).abs().max().item() <= 1e-4
        want = _reference_mtp(mimo, ref, h_ref, ids[:, 1:n + 1])
        got = ours.compute_mtp_logits(0, ours.forward_mtp(0, ids[:, 1:n + 1], h, pos))
    assert (got - want).abs().max().item() <= 1e-4
    paged = paged_mtp_logits(mimo, ids, n, block_size=4)
    assert (paged - want[0]).abs().max().item() <= 1e-4


def test_mimo_greedy_with_drafts_equals_transformers(mimo) -> None:
    assert_greedy_with_drafts_equals(mimo, _reference(mimo), VOCAB_SIZE,
                                     lens=(7, 19))


def test_mimo_tp2_engine_with_prefix_caching_equals_tp1(mimo) -> None:
    """Two gloo ranks: 2 query heads and their sinks per rank, the sliding layers' 2 KV heads
    split, the full layers' one replicated; k = 2 and prefix caching == one process."""
    assert_tp2_engine_equals_tp1(str(mimo))


@pytest.mark.slow
def test_mimo_graph_forwards_match_eager(mimo) -> None:
    """Compiled decode graphs (sinks in the in-place paged attention) == eager."""
    assert_graphs_match_eager(mimo)


def test_mimo_seeded_sampling_batch_independent_and_resumable(mimo) -> None:
    """A seeded sampled request (k = 3) gives the same tokens alone, batched, under
    preemption, and resumed after a migration at round ends."""
    import test_seeded_reproducibility as seeded

    seeded.test_batched_and_preempted_equal_alone(mimo)
    seeded.test_resume_after_migration_equals_alone(mimo)
