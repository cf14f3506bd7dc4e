"""A decode replica's idle prefill threads (`decode.idle_prefill_threads`,
`EngineConfig.prefill_threads`): a step with only prefill chunks runs with that many intra-op
threads on the engine thread, decode rounds keep the engine's own, and the output is the
same as without it."""

from __future__ import annotations

import threading

import pytest
import torch

from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.replica.engine_core import engine_config
from mtpserve.workers.sampling_params import SamplingParams

PROMPTS = [[(7 * i + 3 * j) % 250 + 3 for j in range(40 + 9 * i)] for i in range(3)]


def _run(model: str, prefill_threads: int) -> tuple[list[list[int]], list[tuple[str, int]]]:
    """Greedy outputs of PROMPTS one after another on an engine driven from its own thread
    (as a replica's engine thread is), and the thread count each forward ran with."""
    eng = Engine(EngineConfig(model=model, num_kv_blocks=64, num_speculative_tokens=2,
                              prefill_threads=prefill_threads))
    seen: list[tuple[str, int]] = []
    execute = eng.runner.execute

    def observed(batch, *a, **kw):
        seen.append(("prefill" if max(len(r) for r in batch.input_ids) > 8 else "decode",
                     torch.get_num_threads()))
        return execute(batch, *a, **kw)

    eng.runner.execute = observed
    outs: list[list[int]] = []
    after: list[int] = []

    def drive() -> None:
        torch.set_num_threads(1)
        for i, prompt in enumerate(PROMPTS):
            req = eng.add_request(f"r{i}", prompt, SamplingParams(
                max_tokens=12, temperature=0.0, ignore_eos=True))
            while eng.has_unfinished():
                eng.step()
            outs.append(list(req.output_token_ids))
        after.append(torch.get_num_threads())

    t = threading.Thread(target=drive)
    t.start()
    t.join()
    assert after == [1], "the engine thread's own thread count is restored"
    return outs, seen


def test_prefill_only_steps_borrow_threads_and_decode_keeps_its_own(tiny_qwen3) -> None:
    base, seen0 = _run(str(tiny_qwen3), 0)
    outs, seen = _run(str(tiny_qwen3), 2)
    assert outs == base  # greedy tokens do not depend on the prefill's thread count
    assert {n for kind, n in seen0} == {1}
    assert {n for kind, n in seen if kind == "prefill"} == {2}
    assert {n for kind, n in seen if kind == "decode"} == {1}


def test_cluster_setting_reaches_the_decode_engine_only() -> None:
    cfg = ClusterConfig(decode={"idle_prefill_threads": 2})
    assert engine_config(cfg, "decode", 64).prefill_threads == 2
    assert engine_config(cfg, "prefill", 64).prefill_threads == 0
    assert engine_config(ClusterConfig(), "decode", 64).prefill_threads == 0
    with pytest.raises(ValueError, match="tp_size 1"):
        ClusterConfig(decode={"idle_prefill_threads": 2, "tp_size": 2})
