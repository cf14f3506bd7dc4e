"""The peer benchmark's checkpoints compute what the default model computes: the GLM-4.5
(`glm4_moe`) twin that vLLM's MTP runs (and that measures our MoE path) and the copy without
its MTP layer that vLLM's qwen3 loads (benchmarks/moe_twin.py)."""

from __future__ import annotations

import json

from helpers import greedy, make_engine, run_to_completion

from mtpserve.benchmarks.moe_twin import write_glm4_moe, write_without_mtp

PROMPTS = [[5, 9, 17, 33, 2, 8, 11], [40, 41, 7, 3], [100, 3, 3, 90, 12, 6, 1, 2, 77]]


def _run(path, k: int):
    eng = make_engine(path, k, num_kv_blocks=64, block_size=4, compile="off")
    out = run_to_completion(eng, PROMPTS, greedy(24))
    return out, eng.stats()


def test_moe_twin_is_the_same_function(default_model, tmp_path) -> None:
    """Greedy tokens at k = 0 and k = 2, and what the MTP module accepts, are the default
    model's: the MoE layers route every token to the expert holding the dense MLP with
    weight exactly 1, and the zero expert and shared expert add nothing."""
    twin = write_glm4_moe(tmp_path / "twin", default_model)
    cfg = json.loads((twin / "config.json").read_text())
    assert cfg["model_type"] == "glm4_moe" and cfg["first_k_dense_replace"] == 11
    for k in (0, 2):
        (want, want_stats), (got, got_stats) = _run(default_model, k), _run(twin, k)
        assert got == want
        if k:
            assert got_stats["accepted_per_position"] == want_stats["accepted_per_position"]


def test_copy_without_mtp_decodes_the_same(default_model, tmp_path) -> None:
    plain = write_without_mtp(tmp_path / "plain", default_model)
    assert json.loads((plain / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert _run(plain, 0)[0] == _run(default_model, 0)[0]
