"""Sliding-window attention (Qwen3 with `use_sliding_window`, layers windowed from
`max_window_layers`, an MTP layer windowed by `mtp_layer_types`) against transformers' own
classes, on prompts several windows long: paged prefill + decode logits within 1e-4 (fp32),
MTP draft logits == transformers' MtpModel, greedy k = 0..3 == transformers, and the compiled
decode graphs (slow tier) == eager."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    assert_graphs_match_eager,
    assert_greedy_with_drafts_equals,
    assert_mtp_steps_match_reference,
    paged_mtp_logits,
)
from test_model_families import _check_paged_logits
from tiny_models import make_hf_checkpoint
from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.loader import load_model

WINDOW = 5
SWA = dict(num_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


@pytest.fixture(scope="module")
def swa(tmp_path_factory) -> Path:
    """Qwen3, layer 0 full, layers 1-2 windowed, one MTP layer whose block is windowed."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("swa") / "qwen3", "qwen3", num_mtp=1,
                              vocab_size=VOCAB_SIZE, **SWA)
    cfg = json.loads((path / "config.json").read_text())
    cfg["mtp_layer_types"] = ["sliding_attention"]
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    make_tokenizer(path)
    return path


def _reference(path: Path, mtp: bool = False):
    ref = transformers.Qwen3ForCausalLM.from_pretrained(path).eval()
    if mtp:
        ref._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
        ref.config.num_mtp_layers = 1
        ref.config.mtp_layer_types = ["sliding_attention"]
    return ref


def test_config_reads_the_windows(swa) -> None:
    cfg = ModelConfig.from_pretrained(swa)
    assert [s.sliding_window for s in cfg.layers] == [None, WINDOW, WINDOW, WINDOW]
    lines = cfg.describe()
    assert "layers 1-2: GQA (window 5) + dense (2)" in lines
    assert "MTP module 0 (deepseek_v3 naming): GQA (window 5) + dense block" in lines


def test_sliding_logits_match_transformers_and_the_window_matters(swa, tmp_path) -> None:
    _check_paged_logits(swa, _reference(swa), 24, 6)
    wide = tmp_path / "wide"
    shutil.copytree(swa, wide)
    cfg = json.loads((wide / "config.json").read_text())
    cfg["sliding_window"] = 4096
    (wide / "config.json").write_text(json.dumps(cfg))
    ids = torch.randint(0, VOCAB_SIZE, (1, 20), generator=torch.Generator().manual_seed(3))
    pos = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        a, b = (m.compute_logits(m(ids, pos)) for m in (load_model(swa), load_model(wide)))
    assert (a[0, :WINDOW] - b[0, :WINDOW]).abs().max().item() <= 1e-5  # all inside
    assert (a[0, WINDOW:] - b[0, WINDOW:]).abs().max().item() > 1e-2


def test_sliding_mtp_draft_logits_match_transformers_mtp_model(swa) -> None:
    from transformers.modeling_layers import MtpModel

    ref = _reference(swa, mtp=True)
    mtp_ref = MtpModel.from_pretrained(ref).eval()
    ours = load_model(swa)
    assert ours.mtp[0].block.self_attn.window == WINDOW
    ids = torch.randint(0, VOCAB_SIZE, (1, 21), generator=torch.Generator().manual_seed(2))
    n = 19
    logits_ref = assert_mtp_steps_match_reference(ref, mtp_ref, ours, ids, n)
    paged = paged_mtp_logits(swa, ids, n, block_size=4)
    assert (paged - logits_ref[0]).abs().max().item() <= 1e-4


def test_sliding_greedy_with_drafts_equals_transformers(swa) -> None:
    assert_greedy_with_drafts_equals(swa, _reference(swa), VOCAB_SIZE,
                                     lens=(7, 19))


@pytest.mark.slow
def test_sliding_graph_forwards_match_eager(swa) -> None:
    """The compiled decode graphs (the window mask built in-graph from the positions) give
    the eager logits on a ragged batch past the window."""
    assert_graphs_match_eager(swa)


def test_windows_only_where_the_config_turns_them_on() -> None:
    """Qwen2-shaped configs carry `sliding_window` even with `use_sliding_window` false (MiMo
    ships 32768 so): no layer is windowed then; Llama has no windows at all."""
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, sliding_window=8)
    for model_type in ("mimo", "qwen2", "qwen3", "llama"):
        cfg = ModelConfig.from_dict({**base, "model_type": model_type,
                                     "use_sliding_window": False})
        assert [s.sliding_window for s in cfg.layers] == [None, None], model_type
    on = ModelConfig.from_dict({**base, "model_type": "mimo", "use_sliding_window": True,
                                "max_window_layers": 1})
    assert [s.sliding_window for s in on.layers] == [None, 8]
