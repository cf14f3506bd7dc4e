"""Gated DeltaNet (Qwen3-Next's linear attention) in plain torch, over per-request state slots.

A layer projects x to q, k, v (grouped: each key head serves num_v / num_k value heads), the
output gate z and the per-value-head b (write strength, beta = sigmoid(b)) and a (decay,
g = -exp(A_log) * softplus(a + dt_bias)); q | k | v pass a causal depthwise conv (kernel K,
silu), q and k are L2-normalised, and the gated delta rule runs per value head over a
[key_dim, value_dim] state S:

    S <- S * exp(g_t);  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t / sqrt(dk)

then o = out_proj(RMSNorm(o) * silu(z)). The math and op order are transformers'
`Qwen3NextGatedDeltaNet` (chunked form `torch_chunk_gated_delta_rule`, recurrent form
`torch_recurrent_gated_delta_rule`).

State: one slot per running request (`workers/state_pool.py`) holds, for every linear layer,
the conv window (the last K - 1 conv inputs) and the recurrent state (fp32). A row whose start
position is 0 starts from zeros; padded positions of a row (a shorter row in a padded batch)
get beta = 0 and g = 0, so they leave the state unchanged and the state written back is the
one after the row's last real token.

Forms: rows of more than `RECURRENT_MAX` tokens (prefill chunks) use the chunked form; shorter
ones (decode and verify rows [last, d1..dk]) use the recurrent form. A verify forward (rows of
at most k + 1 tokens) copies the state after each of its first S - 1 positions, and the conv
inputs of those positions, into buffers the state pool preallocates
(`LinearState.keep_rec` / `keep_conv`, `StateCache`: max_num_seqs x k states per layer), so
after acceptance the engine keeps the state at the last accepted token (`LinearState.keep`)
without recomputing anything; the state after the last position is the slot's own.

Tensor parallelism (as vLLM shards Qwen3-Next): rank r of `tp` holds key heads
[r Hk/tp, (r+1) Hk/tp) and the value heads they serve. The input projections are column
parallel (the fused `in_proj_qkvz` / `in_proj_ba` group their outputs per key head, so a
contiguous slice is a set of whole key heads; Qwen3.5's `in_proj_qkv` is cut per q | k | v
component), the conv weight and its state are cut per component (the rank's conv channels are
[q_r | k_r | v_r]), `dt_bias`, `A_log` and the recurrent state by value head, `out_proj` is
row parallel (one all-reduce per layer); the gated norm works per head and stays replicated.
The recurrence needs no collective: heads never mix.

Kernels: on CUDA, with the flash-linear-attention package importable (`pip install
mtpserve[cuda]`, import name `fla`) and `MTPSERVE_LINEAR_ATTENTION` not `torch`, the delta rule
runs in fla's Triton kernels (`fla_gated_delta_rule`; the layout mapping is stated there);
everything else (projections, the conv with its window bookkeeping, the gated norm) stays torch.
The choice is made once per layer at model build (`select_linear_attention_backend`), logged
once per process, and recorded (`GatedDeltaNet.backend`, `linear_attention_backend()`).
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.model.families.base import LinearAttentionConfig
from mtpserve.workers.model.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _divide,
    _plain_loader,
    components_loader,
    get_tp,
)

RECURRENT_MAX = 16  # rows up to this many tokens run the recurrent form (and keep snapshots)

log = logging.getLogger(__name__)

LINEAR_ATTENTION_ENV = "MTPSERVE_LINEAR_ATTENTION"  # auto (default) | torch | fla
_logged: set[tuple[str, str]] = set()
_active: str | None = None  # the backend of the last GatedDeltaNet built in this process


def select_linear_attention_backend(device: torch.device | str) -> tuple[str, str]:
    """("fla" | "torch", why) for a layer built on `device`.

    fla needs a CUDA device and an importable `fla` (its import compiles nothing but checks
    Triton, and a Triton it does not match raises at import, not only ImportError: any error
    means torch). `MTPSERVE_LINEAR_ATTENTION=torch` forces torch; `=fla` demands the kernels
    and raises where they cannot run, so a benchmark never measures the fallback unknowingly.
    """
    want = os.environ.get(LINEAR_ATTENTION_ENV, "auto").strip().lower() or "auto"
    if want not in ("auto", "torch", "fla"):
        raise ValueError(f"{LINEAR_ATTENTION_ENV}={want!r}: expected auto, torch or fla")
    if want == "torch":
        return "torch", f"{LINEAR_ATTENTION_ENV}=torch"
    if torch.device(device).type != "cuda":
        why = f"device is {torch.device(device).type}, the fla kernels need CUDA"
    else:
        try:
            _fla_kernels()
            return "fla", "CUDA and flash-linear-attention importable"
        except Exception as e:  # noqa: BLE001 - any import failure means the torch path
            why = f"flash-linear-attention not usable ({type(e).__name__}: {e})"
    if want == "fla":
        raise RuntimeError(f"{LINEAR_ATTENTION_ENV}=fla but {why}")
    return "torch", why


def linear_attention_backend() -> str | None:
    """The delta-rule backend of the last Gated DeltaNet layer built in this process ("fla" or
    "torch"), None when no hybrid model was built here."""
    return _active


def _record_backend(backend: str, why: str) -> None:
    global _active
    _active = backend
    if (backend, why) not in _logged:  # once per process, not once per layer
        _logged.add((backend, why))
        log.info("Gated DeltaNet delta rule: %s (%s)", backend, why)


def _fla_kernels():
    """(chunk_gated_delta_rule, fused_recurrent_gated_delta_rule) from fla."""
    mod = importlib.import_module("fla.ops.gated_delta_rule")
    return mod.chunk_gated_delta_rule, mod.fused_recurrent_gated_delta_rule


def fla_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, state: torch.Tensor,
                         keep: torch.Tensor | None = None, kernels=None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule through fla (fla-core 0.5.2, read in fla/ops/gated_delta_rule/chunk.py
    `chunk_gated_delta_rule`, fused_recurrent.py `fused_recurrent_gated_delta_rule`, naive.py).

    Inputs in OUR pre-kernel form, sequence-first: q, k [B, S, Hk, Dk] (conv output, not yet
    normalised, not repeated to Hv), v [B, S, Hv, Dv], g, beta [B, S, Hv] (g in log space:
    the state is multiplied by exp(g); beta after the sigmoid), state [B, Hv, Dk, Dv] fp32.
    The mapping to fla, term by term:
    - layout: fla is sequence-first [B, T, H, K] for q, k, v, g, beta; our torch path is
      head-first [B, H, S, D], so nothing is transposed here;
    - grouped heads: fla's GVA serves value head i from key head i // (Hv / Hk)
      (fused_recurrent.py: `i_h = i_hv // (HV // H)`), which is our `repeat_interleave`;
    - l2norm: `use_qk_l2norm_in_kernel=True` is x / sqrt(sum x^2 + 1e-6) (fla/modules/l2norm.py),
      our `l2norm`;
    - scale: ours multiplies q by Dk^-0.5 after the norm; fla's `scale` does the same;
    - gate: fla's `g` is the log-space decay when `use_gate_in_kernel=False` (default), as ours;
      beta is post-sigmoid when `use_beta_sigmoid_in_kernel=False` (default), as ours;
    - state: fla's `initial_state` / final state are [N, HV, K, V] with `state_v_first=False`
      (default), our [B, Hv, Dk, Dv]; o comes back [B, T, HV, V].
    Same dtypes as transformers' Qwen3-Next fast path (q, k, v, beta in the model dtype, g fp32).

    keep: fla returns only the final state, but a verify row needs the state after every
    position but the last (`LinearState.keep`), so with `keep` ([B, S - 1, Hv, Dk, Dv] fp32,
    the state pool's buffer) the fused recurrent kernel runs once per position, each call
    starting from the previous call's state (S <= RECURRENT_MAX launches), and the state after
    position t is copied into keep[:, t]. Otherwise the chunked kernel (S > RECURRENT_MAX) or
    one recurrent call.
    -> (out [B, S, Hv, Dv], final state [B, Hv, Dk, Dv])."""
    chunk, recurrent = kernels if kernels is not None else _fla_kernels()
    scale = q.shape[-1] ** -0.5
    kw = dict(scale=scale, output_final_state=True, use_qk_l2norm_in_kernel=True)
    S = q.shape[1]
    if S > RECURRENT_MAX:
        assert keep is None, "states are kept for recurrent-form rows only"
        out, final = chunk(q, k, v, g=g, beta=beta, initial_state=state, **kw)
        return out, final.float()
    outs = []
    steps = [(0, S)] if keep is None or S == 1 else [(t, t + 1) for t in range(S)]
    for a, b in steps:
        o, state = recurrent(q[:, a:b], k[:, a:b], v[:, a:b], g=g[:, a:b], beta=beta[:, a:b],
                             initial_state=state, **kw)
        state = state.float()
        outs.append(o)
        if keep is not None and a < S - 1:
            keep[:, a].copy_(state)
    out = torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    return out, state


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor, chunk: int = 64
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [B, H, S, Dk] (normalised, q scaled), v [B, H, S, Dv], g, beta [B, H, S], state
    [B, H, Dk, Dv] (fp32 throughout) -> (out [B, H, S, Dv], final state)."""
    S = q.shape[2]
    pad = (chunk - S % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    beta, g = (F.pad(x, (0, pad)) for x in (beta, g))
    B, H, T, Dk = k.shape
    v_beta = v * beta.unsqueeze(-1)
    k_beta = k * beta.unsqueeze(-1)
    q, k, k_beta, v_beta = (x.reshape(B, H, -1, chunk, x.shape[-1])
                            for x in (q, k, k_beta, v_beta))
    g = g.reshape(B, H, -1, chunk)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=3)
    pair = (cum.unsqueeze(4) - cum.unsqueeze(3)).masked_fill(upper, float("-inf")).exp()
    ut = (k_beta @ k.transpose(-1, -2)) * pair
    intra = (q @ k.transpose(-1, -2)) * pair
    decayed_k_beta = k_beta * cum.exp().unsqueeze(-1)
    new_v = torch.linalg.solve_triangular(ut, v_beta, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(ut, decayed_k_beta, upper=False, unitriangular=True)
    out = torch.zeros_like(new_v)
    q = q * cum.exp().unsqueeze(-1)
    k = k * (cum[..., -1:] - cum).exp().unsqueeze(-1)
    chunk_decay = cum[..., -1].exp()[..., None, None]
    for i in range(T // chunk):
        v_new = new_v[:, :, i] - k_cum[:, :, i] @ state
        out[:, :, i] = q[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + k[:, :, i].transpose(-1, -2) @ v_new
    return out.reshape(B, H, -1, v.shape[-1])[:, :, :S], state


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                               keep: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same inputs as `chunk_gated_delta_rule`, one token at a time -> (out [B, H, S, Dv],
    final state). `keep` [B, S - 1, H, Dk, Dv] (the state pool's buffer): receives the state
    after each position but the last; only one state per row is live at a time otherwise."""
    S = q.shape[2]
    out = torch.zeros_like(v)
    for t in range(S):
        state = state * g[:, :, t].exp()[..., None, None]
        kv_mem = (state * k[:, :, t].unsqueeze(-1)).sum(dim=-2)
        delta = (v[:, :, t] - kv_mem) * beta[:, :, t].unsqueeze(-1)
        state = state + k[:, :, t].unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, t] = (state * q[:, :, t].unsqueeze(-1)).sum(dim=-2)
        if keep is not None and t < S - 1:
            keep[:, t].copy_(state)
    return out, state


