"""Rejection sampler: crafted logits, keyed randomness, and the output distribution equals the
target's at every position of a round, bonus token included."""

from __future__ import annotations

import pytest
import torch
from helpers import GREEDY

from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.spec_decode.keyed_random import (
    SLOT_ACCEPT,
    SLOT_DRAFT,
    SLOT_FINAL,
    fold_seed,
    keyed_uniforms,
    uniform_table,
)
from mtpserve.workers.spec_decode.rejection_sampler import RejectionSampler
from mtpserve.workers.spec_decode.sampling import processed_probs, sample_with_uniforms


def one_hot_logits(ids: list[int], V: int = 8) -> torch.Tensor:
    x = torch.full((len(ids), V), -10.0)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return x


def run_greedy(target: list[int], drafts: list[int]):
    logits = one_hot_logits(target).unsqueeze(0)
    return RejectionSampler()(logits, [drafts], [None], [GREEDY], [0], [10])


def test_greedy_all_accepted_plus_bonus() -> None:
    r = run_greedy([1, 2, 3, 4], [1, 2, 3])
    assert r.num_accepted == [3] and r.output_token_ids == [[1, 2, 3, 4]]


def test_greedy_first_rejected() -> None:
    r = run_greedy([1, 2, 3, 4], [5, 2, 3])
    assert r.num_accepted == [0] and r.output_token_ids == [[1]]


def test_greedy_middle_rejected() -> None:
    r = run_greedy([1, 2, 3, 4], [1, 6, 3])
    assert r.num_accepted == [1] and r.output_token_ids == [[1, 2]]


def test_k0_is_plain_decoding() -> None:
    r = run_greedy([5], [])
    assert r.num_accepted == [0] and r.output_token_ids == [[5]]


def test_batch_with_different_k_and_mixed_modes() -> None:
    logits = torch.stack([one_hot_logits([1, 2, 3]), one_hot_logits([4, 5, 6])])
    q = torch.zeros(2, 8)
    q[0, 4] = q[1, 5] = 1.0  # the sampled row drafted 4, 5 with certainty
    sampled = SamplingParams(temperature=1.0)
    r = RejectionSampler()(logits, [[1], [4, 5]], [None, q], [GREEDY, sampled], [0, 1], [3, 3])
    assert r.num_accepted[0] == 1 and r.output_token_ids[0] == [1, 2]
    # p puts ~all mass on the drafted tokens, so both drafts are kept (p/q ~ 1).
    assert r.num_accepted[1] == 2 and r.output_token_ids[1][:2] == [4, 5]


def test_a_row_does_not_depend_on_the_batch() -> None:
    """Same seed and position: the same result alone, next to a longer-k row, anywhere in the
    batch (draws are keyed, not consumed from a stream sized by the batch's max k)."""
    g = torch.Generator().manual_seed(3)
    V = 12
    logits = torch.randn(3, V, generator=g)
    q = torch.softmax(torch.randn(2, V, generator=g), -1)
    params = SamplingParams(temperature=1.0)
    rs = RejectionSampler()
    for seed in range(20):
        alone = rs(logits.unsqueeze(0), [[3, 7]], [q], [params], [seed], [40])
        other = torch.randn(6, V, generator=g)
        q_other = torch.softmax(torch.randn(5, V, generator=g), -1)
        big = torch.stack([torch.cat([logits, torch.zeros(3, V)]), other])
        mixed = rs(big, [[3, 7], [1, 2, 3, 4, 5]], [q, q_other], [params, params],
                   [seed, 99], [40, 7])
        swapped = rs(big.flip(0), [[1, 2, 3, 4, 5], [3, 7]], [q_other, q], [params, params],
                     [99, seed], [7, 40])
        assert alone.output_token_ids[0] == mixed.output_token_ids[0]
        assert alone.output_token_ids[0] == swapped.output_token_ids[1]


