"""Mixed batches (EngineConfig.mixed_batches): prefill chunks ride along decode rounds in one
step (one forward, or with compiled decode graphs the round's graph and the chunks' forward).
Outputs stay those of each request run alone (greedy token for token; seeded sampling
too, since draws are keyed by position), and running requests emit tokens in the very steps in
which a newly admitted long prompt makes prefill progress."""

from __future__ import annotations

import pytest
import torch
from helpers import GREEDY, make_engine, run_to_completion

from mtpserve.workers.engine import Engine
from mtpserve.workers.sampling_params import SamplingParams

SEEDED = SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)


def _engine(path, k: int, mixed: bool, split: bool = False) -> Engine:
    eng = make_engine(path, k, num_kv_blocks=256, mixed_batches=mixed,
                      mixed_prefill_tokens=48)
    # What an engine with compiled decode graphs does: the round and the chunks run as two
    # forwards of one step (here both eager: the outputs do not depend on where they ran).
    eng.split_mixed = split
    return eng


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, 200, (length,), generator=g).tolist()
            for length in (12, 17, 230)[:n]]


def _alone(path, k: int, prompt: list[int], params: SamplingParams) -> list[int]:
    return run_to_completion(_engine(path, k, mixed=False), [prompt], params)[0]


def _burst(path, k: int, mixed: bool, params: list[SamplingParams], split: bool = False
           ) -> tuple[list[list[int]], list[tuple[bool, bool]]]:
    """Two short requests decode; after 3 steps a 230-token prompt arrives. Returns the
    outputs and, per step while the long prompt prefills, (prefill progressed, every running
    request emitted)."""
    eng = _engine(path, k, mixed, split)
    ps = _prompts(3)
    reqs = [eng.add_request(str(i), ps[i], params[i]) for i in range(2)]
    for _ in range(3):
        eng.step()
    long = eng.add_request("long", ps[2], params[2])
    steps = []
    while eng.has_unfinished():
        before = long.num_computed_tokens
        prefilling = not long.output_token_ids
        running = [r.request_id for r in reqs if not r.finished]
        out = eng.step()
        emitted = {o.request_id for o in out if o.new_token_ids}
        if prefilling:
            steps.append((long.num_computed_tokens > before, set(running) <= emitted))
    assert eng.block_manager.num_free_blocks == 256
    return [r.output_token_ids for r in reqs + [long]], steps


@pytest.mark.parametrize(("k", "split"), [(0, False), (2, False), (2, True)])
def test_mixed_greedy_equals_alone_and_decode_never_stalls(default_model, k: int,
                                                           split: bool) -> None:
    params = [GREEDY] * 3
    got, steps = _burst(default_model, k, True, params, split)
    for p, params_i, out in zip(_prompts(3), params, got, strict=True):
        assert out == _alone(default_model, k, p, params_i)
    progressed = [s for s in steps if s[0]]
    assert len(progressed) >= 230 // 48  # the prompt needed several chunks
    assert all(every for _, every in progressed), steps  # decode rode along every chunk
    # Without mixing the same burst has prefill steps in which the running requests stall.
    got_off, steps_off = _burst(default_model, k, False, params)
    assert got_off == got
    assert any(prog and not every for prog, every in steps_off)


@pytest.mark.parametrize("split", [False, True])
def test_mixed_seeded_sampling_equals_alone(default_model, split: bool) -> None:
    params = [SEEDED, GREEDY, SEEDED]
    got, _ = _burst(default_model, 2, True, params, split)
    for p, params_i, out in zip(_prompts(3), params, got, strict=True):
        assert out == _alone(default_model, 2, p, params_i)


@pytest.mark.parametrize("k", [0, 2])
def test_mixed_small_budgets_equal_alternating(tiny_qwen3, k: int) -> None:
    """Many requests, tiny blocks and budgets: chunks shorter than the row width, chunks split
    over several rows, and several chunks riding one round all give the alternating outputs."""
    g = torch.Generator().manual_seed(1)
    ps = [torch.randint(3, 256, (int(n),), generator=g).tolist()
          for n in torch.randint(4, 60, (6,), generator=g)]
    outs = []
    for mixed, budget in ((False, 512), (True, 7), (True, 20)):
        eng = make_engine(tiny_qwen3, k, block_size=4, num_kv_blocks=256,
                          max_num_batched_tokens=7, mixed_batches=mixed,
                          mixed_prefill_tokens=budget)
        outs.append(run_to_completion(eng, ps, GREEDY, check_blocks=True))
        assert eng.block_manager.num_free_blocks == 256
    assert outs[1] == outs[0]
    assert outs[2] == outs[0]