@dataclass
class LinearState:
    """One linear layer's view of the state pool for one forward.

    `conv` [slots, conv_dim, K - 1] and `recurrent` [slots, Hv, Dk, Dv] (fp32) are the pool's
    tensors (shared across forwards); `slots` [B] the rows' slots, `fresh` [B] rows starting
    at position 0, `lens` [B] real tokens per row. `keep_rec` [rows, k, Hv, Dk, Dv] (fp32) and
    `keep_conv` [rows, conv_dim, K - 1 + k] are the pool's verify buffers (None: nothing is
    kept): a forward of B <= rows rows of S <= k + 1 tokens writes the state after each of its
    first S - 1 positions into keep_rec[:B, :S - 1] and its conv inputs (window included) into
    keep_conv[:B, :, :K - 1 + S - 1], and sets `kept` = S - 1, so `keep` can restore any of
    those positions' state; other forwards keep nothing (`kept` = 0)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    slots: torch.Tensor
    fresh: torch.Tensor
    lens: torch.Tensor
    keep_rec: torch.Tensor | None = None
    keep_conv: torch.Tensor | None = None
    kept: int = 0  # positions the last forward kept (host int: known from its shape)

    def keeps(self, B: int, S: int) -> bool:
        """Whether a forward of B rows of S tokens keeps its per-position states."""
        return (self.keep_rec is not None and 1 < S <= self.keep_rec.shape[1] + 1
                and B <= self.keep_rec.shape[0])

    def keep(self, rows: torch.Tensor, positions: torch.Tensor) -> None:
        """Rows `rows` of the last forward keep the state after their `positions`-th token
        (0-based: 0 = after the row's first token; below `kept`) instead of after their last
        one."""
        assert self.kept > 0 and self.keep_rec is not None and self.keep_conv is not None, \
            "keep() needs a verify forward (rows of at most k + 1 tokens, k the pool's)"
        slots = self.slots[rows]
        self.recurrent[slots] = self.keep_rec[rows, positions]
        K1 = self.conv.shape[-1]
        idx = (positions + 1).view(-1, 1, 1) + torch.arange(K1, device=rows.device).view(1, 1, -1)
        win = self.keep_conv[rows].gather(2, idx.expand(-1, self.keep_conv.shape[1], -1))
        self.conv[slots] = win.to(self.conv.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm(x) * w * silu(gate), normalised in fp32 (Qwen3NextRMSNormGated; plain w)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.weight_loader = _plain_loader

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (self.weight * x32.to(dt)) * F.silu(gate.float())
        return out.to(dt)


class GatedDeltaNet(nn.Module):
    """`linear_attn.*` of a Qwen3-Next layer (checkpoint names kept: in_proj_qkvz, in_proj_ba,
    or Qwen3.5's in_proj_qkv, in_proj_z, in_proj_b, in_proj_a; conv1d, dt_bias, A_log, norm,
    out_proj), this rank's heads of it under TP (module docstring)."""

    def __init__(self, hidden: int, lin: LinearAttentionConfig, eps: float) -> None:
        super().__init__()
        tp = get_tp().size
        self.lin = lin
        self.num_key_heads = _divide(lin.num_key_heads, tp, "linear_num_key_heads")
        self.num_value_heads = _divide(lin.num_value_heads, tp, "linear_num_value_heads")
        key_dim = lin.num_key_heads * lin.key_head_dim  # the whole model's
        value_dim = lin.num_value_heads * lin.value_head_dim
        self.key_dim, self.value_dim = key_dim // tp, value_dim // tp  # this rank's
        if lin.fused_projections:  # Qwen3-Next: outputs grouped per key head
            self.in_proj_qkvz = ColumnParallelLinear(hidden, [2 * key_dim + 2 * value_dim])
            self.in_proj_ba = ColumnParallelLinear(hidden, [2 * lin.num_value_heads])
        else:  # Qwen3.5: q | k | v in one tensor, z, b, a apart
            self.in_proj_qkv = ColumnParallelLinear(hidden, [2 * key_dim + value_dim])
            self.in_proj_qkv.weight.weight_loader = components_loader(
                [key_dim, key_dim, value_dim])
            self.in_proj_z = ColumnParallelLinear(hidden, [value_dim])
            self.in_proj_b = ColumnParallelLinear(hidden, [lin.num_value_heads])
            self.in_proj_a = ColumnParallelLinear(hidden, [lin.num_value_heads])
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(lin.conv_dim // tp, 1, lin.conv_kernel))
        self.conv1d.weight.weight_loader = components_loader([key_dim, key_dim, value_dim])
        self.dt_bias = nn.Parameter(torch.ones(self.num_value_heads))
        self.dt_bias.weight_loader = components_loader([lin.num_value_heads])
        self.A_log = nn.Parameter(torch.zeros(self.num_value_heads))
        self.A_log.weight_loader = components_loader([lin.num_value_heads])
        self.norm = GatedRMSNorm(lin.value_head_dim, eps)
        self.out_proj = RowParallelLinear(value_dim, hidden)
        # The model is built under `torch.device(...)` (loader.load_model), so the default
        # device is the one the layer will run on.
        self.backend, why = select_linear_attention_backend(torch.get_default_device())
        _record_backend(self.backend, why)
        self.kernels = None  # (chunk, recurrent) in fla's signatures; None = fla's own

    def _split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Projections -> q, k [B, S, Hk, Dk], v, z [B, S, Hv, Dv], b, a [B, S, Hv] (the
        checkpoint interleaves them per key head: transformers' fix_query_key_value_ordering)."""
        lin = self.lin
        B, S, _ = x.shape
        Hk, Dk, Dv = self.num_key_heads, lin.key_head_dim, lin.value_head_dim
        Hv = self.num_value_heads
        if not lin.fused_projections:  # q | k | v contiguous, z, b, a apart (Qwen3.5)
            q, k, v = torch.split(self.in_proj_qkv(x), [self.key_dim, self.key_dim,
                                                         self.value_dim], dim=-1)
            return (q.view(B, S, Hk, Dk), k.view(B, S, Hk, Dk), v.view(B, S, Hv, Dv),
                    self.in_proj_z(x).view(B, S, Hv, Dv), self.in_proj_b(x),
                    self.in_proj_a(x))
        r = Hv // Hk
        qkvz = self.in_proj_qkvz(x).view(B, S, Hk, 2 * Dk + 2 * r * Dv)
        ba = self.in_proj_ba(x).view(B, S, Hk, 2 * r)
        q, k, v, z = torch.split(qkvz, [Dk, Dk, r * Dv, r * Dv], dim=3)
        b, a = torch.split(ba, [r, r], dim=3)
        return (q, k, v.reshape(B, S, Hv, Dv), z.reshape(B, S, Hv, Dv), b.reshape(B, S, Hv),
                a.reshape(B, S, Hv))

    @staticmethod
    def _torch_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, init: torch.Tensor,
                          keep: torch.Tensor | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch delta rule over `fla_gated_delta_rule`'s inputs (sequence-first, q and k
        un-normalised, Hk heads; `keep` as there) -> (out [B, Hv, S, Dv], final state)."""
        Hk, Hv = q.shape[2], v.shape[2]
        if Hv != Hk:
            q = q.repeat_interleave(Hv // Hk, dim=2)
            k = k.repeat_interleave(Hv // Hk, dim=2)
        q, k, v, beta, g = (t.transpose(1, 2).float().contiguous() for t in (q, k, v, beta, g))
        q, k = l2norm(q), l2norm(k)
        q = q * q.shape[-1] ** -0.5
        if q.shape[2] <= RECURRENT_MAX:
            return recurrent_gated_delta_rule(q, k, v, g, beta, init, keep)
        assert keep is None, "states are kept for recurrent-form rows only"
        return chunk_gated_delta_rule(q, k, v, g, beta, init)

    def forward(self, x: torch.Tensor, state: LinearState | None) -> torch.Tensor:
        lin = self.lin
        B, S, _ = x.shape
        K1 = lin.conv_kernel - 1
        q, k, v, z, b, a = self._split(x)
        mixed = torch.cat([q.reshape(B, S, -1), k.reshape(B, S, -1), v.reshape(B, S, -1)],
                          dim=-1).transpose(1, 2)  # [B, C, S]
        w = self.conv1d.weight
        if state is None:  # no cache: the sequence starts from zero state
            window = mixed.new_zeros(B, mixed.shape[1], K1)
        else:
            window = torch.where(state.fresh.view(-1, 1, 1), 0, state.conv[state.slots])
        full = torch.cat([window.to(mixed.dtype), mixed], dim=-1)  # [B, C, K1 + S]
        conv = F.silu(F.conv1d(full.to(w.dtype), w, groups=full.shape[1]))[:, :, -S:]
        conv = conv.to(x.dtype).transpose(1, 2)
        q, k, v = torch.split(conv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        Hv, Hk = self.num_value_heads, self.num_key_heads
        q = q.reshape(B, S, Hk, lin.key_head_dim)
        k = k.reshape(B, S, Hk, lin.key_head_dim)
        v = v.reshape(B, S, Hv, lin.value_head_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if state is not None:  # padded positions leave the state as it is
            live = (torch.arange(S, device=x.device).view(1, -1) < state.lens.view(-1, 1))
            beta = beta * live.unsqueeze(-1).to(beta.dtype)
            g = g * live.unsqueeze(-1)
        if state is None:
            init = x.new_zeros(B, Hv, lin.key_head_dim, lin.value_head_dim, dtype=torch.float32)
        else:
            init = torch.where(state.fresh.view(-1, 1, 1, 1), 0, state.recurrent[state.slots])
        # A verify forward keeps its per-position states in the pool's buffers, allocated
        # once for max_num_seqs rows x k positions (so KV sizing counts them): the kept
        # memory cannot grow with anything but rows x k. Kept rather than recomputed: the
        # restore is then a copy of the very states the forward computed (exact on either
        # backend, fla's kernel included), with no replay of the recurrence after acceptance.
        keep = None
        if state is not None:
            state.kept = S - 1 if state.keeps(B, S) else 0
            if state.kept:
                keep = state.keep_rec[:B, : S - 1]
                state.keep_conv[:B, :, : K1 + S - 1].copy_(full[:, :, : K1 + S - 1])
        # A layer moved off CUDA after its build falls back to torch (`kernels` set = a test's
        # stand-in for fla on CPU).
        if self.backend == "fla" and (x.is_cuda or self.kernels is not None):
            out, final = fla_gated_delta_rule(q, k, v, g, beta, init, keep, kernels=self.kernels)
            out = out.transpose(1, 2)  # [B, Hv, S, Dv] like the torch path's
        else:
            out, final = self._torch_delta_rule(q, k, v, g, beta, init, keep)
        if state is not None:
            # The conv window ending at each row's last real token: full[len : len + K1].
            ends = state.lens.view(-1, 1, 1) + torch.arange(K1, device=x.device).view(1, 1, -1)
            state.conv[state.slots] = full.gather(
                2, ends.expand(-1, full.shape[1], -1)).to(state.conv.dtype)
            state.recurrent[state.slots] = final
        out = out.transpose(1, 2).to(x.dtype)  # [B, S, Hv, Dv]
        out = self.norm(out.reshape(-1, lin.value_head_dim), z.reshape(-1, lin.value_head_dim))
        return self.out_proj(out.view(B, S, -1))
