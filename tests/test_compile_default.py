"""Compiled decode is the default path: `compile: auto` resolves to graphs where they were
measured faster, serving engines warm up before they are used, nothing compiles inside a
request, and the TP driver offers every capability the single-process runner has."""

from __future__ import annotations

import inspect

import pytest

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.engine_config import compile_enabled
from mtpserve.workers.model import shm_collectives
from mtpserve.workers.model_runner import ModelRunner, Runner
from mtpserve.workers.sampling_params import SamplingParams


def test_auto_means_cpu_tp1_and_the_environment_overrides(compile_as_configured,
                                                          monkeypatch) -> None:
    assert compile_enabled("auto", "cpu", 1)
    # TP > 1 on CPU: graphs hold the shared-memory collectives; over gloo they stay eager.
    assert compile_enabled("auto", "cpu", 2) == shm_collectives.available("cpu")
    assert not compile_enabled("auto", "cuda", 2)
    monkeypatch.setenv("MTPSERVE_SHM_COLLECTIVES", "0")
    assert not compile_enabled("auto", "cpu", 2)
    monkeypatch.delenv("MTPSERVE_SHM_COLLECTIVES")
    assert not compile_enabled("auto", "cuda", 1)  # not measured on a GPU yet
    assert compile_enabled("on", "cuda", 1) and not compile_enabled("off", "cpu", 1)
    monkeypatch.setenv("MTPSERVE_COMPILE", "off")
    assert not compile_enabled("on", "cpu", 1)
    monkeypatch.setenv("MTPSERVE_COMPILE", "on")
    assert compile_enabled("off", "cpu", 1)
    monkeypatch.setenv("MTPSERVE_COMPILE", "fast")
    with pytest.raises(ValueError, match="auto | on | off"):
        compile_enabled("auto", "cpu", 1)


def _protocol_members() -> list[str]:
    return [n for n in dir(Runner) if not n.startswith("_")] + ["config", "kv_cache"]


def test_the_tp_driver_offers_every_runner_capability(tiny_qwen3) -> None:
    """Every member of the `Runner` protocol exists on both implementations with the same
    signature, so the engine never loses a capability (graphs, warm-up, fused rounds) when a
    replica drives a TP group."""
    from mtpserve.workers.replica.tp_group import RankCore, RankSpec, TPDriver

    members = _protocol_members()
    assert {"execute", "warmup_graphs", "fuses_greedy_rounds", "greedy_round"} <= set(members)
    core = RankCore(RankSpec(model=str(tiny_qwen3), role="decode", tp_size=1,
                             num_kv_blocks=16, compile="off"), 0)
    try:
        driver = TPDriver(core)
        assert isinstance(driver, Runner) and isinstance(core.runner, Runner)
        for name in members:
            a, b = getattr(ModelRunner, name, None), getattr(TPDriver, name, None)
            assert hasattr(driver, name), name
            if callable(a) and not isinstance(a, property):
                assert inspect.signature(a) == inspect.signature(b), name
        assert driver.warmup_graphs([1], [1], 64) == 0  # eager runner: nothing to compile
        assert driver.fuses_greedy_rounds is False
    finally:
        core.close()


