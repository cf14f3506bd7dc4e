"""End to end: with speculation (drafts sampled from the MTP head's q, verified by rejection
sampling) the engine's sampled tokens follow the target model's distribution at every output
position (first token, accepted drafts, recovered and bonus tokens), for several sampling
settings and with requests of different k in one batch. A tiny-vocabulary model keeps the
exact marginals cheap to enumerate."""

from __future__ import annotations

import functools

import pytest
import torch
from test_rejection_sampler import chi2

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.spec_decode.sampling import processed_probs

PROMPT = [1, 4, 3, 2]
NUM_POS = 5  # output positions checked: the first token, then up to 3 drafts + bonus


def exact_marginals(path, params: SamplingParams, num_pos: int,
                    banned: tuple[int, ...] = ()) -> list[torch.Tensor]:
    """Marginal of each of the first `num_pos` generated tokens under plain sampling, with
    `banned` tokens impossible (min_tokens covering all of them)."""
    model = load_model(path)

    @functools.cache
    def probs(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            h = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
            logits = model.compute_logits(h[:, -1])
            logits[:, list(banned)] = float("-inf")
            return processed_probs(logits, [params])[0].double()

    out = [torch.zeros(model.config.vocab_size, dtype=torch.float64) for _ in range(num_pos)]

    def walk(prefix: tuple[int, ...], mass: float, depth: int) -> None:
        p = probs(prefix)
        out[depth] += mass * p
        if depth + 1 < num_pos:
            for t in (p > 0).nonzero().flatten().tolist():
                walk(prefix + (t,), mass * float(p[t]), depth + 1)

    walk(tuple(PROMPT), 1.0, 0)
    return out


def sample_many(path, params: SamplingParams, n: int, seed0: int, **engine_kw) -> list:
    """n seeded requests of PROMPT with k = 1, 2, 3 side by side in every round, run to
    NUM_POS tokens; checks every KV block came back."""
    eng = Engine(EngineConfig(model=str(path), num_speculative_tokens=3, num_kv_blocks=8192,
                              block_size=4, max_num_seqs=n, max_num_batched_tokens=4096,
                              **engine_kw))
    reqs = []
    for i in range(n):
        kw = dict(params.__dict__, max_tokens=NUM_POS, seed=seed0 + i,
                  num_speculative_tokens=1 + i % 3)
        reqs.append(eng.add_request(f"s{i}", PROMPT, SamplingParams(**kw)))
    while eng.has_unfinished():
        eng.step()
    assert eng.block_manager.num_free_blocks == 8192
    assert all(r.num_output_tokens == NUM_POS for r in reqs)
    return reqs


def assert_matches(reqs: list, exact: list[torch.Tensor]) -> None:
    for pos in range(NUM_POS):
        # Chi-square against the exact marginal (false alarm rate 1e-6 per check); it also
        # asserts that no token outside the target's support appears (a q/p mix-up).
        stat, limit = chi2(torch.tensor([r.output_token_ids[pos] for r in reqs]),
                           exact[pos].float())
        assert stat < limit, (pos, stat, limit)


@pytest.mark.parametrize("params,banned", [
    (SamplingParams(temperature=0.7, top_k=3, ignore_eos=True), ()),
    (SamplingParams(temperature=1.3, top_p=0.6, ignore_eos=True), ()),
    # min_tokens bans EOS (id 2) and the stop token on p and q alike: still exact.
    (SamplingParams(temperature=1.0, min_tokens=NUM_POS, stop_token_ids=(4,)), (2, 4)),
], ids=["T0.7-topk", "T1.3-topp", "min_tokens"])
def test_every_position_matches_the_target(tiny_factory, params: SamplingParams,
                                           banned: tuple[int, ...]) -> None:
    path = tiny_factory(vocab_size=6, seed=5)  # small V: q overlaps p, drafts get accepted
    n = 2400
    exact = exact_marginals(path, params, NUM_POS, banned)
    reqs = sample_many(path, params, n, seed0=10_000)
    # Every path was exercised: drafts accepted at each depth, so bonus tokens too.
    for k in (1, 2, 3):
        group = [r for r in reqs if r.num_speculative_tokens == k]
        assert sum(r.accepted_per_position[k - 1] for r in group) > 20
    assert_matches(reqs, exact)

def test_a_row_without_top_p_ignores_the_batch_filters() -> None:
    """top-p of one row must not touch another: float32 cumulative sums reach 1.0 before the
    vocabulary's tail, and a `>= top_p` test with top_p = 1 would then drop that tail (the
    target distribution changes, and a seeded request's tokens depend on its neighbours)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 32000, generator=g) * 3
    rows = [SamplingParams(top_p=0.9), SamplingParams(), SamplingParams(top_k=50)]
    batched = processed_probs(logits, rows)
    for i in (1, 2):
        alone = processed_probs(logits[i : i + 1], [rows[i]])
        assert torch.equal(batched[i], alone[0]), i
    assert (batched[1] > 0).all()  # softmax of finite logits: every token stays possible
