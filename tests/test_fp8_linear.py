"""FP8 128x128 block linears (workers/model/fp8.py), on CPU: the blockwise math the CUDA
scaled matmul computes, written in plain torch, against the dequantized product; which path a
load takes; the module's fallback forward == nn.Linear on the dequantized weight; per-rank
block scales under TP; a load that keeps the FP8 linears == today's dequantized load."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_checkpoint

from mtpserve.workers.model import fp8
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model.parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    set_tp,
)
from mtpserve.workers.model.quantization import FP8BlockConfig, dequantize, quantize

BLOCK = (128, 128)
U = 2.0 ** -4  # e4m3's unit roundoff (3 mantissa bits)


def _weight(out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Blocks of different magnitudes, so a scale applied to the wrong block shows.
    mag = torch.rand(out // 128, inp // 128, generator=g) + 0.1
    w = torch.randn(out, inp, generator=g) * mag.repeat_interleave(128, 0).repeat_interleave(
        128, 1)
    return quantize(w, BLOCK)


def test_activation_quantization_per_token_group() -> None:
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(1)) * torch.tensor(
        [0.01, 1.0, 50.0]).repeat_interleave(128)
    q, s = fp8.quantize_activation(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    back = (q.float().view(5, 3, 128) * s.unsqueeze(-1)).view(5, 384)
    # Each group's largest |x| maps onto e4m3's max; every value within one rounding.
    assert torch.equal(q.float().view(5, 3, 128).abs().amax(-1), torch.full((5, 3), 448.0))
    tol = U * x.abs() + s.repeat_interleave(128, 1) * 2.0 ** -10  # normal / subnormal step
    assert ((back - x).abs() <= tol * (1 + 1e-6)).all()


def test_blockwise_reference_close_to_dequantized_twin() -> None:
    """Only the activations' 1 x 128 fp8 rounding separates the blockwise product from the
    dequantized one: |error| <= u * (|x| @ |W|^T) per output, and it is not zero."""
    wq, s = _weight(384, 512, seed=2)
    x = torch.randn(2, 7, 512, generator=torch.Generator().manual_seed(3))
    w = dequantize(wq, s, BLOCK)
    ref = fp8.blockwise_reference(x, wq, s)
    twin = F.linear(x, w)
    assert ref.shape == twin.shape == (2, 7, 384)
    bound = U * (x.abs() @ w.abs().T) * (1 + 1e-4) + 1e-5
    assert ((ref - twin).abs() <= bound).all()
    rel = ((ref - twin).norm() / twin.norm()).item()
    assert 0 < rel < 0.05


def test_path_selection_without_a_gpu() -> None:
    q = FP8BlockConfig((128, 128))
    assert fp8.select_path(None, torch.bfloat16, "cuda") == (fp8.DEQUANTIZED, "not quantized")
    assert fp8.select_path(q, torch.bfloat16, "cpu") == (fp8.DEQUANTIZED, "cpu device")
    # Refused before any CUDA call: block shape and serving dtype.
    path, why = fp8.select_path(FP8BlockConfig((16, 16)), torch.bfloat16, "cuda")
    assert path == fp8.DEQUANTIZED and "16x16" in why
    path, why = fp8.select_path(q, torch.float32, "cuda:0")
    assert path == fp8.DEQUANTIZED and "bf16 only" in why


def test_fallback_forward_equals_linear_on_dequantized_weight() -> None:
    wq, s = _weight(256, 384, seed=4)
    bias = torch.randn(256)
    mod = fp8.Fp8BlockLinear(wq, s, bias)
    assert not mod.use_scaled_mm and mod.weight.dtype == torch.float8_e4m3fn
    lin = torch.nn.Linear(384, 256)
    with torch.no_grad():
        lin.weight.copy_(dequantize(wq, s, BLOCK))
        lin.bias.copy_(bias)
        x = torch.randn(3, 5, 384)
        assert torch.equal(mod(x), lin(x))
        # `.to(dtype)` (lower_mtp_precision) keeps the fp8 weight and fp32 scales.
        mod.to(torch.bfloat16)
        assert mod.weight.dtype == torch.float8_e4m3fn and torch.equal(mod.weight, wq)
        assert mod.weight_scale_inv.dtype == mod.scale_b.dtype == torch.float32
        assert mod.bias.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="128x128 grid"):
        fp8.Fp8BlockLinear(wq[:200], s)


@pytest.fixture
def tp2_rank1():
    set_tp(1, 2, None)
    yield
    set_tp(0, 1, None)


def test_local_block_scales_under_tp(tp2_rank1) -> None:
    """Rank 1 of 2: the fused column linear's parts and the row linear's input slice get the
    block scales of exactly the rows / columns their weight loaders take."""
    parts = [_weight(n, 256, seed=5 + i) for i, n in enumerate((512, 256))]
    col = ColumnParallelLinear(256, [512, 256])
    assert fp8.eligible("mlp.gate_up_proj", col) and fp8.num_parts(col) == 2
    assert not fp8.eligible("self_attn.kv_b_proj", col)
    assert not fp8.eligible("x", ColumnParallelLinear(256, [512, 128]))  # 64-row shard
    scales = torch.empty(3, 2)
    for i, (wq, s) in enumerate(parts):
        col.weight.weight_loader(col.weight, wq, i)
        fp8.local_scale(col, s, i, scales)
    x = torch.randn(4, 256)
    want = torch.cat([F.linear(x, dequantize(wq, s, BLOCK)[n // 2:])
                      for (wq, s), n in zip(parts, (512, 256), strict=True)], dim=-1)
    with torch.no_grad():
        assert torch.equal(fp8.Fp8BlockLinear.from_linear(col, scales)(x), want)

    wq, s = _weight(128, 512, seed=7)
    row = RowParallelLinear(512, 128, reduce=False)
    assert fp8.eligible("self_attn.o_proj", row)
    row.weight.weight_loader(row.weight, wq)
    local = torch.empty(1, 2)
    fp8.local_scale(row, s, None, local)
    x = torch.randn(4, 256)
    with torch.no_grad():
        got = fp8.Fp8BlockLinear.from_linear(row, local)(x)
    assert torch.equal(got, F.linear(x, dequantize(wq, s, BLOCK)[:, 256:]))


def test_load_keeping_fp8_linears_equals_dequantized_load(tmp_path, monkeypatch) -> None:
    """A DeepSeek checkpoint on the 128 grid, FP8 128x128 blocks: on CPU it loads
    dequantized (and says so); with the FP8 path forced (the CUDA selection, here run with
    the fallback forward) the plain linears stay FP8, kv_b_proj and the experts do not, and
    logits and MTP drafts equal the dequantized load exactly."""
    src = make_hf_checkpoint(tmp_path / "bf", "deepseek_v3", num_mtp=1, hidden_size=128,
                             intermediate_size=256, num_attention_heads=8, q_lora_rank=128,
                             kv_lora_rank=128, moe_intermediate_size=128)
    tensors = load_file(src / "model.safetensors")
    for name, t in list(tensors.items()):
        if name.endswith("proj.weight") and t.dim() == 2:
            tensors[name], tensors[name + "_scale_inv"] = quantize(t, BLOCK)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (src / "config.json").write_text(json.dumps(cfg))

    plain = load_model(src)
    # The routed experts (layer 1, the MTP block) stay fp8 on every device (test_moe_kernels).
    experts = "; 2 expert layers kept fp8 (dequantized at use)"
    assert plain.quant_path == "dequantized (cpu device)" + experts
    monkeypatch.setattr(fp8, "select_path", lambda *a: (fp8.SCALED_MM, "forced"))
    kept = load_model(src)
    names = {n for n, m in kept.named_modules() if isinstance(m, fp8.Fp8BlockLinear)}
    assert kept.quant_path == f"{fp8.SCALED_MM} (forced): {len(names)} linears kept fp8" + experts
    # q_a_proj and o_proj in 3 blocks, layer 0's dense MLP, 2 shared-expert MLPs (fused
    # gate_up + down each); q_b_proj (192 rows) is off the 128 grid.
    assert len(names) == 12
    assert all(kept.get_submodule(n).weight.dtype == torch.float8_e4m3fn for n in names)
    layer0, layer1 = "model.layers.0.", "model.layers.1."
    for prefix in (layer0, layer1):
        assert {prefix + "self_attn.q_a_proj", prefix + "self_attn.o_proj"} <= names
    assert {layer0 + "mlp.gate_up_proj", layer0 + "mlp.down_proj"} <= names
    assert not any(n.endswith(("kv_b_proj", "q_b_proj", "eh_proj")) or "mlp.experts" in n
                   for n in names)
    assert any("shared" in n for n in names) and any(n.startswith("mtp.") for n in names)
    assert isinstance(plain.get_submodule(next(iter(names))),
                      ColumnParallelLinear | RowParallelLinear | ReplicatedLinear)
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        a, b = plain(ids, pos), kept(ids, pos)
        assert torch.equal(a, b)
        assert torch.equal(plain.forward_mtp(0, ids, a, pos), kept.forward_mtp(0, ids, b, pos))


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_local_block_scales_of_replicated_kv_parts(rank: int) -> None:
    """TP 4 over 2 KV heads of 128: q is split 4 ways, K and V each held whole by 2 ranks
    (rank r has head r // 2). The block scales follow the rows each part's loader takes."""
    from mtpserve.workers.model.parallel import construction_tp

    sizes = (512, 256, 256)  # q: 4 heads, k / v: 2 heads of 128
    parts = [_weight(n, 256, seed=11 + i) for i, n in enumerate(sizes)]
    with construction_tp(rank, 4):
        qkv = ColumnParallelLinear(256, list(sizes), replicas=[1, 2, 2])
    assert qkv.replicated and fp8.keeps_fp8("self_attn.qkv_proj", qkv, 3)
    scales = torch.empty(3, 2)  # q 128 rows + k 128 + v 128 per rank
    for i, (wq, s) in enumerate(parts):
        qkv.weight.weight_loader(qkv.weight, wq, i)
        fp8.local_scale(qkv, s, i, scales)
    x = torch.randn(4, 256)
    rows = [slice(rank * 128, rank * 128 + 128), slice(rank // 2 * 128, rank // 2 * 128 + 128),
            slice(rank // 2 * 128, rank // 2 * 128 + 128)]
    want = torch.cat([F.linear(x, dequantize(wq, s, BLOCK)[r])
                      for (wq, s), r in zip(parts, rows, strict=True)], dim=-1)
    with torch.no_grad():
        assert torch.equal(fp8.Fp8BlockLinear.from_linear(qkv, scales)(x), want)
