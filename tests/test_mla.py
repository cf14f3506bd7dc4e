"""MLA's absorbed decode (workers/model/mla.py): the local heads folded into query rows
against the one latent head equal SDPA's GQA form (the latent repeated per head, the path
before issue 41 item 5), with a causal-style mask, without one, and several query rows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_hf_checkpoint

from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model.mla import MLAttention


def _gqa_reference(attn: MLAttention, q_nope, q_rot, latent, mask) -> torch.Tensor:
    m, Hl = attn.mla, attn.num_heads
    B, S = q_nope.shape[:2]
    w = attn.kv_b_proj.weight.unflatten(0, (Hl, m.qk_nope_head_dim + m.v_head_dim))
    w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
    q = torch.cat([torch.einsum("bshn,hnr->bhsr", q_nope, w_uk), q_rot.transpose(1, 2)], -1)
    kv = latent.unsqueeze(1)
    out = F.scaled_dot_product_attention(q, kv, kv[..., : m.kv_lora_rank], attn_mask=mask,
                                         scale=attn.scale, enable_gqa=True)
    out = torch.einsum("bhsr,hvr->bshv", out, w_uv)
    return attn.o_proj(out.reshape(B, S, Hl * m.v_head_dim))


@pytest.fixture(scope="module")
def attn(tmp_path_factory) -> MLAttention:
    path = make_hf_checkpoint(tmp_path_factory.mktemp("mla") / "ds", "deepseek_v3", num_mtp=1)
    model = load_model(path)
    return next(m for m in model.modules() if isinstance(m, MLAttention))


@pytest.mark.parametrize("S", [1, 4])
@pytest.mark.parametrize("masked", [True, False])
def test_folded_heads_equal_gqa_form(attn: MLAttention, S: int, masked: bool) -> None:
    m, Hl = attn.mla, attn.num_heads
    assert Hl > 1, "one head would not show the fold"
    g = torch.Generator().manual_seed(S)
    B, L = 3, 11
    q_nope = torch.randn(B, S, Hl, m.qk_nope_head_dim, generator=g)
    q_rot = torch.randn(B, S, Hl, m.qk_rope_head_dim, generator=g)
    latent = torch.randn(B, L, m.kv_lora_rank + m.qk_rope_head_dim, generator=g)
    mask = None
    if masked:  # row b's query s sees positions <= its own (rows of different lengths)
        pos = torch.tensor([[L - S + s for s in range(S)], [s for s in range(S)],
                            [3 + s for s in range(S)]])
        mask = (torch.arange(L).view(1, 1, -1) <= pos.unsqueeze(-1)).unsqueeze(1)
    with torch.no_grad():
        want = _gqa_reference(attn, q_nope, q_rot, latent, mask)
        got = attn._absorbed(q_nope, q_rot, latent, mask)
    assert got.shape == want.shape == (B, S, attn.o_proj.weight.shape[0])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
