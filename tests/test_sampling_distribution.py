"""End to end: with speculation (drafts sampled from the MTP head's q, verified by rejection
sampling) the engine's sampled tokens follow the target model's distribution."""

from __future__ import annotations

import torch

from workers.engine import Engine, EngineConfig
from workers.model.loader import load_model
from workers.sampling_params import SamplingParams
from workers.spec.sampling import processed_probs

PROMPT = [11, 42, 7, 99]
TOP_K = 6  # small support so a few thousand samples pin the distribution down


def exact_second_token(path) -> torch.Tensor:
    """Marginal of the 2nd generated token: sum_t1 p(t1) p(t2 | t1) under top-k sampling."""
    model = load_model(path)
    params = [SamplingParams(temperature=1.0, top_k=TOP_K)]
    with torch.no_grad():
        def probs(ids: list[int]) -> torch.Tensor:
            h = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
            return processed_probs(model.compute_logits(h[:, -1]), params)[0]

        p1 = probs(PROMPT)
        out = torch.zeros_like(p1)
        for t1 in p1.nonzero().flatten().tolist():
            out += p1[t1] * probs(PROMPT + [t1])
    return out


def sample_second_tokens(path, k: int, n: int) -> torch.Tensor:
    eng = Engine(EngineConfig(model=str(path), num_speculative_tokens=k, num_kv_blocks=4096,
                              block_size=4, max_num_seqs=256, max_num_batched_tokens=1024))
    counts = torch.zeros(eng.model_config.vocab_size)
    reqs = [eng.add_request(f"s{i}", PROMPT, SamplingParams(
        max_tokens=4, temperature=1.0, top_k=TOP_K, seed=1000 + i, ignore_eos=True))
        for i in range(n)]
    while eng.has_unfinished():
        eng.step()
    for r in reqs:
        counts[r.output_token_ids[1]] += 1
    if k:  # the 2nd token really went through verification of sampled drafts
        assert all(r.drafted_per_position[0] >= 1 for r in reqs)
    assert eng.block_manager.num_free_blocks == 4096
    return counts


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def test_speculative_sampling_matches_the_target(tiny_qwen3) -> None:
    n = 3000
    exact = exact_second_token(tiny_qwen3)
    spec = sample_second_tokens(tiny_qwen3, k=2, n=n)
    g = torch.Generator().manual_seed(0)
    direct = torch.bincount(torch.multinomial(exact, n, replacement=True, generator=g),
                            minlength=len(exact)).float()
    noise = tv(direct, exact)
    assert tv(spec, exact) < 2.5 * noise + 0.01, (tv(spec, exact), noise)
    # Tokens outside the target's support never appear (a q/p mix-up would leak them).
    assert spec[exact == 0].sum() == 0
