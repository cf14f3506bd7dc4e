"""Compiled decode graphs survive a restart: a replica that starts with a warm on-disk compile
cache loads every graph and compiles nothing, before and during its first request; a cache
entry never serves other weights."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from helpers import COMPILED_DECODE, greedy, make_engine, run_to_completion

from mtpserve.router.metrics_api import parse_samples, render
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model_runner import ModelRunner
from mtpserve.workers.replica.metrics import EngineRecorder


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
    assert first["compiled"] >= 2 and first["loaded"] == 0
    assert compiled_decode.cold_files == first["compiled"]  # one package per graph
    p = cold.stats()["compile"]  # its compile progress: all compiled within its budget
    assert (p["total"], p["done"], p["compiled"], p["state"], p["eta_s"]) == \
        (first["compiled"], first["compiled"], first["compiled"], "done", 0.0)
    assert p["seconds_per_bucket"] > 0 and p["elapsed_s"] >= p["seconds_per_bucket"]
    cold_ids = _greedy(cold, prompt)

    warm = _serving_engine(tiny_qwen3, cache)  # the restart
    stats = warm.runner.graphs.compile_stats()
    assert stats["compiled"] == 0 and stats["loaded"] == first["compiled"]
    assert _greedy(warm, prompt) == cold_ids  # its first request
    assert warm.runner.graphs.compile_stats()["compiled"] == 0  # nothing compiled inside it
    eager = make_engine(tiny_qwen3, 1, num_kv_blocks=48, block_size=4, compile="off")
    assert _greedy(eager, prompt) == cold_ids

    # A replica of more rows (batches 1-2) needs no other graph: the dynamic-shape packages
    # the batch-1 replica compiled cover any batch; it loads them and compiles nothing.
    wider = _serving_engine(tiny_qwen3, cache, max_num_seqs=2)
    stats = wider.runner.graphs.compile_stats()
    assert stats["compiled"] == 0 and stats["loaded"] == first["compiled"]
    assert wider.runner.graphs.compiled == cold.runner.graphs.compiled
    assert all(k.dynamic for k in wider.runner.graphs.compiled)
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
    # The main model's package; test_other_weights may have left a bf16 twin here.
    for f in cache.glob("main0-dynamic-*.pt2"):
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
    total = compiled_decode.cold_stats["compiled"]
    assert bg is not None and len(bg.pending) == 1 and bg.proc.poll() is None
    assert len(runner.graphs.compiled) == total - 1
    # Its compile progress: every bucket of the configuration counted, all but the missing
    # one done (loaded), that one being compiled, no ETA before anything was measured
    # (everything else loaded). The child needs seconds to start; should it have finished
    # already, the package on disk counts as done.
    (missing,) = bg.pending
    p = eng.stats()["compile"]
    assert (p["total"], p["adopted"]) == (total, total - 1)
    if p["done"] == total - 1:
        assert p["state"] == "compiling" and p["compiling"] == [missing.name]
        assert p["eta_s"] is None and p["seconds_per_bucket"] is None and p["compiled"] == 0
    else:
        assert (p["done"], p["state"]) == (total, "done")
    assert missing.name == "main0-dynamic"
    assert _greedy(eng, prompt) == eager  # while it compiles: that bucket runs eagerly
    assert bg.proc.wait(timeout=240) == 0  # the child compiled it and exited
    # Done as soon as the package is on disk, adopted or not (an idle engine adopts
    # nothing; a step may have adopted it already).
    p = eng.stats()["compile"]
    assert (p["total"], p["done"], p["state"], p["eta_s"], p["compiling"]) == \
        (total, total, "done", 0.0, [])
    assert p["adopted"] == (total - 1 if runner.background is not None else total)
    assert p["compiled"] == 1 and p["seconds_per_bucket"] > 0 and p["elapsed_s"] > 0
    deadline = time.monotonic() + 30  # adoption: the engine looks once a second, per step
    while runner.background is not None and time.monotonic() < deadline:
        assert _greedy(eng, prompt) == eager
    assert runner.background is None, "the engine did not adopt the package"
    assert bg.adopted == 1 and bg.proc is None  # the child exited and was reaped
    assert list(cache.glob("main0-dynamic-*.pt2"))  # under the name the replica looks up
    assert len(runner.graphs.compiled) == compiled_decode.cold_stats["compiled"]
    assert _greedy(eng, prompt) == eager
    p = eng.stats()["compile"]
    assert (p["done"], p["adopted"], p["state"]) == (total, total, "done")
    # The same numbers as /metrics gauges, labelled with the replica.
    recorder = EngineRecorder(SimpleNamespace(engine=eng, step_observers=[]), "decode")
    m = parse_samples(render({"snapshots": [recorder.snapshot("decode:a", eng.stats())]},
                             "m"))
    labels = (("model_name", "m"), ("replica", "decode:a"), ("role", "decode"))
    assert m[("mtpserve:compile_buckets_total", labels)] == total
    assert m[("mtpserve:compile_buckets_done", labels)] == total
    assert m[("mtpserve:compile_eta_seconds", labels)] == 0
    again = start()
    assert again.runner.background is None
    assert again.runner.graphs.compile_stats()["loaded"] == compiled_decode.cold_stats["compiled"]
    p = again.stats()["compile"]  # a start that found everything cached
    assert (p["total"], p["done"], p["state"], p["compiled"]) == (total, total, "done", 0)


def test_a_package_is_named_for_the_thread_count_its_kernels_are_built_for(tmp_path) -> None:
    """Inductor builds CPU kernels for the current thread count (1: no OpenMP regions), so a
    package serves only engines at that count: the count is part of its name, and a
    background compile child (itself on one thread) builds for its replica's count."""
    from torch._inductor import config as inductor_config

    from mtpserve.workers.model.compile_cache import AOTGraphCache, codegen_threads

    cache = AOTGraphCache(tmp_path, "fingerprint")
    args = (torch.zeros(2, 3),)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cache.path_for("main0-dynamic", args)
        torch.set_num_threads(2)
        two = cache.path_for("main0-dynamic", args)
        assert one != two and codegen_threads() == 2
        torch.set_num_threads(1)  # the child's own count, its replica's kernels
        with inductor_config.patch({"cpp.threads": 2}):
            assert codegen_threads() == 2 and cache.path_for("main0-dynamic", args) == two
    finally:
        torch.set_num_threads(before)
