"""Mixture-of-experts MLP: router, batched routed experts, shared experts.

Routers (each the exact op sequence of its transformers reference, so expert choices match):
- softmax top-k, optionally renormalised (`norm_topk_prob`): Qwen3-MoE (`Qwen3MoeTopKRouter`).
- sigmoid scores; the choice adds `e_score_correction_bias` and keeps the best `topk_group`
  of `n_group` groups (a group scores the sum of its top-2); the weights are the plain sigmoid
  scores of the chosen experts, renormalised, times `routed_scaling_factor`: DeepSeek-V3 and
  GLM-4.5 (`Glm4MoeTopkRouter`). Router weight and bias are fp32, as transformers keeps them.

Experts run batched, never one token at a time:
- gathered (decode; always inside compiled graphs): each (token, slot) pair gathers its
  expert's weights and one `bmm` runs them all. Static shapes, so the compiled decode graphs
  cover MoE layers; it reads T*K experts' weights, which is what decode reads anyway.
- grouped by expert (large eager batches: prefill): pairs sorted by expert, one matmul per
  expert that has tokens (a loop over experts, not tokens).

Tensor parallelism: every rank holds a 1/tp slice of every expert's intermediate dimension
(and of the shared experts'); the router is replicated and runs on the same (all-reduced)
input on every rank, so routing is identical everywhere; routed + shared partial outputs are
summed with one all-reduce per layer.

Expert parallelism (not built): would give each rank E/ep whole experts instead of slices;
the gathered path becomes an all-to-all dispatch of (token, slot) pairs to the owning rank and
a combine back, the router staying replicated. `MoE.experts` is the only piece that changes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.model.families.base import MoEConfig
from mtpserve.workers.model.layers import MLP
from mtpserve.workers.model.parallel import (
    ReplicatedLinear,
    _divide,
    _plain_loader,
    all_reduce,
    get_tp,
)

_GATHER_BYTES = 64 << 20


class Router(nn.Module):
    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # fp32 for the sigmoid routers (transformers' _keep_in_fp32_modules_strict); the
        # softmax router runs in the model dtype like Qwen3MoeTopKRouter.
        fp32 = torch.float32 if cfg.scoring == "sigmoid" else None
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, hidden, dtype=fp32))
        self.weight.weight_loader = _plain_loader
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
            logits = F.linear(x, self.weight)
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            top, idx = torch.topk(probs, c.top_k, dim=-1)
            if c.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return top.to(logits.dtype), idx
        scores = F.linear(x.float(), self.weight.float()).sigmoid()
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


class Experts(nn.Module):
    """Routed experts as stacked weights: w13 [E, 2 * I_local, hidden] (gate; up) and
    w2 [E, hidden, I_local]; checkpoint tensors `experts.{e}.{gate,up,down}_proj.weight`."""

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        tp = get_tp()
        self.num_experts, self.tp_rank = cfg.num_experts, tp.rank
        self.full_inter = cfg.intermediate_size
        self.local_inter = _divide(cfg.intermediate_size, tp.size, "moe_intermediate_size")
        n, i = cfg.num_experts, self.local_inter
        self.w13 = nn.Parameter(torch.empty(n, 2 * i, hidden))
        self.w13.weight_loader = self.weight_loader
        self.w2 = nn.Parameter(torch.empty(n, hidden, i))
        self.w2.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor,
                      shard: tuple[int, int | None]) -> None:
        """shard = (expert, 0 gate | 1 up | None down); keeps this rank's intermediate slice."""
        expert, part = shard
        i, full = self.local_inter, self.full_inter
        hidden = param.shape[1] if part is None else param.shape[2]
        want = (hidden, full) if part is None else (full, hidden)
        if tuple(loaded.shape) != want:
            raise ValueError(f"shape mismatch: expected {want}, got {tuple(loaded.shape)}")
        if part is None:
            param.data[expert].copy_(loaded.narrow(1, self.tp_rank * i, i))
        else:
            param.data[expert, part * i:(part + 1) * i].copy_(
                loaded.narrow(0, self.tp_rank * i, i))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights/idx [T, K] -> this rank's partial sum [T, hidden]."""
        T, K = idx.shape
        # Gathering costs T*K experts' weights of traffic; grouping reads each hit expert once
        # but loops over experts with a host sync. Gather while it reads no more than all the
        # experts would, or no more than _GATHER_BYTES (small models: always at decode sizes).
        pair_bytes = self.w13[0].nbytes + self.w2[0].nbytes
        if (torch.compiler.is_compiling() or T * K <= self.num_experts
                or T * K * pair_bytes <= _GATHER_BYTES):
            return self._gathered(x, weights, idx)
        return self._grouped(x, weights, idx)

    def _swiglu(self, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up

    def _gathered(self, x: torch.Tensor, weights: torch.Tensor,
                  idx: torch.Tensor) -> torch.Tensor:
        T, K = idx.shape
        flat = idx.reshape(-1)
        xk = x.unsqueeze(1).expand(T, K, x.shape[-1]).reshape(T * K, -1, 1)
        h = self._swiglu(torch.bmm(self.w13[flat], xk).squeeze(-1))  # [T*K, I]
        out = torch.bmm(self.w2[flat], h.unsqueeze(-1)).view(T, K, -1)
        return (out * weights.unsqueeze(-1)).sum(dim=1)

    def _grouped(self, x: torch.Tensor, weights: torch.Tensor,
                 idx: torch.Tensor) -> torch.Tensor:
        T, K = idx.shape
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        token = order // K
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        w = weights.reshape(-1)[order].unsqueeze(-1)
        rows = x[token]
        out = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                seg = slice(start, start + n)
                h = self._swiglu(F.linear(rows[seg], self.w13[e]))
                out[seg] = F.linear(h, self.w2[e])
                start += n
        return torch.zeros_like(x).index_add_(0, token, out * w)


class MoE(nn.Module):
    """Router + routed experts (+ shared experts); one all-reduce per layer under TP."""

    def __init__(self, hidden: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.gate = Router(hidden, cfg)
        self.experts = Experts(hidden, cfg)
        self.shared_experts = (
            MLP(hidden, cfg.intermediate_size * cfg.num_shared_experts, reduce=False)
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
