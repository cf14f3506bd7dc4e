"""Speculation depth: per batch band from the perf model (0 where drafts do not pay), per
request from its own acceptance (capped by the replica's), never for seeded requests; outputs
stay exact (greedy) or unchanged (seeded) while k moves."""

from __future__ import annotations

import torch
from helpers import GREEDY, run_to_completion

from mtpserve.workers.adaptive_k import BANDS, AdaptiveK, band_of, best_k
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.perf_model import PerfModel
from mtpserve.workers.request import Request
from mtpserve.workers.sampling_params import SamplingParams


def test_best_k_follows_acceptance() -> None:
    assert best_k([0.9, 0.9, 0.9], cost_per_draft=0.2) == 3
    assert best_k([0.1, 0.1, 0.1], cost_per_draft=0.3) == 1
    # A good first draft but poor later ones: stop after the first.
    assert best_k([0.9, 0.05, 0.05], cost_per_draft=0.3) == 1


def test_adaptive_k_moves_with_observed_rounds() -> None:
    ak = AdaptiveK(k_max=3, cost_per_draft=0.3, update_every=8)
    assert ak.k == 3
    for _ in range(64):
        ak.observe(num_drafts=ak.k, num_accepted=0)  # every first draft rejected
    assert ak.k == 1
    for _ in range(400):
        ak.observe(num_drafts=ak.k, num_accepted=ak.k)  # everything accepted again
    assert ak.k == 3


def test_band_k_from_the_model_is_zero_at_large_batches() -> None:
    # Drafted tokens are expensive per request (compute bound at large batches).
    ak = AdaptiveK(k_max=3, update_every=1, model=PerfModel([0.01, 0.0005, 0.001, 0.002]))
    for _ in range(50):
        ak.observe(3, 2)  # alpha ~ (1, 1, 0): two of three drafts land
    assert ak.band_k[band_of(1)] >= 2
    assert ak.band_k[band_of(64)] == 0
    assert ak.band_k == sorted(ak.band_k, reverse=True)  # k shrinks as the batch grows
    assert len(ak.band_k) == len(BANDS)


def _req(rid: str, k: int, seed: int | None = None) -> Request:
    return Request(rid, [5, 6, 7], SamplingParams(max_tokens=64, seed=seed),
                   num_speculative_tokens=k)


def test_request_k_follows_its_own_acceptance_and_seeded_k_never_moves() -> None:
    ak = AdaptiveK(k_max=3, update_every=1)
    for _ in range(50):
        ak.observe(3, 3)  # the replica's drafts all land: replica k = 3
    good, bad, seeded = _req("g", 3), _req("b", 3), _req("s", 3, seed=7)
    for r, acc in ((good, 3), (bad, 0), (seeded, 0)):
        r.num_rounds = 40
        r.drafted_per_position = [40, 40 if acc else 0, 40 if acc else 0]
        r.accepted_per_position = [40 if acc else 0] * 3
    assert ak.k_for(good, 1) == 3
    assert ak.k_for(bad, 1) == 1  # its own drafts miss: shallow, under the replica's 3
    assert ak.k_for(seeded, 1) == 3  # seeded: its own k, whatever its acceptance
    ak.band_k = [1] * len(BANDS)  # the replica caps k at 1
    assert ak.k_for(good, 1) == 1 and ak.k_for(seeded, 1) == 3


def _run(path, reqs: list[tuple[list[int], SamplingParams]], **kw) -> tuple[list, Engine]:
    eng = Engine(EngineConfig(model=str(path), num_kv_blocks=512, **kw))
    out = run_to_completion(eng, [p for p, _ in reqs], [sp for _, sp in reqs])
    assert eng.block_manager.num_free_blocks == 512
    return out, eng


def test_outputs_unchanged_while_k_moves(default_model) -> None:
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (6 + 3 * i,), generator=g).tolist() for i in range(6)]
    greedy = GREEDY
    seeded = [SamplingParams(max_tokens=40, temperature=0.8, seed=100 + i, ignore_eos=True)
              for i in range(3)]
    work = [(p, greedy) for p in prompts] + list(zip(prompts[:3], seeded, strict=True))
    plain, _ = _run(default_model, [(p, greedy) for p in prompts], num_speculative_tokens=0)
    fixed, _ = _run(default_model, work, num_speculative_tokens=3, adaptive_k=False)
    # A model that makes k change with the batch (k = 0 at batch >= 4) and frequent updates.
    eng_kw = dict(num_speculative_tokens=3, adaptive_k=True)
    eng = Engine(EngineConfig(model=str(default_model), num_kv_blocks=512, **eng_kw))
    eng.adaptive.model = PerfModel([0.01, 0.0005, 0.004, 0.003])
    eng.adaptive.update_every = 2
    seen_k = set()
    reqs = [eng.add_request(str(i), p, sp) for i, (p, sp) in enumerate(work)]
    while eng.has_unfinished():
        eng.step()
        seen_k.add(eng.adaptive.k)
    got = [r.output_token_ids for r in reqs]
    assert 0 in seen_k and len(seen_k) >= 2, f"k never moved: {seen_k}"
    assert got[:6] == plain == fixed[:6]  # greedy: exact for every k
    assert got[6:] == fixed[6:]  # seeded: kept their k, so the same tokens


def test_exploring_rounds_try_a_neighbouring_k_except_for_seeded_requests() -> None:
    ak = AdaptiveK(k_max=2, update_every=1, explore_every=4)
    for _ in range(50):
        ak.observe(2, 0)  # nothing lands
    ak.band_k = [0] * len(BANDS)  # the replica runs k = 0
    plain, seeded = _req("p", 2), _req("s", 2, seed=3)
    plain.num_rounds = seeded.num_rounds = 40
    seen = []
    for step in range(16):
        ak.round_index = step
        seen.append(ak.k_for(plain, 1))
        assert ak.k_for(seeded, 1) == 2  # its own k, always
    # Rounds 3, 7, 11, 15 explore; from k = 0 the only neighbour is 1.
    assert seen == [0, 0, 0, 1] * 4
    ak.band_k = [2] * len(BANDS)
    for _ in range(50):
        ak.observe(2, 2)  # everything lands: k = 2, the request's own cap
    plain.drafted_per_position = plain.accepted_per_position = [40, 40]
    seen = []
    for step in range(16):
        ak.round_index = step
        seen.append(ak.k_for(plain, 1))
    assert seen == [2, 2, 2, 1] * 4  # above 2 is past the request's k: one less instead
    ak.explore_every = 0
    assert all(ak.k_for(plain, 1) == 2 for ak.round_index in range(16))
