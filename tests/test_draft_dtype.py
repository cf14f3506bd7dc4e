"""The MTP module(s) may run in a cheaper dtype than the main model (`draft_dtype`): drafts
change at most, outputs never. Greedy output equals plain decoding, sampled output keeps the
target distribution at every position (q is what the bf16 head gives, and that q is what
rejection sampling uses), and `auto` picks bf16 only for a float32 model on a CPU with native
bf16 whose linears do not already stream bf16 bytes (the bf16-weight kernel)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine, run_to_completion
from test_sampling_distribution import NUM_POS, assert_matches, exact_marginals, sample_many

from mtpserve.workers.engine_config import cpu_has_native_bf16, resolve_draft_dtype
from mtpserve.workers.model import bf16_weights
from mtpserve.workers.sampling_params import SamplingParams


def test_resolution(monkeypatch, tiny_qwen3, tmp_path) -> None:
    monkeypatch.delenv("MTPSERVE_DRAFT_DTYPE", raising=False)  # conftest pins it
    assert resolve_draft_dtype("model", "float32", "cpu") == "float32"
    assert resolve_draft_dtype("float16", "float32", "cpu") == "float16"
    assert resolve_draft_dtype("auto", "bfloat16", "cuda") == "bfloat16"
    assert resolve_draft_dtype("auto", "float32", "cuda") == "float32"  # GPUs: not measured
    assert resolve_draft_dtype("auto", "bfloat16", "cpu") == "bfloat16"
    native = cpu_has_native_bf16()
    assert resolve_draft_dtype("auto", "float32", "cpu", tiny_qwen3) == ("bfloat16" if native
                                                                          else "float32")
    # A bf16 checkpoint served in float32 keeps float32 drafts where the bf16-weight kernel
    # streams its linears (the same bytes as bf16 drafts, float32 arithmetic).
    bf16_ckpt = tmp_path / "bf16"
    bf16_ckpt.mkdir()
    (bf16_ckpt / "config.json").write_text('{"torch_dtype": "bfloat16"}')
    assert resolve_draft_dtype("auto", "float32", "cpu", bf16_ckpt) == (
        "float32" if bf16_weights.available() or not native else "bfloat16")
    with pytest.raises(ValueError, match="draft dtype 'fp8'"):
        resolve_draft_dtype("fp8", "float32", "cpu")
    monkeypatch.setenv("MTPSERVE_DRAFT_DTYPE", "float16")  # replaces auto only
    assert resolve_draft_dtype("auto", "float32", "cpu") == "float16"
    assert resolve_draft_dtype("model", "float32", "cpu") == "float32"


def test_cluster_config_takes_it_and_rejects_a_bad_one() -> None:
    from pydantic import ValidationError

    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers.replica.engine_core import engine_config, rank_spec

    cfg = ClusterConfig(speculation={"draft_dtype": "bfloat16"})
    assert rank_spec(cfg, "decode").draft_dtype == "bfloat16"
    assert engine_config(cfg, "prefill", 64).draft_dtype == "bfloat16"
    assert ClusterConfig().speculation.draft_dtype == "auto"
    with pytest.raises(ValidationError, match="draft_dtype"):
        ClusterConfig(speculation={"draft_dtype": "int8"})


def test_greedy_output_is_unchanged(default_model) -> None:
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 4000, (10 + 9 * i,), generator=g).tolist() for i in range(3)]
    outs = {}
    for name, k, dd in (("plain", 0, "model"), ("bf16", 3, "bfloat16")):
        eng = make_engine(default_model, k, num_kv_blocks=128, draft_dtype=dd, compile="off")
        if k:
            model = eng.runner.model
            assert {p.dtype for p in model.mtp.parameters()} == {torch.bfloat16}
            assert {p.dtype for p in model.model.parameters()} == {torch.float32}
        outs[name] = run_to_completion(eng, prompts)
        if k:
            assert eng.totals["accepted"] > 0
    assert outs["bf16"] == outs["plain"]


def test_sampled_output_keeps_the_target_distribution(tiny_factory) -> None:
    path = tiny_factory(vocab_size=6, seed=5)
    params = SamplingParams(temperature=1.0, ignore_eos=True)
    exact = exact_marginals(path, params, NUM_POS)
    reqs = sample_many(path, params, 2400, seed0=30_000, draft_dtype="bfloat16")
    assert sum(r.num_accepted for r in reqs) > 100
    assert_matches(reqs, exact)
