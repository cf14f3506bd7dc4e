"""Tensor-parallel layers: column/row-parallel linears and a vocab-parallel embedding/head.

Each parameter carries a `weight_loader(param, loaded, shard_id=None)` that narrows the full
checkpoint tensor to this rank's shard, so the model file stays TP-agnostic. With no process
group (TP=1) every layer is a plain linear/embedding and no collective runs.

The activations' collectives go through shared memory when the ranks share a CPU node
(`workers.model.shm_collectives`), else through the data process group. Inside a compiled graph
the shared-memory ones are the custom ops `mtpserve::tp_all_reduce` / `tp_all_gather_last`, so
TP ranks run compiled decode graphs too (an opaque op in the graph, called back each forward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.model import bf16_weights

if TYPE_CHECKING:
    from mtpserve.workers.model.shm_collectives import ShmCollectives


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    shm: ShmCollectives | None = None  # same-node CPU ranks: collectives in shared memory


_TP = TPGroup()


def get_tp() -> TPGroup:
    return _TP


def set_tp(rank: int, size: int, group: dist.ProcessGroup | None,
           shm: ShmCollectives | None = None) -> None:
    """Set this process's TP coordinates; call before building the model."""
    global _TP
    _TP = TPGroup(rank, size, group, shm)


@contextmanager
def construction_tp(rank: int, size: int) -> Iterator[TPGroup]:
    """TP coordinates (no process group) for building one rank's shard, e.g. on the meta
    device for a memory plan (workers/memory_plan.py); the previous ones come back on exit.
    Layers read `get_tp()` when built, so the shapes are the rank's; a forward of such a
    model would need the group. Process-global, like `set_tp`: not for a process that is
    serving."""
    global _TP
    prev, _TP = _TP, TPGroup(rank, size, None)
    try:
        yield _TP
    finally:
        _TP = prev


@torch.library.custom_op("mtpserve::tp_all_reduce", mutates_args=())
def _shm_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp().shm.all_reduce(x)


@_shm_all_reduce.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("mtpserve::tp_all_gather_last", mutates_args=())
def _shm_all_gather_last(x: torch.Tensor) -> torch.Tensor:
    return get_tp().shm.all_gather_last(x)


@_shm_all_gather_last.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], x.shape[-1] * get_tp().size))


