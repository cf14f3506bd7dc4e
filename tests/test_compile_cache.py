"""Compiled decode graphs survive a restart: a replica that starts with a warm on-disk compile
cache loads every graph and compiles nothing, before and during its first request; a cache
entry never serves other weights."""

from __future__ import annotations

import torch
from helpers import COMPILED_DECODE, greedy, make_engine, run_to_completion

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model_runner import ModelRunner


def _serving_engine(model, cache, max_num_seqs: int = 1) -> Engine:
    # A decode replica's engine (conftest's `compiled_decode` settings): it warms up in its
    # constructor, before it is used.
    kw = {**COMPILED_DECODE, "max_num_seqs": max_num_seqs}
    return Engine(EngineConfig(model=str(model), role="decode", compile="on",
                               compile_cache_dir=str(cache), warmup_budget_s=600, **kw))


def _greedy(eng: Engine, prompt: list[int]) -> list[int]:
    return run_to_completion(eng, [prompt], greedy(12))[0]


def test_a_restarted_replica_loads_its_graphs_and_compiles_nothing(
        tiny_qwen3, compiled_decode, compile_as_configured) -> None:
    prompt = [5, 9, 17, 33, 2, 8, 11]
    # The cold start: the session's compiled decode engine (it compiled into its own cache).
    cold, cache, first = compiled_decode.engine, compiled_decode.cache_dir, \
        compiled_decode.cold_stats
    assert first["compiled"] >= 3 and first["loaded"] == 0
    assert compiled_decode.cold_files == first["compiled"]  # one package per graph
    cold_ids = _greedy(cold, prompt)

    warm = _serving_engine(tiny_qwen3, cache)  # the restart
    stats = warm.runner.graphs.compile_stats()
    assert stats["compiled"] == 0 and stats["loaded"] == first["compiled"]
    assert _greedy(warm, prompt) == cold_ids  # its first request
    assert warm.runner.graphs.compile_stats()["compiled"] == 0  # nothing compiled inside it
    eager = make_engine(tiny_qwen3, 1, num_kv_blocks=48, block_size=4, compile="off")
    assert _greedy(eager, prompt) == cold_ids

    # A replica that finds only some of its buckets cached (batch 1 of batches 1-2) loads
    # them and compiles no new one (warmup_restart_budget_s 0): it is ready in seconds and
    # runs the batch-2 buckets eagerly.
    wider = _serving_engine(tiny_qwen3, cache, max_num_seqs=2)
    stats = wider.runner.graphs.compile_stats()
    assert stats["compiled"] == 0 and stats["loaded"] == first["compiled"]
    assert {k.batch for k in wider.runner.graphs.compiled} == {1}
    assert _greedy(wider, prompt) == cold_ids


def test_other_weights_never_load_a_cached_graph(tiny_qwen3, compiled_decode,
                                                compile_as_configured) -> None:
    """The entry's name hashes the weights as loaded: the checkpoint `compiled_decode`
    compiled loads its k = 0 graph from that cache; the same checkpoint with its MTP module
    in bf16 (other weights, same shapes and graph inputs) compiles its own graph instead."""
    cache = compiled_decode.cache_dir
    kw = dict(num_blocks=COMPILED_DECODE["num_kv_blocks"],
              block_size=COMPILED_DECODE["block_size"], decode_graphs=True,
              compile_cache_dir=cache)
    a = ModelRunner(tiny_qwen3, **kw)
    assert a.graphs.cached(a.graphs.warmup_keys([1], [1], 32, 0))
    a.warmup_graphs([1], [1], 32, mtp_modules=0)  # the k = 0 graph only
    stats = a.graphs.compile_stats()
    assert (stats["compiled"], stats["loaded"]) == (0, 1)
    files = len(list(cache.glob("*.pt2")))
    b = ModelRunner(tiny_qwen3, mtp_dtype=torch.bfloat16, **kw)
    assert not b.graphs.cached(b.graphs.warmup_keys([1], [1], 32, 0))
    b.warmup_graphs([1], [1], 32, mtp_modules=0)
    stats = b.graphs.compile_stats()
    assert (stats["compiled"], stats["loaded"]) == (1, 0)
    assert len(list(cache.glob("*.pt2"))) == files + 1


def test_a_bucket_the_start_left_is_compiled_in_the_background_and_adopted(
        tiny_qwen3, compiled_decode, compile_as_configured, tmp_path) -> None:
    """A decode replica whose cache lacks one of its buckets loads the others, reports ready
    at once, and a low-priority child compiles the missing one into the cache; the engine
    runs it eagerly (same tokens) until the package appears, then adopts it between steps.
    The next start finds every bucket cached and starts no child."""
    import shutil
    import time

    cache = tmp_path / "cache"
    shutil.copytree(compiled_decode.cache_dir, cache)
    # The rarest bucket (compiled last); test_other_weights may have left a bf16 twin here.
    for f in cache.glob("main0-b1-s1-*.pt2"):
        f.unlink()
    prompt = [5, 9, 17, 33, 2, 8, 11]
    eager = _greedy(make_engine(tiny_qwen3, 1, num_kv_blocks=48, block_size=4,
                                compile="off"), prompt)

    def start() -> Engine:
        kw = {**COMPILED_DECODE, "max_num_seqs": 1}
        return Engine(EngineConfig(model=str(tiny_qwen3), role="decode", compile="on",
                                   compile_cache_dir=str(cache), warmup_budget_s=0.0,
                                   background_compile=True, **kw))

    eng = start()
    runner = eng.runner
    bg = runner.background
    assert bg is not None and len(bg.pending) == 1 and bg.proc.poll() is None
    assert len(runner.graphs.compiled) == compiled_decode.cold_stats["compiled"] - 1
    assert _greedy(eng, prompt) == eager  # while it compiles: that bucket runs eagerly
    assert bg.proc.wait(timeout=240) == 0  # the child compiled it and exited
    deadline = time.monotonic() + 30  # adoption: the engine looks once a second, per step
    while runner.background is not None and time.monotonic() < deadline:
        assert _greedy(eng, prompt) == eager
    assert runner.background is None, "the engine did not adopt the package"
    assert bg.adopted == 1 and bg.proc is None  # the child exited and was reaped
    assert list(cache.glob("main0-b1-s1-*.pt2"))  # under the name the replica looks up
    assert len(runner.graphs.compiled) == compiled_decode.cold_stats["compiled"]
    assert _greedy(eng, prompt) == eager
    again = start()
    assert again.runner.background is None
    assert again.runner.graphs.compile_stats()["loaded"] == compiled_decode.cold_stats["compiled"]
