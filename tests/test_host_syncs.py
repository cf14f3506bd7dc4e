"""One host sync per speculative round (issue 33 item 7), counted on CPU.

Every device -> host read of the engine's hot path goes through `workers.host_sync.to_host`,
which counts it (`HOST_SYNCS`). A decode round must make exactly one: its accepted ids, with
the recovered / bonus tokens and the drafts the previous chain left on the device. A torch
function mode checks the other half of the claim: no value read (`.tolist()`, `.item()`,
`bool(t)`, ...) and no host-data tensor built on a device from the engine's hot-path files
bypasses it. On a GPU, `benchmarks/gpu_check.py` counts the same with CUDA sync debug mode.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import make_engine
from torch.overrides import TorchFunctionMode

import mtpserve.workers as workers_pkg
from mtpserve.workers.host_sync import HOST_SYNCS, to_host
from mtpserve.workers.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3, 250, 7, 42, 8, 1, 77, 31], [3, 4, 5, 6, 7, 8],
           [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111, 112, 113]]
_WORKERS = Path(workers_pkg.__file__).parent
# The files a decode round runs through that handle device tensors (the model's own files
# build host metadata from host tensors: attention_metadata.py, decode_graph.py).
HOT_FILES = {str(_WORKERS / f) for f in (
    "engine.py", "round_outcomes.py", "model_runner.py", "outputs.py",
    "spec_decode/mtp_proposer.py", "spec_decode/rejection_sampler.py",
    "spec_decode/sampling.py", "spec_decode/keyed_random.py",
    "spec_decode/device_drafts.py")}


class _Bypasses(TorchFunctionMode):
    """Records, from `HOT_FILES`, reads of tensor values into Python and tensors built from
    host data on a named device: on CUDA each is a sync unless it goes through `to_host` /
    the staged copies."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy",
             "cpu", "equal"}
    BUILDS = {"tensor", "as_tensor"}

    def __init__(self) -> None:
        super().__init__()
        self.sites: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in self.READS or (name in self.BUILDS and "device" in kwargs):
            frame = sys._getframe(1)
            if frame.f_code.co_filename in HOT_FILES:
                self.sites.append(f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno} "
                                  f"{name}")
        return func(*args, **kwargs)


def _decode_rounds(engine, params: SamplingParams) -> tuple[list[dict], list[str], list]:
    """Admit PROMPTS, run the prefill steps, then every decode round: the syncs of each
    round by reason, the bypassing reads seen during the rounds, and the outputs."""
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    while engine.scheduler.waiting or engine.scheduler.prefilling:
        engine.step()
    rounds, bypass = [], _Bypasses()
    with bypass:
        while engine.has_unfinished():
            before = HOST_SYNCS.snapshot()
            engine.step()
            rounds.append(dict(HOST_SYNCS.snapshot() - before))
    return rounds, bypass.sites, [r.output_token_ids for r in reqs]


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_one_host_sync_per_round(tiny_qwen3, k: int, temperature: float) -> None:
    params = SamplingParams(max_tokens=16, temperature=temperature, seed=11, ignore_eos=True)
    rounds, bypass, out = _decode_rounds(
        make_engine(tiny_qwen3, k, num_kv_blocks=256, block_size=4), params)
    assert len(rounds) >= 16 // (k + 1)
    assert all(r == {"accepted ids": 1} for r in rounds), rounds
    assert bypass == []
    # The drafts the host learnt with the accepted ids are the ones that were verified: the
    # output is the plain (k = 0) engine's for greedy, and a seeded request's own (alone).
    if temperature == 0.0:
        _, _, plain = _decode_rounds(make_engine(tiny_qwen3, 0, num_kv_blocks=256,
                                                 block_size=4), params)
        assert out == plain
    else:
        eng = make_engine(tiny_qwen3, k, num_kv_blocks=256, block_size=4)
        alone = eng.add_request("alone", PROMPTS[1], params)
        while eng.has_unfinished():
            eng.step()
        assert out[1] == alone.output_token_ids