def _on_shm(op: Callable[[torch.Tensor], torch.Tensor],
            eager: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """A shared-memory collective: its custom op while a graph is traced (the graph calls it
    back), the method itself in eager forwards (a custom op's dispatch costs ~8 us here)."""
    return op(x) if torch.compiler.is_compiling() else eager(x)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks (public name, for layers that sum partials themselves)."""
    return _all_reduce(x)


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP ranks (may reuse `x`; use the result)."""
    tp = get_tp()
    if tp.size == 1:
        return x
    if tp.shm is not None:
        return _on_shm(torch.ops.mtpserve.tp_all_reduce, tp.shm.all_reduce, x)
    dist.all_reduce(x, group=tp.group)
    return x


def _all_gather_last(x: torch.Tensor) -> torch.Tensor:
    tp = get_tp()
    if tp.size == 1:
        return x
    if tp.shm is not None:
        return _on_shm(torch.ops.mtpserve.tp_all_gather_last, tp.shm.all_gather_last, x)
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {d}")
    return n // d


def _plain_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: expected {tuple(param.shape)}, got {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def components_loader(sizes: list[int]):
    """A weight loader for a checkpoint tensor whose dim 0 concatenates components of `sizes`
    (q | k | v channels, or one component): this rank keeps its 1/tp of each, concatenated."""

    def load(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        tp = get_tp()
        if loaded.shape[0] != sum(sizes) or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"shape mismatch: expected ({sum(sizes)}, "
                             f"*{tuple(param.shape[1:])}), got {tuple(loaded.shape)}")
        parts = [part.narrow(0, tp.rank * (n // tp.size), n // tp.size)
                 for part, n in zip(torch.split(loaded, sizes), sizes, strict=True)]
        param.data.copy_(torch.cat(parts))

    return load


class ReplicatedLinear(nn.Module):
    """Full weight on every rank (small projections such as the MTP `eh_proj`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.weight.weight_loader = _plain_loader
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = _plain_loader
        self.register_buffer("packed_bf16", None, persistent=False)  # bf16_weights.pack_linears

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_weights.linear(x, self.weight, self.bias, self.packed_bf16)


class ColumnParallelLinear(nn.Module):
    """Output features split across ranks; `output_sizes` lists fused sub-matrices
    (e.g. [q, k, v] or [gate, up]) so each is sharded separately. `replicas[i]` ranks hold
    the same shard of part i (default 1): the part is split into tp / replicas[i] shards and
    rank r holds shard r // replicas[i] (GQA's K and V when TP exceeds the KV heads)."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 replicas: list[int] | None = None) -> None:
        super().__init__()
        tp = get_tp()
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.full_sizes = list(output_sizes)
        self.replicas = list(replicas) if replicas else [1] * len(output_sizes)
        if len(self.replicas) != len(output_sizes) or any(
                n < 1 or tp.size % n for n in self.replicas):
            raise ValueError(f"replicas {self.replicas} of {output_sizes} under TP {tp.size}")
        self.local_sizes = [_divide(s, tp.size // n, "output size")
                            for s, n in zip(output_sizes, self.replicas, strict=True)]
        out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader
        self.register_buffer("packed_bf16", None, persistent=False)  # bf16_weights.pack_linears

    def weight_loader(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        shard_id = shard_id or 0
        full, local = self.full_sizes[shard_id], self.local_sizes[shard_id]
        if loaded.shape[0] != full or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(
                f"shape mismatch: expected ({full}, *{tuple(param.shape[1:])}), "
                f"got {tuple(loaded.shape)}"
            )
        offset = sum(self.local_sizes[:shard_id])
        param.data.narrow(0, offset, local).copy_(
            loaded.narrow(0, self.shard_start(shard_id), local))

    @property
    def replicated(self) -> bool:
        """Whether some part is held whole by more than one rank (its rows are not at
        tp_rank * local in the checkpoint tensor: use `shard_start`)."""
        return any(n > 1 for n in self.replicas)

    def shard_start(self, part: int = 0) -> int:
        """Row of checkpoint part `part` where this rank's shard of it starts."""
        return (self.tp_rank // self.replicas[part]) * self.local_sizes[part]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bf16_weights.linear(x, self.weight, self.bias, self.packed_bf16)


class RowParallelLinear(nn.Module):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 reduce: bool = True) -> None:
        super().__init__()
        tp = get_tp()
        self.tp_rank = tp.rank
        self.reduce = reduce  # False: the caller sums the partials (one all-reduce per layer)
        if bias and not reduce:
            raise ValueError("a bias needs the reduced output")
        self.local_in = _divide(in_features, tp.size, "input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = _plain_loader
        self.register_buffer("packed_bf16", None, persistent=False)  # bf16_weights.pack_linears

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None):
        if loaded.shape[0] != param.shape[0] or loaded.shape[1] != self.local_in * get_tp().size:
            raise ValueError(
                f"shape mismatch: expected ({param.shape[0]}, {self.local_in * get_tp().size}), "
                f"got {tuple(loaded.shape)}"
            )
        param.data.copy_(loaded.narrow(1, self.tp_rank * self.local_in, self.local_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = bf16_weights.linear(x, self.weight, None, self.packed_bf16)
        if not self.reduce:
            return y
        y = _all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Vocabulary rows split across ranks; out-of-shard ids contribute zeros, then all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp()
        self.vocab_size = vocab_size
        self.local_vocab = _divide(vocab_size, tp.size, "vocab_size")
        self.start = tp.rank * self.local_vocab
        self.tp_size = tp.size
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden_size))
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None):
        if loaded.shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"shape mismatch: expected ({self.vocab_size}, {param.shape[1]}), "
                f"got {tuple(loaded.shape)}"
            )
        param.data.copy_(loaded.narrow(0, self.start, self.local_vocab))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        return _all_reduce(out * mask.unsqueeze(-1).to(out.dtype))


class ParallelLMHead(VocabParallelEmbedding):
    """Vocab-parallel output projection; logits are gathered so every rank sees all of them."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        self.register_buffer("packed_bf16", None, persistent=False)  # bf16_weights.pack_linears

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return _all_gather_last(bf16_weights.linear(hidden, self.weight, None, self.packed_bf16))


# Logit of a token outside a draft vocabulary: exp() of it is 0 next to any real logit, so
# q is the subset's softmax; but it is finite, so if a min_tokens mask (-inf) covers the whole
# subset, q falls back to the other tokens instead of becoming NaN (any q is exact).
OUTSIDE_SUBSET = -1e20


class SubsetLMHead(nn.Module):
    """An LM head over a subset of the vocabulary (a draft vocabulary): the other tokens get
    OUTSIDE_SUBSET, so softmax, top-k/top-p and argmax over the full [.., V] row see only the
    subset. The rows are a replicated copy (they are few), so no collective runs."""

    def __init__(self, full_weight: torch.Tensor, token_ids: list[int]) -> None:
        super().__init__()
        self.vocab_size = full_weight.shape[0]
        idx = torch.tensor(token_ids, dtype=torch.long, device=full_weight.device)
        self.register_buffer("token_ids", idx, persistent=False)
        self.weight = nn.Parameter(full_weight.index_select(0, idx).clone(),
                                   requires_grad=False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        sub = F.linear(hidden, self.weight).float()  # OUTSIDE_SUBSET is -inf in fp16
        full = sub.new_full((*sub.shape[:-1], self.vocab_size), OUTSIDE_SUBSET)
        return full.index_copy(-1, self.token_ids, sub)


def full_head_weight(head: ParallelLMHead) -> torch.Tensor:
    """[V, hidden] of a vocab-parallel head (gathered from every TP rank: a collective)."""
    tp = get_tp()
    if tp.size == 1:
        return head.weight.data
    parts = [torch.empty_like(head.weight.data) for _ in range(tp.size)]
    dist.all_gather(parts, head.weight.data.contiguous(), group=tp.group)
    return torch.cat(parts, dim=0)
