"""Mixture-of-experts MLP: router, batched routed experts, shared experts.

Routers (each the exact op sequence of its transformers reference, so expert choices match):
- softmax top-k, optionally renormalised (`norm_topk_prob`): Qwen3-MoE (`Qwen3MoeTopKRouter`).
- sigmoid scores; the choice adds `e_score_correction_bias` and keeps the best `topk_group`
  of `n_group` groups (a group scores the sum of its top-2); the weights are the plain sigmoid
  scores of the chosen experts, renormalised, times `routed_scaling_factor`: DeepSeek-V3 and
  GLM-4.5 (`Glm4MoeTopkRouter`). Router weight and bias are fp32, as transformers keeps them.

Experts run batched, never one token at a time, with static shapes and no host read (so the
compiled decode graphs cover MoE layers and CUDA graphs can capture them):
- indirect (compiled CPU graphs, unquantized experts, while the pairs number at most
  `_INDIRECT_PAIRS_PER_EXPERT` per expert; a `torch.cond` on the batch, so one dynamic-shape
  package holds both paths): every (token, slot) pair's products as broadcast products and
  sums over its expert's weights, which inductor fuses into reductions that read the chosen
  experts' weights in place. AOTInductor package, CPU, 2 threads, fp32, us per MoE layer with
  a shared expert, grouped / indirect: H=256 I=768 E=2 K=1, T=1: 331/185, T=3: 566/244, T=10:
  737/419, T=32: 955/1114; H=256 I=128 E=64 K=8, T=1: 634/165, T=10: 4466/603, T=32:
  5963/2296 (on CPU the grouped product is a loop over groups behind a Python custom op).
- grouped (every batch above `_GATHER_PAIRS` (token, slot) pairs): pairs sorted by expert,
  the group offsets (cumulative counts) computed on the device with `searchsorted`, and two
  grouped matmuls over the stacked weights as they are (`group_mm`: `F.grouped_mm`, the CUDA
  kernel for bf16; on CPU the same op in any float dtype, wrapped in a custom op under
  torch.compile because its meta function takes bf16 only; elsewhere (fp32 / fp16 on CUDA) a
  masked loop over experts, E times the FLOPs). Results go back to (token, slot) order by a
  permutation, then the slots' weighted sum, the gathered path's arithmetic.
- gathered (a single pair): the pair gathers its expert's weights, one `bmm`. Gathering
  copies T*K experts' weights (a 64 x 8 DeepSeek-V3 decode bucket at TP=8: ~22 GB per layer),
  so it is kept only where it measured cheaper. CPU, one thread, fp32, median of 21, us
  gathered / grouped by pairs: H=64 I=32 E=8: 1: 77/175, 2: 96/175, 16: 240/203; H=256 I=128
  E=16: 1: 144/225, 2: 434/242; H=1024 I=256 E=64: 1: 654/530, 2: 3063/640; H=2048 I=256 E=64:
  1: 1338/632, 4: 13099/2506. Grouped wins from 2 pairs at every size but toy ones.

- packed (float32 experts a bf16 checkpoint holds, on CPU with AVX-512, eager and compiled):
  `bf16_weights.experts_linear`, the bf16-weight linear kernel over each pair's own expert,
  rows grouped by expert in C++ (half the bytes of the float32 weights, read in place; above
  `MAX_ROWS` pairs one float32 GEMM per used expert). Ahead of every other path when set.

FP8 experts (`fp8.keep_experts_fp8`: an FP8 128x128-block checkpoint whose per-rank expert
slice lies on the 128 grid, decided when `Experts` is built, so a meta-device build agrees):
w13 / w2 hold the checkpoint's float8_e4m3fn values and `*_scale_inv` their block scales,
loaded expert part by expert part. They are dequantized at use, in fp32 rounded once to the
serving dtype (the values a dequantized-at-load twin holds): the gathered path the gathered
experts, the grouped path min(E, pairs) experts, the used ones first (a static count). On CUDA
`fp8_grouped_kernel` is the seam for a grouped FP8 kernel reading fp8 directly; none is wired.

Tensor parallelism: every rank holds a 1/tp slice of every expert's intermediate dimension
(and of the shared experts'); the router is replicated and runs on the same (all-reduced)
input on every rank, so routing is identical everywhere; routed + shared partial outputs are
summed with one all-reduce per layer.

Expert parallelism (not built): would give each rank E/ep whole experts instead of slices;
the gathered path becomes an all-to-all dispatch of (token, slot) pairs to the owning rank and
a combine back, the router staying replicated. `MoE.experts` is the only piece that changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.model import bf16_weights
from mtpserve.workers.model.families.base import MoEConfig
from mtpserve.workers.model.fp8 import FP8, GROUP, keep_experts_fp8
from mtpserve.workers.model.layers import MLP, swiglu
from mtpserve.workers.model.parallel import (
    ReplicatedLinear,
    _divide,
    _plain_loader,
    all_reduce,
    get_tp,
)

if TYPE_CHECKING:
    from mtpserve.workers.model.config import ModelConfig

_GATHER_PAIRS = 1  # the measured crossover (module docstring)
_INDIRECT_PAIRS_PER_EXPERT = 8

# The seam for a grouped FP8 kernel on CUDA (FlashInfer's fused MoE, torch._scaled_grouped_mm
# with 128x128 weight blocks): (experts, rows [M, hidden] grouped by expert, offs [E] int32)
# -> [M, hidden], reading `w13` / `w2` and their `*_scale_inv` in fp8. None: no such kernel is
# wired in or verified here, so FP8 experts are dequantized at use on every device.
fp8_grouped_kernel: Callable[[Experts, torch.Tensor, torch.Tensor], torch.Tensor] | None = None


class Router(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # fp32 for the sigmoid routers (transformers' _keep_in_fp32_modules_strict); the
        # softmax router runs in the model dtype like Qwen3MoeTopKRouter.
        fp32 = torch.float32 if cfg.scoring == "sigmoid" else None
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=fp32))
        self.weight.weight_loader = _plain_loader
        # A float32 router weight that bf16 holds exactly (a bf16 checkpoint's) is read through
        # the bf16-weight kernel (bf16_weights.pack_linears): inside compiled CPU graphs oneDNN
        # took ~85 us for a 2-expert router's [1, 256] x [256, 2], the kernel ~3 us.
        self.register_buffer("packed_bf16", None, persistent=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(cfg.num_experts, dtype=torch.float32), requires_grad=False)
            if cfg.correction_bias else None
        )
        if self.e_score_correction_bias is not None:
            self.e_score_correction_bias.weight_loader = _plain_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (weights [T, K] in x's dtype, expert ids [T, K])."""
        c = self.cfg
        if c.scoring == "softmax":
            logits = bf16_weights.linear(x, self.weight, None, self.packed_bf16)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top, idx = torch.topk(probs, c.top_k, dim=-1)
            if c.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return top.to(logits.dtype), idx
        scores = bf16_weights.linear(x.float(), self.weight.float(), None,
                                     self.packed_bf16).sigmoid()
        choice = scores if self.e_score_correction_bias is None else (
            scores + self.e_score_correction_bias)
        if c.n_group > 1:
            T = choice.shape[0]
            per = c.num_experts // c.n_group
            group_scores = choice.view(T, c.n_group, per).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx = torch.topk(group_scores, k=c.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask.unsqueeze(-1).expand(T, c.n_group, per).reshape(T, -1)
            choice = choice.masked_fill(~keep.bool(), float("-inf"))
        idx = torch.topk(choice, k=c.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if c.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * c.routed_scaling_factor).to(x.dtype), idx


def _cpu_group_mm_impl(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if _aligned(a) and _aligned(b):
        return F.grouped_mm(a, b, offs=offs)
    # Off the kernel's 16-byte stride grid (odd test sizes): one matmul per group. Reading
    # offs here costs nothing: on CPU there is no device to wait for.
    out = a.new_zeros(a.shape[0], b.shape[-1])
    start = 0
    for g, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = a[start:end] @ b[g]
        start = end
    return out


# torch 2.13 runs `grouped_mm` on CPU in any float dtype, but its meta function (what
# torch.compile traces with) accepts bf16 only; an opaque op with its own fake keeps fp32 CPU
# models compilable. CUDA calls F.grouped_mm directly (the kernel the graph captures).
_cpu_group_mm = torch.library.custom_op("mtpserve::group_mm_cpu", mutates_args=())(
    _cpu_group_mm_impl)


@_cpu_group_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return a.new_empty(a.shape[0], b.shape[-1])


def _aligned(t: torch.Tensor) -> bool:
    """grouped_mm's layout rule: the non-unit stride of the last two dims a multiple of 16 B."""
    step = 16 // t.element_size()
    s = t.stride()
    return (s[-1] == 1 and s[-2] % step == 0) or (s[-2] == 1 and s[-1] % step == 0)


def _masked_group_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """The grouped product with static shapes and no host read, without a grouped kernel:
    every group's matmul over all rows, each row keeping its own group's. G times the FLOPs,
    so only for what the CUDA kernel refuses (fp32 / fp16 serving on CUDA)."""
    rows = torch.arange(a.shape[0], device=a.device, dtype=offs.dtype)
    group = torch.searchsorted(offs, rows, right=True)  # the group each row falls in
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for g in range(b.shape[0]):
        out = torch.where((group == g).unsqueeze(-1), a @ b.select(0, g), out)
    return out


def group_mm(a: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """a [M, K] rows sorted by group, w [G, N, K], offs [G] int32 (end row of each group,
    offs[-1] == M) -> [M, N], row r times w[its group]^T. Static shapes, no host read."""
    b = w.transpose(1, 2)  # [G, K, N] column-major: the layout grouped GEMM kernels take
    if a.device.type == "cpu":  # the op only where traced: its dispatch costs ~40 us eager
        op = _cpu_group_mm if torch.compiler.is_compiling() else _cpu_group_mm_impl
        return op(a, b, offs)
    if a.dtype == w.dtype == torch.bfloat16 and _aligned(a) and _aligned(b):
        return F.grouped_mm(a, b, offs=offs)
    return _masked_group_mm(a, b, offs)


def dequantize_experts(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype,
                       chunk: int = 8) -> torch.Tensor:
    """[G, R, C] fp8 experts with [G, R / 128, C / 128] block scales -> `dtype`, computed in
    fp32 and rounded once (the values a dequantize-at-load twin holds); `chunk` experts at a
    time, so the fp32 intermediate stays small."""
    g, r, c = w.shape
    out = torch.empty(g, r, c, dtype=dtype, device=w.device)
    # narrow / index_copy_ rather than indexing and copy_: the ops a CPU build's fake CUDA
    # tensors run (the no-host-read test), and the same kernels on a real device.
    for i in range(0, g, chunk):
        n = min(chunk, g - i)
        blocks = w.narrow(0, i, n).float().view(n, r // GROUP, GROUP, c // GROUP, GROUP)
        si = scale_inv.narrow(0, i, n).float().view(n, r // GROUP, 1, c // GROUP, 1)
        out.index_copy_(0, torch.arange(i, i + n, device=w.device),
                        (blocks * si).view(n, r, c).to(dtype))
    return out


class Experts(nn.Module):
    """Routed experts as stacked weights: w13 [E, 2 * I_local, hidden] (gate; up) and
    w2 [E, hidden, I_local]; checkpoint tensors `experts.{e}.{gate,up,down}_proj.weight`.

    With `model_cfg` given and `fp8.keep_experts_fp8(model_cfg, tp, device type)` true, w13 and
    w2 hold the checkpoint's float8_e4m3fn values and `w13_scale_inv` [E, 2 I_local / 128,
    hidden / 128] / `w2_scale_inv` [E, hidden / 128, I_local / 128] their 128x128 block
    scales (fp32), this rank's blocks; they are dequantized at use."""

    def __init__(self, hidden: int, cfg: MoEConfig, model_cfg: ModelConfig | None = None
                 ) -> None:
        super().__init__()
        tp = get_tp()
        self.num_experts, self.tp_rank = cfg.num_experts, tp.rank
        self.full_inter = cfg.intermediate_size
        self.local_inter = _divide(cfg.intermediate_size, tp.size, "moe_intermediate_size")
        # The same rule wherever the module is built (a load, a meta-device memory plan).
        self.fp8 = model_cfg is not None and keep_experts_fp8(
            model_cfg, tp.size, torch.get_default_device().type)
        n, i = cfg.num_experts, self.local_inter
        dtype = FP8 if self.fp8 else None
        self.w13 = nn.Parameter(torch.empty(n, 2 * i, hidden, dtype=dtype),
                                requires_grad=not self.fp8)
        self.w13.weight_loader = self.weight_loader
        self.w2 = nn.Parameter(torch.empty(n, hidden, i, dtype=dtype),
                               requires_grad=not self.fp8)
        self.w2.weight_loader = self.weight_loader
        # fp32 block scales of the fp8 experts (None otherwise).
        self.register_buffer("w13_scale_inv", torch.ones(
            n, 2 * i // GROUP, hidden // GROUP, dtype=torch.float32) if self.fp8 else None)
        self.register_buffer("w2_scale_inv", torch.ones(
            n, hidden // GROUP, i // GROUP, dtype=torch.float32) if self.fp8 else None)
        # bf16 bits of float32 experts a bf16 checkpoint holds (bf16_weights.pack_linears).
        self.register_buffer("w13_packed", None, persistent=False)
        self.register_buffer("w2_packed", None, persistent=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: tuple[int, int | None]) -> None:
        """shard = (expert, 0 gate | 1 up | None down); keeps this rank's intermediate slice."""
        expert, part = shard
        i, full = self.local_inter, self.full_inter
        hidden = param.shape[1] if part is None else param.shape[2]
        want = (hidden, full) if part is None else (full, hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape mismatch: expected {want}, got {tuple(loaded.shape)}")
        if self.fp8 and loaded.dtype != FP8:
            raise ValueError(f"expert weight of dtype {loaded.dtype} where the experts keep "
                             "the checkpoint's fp8 values (a weight_scale_inv is needed)")
        if part is None:
            param.data[expert].copy_(loaded.narrow(1, self.tp_rank * i, i))
        else:
            param.data[expert, part * i:(part + 1) * i].copy_(
                loaded.narrow(0, self.tp_rank * i, i))

    def scale_loader(self, param: nn.Parameter, scale_inv: torch.Tensor,
                     shard: tuple[int, int | None]) -> None:
        """One expert part's `weight_scale_inv` [rows / 128, cols / 128] -> this rank's blocks,
        the slice `weight_loader` takes of the weight (the local slice is on the 128 grid)."""
        expert, part = shard
        full, b = self.full_inter // GROUP, self.local_inter // GROUP
        hidden = self.w13.shape[2] // GROUP
        want = (hidden, full) if part is None else (full, hidden)
        if tuple(scale_inv.shape) != want:
            raise ValueError(f"scale shape mismatch: expected {want}, "
                             f"got {tuple(scale_inv.shape)}")
        if part is None:
            self.w2_scale_inv[expert].copy_(scale_inv.narrow(1, self.tp_rank * b, b))
        else:
            self.w13_scale_inv[expert, part * b:(part + 1) * b].copy_(
                scale_inv.narrow(0, self.tp_rank * b, b))

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # `.to(dtype)` (lower_mtp_precision) casts every float tensor: fp8 experts keep their
        # fp8 values and fp32 scales and follow only the device (no transient wide copy).
        if not self.fp8:
            return super()._apply(fn, recurse)
        device = fn(torch.empty(0, device=self.w13.device)).device
        for n in ("w13", "w2", "w13_scale_inv", "w2_scale_inv"):
            t = getattr(self, n)
            t.data = t.data.to(device)
        return self

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights/idx [T, K] -> this rank's partial sum [T, hidden]."""
        T, K = idx.shape
        if self.w13_packed is not None and x.dtype == torch.float32:
            return self._packed(x, weights, idx)
        if x.device.type == "cpu" and not self.fp8 and torch.compiler.is_compiling():
            # Reading each pair's expert in place beats the grouped product until the pairs
            # re-read the experts many times over (measured crossover: module docstring).
            return torch.cond(T * K <= _INDIRECT_PAIRS_PER_EXPERT * self.num_experts,
                              self._indirect, self._grouped, (x, weights, idx))
        # Elsewhere T and K are static in a compiled bucket, so this choice is too; a
        # dynamic-shape package is traced with T * K > 1 and runs the grouped path at every T.
        if T * K <= _GATHER_PAIRS:
            return self._gathered(x, weights, idx)
        return self._grouped(x, weights, idx)

    # Step's clamp of the routed experts (`layers.swiglu`); set by MoE, None: plain SwiGLU.
    limit: float | None = None

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        return swiglu(gate, up, self.limit)

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor,
                  idx: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair gathers its expert's weights; one bmm runs them all."""
        T, K = idx.shape
        flat = idx.reshape(-1)
        w13, w2 = self.w13[flat], self.w2[flat]
        if self.fp8:
            w13 = dequantize_experts(w13, self.w13_scale_inv[flat], x.dtype)
            w2 = dequantize_experts(w2, self.w2_scale_inv[flat], x.dtype)
        xk = x.unsqueeze(1).expand(T, K, x.shape[-1]).reshape(T * K, -1, 1)
        h = self._swiglu(torch.bmm(w13, xk).squeeze(-1))  # [T*K, I]
        out = torch.bmm(w2, h.unsqueeze(-1)).view(T, K, -1)
        return (out * weights.unsqueeze(-1)).sum(dim=1)

    def _packed(self, x: torch.Tensor, weights: torch.Tensor,
                idx: torch.Tensor) -> torch.Tensor:
        """Float32 experts streamed from their bf16 copy (bf16_weights.experts_linear): each
        pair's rows through its expert in one C++ call per projection, eager or compiled."""
        T, K = idx.shape
        flat = idx.reshape(-1)
        xk = x.unsqueeze(1).expand(T, K, x.shape[-1]).reshape(T * K, -1)
        h = self._swiglu(bf16_weights.experts_linear(xk, flat, self.w13, self.w13_packed))
        out = bf16_weights.experts_linear(h, flat, self.w2, self.w2_packed).view(T, K, -1)
        return (out * weights.unsqueeze(-1)).sum(dim=1)

    def _indirect(self, x: torch.Tensor, weights: torch.Tensor,
                  idx: torch.Tensor) -> torch.Tensor:
        """Compiled CPU graphs: each pair's products written as broadcast products and sums
        over its expert's weights, which inductor's C++ code generator turns into reductions
        with indirect loads: every pair reads its expert's weights in place (no copy, no
        sort, no grouped kernel). Eagerly this would materialise [T*K, 2I, H]: graphs only."""
        T, K = idx.shape
        flat = idx.reshape(-1)
        xk = x.unsqueeze(1).expand(T, K, x.shape[-1]).reshape(T * K, 1, -1)
        h = self._swiglu((self.w13[flat] * xk).sum(-1))  # [T*K, 2I] -> [T*K, I]
        out = (self.w2[flat] * h.unsqueeze(1)).sum(-1).view(T, K, -1)
        return (out * weights.unsqueeze(-1)).sum(dim=1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor,
                 idx: torch.Tensor) -> torch.Tensor:
        """Pairs sorted by expert, group offsets computed on the device, two grouped matmuls
        over the experts' own weights: static shapes, no host read, no weight copies."""
        T, K = idx.shape
        E, M = self.num_experts, T * K
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        experts = torch.arange(E, device=idx.device, dtype=flat.dtype)
        # offs[e] = pairs routed to experts <= e: the end row of expert e's group.
        offs = torch.searchsorted(flat.index_select(0, order), experts, right=True,
                                  out_int32=True)
        rows = x.index_select(0, order // K)  # [M, hidden], grouped by expert
        w13, w2 = self.w13, self.w2
        # The fused FP8 kernel knows no SwiGLU clamp: clamped experts take the torch path.
        if self.fp8 and x.is_cuda and fp8_grouped_kernel is not None and self.limit is None:
            out = fp8_grouped_kernel(self, rows, offs)
        else:
            if self.fp8:
                w13, w2, offs = self._used_experts_dequantized(offs, min(E, M), x.dtype)
            h = self._swiglu(group_mm(rows, w13, offs))
            out = group_mm(h, w2, offs)  # [M, hidden], still by expert
        # Back to (token, slot) order (a permutation: no atomics, deterministic), then the
        # gathered path's weighted sum over slots.
        out = torch.empty_like(out).index_copy_(0, order, out).view(T, K, -1)
        return (out * weights.unsqueeze(-1)).sum(dim=1)

    def _used_experts_dequantized(self, offs: torch.Tensor, n: int, dtype: torch.dtype
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w13, w2, offs) over `n` = min(E, pairs) experts: those that have pairs first, in
        expert order, padded with unused ones (zero rows), dequantized to `dtype`. A static
        count, yet never more experts than pairs, so a decode step dequantizes what it uses."""
        counts = torch.diff(offs, prepend=offs.new_zeros(1))
        sel = torch.argsort((counts == 0).to(torch.int8), stable=True).narrow(0, 0, n)
        offs = torch.cumsum(counts.index_select(0, sel), 0, dtype=torch.int32)
        w13 = dequantize_experts(self.w13.index_select(0, sel),
                                 self.w13_scale_inv.index_select(0, sel), dtype)
        w2 = dequantize_experts(self.w2.index_select(0, sel),
                                self.w2_scale_inv.index_select(0, sel), dtype)
        return w13, w2, offs


class MoE(nn.Module):
    """Router + routed experts (+ shared experts); one all-reduce per layer under TP."""

    def __init__(self, hidden: int, cfg: MoEConfig, model_cfg: ModelConfig | None = None,
                 layer_idx: int | None = None) -> None:
        super().__init__()
        spec = (model_cfg.layer(layer_idx) if model_cfg is not None and layer_idx is not None
                else None)
        self.gate = Router(hidden, cfg)
        self.experts = Experts(hidden, cfg, model_cfg)
        self.experts.limit = spec.swiglu_limit if spec is not None else None
        self.shared_experts = (
            MLP(hidden, cfg.shared_experts_width, reduce=False,
                limit=spec.shared_swiglu_limit if spec is not None else None)
            if cfg.num_shared_experts else None
        )
        # Qwen3-Next: `shared_expert` (its own width) times sigmoid(shared_expert_gate(x)); the
        # gate is replicated, so scaling this rank's partial sum keeps the all-reduce exact.
        self.shared_expert = (MLP(hidden, cfg.shared_intermediate_size, reduce=False)
                              if cfg.shared_expert_gate else None)
        self.shared_expert_gate = (ReplicatedLinear(hidden, 1) if cfg.shared_expert_gate
                                   else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        weights, idx = self.gate(x2)
        y = self.experts(x2, weights, idx)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x2)
        if self.shared_expert is not None:
            y = y + torch.sigmoid(self.shared_expert_gate(x2)) * self.shared_expert(x2)
        return all_reduce(y).view(shape)
