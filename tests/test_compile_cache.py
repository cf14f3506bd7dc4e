"""Compiled decode graphs survive a restart: a replica that starts with a warm on-disk compile
cache loads every graph and compiles nothing, before and during its first request; a cache
entry never serves other weights."""

from __future__ import annotations

import pytest
import torch

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model_runner import ModelRunner
from mtpserve.workers.sampling_params import SamplingParams


@pytest.fixture
def no_override(monkeypatch):
    """The suite runs eager (conftest); these tests take the configured mode."""
    monkeypatch.delenv("MTPSERVE_COMPILE", raising=False)
    monkeypatch.delenv("MTPSERVE_DECODE_GRAPHS", raising=False)


def _serving_engine(model, cache, max_num_seqs: int = 1) -> Engine:
    # A decode replica's engine: it warms up in its constructor, before it is used.
    return Engine(EngineConfig(model=str(model), num_speculative_tokens=1, num_kv_blocks=48,
                               block_size=4, max_num_seqs=max_num_seqs, role="decode",
                               compile="on", compile_cache_dir=str(cache),
                               warmup_budget_s=600))


def _greedy(eng: Engine, prompt: list[int]) -> list[int]:
    req = eng.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0,
                                                      ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    return list(req.output_token_ids)


def test_a_restarted_replica_loads_its_graphs_and_compiles_nothing(tiny_qwen3, tmp_path,
                                                                   no_override) -> None:
    prompt = [5, 9, 17, 33, 2, 8, 11]
    cold = _serving_engine(tiny_qwen3, tmp_path)
    first = cold.runner.graphs.compile_stats()
    assert first["compiled"] >= 3 and first["loaded"] == 0
    assert len(list(tmp_path.glob("*.pt2"))) == first["compiled"]
    cold_ids = _greedy(cold, prompt)

    warm = _serving_engine(tiny_qwen3, tmp_path)  # the restart
    stats = warm.runner.graphs.compile_stats()
    assert stats["compiled"] == 0 and stats["loaded"] == first["compiled"]
    assert _greedy(warm, prompt) == cold_ids  # its first request
    assert warm.runner.graphs.compile_stats()["compiled"] == 0  # nothing compiled inside it
    eager = Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=1,
                                num_kv_blocks=48, block_size=4, compile="off"))
    assert _greedy(eager, prompt) == cold_ids

    # A replica that finds only some of its buckets cached (batch 1 of batches 1-2) loads
    # them and compiles no new one (warmup_restart_budget_s 0): it is ready in seconds and
    # runs the batch-2 buckets eagerly.
    wider = _serving_engine(tiny_qwen3, tmp_path, max_num_seqs=2)
    stats = wider.runner.graphs.compile_stats()
    assert stats["compiled"] == 0 and stats["loaded"] == first["compiled"]
    assert {k.batch for k in wider.runner.graphs.compiled} == {1}
    assert _greedy(wider, prompt) == cold_ids


def test_other_weights_never_load_a_cached_graph(tiny_qwen3, tmp_path, no_override) -> None:
    """The entry's name hashes the weights as loaded: the same checkpoint with its MTP
    module in bf16 (other weights, same shapes and graph inputs) compiles its own graph
    instead of loading the first one's."""
    kw = dict(num_blocks=32, block_size=4, decode_graphs=True, compile_cache_dir=tmp_path)
    a = ModelRunner(tiny_qwen3, **kw)
    a.warmup_graphs([1], [1], 32, mtp_modules=0)  # the k = 0 graph only
    assert a.graphs.compile_stats()["compiled"] == 1
    again = ModelRunner(tiny_qwen3, **kw)
    assert again.graphs.cached(again.graphs.warmup_keys([1], [1], 32, 0))
    b = ModelRunner(tiny_qwen3, mtp_dtype=torch.bfloat16, **kw)
    assert not b.graphs.cached(b.graphs.warmup_keys([1], [1], 32, 0))
    b.warmup_graphs([1], [1], 32, mtp_modules=0)
    stats = b.graphs.compile_stats()
    assert (stats["compiled"], stats["loaded"]) == (1, 0)
    assert len(list(tmp_path.glob("*.pt2"))) == 2
