"""Greedy speculative decoding is exact: k = 0..3 give the same tokens as each other and as
`transformers.generate` on the same weights (fp32), and batching does not change outputs."""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import greedy, make_engine, run_to_completion

from mtpserve.workers.tokenizer import load_tokenizer
from mtpserve.workers.training.prompts import held_out_prompts

NUM_PROMPTS, NEW_TOKENS = 16, 64
GREEDY = greedy(NEW_TOKENS)


def _prompt_ids(path) -> list[list[int]]:
    if (path / "tokenizer.json").is_file():
        tok = load_tokenizer(str(path))
        return [tok.encode(p)[:96] for p in held_out_prompts(NUM_PROMPTS)]
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 256, (8 + 5 * i,), generator=g).tolist()
            for i in range(NUM_PROMPTS)]


def _run(path, k: int, ps: list[list[int]], **kw) -> list[list[int]]:
    eng = make_engine(path, k, num_kv_blocks=512, **kw)
    # Compiles what these prompts hit when graphs are on (MTPSERVE_COMPILE=on); eager: no-op.
    eng.warmup(len(ps), max(len(p) for p in ps) + NEW_TOKENS + 2 * k + 2)
    out = run_to_completion(eng, ps, GREEDY)
    assert eng.block_manager.num_free_blocks == 512
    return out


@pytest.fixture(scope="module")
def reference(default_model) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts and `transformers.generate`'s greedy tokens for them."""
    ps = _prompt_ids(default_model)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        default_model, dtype=torch.float32).eval()
    want = []
    for p in ps:
        out = ref.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
        want.append(out[0, len(p):].tolist())
    return ps, want


# k = 0 (plain) and k = 3 (the deepest drafts: every acceptance length 0..3 and its rollback)
# run by default; k = 1 and 2 lie between them (the slow tier).
@pytest.mark.parametrize("k", [0, pytest.param(1, marks=pytest.mark.slow),
                               pytest.param(2, marks=pytest.mark.slow), 3])
def test_speculative_equals_plain_and_transformers(default_model, reference, k: int) -> None:
    ps, want = reference
    got = _run(default_model, k, ps)
    bad = [i for i in range(len(ps)) if got[i] != want[i]]
    assert not bad, f"k={k}: prompts {bad} differ from transformers.generate"


def test_batched_equals_alone(default_model) -> None:
    ps = _prompt_ids(default_model)[:8]
    ps = [p[: 10 + 9 * i] for i, p in enumerate(ps)]  # 8 different lengths
    together = _run(default_model, 2, ps)
    for i, p in enumerate(ps):
        assert _run(default_model, 2, [p]) == [together[i]], f"request {i}"
