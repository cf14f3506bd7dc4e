"""Rejection sampler: crafted logits, keyed randomness, and the output distribution equals the
target's at every position of a round, bonus token included."""

from __future__ import annotations

import pytest
import torch

from workers.sampling_params import SamplingParams
from workers.spec.rejection_sampler import RejectionSampler
from workers.spec.sampling import processed_probs

GREEDY = SamplingParams(temperature=0)


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


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.7, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.8),
])
def test_every_position_follows_the_target(params: SamplingParams) -> None:
    """k = 3, fixed target conditionals, drafts from a different q: the token emitted at each
    position (given the round reached it), bonus included, follows processed p there. One
    batch row per trial; seeds differ per row, positions are shared."""
    V, N, k = 6, 12000, 3
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(k + 1, V, generator=g) * 1.5
    p = processed_probs(p_logits, [params] * (k + 1))  # [k+1, V]
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)  # [k, V]
    drafts = torch.stack([torch.multinomial(q[i], N, replacement=True, generator=g)
                          for i in range(k)], 1)  # [N, k]
    res = RejectionSampler()(p_logits.expand(N, -1, -1), drafts.tolist(), [q] * N,
                             [params] * N, list(range(N)), [50] * N)
    out = res.output_token_ids
    acc = torch.tensor(res.num_accepted)
    noise = (V - 1) / (2 * N) ** 0.5  # ~ expected TV of N direct samples, generously
    for pos in range(k + 1):
        reached = [o[pos] for o, a in zip(out, acc.tolist(), strict=True) if a >= pos]
        c = torch.bincount(torch.tensor(reached), minlength=V).float()
        bound = noise * (N / len(reached)) ** 0.5
        assert tv(c, p[pos]) < bound, (pos, tv(c, p[pos]), bound)
    assert (acc == k).any(), "the bonus position was never reached"
    # A sampler that always kept the draft would fail the same check.
    assert tv(torch.bincount(drafts[:, 0], minlength=V).float(), p[0]) > noise