def _splitmix_ref(x: int) -> int:
    """splitmix64's finaliser on Python ints (uint64), the reference for the torch version."""
    m = (1 << 64) - 1
    z = (x + 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return z ^ (z >> 31)


def test_keyed_uniforms_are_splitmix_bit_for_bit() -> None:
    keys = [(0, 0, 0), (1234, 57, SLOT_DRAFT + 3), (-3, 10**6, 129), (2**70 + 5, 4095, 64),
            (2**63 - 1, 2**40, 191)]
    got = keyed_uniforms(torch.tensor([fold_seed(s) for s, _, _ in keys]),
                         torch.tensor([p for _, p, _ in keys]),
                         torch.tensor([sl for _, _, sl in keys]))
    for (seed, pos, slot), u in zip(keys, got.tolist(), strict=True):
        h = _splitmix_ref(seed % (1 << 64))
        h = _splitmix_ref(h ^ pos)
        h = _splitmix_ref(h ^ slot)
        assert u == ((h >> 11) + 0.5) / (1 << 53), (seed, pos, slot)


@pytest.mark.parametrize("rows", [1, 3, 40])  # Python-int draws, then numpy past 16
def test_host_uniform_tables_match_the_device_hash(rows: int) -> None:
    """The engine draws its uniforms on the host (`uniform_table`): the same bits as
    `keyed_uniforms` at (seed, position + d, slot + step * d), extreme seeds included."""
    g = torch.Generator().manual_seed(rows)
    seeds = [fold_seed(s) for s in (2**63 - 1, -(2**63), -1, 0)][:rows]
    seeds += torch.randint(-(2**62), 2**62, (rows - len(seeds),), generator=g).tolist()
    positions = torch.randint(0, 2**40, (rows,), generator=g).tolist()
    for width, slot, step in [(1, SLOT_FINAL, 0), (3, SLOT_ACCEPT + 1, 1), (4, SLOT_FINAL, 0)]:
        got = uniform_table(seeds, positions, width, slot, step)
        depth = torch.arange(width).unsqueeze(0)
        want = keyed_uniforms(torch.tensor(seeds).unsqueeze(1),
                              torch.tensor(positions).unsqueeze(1) + depth, slot + step * depth)
        assert got.dtype == torch.float64 and torch.equal(got, want), (width, slot)


def test_keyed_uniforms_look_independent() -> None:
    """Uniform on (0, 1), and uncorrelated between the slots one position uses (draft,
    acceptance, final), between neighbouring positions and between consecutive seeds."""
    n = 100_000
    pos = torch.arange(n)
    u = {s: keyed_uniforms(torch.tensor(7), pos, s)
         for s in (SLOT_FINAL, SLOT_DRAFT + 1, SLOT_ACCEPT + 1)}
    u["next_seed"] = keyed_uniforms(torch.tensor(8), pos, SLOT_FINAL)
    for x in u.values():
        assert 0 < x.min() and x.max() < 1
        stat, limit = chi2((x * 20).long(), torch.full((20,), 0.05))
        assert stat < limit
    pairs = [(u[SLOT_FINAL], u[SLOT_DRAFT + 1]), (u[SLOT_DRAFT + 1], u[SLOT_ACCEPT + 1]),
             (u[SLOT_FINAL][1:], u[SLOT_FINAL][:-1]), (u[SLOT_FINAL], u["next_seed"])]
    for a, b in pairs:
        r = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
        assert abs(r) < 5 / n**0.5, r


def test_sampled_drafts_without_q_are_refused() -> None:
    """A missing q would make every draft p allows look certain (u * 0 < p): fail loudly."""
    logits = torch.randn(1, 3, 8)
    with pytest.raises(AssertionError, match="without their q"):
        RejectionSampler()(logits, [[1, 2]], [None], [SamplingParams(temperature=1.0)], [0],
                           [5])


def chi2_limit(df: int, z: float = 4.753) -> float:
    """Upper 1e-6 quantile of chi-square with `df` degrees of freedom (Wilson-Hilferty), so a
    correct sampler fails one check in a million."""
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def chi2(samples: torch.Tensor, p: torch.Tensor) -> tuple[float, float]:
    """Pearson's statistic of `samples` against `p`, and its limit. Tokens expected fewer than
    5 times share one bin (the chi-square approximation needs that); tokens outside p's
    support must not occur at all."""
    counts = torch.bincount(samples, minlength=len(p)).double()
    assert counts[p == 0].sum() == 0, "a token outside the target's support"
    expected = p.double() * len(samples)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[(p > 0) & ~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[(p > 0) & ~big].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, chi2_limit(max(int(keep.sum()) - 1, 1))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
], ids=["T1", "T0.7-topk", "T1.3-topp"])
def test_every_position_follows_the_target(params: SamplingParams) -> None:
    """k = 3, fixed target conditionals, drafts from a different q: the token emitted at each
    position (given the round reached it), bonus included, follows processed p there. One
    batch row per trial; seeds differ per row, positions are shared. A chi-square test (not a
    loose TV bound): it catches correlated draws, e.g. one acceptance uniform shared by all
    depths of a round, which biases every depth after the first by a few percent."""
    V, N, k = 6, 20000, 3
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(k + 1, V, generator=g)
    p = processed_probs(p_logits, [params] * (k + 1))  # [k+1, V]
    q = torch.softmax(torch.randn(k, V, generator=g), -1)  # [k, V]
    # Drafts drawn as MTPProposer draws them: draft i decides position 50 + i - 1, keyed
    # (seed, that position, SLOT_DRAFT + i); a slot clash with acceptance would show here.
    seeds = torch.arange(N)
    drafts = torch.stack([sample_with_uniforms(q[i].expand(N, V), keyed_uniforms(
        seeds, torch.tensor(50 + i), SLOT_DRAFT + 1 + i)) for i in range(k)], 1)  # [N, k]
    res = RejectionSampler()(p_logits.expand(N, -1, -1), drafts.tolist(), [q] * N,
                             [params] * N, seeds.tolist(), [50] * N)
    out = torch.tensor([o + [-1] * (k + 1 - len(o)) for o in res.output_token_ids])  # [N, k+1]
    acc = torch.tensor(res.num_accepted)  # [N]
    for pos in range(k + 1):
        reached = out[acc >= pos, pos]
        assert len(reached) > N // 20, (pos, len(reached))  # every depth, bonus included
        stat, limit = chi2(reached, p[pos])
        assert stat < limit, (pos, stat, limit)
    # Drafts are accepted and rejected at every depth, so each depth's test has work to do.
    for i in range(k):
        reached = acc >= i
        assert 0.1 < (acc[reached] > i).double().mean() < 0.9, i
    # The check has power: the drafts themselves (a sampler that always kept them) fail it.
    draft_counts = torch.bincount(drafts[:, 0], minlength=V).double()
    expected = p[0].double() * N
    support = expected > 0
    stat = ((draft_counts - expected)[support] ** 2 / expected[support]).sum().item()
    assert stat > 10 * chi2_limit(int(support.sum()) - 1)