def test_mixed_greedy_and_seeded_rows_share_the_sync(tiny_qwen3) -> None:
    """Greedy and sampled rows of one round (different k): still one copy for the round."""
    eng = make_engine(tiny_qwen3, 3, num_kv_blocks=256, block_size=4)
    mixed = [SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=14, temperature=0.9, top_p=0.9, seed=3,
                            num_speculative_tokens=2, ignore_eos=True),
             SamplingParams(max_tokens=14, temperature=1.1, top_k=20, seed=4, ignore_eos=True)]
    for i, (p, sp) in enumerate(zip(PROMPTS, mixed, strict=True)):
        eng.add_request(f"m{i}", p, sp)
    while eng.scheduler.waiting or eng.scheduler.prefilling:
        eng.step()
    bypass = _Bypasses()
    with bypass:
        while eng.has_unfinished():
            before = HOST_SYNCS.snapshot()
            eng.step()
            assert dict(HOST_SYNCS.snapshot() - before) == {"accepted ids": 1}
    assert bypass.sites == []


def test_to_host_is_one_counted_copy() -> None:
    before = HOST_SYNCS.snapshot()
    a, b, c = to_host([torch.tensor([3, 1]), torch.arange(6).view(2, 3),
                       torch.tensor(7)], "test")
    assert (a, b, c) == ([3, 1], [[0, 1, 2], [3, 4, 5]], 7)
    assert dict(HOST_SYNCS.snapshot() - before) == {"test": 1}
    assert to_host([torch.zeros(2, 0, dtype=torch.long)], "test") == [[[], []]]


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_a_prompt_finishing_in_a_round_shares_its_sync(tiny_qwen3, temperature) -> None:
    """Mixed batches: a prompt whose last chunk rides along a decode round gets its first
    token in the round's one copy; every request's tokens are what it makes alone."""
    params = SamplingParams(max_tokens=12, temperature=temperature, seed=5, ignore_eos=True)
    eng = make_engine(tiny_qwen3, 2, num_kv_blocks=256, block_size=4)
    first = eng.add_request("first", PROMPTS[0], params)
    eng.step()  # its prefill; it decodes from the next step on
    late = eng.add_request("late", PROMPTS[2], params)
    mixed = 0
    while eng.has_unfinished():
        chunks = bool(eng.scheduler.waiting or eng.scheduler.prefilling)
        before = HOST_SYNCS.snapshot()
        eng.step()
        assert dict(HOST_SYNCS.snapshot() - before) == {"accepted ids": 1}
        mixed += chunks
    assert mixed >= 1 and late.output_token_ids
    for req, prompt in ((first, PROMPTS[0]), (late, PROMPTS[2])):
        alone = make_engine(tiny_qwen3, 2, num_kv_blocks=256, block_size=4)
        r = alone.add_request("alone", prompt, params)
        while alone.has_unfinished():
            alone.step()
        assert req.output_token_ids == r.output_token_ids


def test_compiled_rounds_make_one_sync(tiny_qwen3, compiled_decode,
                                       compile_as_configured) -> None:
    """The compiled decode graphs a server runs (conftest's cached set, loaded): their
    rounds feed the drafts from the device too, one sync each, the eager engine's tokens."""
    from helpers import COMPILED_DECODE

    from mtpserve.workers.engine import Engine, EngineConfig

    eng = Engine(EngineConfig(model=str(tiny_qwen3), role="decode", compile="on",
                              compile_cache_dir=str(compiled_decode.cache_dir),
                              warmup_budget_s=600, **COMPILED_DECODE))
    runner, replays = eng.runner, []
    run_graph = runner._run_graph
    runner._run_graph = lambda inp, prev: replays.append(inp.key) or run_graph(inp, prev)
    eager = Engine(EngineConfig(model=str(tiny_qwen3), compile="off", **COMPILED_DECODE))
    for temperature in (0.0, 0.8):
        params = SamplingParams(max_tokens=20, temperature=temperature, seed=3,
                                ignore_eos=True)
        got = []
        for e in (eng, eager):
            req = e.add_request(f"c{temperature}", PROMPTS[0], params)
            while e.scheduler.waiting or e.scheduler.prefilling:
                e.step()
            while e.has_unfinished():
                before = HOST_SYNCS.snapshot()
                e.step()
                assert dict(HOST_SYNCS.snapshot() - before) == {"accepted ids": 1}
            got.append(req.output_token_ids)
        assert got[0] == got[1]
    assert {k.kind for k in replays} == {"main", "mtp"}  # verify and extend ran as graphs
