"""Float32 linears over weights stored as bf16 (workers/model/bf16_weights.py): the same
product as float32 up to summation order, a row's result independent of its batch, used only
for weights bf16 holds exactly, and the default (bf16) model decodes the same tokens with
them as without."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine, run_to_completion

from mtpserve.workers.model import bf16_weights
from mtpserve.workers.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(not bf16_weights.available(),
                                reason="no AVX-512 or no C++ compiler: float32 weights")


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(torch.bfloat16).float()


@pytest.mark.parametrize("n,k", [(100, 48), (64, 64), (200, 7), (1, 32)])
def test_product_matches_float32_and_rows_do_not_depend_on_the_batch(n, k) -> None:
    w = _weight(n, k)
    packed = bf16_weights.pack(w)
    bias = torch.randn(n)
    x = torch.randn(2, 9, k)  # 18 rows: full 6-row tiles and a tail
    y = bf16_weights.linear(x, w, bias, packed)
    ref = (x.double() @ w.double().t() + bias.double()).float()
    assert y.shape == (2, 9, n)
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    many = torch.randn(bf16_weights.MAX_ROWS + 5, k)  # the float32 GEMM's side
    assert torch.allclose(bf16_weights.linear(many, w, None, packed),
                          (many.double() @ w.double().t()).float(), rtol=1e-5, atol=1e-5)
    flat = x.reshape(-1, k)
    for m in (1, 2, 3, 5, 6, 7):  # every tile height, alone or in a bigger batch
        part = bf16_weights.linear(flat[:m], w, bias, packed)
        assert torch.equal(part, y.reshape(-1, n)[:m])
    assert bf16_weights.linear(flat[:0], w, None, packed).shape == (0, n)


def test_only_exact_float32_weights_are_packed(tiny_qwen3, default_model) -> None:
    assert bf16_weights.exact_in_bf16(_weight(8, 8))
    assert not bf16_weights.exact_in_bf16(torch.randn(8, 8))
    assert not bf16_weights.exact_in_bf16(_weight(8, 8).to(torch.bfloat16))
    # A random float32 checkpoint keeps its float32 weights.
    assert ModelRunner(tiny_qwen3, num_blocks=8, block_size=4).bf16_weight_linears == 0
    runner = ModelRunner(default_model, num_blocks=8, block_size=4)
    cfg = runner.config
    if cfg.vocab_size != 4096:
        pytest.skip("the embedded bf16 model is not there")
    # 4 linears per layer (qkv, o, gate_up, down), the LM head, the MTP module's 5 + its head
    packed = [n for n, b in runner.model.named_buffers() if n.endswith("packed_bf16")]
    assert runner.bf16_weight_linears == len(packed) >= 4 * cfg.num_hidden_layers + 1
    # bf16 drafts (draft_dtype) keep their own bf16 GEMM: their linears are not packed.
    lowered = ModelRunner(default_model, num_blocks=8, block_size=4, mtp_dtype=torch.bfloat16)
    assert not any(n.startswith("mtp.") for n, _ in lowered.model.named_buffers()
                   if n.endswith("packed_bf16"))


def test_default_model_decodes_the_same_tokens(default_model, monkeypatch) -> None:
    """Against float32 weights (the switch off): greedy decoding, plain and speculative,
    gives the same tokens (the product itself is checked against float64 above)."""
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 4000, (9 + 11 * i,), generator=g).tolist() for i in range(3)]
    outs = {}
    for name, on in (("bf16w", True), ("float32", False)):
        if not on:
            monkeypatch.setattr(bf16_weights, "available", lambda: False)
        for k in (0, 2):
            eng = make_engine(default_model, k, num_kv_blocks=128, compile="off")
            assert (eng.runner.bf16_weight_linears > 0) == (on and eng.runner.config.vocab_size
                                                            == 4096)
            outs[name, k] = run_to_completion(eng, prompts)
    assert outs["bf16w", 0] == outs["bf16w", 2] == outs["float32", 0] == outs["float32", 2]


def test_experts_product_matches_float32_per_row() -> None:
    """Routed experts: each row through its own expert, equal to float64 up to summation
    order, and to the dense kernel on that expert bit for bit (batch-invariant); more rows
    than MAX_ROWS take the float32 GEMMs; a bad expert id is an error, not a wild read."""
    E, n, k = 5, 130, 40
    w = torch.stack([_weight(n, k, seed=e) for e in range(E)])
    packed = bf16_weights.pack_experts(w)
    g = torch.Generator().manual_seed(3)
    for m in (1, 4, 13, bf16_weights.MAX_ROWS + 7):
        x = torch.randn(m, k, generator=g)
        idx = torch.randint(0, E, (m,), generator=g)
        y = bf16_weights.experts_linear(x, idx, w, packed)
        ref = torch.einsum("mk,mnk->mn", x.double(), w[idx].double()).float()
        assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
        if m <= bf16_weights.MAX_ROWS:
            for r in range(m):
                alone = bf16_weights.linear(x[r:r + 1], w[idx[r]], None, packed[idx[r]])
                assert torch.equal(alone[0], y[r])
    with pytest.raises(RuntimeError, match="out of range"):
        bf16_weights.experts_linear(torch.randn(2, k), torch.tensor([0, E]), w, packed)


def test_moe_layer_with_packed_experts_matches_float32() -> None:
    """The MoE layer's packed path (top-2 of 4 experts, weighted slots) against its float32
    paths on the same weights."""
    from mtpserve.workers.model.families.base import MoEConfig
    from mtpserve.workers.model.moe import Experts

    cfg = MoEConfig(num_experts=4, top_k=2, intermediate_size=96, scoring="softmax",
                    norm_topk_prob=True)
    experts = Experts(64, cfg)
    with torch.no_grad():
        experts.w13.copy_(torch.randn_like(experts.w13).to(torch.bfloat16).float())
        experts.w2.copy_(torch.randn_like(experts.w2).to(torch.bfloat16).float())
    assert bf16_weights.pack_linears(experts) == 1 and experts.w13_packed is not None
    g = torch.Generator().manual_seed(5)
    for t in (1, 3, 11):
        x = torch.randn(t, 64, generator=g)
        idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(t)])
        weights = torch.softmax(torch.randn(t, 2, generator=g), -1)
        got = experts(x, weights, idx)
        assert torch.allclose(got, experts._grouped(x, weights, idx), rtol=1e-4, atol=1e-4)
        assert torch.allclose(got, experts._gathered(x, weights, idx), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("scoring,correction_bias", [("sigmoid", True), ("softmax", False)])
def test_router_reads_its_packed_weight_and_routes_as_float32(scoring, correction_bias) -> None:
    """A router whose float32 weight bf16 holds exactly is packed and gives the float32
    router's expert choice and (to summation order) its weights; one that bf16 does not hold
    keeps F.linear."""
    from mtpserve.workers.model.families.base import MoEConfig
    from mtpserve.workers.model.moe import Router

    cfg = MoEConfig(num_experts=6, top_k=2, intermediate_size=32, scoring=scoring,
                    norm_topk_prob=True, correction_bias=correction_bias)
    router = Router(64, cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        router.weight.copy_(torch.randn(6, 64, generator=g).to(torch.bfloat16).float())
    reference = Router(64, cfg)
    reference.load_state_dict(router.state_dict())
    assert bf16_weights.pack_linears(router) == 1 and router.packed_bf16 is not None
    x = torch.randn(9, 64, generator=g)
    (w, idx), (w_ref, idx_ref) = router(x), reference(x)
    assert torch.equal(idx.sort(-1).values, idx_ref.sort(-1).values)
    assert torch.allclose(w.gather(1, idx.argsort(-1)), w_ref.gather(1, idx_ref.argsort(-1)),
                          rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        reference.weight.add_(1e-3)  # off the bf16 grid
    assert bf16_weights.pack_linears(reference) == 0 and reference.packed_bf16 is None