def test_an_unwarmed_bucket_runs_eagerly_with_the_same_output(tiny_qwen3,
                                                              compile_as_configured) -> None:
    """A serving engine whose warm-up budget compiled nothing (budget 0) answers every request
    eagerly, never compiling inside one, with the eager engine's tokens."""
    prompts = [[5, 9, 17, 33, 2, 8], [40, 41, 42]]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = {}
    for mode in ("off", "on"):
        eng = Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=2,
                                  num_kv_blocks=64, block_size=4, compile=mode,
                                  warmup_budget_s=0.0, role="decode"))
        assert (eng.runner.graphs is not None) == (mode == "on")
        reqs = [eng.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        while eng.has_unfinished():
            eng.step()
        out[mode] = [r.output_token_ids for r in reqs]
        if mode == "on":
            assert eng.runner.graphs.warmed and not eng.runner.graphs.compiled
    assert out["on"] == out["off"]


@pytest.mark.slow  # a minute of compiling; compiled == eager is also conftest's compiled_decode
def test_compiled_llm_equals_eager(tiny_qwen3, compile_as_configured) -> None:
    """`LLM(compile="on")` compiles the graphs its prompts hit before they run (one
    dynamic-shape package per kind), then decodes greedily exactly like eager; under `auto` a call
    too small to pay for a cold compile runs eagerly and compiles nothing."""
    from mtpserve.workers.llm import AUTO_COMPILE_MIN_TOKENS, LLM

    prompt = [5, 9, 17, 33, 2, 8, 11]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(num_speculative_tokens=2, block_size=4, num_kv_blocks=64)
    eager = LLM(str(tiny_qwen3), compile="off", **kw).generate([prompt], params)
    eager_ids = eager[0].output_token_ids
    auto = LLM(str(tiny_qwen3), **kw)
    assert 16 < AUTO_COMPILE_MIN_TOKENS
    assert auto.generate([prompt], params)[0].output_token_ids == eager_ids
    # (It may load graphs an earlier test left in the suite's compile cache; it compiles none.)
    assert auto.engine.runner.graphs.compile_stats()["compiled"] == 0
    llm = LLM(str(tiny_qwen3), compile="on", **kw)
    graphs = llm.engine.runner.graphs
    # Nothing compiled at construction (graphs an earlier test left in the suite's compile
    # cache may load: loading is not compiling).
    built = graphs.compile_stats() if graphs is not None else None
    assert built is not None and built["compiled"] == 0, built
    got = llm.generate([prompt], params)[0].output_token_ids
    compiled = set(graphs.compiled)
    assert {k.name for k in compiled} == {"main0-dynamic", "mtp0-dynamic"}
    assert got == eager_ids
    # A second call of the same shape compiles nothing more.
    assert llm.generate([prompt], params)[0].output_token_ids == eager_ids
    assert graphs.compiled == compiled
    # A new process-level LLM under `auto` now loads those graphs from the on-disk cache,
    # even for a call too small to pay for compiling them, and compiles nothing.
    again = LLM(str(tiny_qwen3), **kw)
    assert again.generate([prompt], params)[0].output_token_ids == eager_ids
    stats = again.engine.runner.graphs.compile_stats()
    assert stats["compiled"] == 0 and stats["loaded"] == len(compiled)


def test_warmup_covers_every_batch_bucket_and_skips_mtp_at_k0(tiny_qwen3) -> None:
    """Warm-up asks for every batch size up to the cap (3 prompts need the 4-row bucket, 24
    sequences the 32-row one), and no MTP graphs when k = 0 (it never drafts)."""
    calls = []
    for k, cap, asked in ((2, 24, None), (0, 8, 3)):
        runner = ModelRunner(tiny_qwen3, num_blocks=32, block_size=4, decode_graphs=False)
        runner.warmup_graphs = lambda *a, **kw: calls.append((a, kw)) or 0
        eng = Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=k,
                                  num_kv_blocks=32, block_size=4, max_num_seqs=cap,
                                  role="decode"), runner=runner)
        if asked is not None:
            eng.warmup(asked)
    (batches, queries, _), kw = calls[0]
    assert batches == list(range(1, 25)) and queries == [1, 2, 3] and kw["mtp_modules"] is None
    (batches, queries, _), kw = calls[-1]
    assert batches == [1, 2, 3] and queries == [1] and kw["mtp_modules"] == 0


def test_an_offline_engine_never_compiles_inside_a_step(tiny_qwen3,
                                                        compile_as_configured) -> None:
    """An `Engine` built directly (evaluation, profiling) under `auto` marks its graphs warmed
    with nothing compiled (it loads only what the on-disk cache holds): its other buckets run
    eagerly until something warms it on purpose."""
    eng = Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=2,
                              num_kv_blocks=64, block_size=4))
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.warmed and graphs.compile_stats()["compiled"] == 0
    held = set(graphs.compiled)
    eng.add_request("r", [5, 9, 17], SamplingParams(max_tokens=6, temperature=0))
    while eng.has_unfinished():
        eng.step()
    assert graphs.compiled == held and graphs.compile_stats()["compiled"] == 0
