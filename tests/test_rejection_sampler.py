"""Rejection sampler: crafted logits, and the output distribution equals the target's."""

from __future__ import annotations

import torch

from workers.sampling_params import SamplingParams
from workers.spec.rejection_sampler import PLACEHOLDER_TOKEN_ID, RejectionSampler

GREEDY = SamplingParams(temperature=0)


def one_hot_logits(ids: list[int], V: int = 8) -> torch.Tensor:
    x = torch.full((len(ids), V), -10.0)
    x[torch.arange(len(ids)), torch.tensor(ids)] = 10.0
    return x


def run_greedy(target: list[int], drafts: list[int]):
    rs = RejectionSampler()
    logits = one_hot_logits(target).unsqueeze(0)
    d = torch.tensor(
        [drafts + [PLACEHOLDER_TOKEN_ID] * (len(target) - 1 - len(drafts))], dtype=torch.long
    ).view(1, len(target) - 1)
    return rs(logits, d, None, [len(drafts)], [GREEDY], [None])


def test_greedy_all_accepted_plus_bonus() -> None:
    r = run_greedy([1, 2, 3, 4], [1, 2, 3])
    assert r.num_accepted == [3]
    assert r.output_token_ids.tolist() == [[1, 2, 3, 4]]


def test_greedy_first_rejected() -> None:
    r = run_greedy([1, 2, 3, 4], [5, 2, 3])
    assert r.num_accepted == [0]
    assert r.output_token_ids.tolist() == [[1, -1, -1, -1]]


def test_greedy_middle_rejected() -> None:
    r = run_greedy([1, 2, 3, 4], [1, 6, 3])
    assert r.num_accepted == [1]
    assert r.output_token_ids.tolist() == [[1, 2, -1, -1]]


def test_k0_is_plain_decoding() -> None:
    r = run_greedy([5], [])
    assert r.num_accepted == [0] and r.output_token_ids.tolist() == [[5]]


def test_batch_with_different_k_and_mixed_modes() -> None:
    rs = RejectionSampler()
    logits = torch.stack([one_hot_logits([1, 2, 3]), one_hot_logits([4, 5, 6])])
    drafts = torch.tensor([[1, PLACEHOLDER_TOKEN_ID], [4, 5]])
    q = torch.zeros(2, 2, 8)
    q[1, 0, 4] = q[1, 1, 5] = 1.0  # the sampled row drafted 4, 5 with certainty
    sampled = SamplingParams(temperature=1.0)
    r = rs(logits, drafts, q, [1, 2], [GREEDY, sampled], [None, torch.Generator()])
    assert r.num_accepted[0] == 1
    assert r.output_token_ids[0].tolist() == [1, 2, -1]
    # p puts ~all mass on the drafted tokens, so both drafts are kept (p/q ~ 1).
    assert r.num_accepted[1] == 2 and r.output_token_ids[1, :2].tolist() == [4, 5]


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def test_speculative_sampling_keeps_the_target_distribution() -> None:
    """Tokens at each of positions 0..2 of a k=2 round follow the target's conditionals.

    The draft distribution q deliberately differs from p; we compare the TV distance to p
    with the TV distance of the same number of direct samples from p (sampling noise)."""
    V, N, k = 6, 20000, 2
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(k + 1, V, generator=g) * 1.5
    p = torch.softmax(p_logits, -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.5, -1)
    # Drafts are sampled from q; position-1 target/draft do not depend on the draft here
    # (the target conditionals are fixed), which is what the sampler may assume per round.
    d0 = torch.multinomial(q[0], N, replacement=True, generator=g)
    d1 = torch.multinomial(q[1], N, replacement=True, generator=g)
    drafts = torch.stack([d0, d1], 1)
    rs = RejectionSampler()
    params = [SamplingParams(temperature=1.0)] * N
    res = rs(p_logits.expand(N, -1, -1), drafts, q.expand(N, -1, -1), [k] * N, params, [None] * N)
    out = res.output_token_ids
    first = torch.bincount(out[:, 0], minlength=V).float()
    direct = torch.bincount(
        torch.multinomial(p[0], N, replacement=True, generator=g), minlength=V
    ).float()
    noise = tv(direct, p[0])
    assert tv(first, p[0]) < 3 * noise + 0.01, (tv(first, p[0]), noise)
    # Position 1 where position 0 was accepted must follow p[1].
    second = out[torch.tensor(res.num_accepted) >= 1, 1]
    c2 = torch.bincount(second, minlength=V).float()
    assert tv(c2, p[1]) < 0.03
    # A deliberately wrong sampler (always keep the draft) must fail the same check.
    assert tv(torch.bincount(d0, minlength=V).float(), p[0]) > 3 * noise + 0.01
