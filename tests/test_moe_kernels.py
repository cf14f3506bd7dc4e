"""Routed experts without weight gathers (workers/model/moe.py): the grouped path (pairs sorted
by expert, device-side offsets, grouped matmuls) == a plain per-pair reference == the gathered
path, eager and compiled, and it reads nothing back to the host (fake CUDA tensors); FP8
128x128-block experts kept in fp8 (`fp8.keep_experts_fp8`) serve what their dequantized twin
serves, per rank under TP and through greedy decoding."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import greedy, make_engine, run_to_completion
from safetensors.torch import load_file, save_file
from tiny_models import make_hf_checkpoint
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
)

from mtpserve.workers.model import fp8
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.families.base import MoEConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model.moe import Experts, dequantize_experts
from mtpserve.workers.model.parallel import set_tp
from mtpserve.workers.model.quantization import FP8BlockConfig, dequantize, quantize
from mtpserve.workers.model.transformer import CausalLM

BLOCK = (128, 128)


def _experts(hidden: int, inter: int, n: int, k: int, seed: int = 0,
             dtype: torch.dtype = torch.float32) -> Experts:
    ex = Experts(hidden, MoEConfig(num_experts=n, top_k=k, intermediate_size=inter,
                                   scoring="softmax", norm_topk_prob=True))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        ex.w13.copy_(torch.randn(ex.w13.shape, generator=g) * 0.2)
        ex.w2.copy_(torch.randn(ex.w2.shape, generator=g) * 0.2)
    return ex.to(dtype)


def _route(t: int, k: int, n: int, seed: int, only: int | None = None,
           dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [t, k], distinct expert ids [t, k]) drawn from the first `only` experts, so
    the rest get no pairs."""
    g = torch.Generator().manual_seed(seed)
    pool = only or n
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)])
    return torch.rand(t, k, generator=g).to(dtype), idx


def _reference(ex: Experts, x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor,
               w13: torch.Tensor | None = None, w2: torch.Tensor | None = None) -> torch.Tensor:
    """One pair at a time, plain linears."""
    w13 = ex.w13 if w13 is None else w13
    w2 = ex.w2 if w2 is None else w2
    out = torch.zeros_like(x)
    for t in range(idx.shape[0]):
        for s in range(idx.shape[1]):
            e = int(idx[t, s])
            gate, up = F.linear(x[t], w13[e]).chunk(2)
            out[t] += w[t, s] * F.linear(F.silu(gate) * up, w2[e])
    return out


@pytest.mark.parametrize("hidden,inter,n,t,k,only", [
    (64, 32, 8, 1, 1, None),   # one pair: the gathered path
    (64, 32, 8, 3, 2, 4),      # fewer pairs than experts, half the experts unused
    (64, 32, 4, 17, 2, None),  # many more pairs than experts
    (48, 16, 16, 9, 4, 6),     # 36 pairs over 6 of 16 experts
    (30, 10, 8, 5, 3, None),   # sizes off grouped_mm's 16-byte stride grid
])
def test_grouped_equals_gathered_and_reference(hidden, inter, n, t, k, only) -> None:
    ex = _experts(hidden, inter, n, k, seed=t)
    x = torch.randn(t, hidden, generator=torch.Generator().manual_seed(100 + t))
    w, idx = _route(t, k, n, seed=t, only=only)
    with torch.no_grad():
        ref = _reference(ex, x, w, idx)
        grouped, gathered, auto = ex._grouped(x, w, idx), ex._gathered(x, w, idx), ex(x, w, idx)
    assert ref.abs().max() > 0.1
    assert (grouped - ref).abs().max().item() <= 1e-5
    assert (gathered - ref).abs().max().item() <= 1e-5
    assert torch.equal(auto, gathered if t * k == 1 else grouped)


def test_grouped_bf16_runs_the_grouped_kernel() -> None:
    """bf16 (CPU `F.grouped_mm`) against the fp32 reference on the same bf16 weights."""
    ex = _experts(64, 32, 8, 2, seed=1, dtype=torch.bfloat16)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(2)).bfloat16()
    w, idx = _route(20, 2, 8, seed=3, only=6, dtype=torch.bfloat16)
    with torch.no_grad():
        got = ex._grouped(x, w, idx).float()
        ref = _reference(ex, x.float(), w.float(), idx, ex.w13.float(), ex.w2.float())
    assert got.dtype == torch.float32 and (got - ref).abs().max().item() <= 2e-2 * ref.abs().max()


