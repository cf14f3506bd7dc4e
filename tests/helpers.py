"""What many tests share: one greedy setting, one engine factory, one run-until-done loop.

Tests import it as `from helpers import ...` (conftest puts this folder on sys.path)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from mtpserve.workers.engine import Engine, EngineConfig, RequestOutput
from mtpserve.workers.sampling_params import SamplingParams


def greedy(max_tokens: int = 40, **kw) -> SamplingParams:
    """Greedy decoding of exactly `max_tokens` tokens (EOS ignored, so lengths are fixed and
    outputs compare token for token)."""
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


GREEDY = greedy()

# The decode settings of conftest's `compiled_decode`: one sequence, k = 1, a small pool, a
# 128-token window (one block-table bucket: 4 graphs, not 12). Compiling a graph costs 10-50 s
# on 2 shared cores, so the suite compiles this set once and every compiled test with these
# settings loads it from that fixture's cache.
COMPILED_DECODE = dict(num_speculative_tokens=1, num_kv_blocks=48, block_size=4, max_num_seqs=1,
                       max_model_len=128)


def make_engine(model: str | Path, k: int = 2, **kw) -> Engine:
    """An offline engine on `model` with `k` speculative tokens; `kw` are EngineConfig
    fields."""
    return Engine(EngineConfig(model=str(model), num_speculative_tokens=k, **kw))


def drain(eng: Engine, check_blocks: bool = False) -> list[RequestOutput]:
    """Step `eng` until every request finished; the outputs of every step, in order.
    `check_blocks`: check the block manager's integrity after every step."""
    outs: list[RequestOutput] = []
    while eng.has_unfinished():
        outs += eng.step()
        if check_blocks:
            eng.block_manager.check_integrity(eng.scheduler.running + eng.scheduler.prefilling)
    return outs


def run_to_completion(eng: Engine, prompts: Sequence[list[int]],
                      params: SamplingParams | Sequence[SamplingParams] = GREEDY,
                      prefix: str = "r", check_blocks: bool = False) -> list[list[int]]:
    """Submit `prompts` together (ids `{prefix}{i}`; one params for all or one each), step
    until done; each request's output token ids."""
    each = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    reqs = [eng.add_request(f"{prefix}{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, each, strict=True))]
    drain(eng, check_blocks)
    return [r.output_token_ids for r in reqs]
