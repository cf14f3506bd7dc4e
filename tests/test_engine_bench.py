"""`mtpserve bench engine` measures the engine a user runs: its "graphs" variant makes the
same fused-round choice as a default engine at a fixed k, and the suffixes override it."""

from __future__ import annotations

import pytest

from mtpserve.benchmarks.engine_bench import _greedy_rounds, parse_variant
from mtpserve.workers.engine_config import EngineConfig, fused_greedy_rounds


@pytest.mark.parametrize("k", [1, 2])
def test_graphs_variant_fuses_rounds_as_the_default_cpu_engine_does(
        k: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MTPSERVE_GREEDY_ROUNDS", raising=False)
    engine = fused_greedy_rounds(EngineConfig(model=None, num_speculative_tokens=k,
                                                 device="cpu"))
    bench = _greedy_rounds(parse_variant("graphs"), "cpu")
    # The engine asks only at k = 1 (the only fused round); a runner that fuses serves every
    # k, since other ks find no round graph and run step by step.
    assert bench is True
    assert engine is (True if k == 1 else None)


def test_variant_suffixes_choose_rounds_explicitly() -> None:
    assert _greedy_rounds(parse_variant("graphs-steps"), "cpu") is False
    assert _greedy_rounds(parse_variant("graphs-dv1024-rounds"), "cpu") is True
    assert _greedy_rounds(parse_variant("eager"), "cpu") is False
    assert _greedy_rounds(parse_variant("graphs"), "cuda") is False
    with pytest.raises(ValueError):
        parse_variant("graphs-sideways")
