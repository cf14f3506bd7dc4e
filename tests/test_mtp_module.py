"""MTP module(s) against a plain-torch reference of the DeepSeek-V3 formula, and the engine's
cached drafts against the same reference recomputed from the whole token history."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.sampling_params import SamplingParams


def rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def ref_module(model, m: int, tokens: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
    """h'_t = Block(eh_proj([enorm(emb(tok_t)); hnorm(prev_t)])) -> shared norm, [1, S, H].

    The decoder block is the one `test_model_parity` checks against transformers; the
    formula around it is spelled out here."""
    mod = model.mtp[m]
    emb = F.embedding(tokens, model.model.embed_tokens.weight)
    x = torch.cat([rms(emb, mod.enorm.weight), rms(prev, mod.hnorm.weight)], dim=-1)
    x = x @ mod.eh_proj.weight.T
    pos = torch.arange(tokens.shape[1]).unsqueeze(0)
    x = mod.block(x, model.rotary.cos_sin(pos), None, None)
    return rms(x, mod.norm.weight)


@pytest.mark.parametrize("num_mtp", [1, 2])
def test_training_forward_matches_formula(tiny_factory, num_mtp: int) -> None:
    model = load_model(tiny_factory("qwen3", num_mtp=num_mtp))
    g = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (1, 20), generator=g)
    S = 20 - 1 - num_mtp
    with torch.no_grad():
        h = model(w[:, :S], torch.arange(S).unsqueeze(0))
        prev_ours = prev_ref = h
        for m in range(num_mtp):
            toks = w[:, 1 + m : S + 1 + m]
            ours = model.forward_mtp(m, toks, prev_ours, torch.arange(S).unsqueeze(0))
            ref = ref_module(model, m, toks, prev_ref)
            assert (ours - ref).abs().max() < 1e-5, f"module {m}"
            assert torch.equal(
                model.compute_mtp_logits(m, ours), (ours @ model.lm_head.weight.T).float()
            )
            prev_ours, prev_ref = ours, ref


def ref_drafts(model, tokens: list[int], n_computed: int, k: int, num_mtp: int) -> list[int]:
    """Drafts the engine must propose given the committed token history.

    tokens = all tokens (last one not yet in the main KV), n_computed = len(tokens) - 1.
    Reused module: entries n..n+k-2 continue module 0's sequence. Depth modules: module m
    forms its own one-entry sequence at entry n-1 (only drafting writes it)."""
    t = torch.tensor([tokens])
    n = n_computed
    with torch.no_grad():
        h = model(t[:, :n], torch.arange(n).unsqueeze(0))
        out = ref_module(model, 0, t[:, 1 : n + 1], h)
        d = [int(model.compute_mtp_logits(0, out[:, -1]).argmax())]
        prev_seq, tok_seq = h, t[:, 1 : n + 1]
        last = out[:, -1:]
        for step in range(2, k + 1):
            m = min(step - 1, num_mtp - 1)
            if num_mtp == 1:  # grow module 0's sequence by one entry
                prev_seq = torch.cat([prev_seq, last], dim=1)
                tok_seq = torch.cat([tok_seq, torch.tensor([[d[-1]]])], dim=1)
                out = ref_module(model, 0, tok_seq, prev_seq)
            else:
                raise NotImplementedError
            last = out[:, -1:]
            d.append(int(model.compute_mtp_logits(m, last[:, 0]).argmax()))
    return d


def test_engine_drafts_equal_reference_every_round(tiny_qwen3) -> None:
    """The MTP KV cache (filled in chunked prefill, caught up after every round, rolled back
    past rejections) gives the same drafts as recomputing from the full history."""
    k = 3
    eng = Engine(
        EngineConfig(
            model=str(tiny_qwen3),
            num_speculative_tokens=k,
            num_kv_blocks=64,
            block_size=4,
            max_num_batched_tokens=8,
        )
    )
    model = eng.runner.model
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 256, (19,), generator=g).tolist()
    req = eng.add_request(
        "r", prompt, SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    checked = 0
    while eng.has_unfinished():
        eng.step()
        if req.draft_token_ids and not req.finished:
            want = ref_drafts(
                model, req.all_token_ids, req.num_computed_tokens, len(req.draft_token_ids), 1
            )
            assert req.draft_token_ids == want, f"after {req.num_output_tokens} tokens"
            checked += 1
    assert checked >= 5