def test_grouped_under_torch_compile() -> None:
    """fullgraph, static shapes: the fp32 grouped path (the custom op around the CPU kernel)
    and the fp8 dequantize-at-use path compile without a break and match eager."""
    ex = _experts(128, 128, 8, 2, seed=4)
    q = _fp8_experts(ex)
    x = torch.randn(6, 128, generator=torch.Generator().manual_seed(5))
    w, idx = _route(6, 2, 8, seed=6, only=5)

    def both(x: torch.Tensor, w: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return torch.stack([ex(x, w, idx), q(x, w, idx)])

    with torch.no_grad():
        eager = both(x, w, idx)
        compiled = torch.compile(both, fullgraph=True, dynamic=False)(x, w, idx)
    assert (compiled - eager).abs().max().item() <= 1e-5
    assert (eager[0] - _reference(ex, x, w, idx)).abs().max().item() <= 1e-5


def test_compiled_cpu_package_reads_experts_in_place_then_groups(tmp_path) -> None:
    """One dynamic-shape AOTInductor package (what a CPU decode graph is) holds both paths:
    small batches read each pair's expert in place (`_indirect`), batches past
    `_INDIRECT_PAIRS_PER_EXPERT` pairs per expert take the grouped product; both match the
    per-pair reference at every batch size."""
    from torch.export import Dim

    from mtpserve.workers.model import moe
    from mtpserve.workers.model.compile_cache import AOTGraphCache

    ex = _experts(64, 32, 4, 2, seed=7)
    T = Dim("T", min=1, max=1024)
    example = (torch.randn(3, 64), *_route(3, 2, 4, seed=8))
    with torch.no_grad():
        ep = torch.export.export(ex, example, dynamic_shapes=({0: T}, {0: T}, {0: T}),
                                 strict=False)
        assert any(n.target is torch.ops.higher_order.cond for n in ep.graph.nodes)
        fn = AOTGraphCache(tmp_path, "moe").get(
            "experts", ex, example, dynamic_shapes=({0: T}, {0: T}, {0: T}))
        for t in (1, 3, moe._INDIRECT_PAIRS_PER_EXPERT * 4 // 2, 40):  # 40 * 2 > 8 * 4: grouped
            x = torch.randn(t, 64, generator=torch.Generator().manual_seed(t))
            w, idx = _route(t, 2, 4, seed=t)
            got = fn(x, w, idx)
            got = got[0] if isinstance(got, (list, tuple)) else got
            ref = _reference(ex, x, w, idx)
            assert (got - ref).abs().max().item() <= 1e-5, t
            assert (ex._indirect(x, w, idx) - ref).abs().max().item() <= 1e-5


@pytest.mark.parametrize("dtype,kept_fp8", [(torch.bfloat16, False), (torch.float32, False),
                                            (torch.bfloat16, True)])
def test_grouped_path_makes_no_host_read(dtype, kept_fp8) -> None:
    """On fake CUDA tensors a value read (`.item()`, `.tolist()`, a data-dependent shape)
    raises: the grouped path (bf16: `F.grouped_mm`; fp32: the masked loop; fp8 experts:
    dequantize the used experts) runs through, so it never syncs the host and a CUDA graph
    can capture it. A `.tolist()` and the old path's `bincount` raise here (the controls)."""
    cfg = _fp8_model_config(256) if kept_fp8 else None
    moe = cfg.moe if cfg else MoEConfig(8, 2, 64, "softmax", True)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # as the loader builds the model in the serving dtype
    try:
        # no_grad as serving runs: autograd on fake CUDA tensors needs a CUDA build.
        with FakeTensorMode(), torch.device("cuda"), torch.no_grad():
            ex = Experts(128, moe, cfg)
            torch.set_default_dtype(prev)
            assert ex.fp8 == kept_fp8 and ex.w13.is_cuda
            assert ex.w13.dtype == (torch.float8_e4m3fn if kept_fp8 else dtype)
            x = torch.empty(24, 128, dtype=dtype)
            idx = torch.empty(24, 2, dtype=torch.long)
            out = ex._grouped(x, torch.empty(24, 2, dtype=dtype), idx)
            assert out.shape == (24, 128) and out.is_cuda and out.dtype == dtype
            # The controls: a value read, and the old path's data-dependent bincount.
            with pytest.raises(DataDependentOutputException):
                idx.reshape(-1).tolist()
            with pytest.raises(DynamicOutputShapeException):
                torch.bincount(idx.reshape(-1), minlength=8)
    finally:
        torch.set_default_dtype(prev)


# -- FP8 experts ----------------------------------------------------------------------------


def _fp8_model_config(moe_inter: int, block: tuple[int, int] = BLOCK) -> ModelConfig:
    import transformers

    hf = transformers.DeepseekV3Config(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=moe_inter, n_group=2, topk_group=1,
        first_k_dense_replace=1, n_shared_experts=1)
    return dataclasses.replace(ModelConfig.from_dict(hf.to_dict()), quant=FP8BlockConfig(block))


def test_keep_experts_fp8_rule() -> None:
    cfg = _fp8_model_config(256)
    assert fp8.keep_experts_fp8(cfg, 1, "cuda") and fp8.keep_experts_fp8(cfg, 2, "meta")
    assert fp8.keep_experts_fp8(cfg, 2, "cpu")
    assert not fp8.keep_experts_fp8(cfg, 4, "cuda")  # 64 rows per rank: off the 128 grid
    assert not fp8.keep_experts_fp8(cfg, 1, "mps")
    assert not fp8.keep_experts_fp8(dataclasses.replace(cfg, quant=None), 1, "cuda")
    assert not fp8.keep_experts_fp8(_fp8_model_config(256, (64, 64)), 1, "cuda")
    # A meta-device build (a memory plan) gets the fp8 experts a load gets.
    with torch.device("meta"):
        model = CausalLM(cfg)
    experts = [m for m in model.modules() if isinstance(m, Experts)]
    assert experts and all(m.fp8 and m.w13.dtype == torch.float8_e4m3fn and m.w13.is_meta
                           and m.w2_scale_inv.shape == (8, 1, 2) for m in experts)


def _fp8_experts(ex: Experts) -> Experts:
    """An fp8-kept copy of `ex` (its weights quantized per expert, 128x128 blocks)."""
    hidden, inter = ex.w13.shape[2], ex.local_inter
    cfg = _fp8_model_config(inter)
    q = Experts(hidden, cfg.moe, cfg)
    assert q.fp8
    for e in range(ex.num_experts):
        for part in (0, 1):
            wq, s = quantize(ex.w13.data[e, part * inter:(part + 1) * inter], BLOCK)
            q.weight_loader(q.w13, wq, (e, part))
            q.scale_loader(q.w13, s, (e, part))
        wq, s = quantize(ex.w2.data[e], BLOCK)
        q.weight_loader(q.w2, wq, (e, None))
        q.scale_loader(q.w2, s, (e, None))
    return q


@pytest.fixture
def tp2_rank1():
    set_tp(1, 2, None)
    yield
    set_tp(0, 1, None)


def test_fp8_experts_per_rank_equal_dequantized_twin(tp2_rank1) -> None:
    """Rank 1 of 2: the fp8 experts take the second half of every expert's intermediate rows
    (and its block scales); grouped and gathered outputs == a twin loaded with the
    dequantized checkpoint tensors, exactly."""
    cfg = _fp8_model_config(256)
    q, twin = Experts(128, cfg.moe, cfg), Experts(128, cfg.moe)
    assert q.fp8 and q.w13.shape == (8, 256, 128) and q.w13_scale_inv.shape == (8, 2, 1)
    g = torch.Generator().manual_seed(9)
    for e in range(8):
        for part, shape in ((0, (256, 128)), (1, (256, 128)), (None, (128, 256))):
            mag = torch.rand(shape[0] // 128, shape[1] // 128, generator=g) + 0.1
            full = torch.randn(shape, generator=g) * mag.repeat_interleave(
                128, 0).repeat_interleave(128, 1)
            wq, s = quantize(full, BLOCK)
            param = q.w2 if part is None else q.w13
            q.weight_loader(param, wq, (e, part))
            q.scale_loader(param, s, (e, part))
            twin.weight_loader(twin.w2 if part is None else twin.w13, dequantize(wq, s, BLOCK),
                               (e, part))
    assert q.w13.dtype == q.w2.dtype == torch.float8_e4m3fn
    assert torch.equal(dequantize_experts(q.w13, q.w13_scale_inv, torch.float32), twin.w13)
    x = torch.randn(10, 128, generator=g)
    with torch.no_grad():
        for t, k, only in ((10, 2, 3), (1, 1, None), (3, 2, None)):
            w, idx = _route(t, k, 8, seed=t, only=only)
            assert torch.equal(q._grouped(x[:t], w, idx), twin._grouped(x[:t], w, idx))
            assert torch.equal(q._gathered(x[:t], w, idx), twin._gathered(x[:t], w, idx))
    with pytest.raises(ValueError, match="fp8 values"):
        q.weight_loader(q.w2, torch.zeros(128, 256), (0, None))
    # `.to(bf16)` (lower_mtp_precision) keeps fp8 values and fp32 scales; bf16 serving then
    # dequantizes to exactly the twin's bf16 weights (the grouped bf16 kernel on both).
    q.to(torch.bfloat16), twin.to(torch.bfloat16)
    assert q.w13.dtype == torch.float8_e4m3fn and q.w2_scale_inv.dtype == torch.float32
    w, idx = _route(10, 2, 8, seed=11, only=5, dtype=torch.bfloat16)
    with torch.no_grad():
        xb = x.bfloat16()
        assert torch.equal(q._grouped(xb, w, idx), twin._grouped(xb, w, idx))


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """A DeepSeek-V3 checkpoint on the 128 grid with every projection (experts included) in
    FP8 128x128 blocks, and its twin holding the dequantized tensors, unquantized."""
    root = tmp_path_factory.mktemp("fp8moe")
    src = make_hf_checkpoint(root / "src", "deepseek_v3", num_mtp=1, hidden_size=128,
                             intermediate_size=256, num_attention_heads=8, q_lora_rank=128,
                             kv_lora_rank=128, moe_intermediate_size=128)
    tensors = load_file(src / "model.safetensors")
    quant, twin = dict(tensors), dict(tensors)
    for name, t in tensors.items():
        if name.endswith("proj.weight") and t.dim() == 2:
            q, s = quantize(t, BLOCK)
            quant[name], quant[name + "_scale_inv"] = q, s
            twin[name] = dequantize(q, s, BLOCK)
    assert sum(".experts." in n and n.endswith("_scale_inv") for n in quant) == 2 * 8 * 3
    paths = {}
    for kind, sd in (("fp8", quant), ("twin", twin)):
        paths[kind] = root / kind
        shutil.copytree(src, paths[kind])
        save_file(sd, paths[kind] / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((paths["fp8"] / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    (paths["fp8"] / "config.json").write_text(json.dumps(cfg))
    return paths


def test_fp8_checkpoint_keeps_experts_fp8_and_equals_twin(fp8_pair) -> None:
    """Loaded on CPU: the routed experts of the MoE layer and of the MoE MTP block stay
    float8_e4m3fn (quant_path counts them); logits, every MoE layer's output and MTP drafts
    == the dequantized twin, bit for bit."""
    models = {k: load_model(p) for k, p in fp8_pair.items()}
    ours, twin = models["fp8"], models["twin"]
    experts = {n: m for n, m in ours.named_modules() if isinstance(m, Experts)}
    assert len(experts) == 2 and all(m.fp8 for m in experts.values())
    for m in experts.values():
        assert m.w13.dtype == m.w2.dtype == torch.float8_e4m3fn
        assert m.w13_scale_inv.dtype == torch.float32 and m.w13_scale_inv.shape == (8, 2, 1)
    assert ours.quant_path.endswith("; 2 expert layers kept fp8 (dequantized at use)")
    assert not any(isinstance(m, Experts) and m.fp8 for m in twin.modules())
    seen: dict[str, list[torch.Tensor]] = {"fp8": [], "twin": []}
    for kind, model in models.items():
        for m in model.modules():
            if isinstance(m, Experts):
                m.register_forward_hook(lambda _m, _a, out, kind=kind: seen[kind].append(out))
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(8))
    pos = torch.arange(20).unsqueeze(0)
    with torch.no_grad():
        a, b = ours(ids, pos), twin(ids, pos)
        assert torch.equal(a, b)
        assert torch.equal(ours.forward_mtp(0, ids, a, pos), twin.forward_mtp(0, ids, b, pos))
    assert len(seen["fp8"]) == len(seen["twin"]) == 2
    for x, y in zip(seen["fp8"], seen["twin"], strict=True):
        assert x.abs().max() > 0 and torch.equal(x, y)


def test_fp8_experts_greedy_with_drafts_equals_twin(fp8_pair) -> None:
    """The engine (k = 2 MTP drafts, prefill then one- and multi-token decode steps) emits
    the same greedy tokens on the fp8-expert checkpoint as on its dequantized twin."""
    prompts = [[5, 17, 99, 3, 250, 7, 42, 8, 1, 77, 31], [3, 4, 5, 6, 7, 8]]
    got = {k: run_to_completion(make_engine(p, k=2, num_kv_blocks=64, block_size=4), prompts,
                                greedy(12))
           for k, p in fp8_pair.items()}
    assert got["fp8"] == got["twin"] and all(len(t) == 12 for t in got["fp8"])
