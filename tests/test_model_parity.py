"""Our model == transformers on the same random weights: prefill and paged incremental decode."""

from __future__ import annotations

import pytest
import torch
import transformers

from mtpserve.workers.model_runner import ForwardBatch, ModelRunner


@pytest.mark.parametrize("family,tie", [("llama", False), ("qwen2", True), ("qwen3", True)])
def test_logits_match_transformers(tiny_factory, family: str, tie: bool) -> None:
    path = tiny_factory(family, tie=tie)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    runner = ModelRunner(path, num_blocks=32, block_size=4)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (13,), generator=g).tolist()
    more = torch.randint(0, 256, (6,), generator=g).tolist()
    blocks = list(range(31, 20, -1))  # non-contiguous, descending block ids

    ours = runner.execute(
        ForwardBatch("main", [prompt], [0], [blocks], logit_rows=list(range(len(prompt))))
    )
    with torch.no_grad():
        full = ref(torch.tensor([prompt + more])).logits[0]
    assert (ours - full[: len(prompt)]).abs().max().item() <= 1e-4
    # Incremental decode, one token at a time through the paged cache.
    for i, tok in enumerate(more):
        pos = len(prompt) + i
        step = runner.execute(ForwardBatch("main", [[tok]], [pos], [blocks], logit_rows=[0]))
        assert (step[0] - full[pos]).abs().max().item() <= 1e-4, f"decode step {i}"


def test_batched_padded_forward_matches_single(tiny_qwen3) -> None:
    runner = ModelRunner(tiny_qwen3, num_blocks=64, block_size=4)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 7)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(3)]
    S = max(map(len, seqs))
    batched = runner.execute(
        ForwardBatch(
            "main",
            seqs,
            [0, 0, 0],
            tables,
            logit_rows=[b * S + len(s) - 1 for b, s in enumerate(seqs)],
        )
    )
    for b, s in enumerate(seqs):
        alone = runner.execute(ForwardBatch("main", [s], [0], [tables[b]], [len(s) - 1]))
        assert torch.allclose(batched[b], alone[0], atol=1e-5)
