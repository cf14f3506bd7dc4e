"""Building blocks of the dense decoder: RMSNorm, RoPE, SwiGLU MLP, attention, decoder layer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.model import cpu_paged_attention
from mtpserve.workers.model.attention_metadata import AttentionMetadata
from mtpserve.workers.model.config import ModelConfig, kv_head_split
from mtpserve.workers.model.parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    _plain_loader,
    components_loader,
    get_tp,
)
from mtpserve.workers.model.rope import RopeConfig, inv_freq_and_scale


class RMSNorm(nn.Module):
    # Qwen3-Next's norms scale by (1 + w) (weights stored zero-centred); CausalLM sets it.
    zero_centred: bool = False

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.weight.weight_loader = _plain_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centred:  # transformers' Qwen3NextRMSNorm: (x_normed * (1 + w)).to(dtype)
            x32 = x.float()
            x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
            return (x32 * (1.0 + self.weight.float())).to(x.dtype)
        # Normalise in fp32 like the HF reference, so bf16 runs round the same way; in fp32
        # skip the no-op casts (each is a dispatch on the per-token hot path).
        if x.dtype == torch.float32:  # one fused op, same result as the formula below
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Non-interleaved RoPE (rotate_half), as in Llama/Qwen/GLM; cos/sin cached up to max
    positions. The rope config (`rope.py`) gives the frequencies (default / YaRN / llama3) and
    the cos/sin factor (YaRN's attention scaling); `partial_rotary_factor` < 1 rotates only the
    first `rotary_dim` dims of each head (GLM-4.5)."""

    def __init__(self, head_dim: int, max_positions: int, rope: RopeConfig | float) -> None:
        super().__init__()
        if not isinstance(rope, RopeConfig):  # a bare theta (older callers)
            rope = RopeConfig(theta=float(rope))
        inv_freq, scale = inv_freq_and_scale(rope, head_dim)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # [P, rotary_dim]
        self.rotary_dim = emb.shape[-1]
        self.register_buffer("cos", emb.cos() * scale, persistent=False)
        self.register_buffer("sin", emb.sin() * scale, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, S, 1, rotary_dim] each; computed once per forward and shared by every layer."""
        return self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, S, H, D] (q and k concatenated along H, so one pass serves both); the first
    `cos.shape[-1]` dims rotate, the rest pass through (partial rotary)."""
    rot = cos.shape[-1]
    if rot < x.shape[-1]:
        return torch.cat([apply_rope(x[..., :rot], cos, sin), x[..., rot:]], dim=-1)
    x32 = x if x.dtype == torch.float32 else x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    out = x32 * cos + torch.cat([-x2, x1], dim=-1) * sin
    return out if x.dtype == torch.float32 else out.to(x.dtype)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); gate/up fused in one column-parallel matmul.
    `reduce=False` leaves the TP partial sums to the caller (an MoE layer's shared experts,
    summed with the routed experts in one all-reduce)."""

    def __init__(self, hidden: int, intermediate: int, reduce: bool = True,
                 limit: float | None = None) -> None:
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [intermediate, intermediate])
        self.down_proj = RowParallelLinear(intermediate, hidden, reduce=reduce)
        self.limit = limit  # Step's clamp (`swiglu`); None: plain SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(swiglu(gate, up, self.limit))


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float | None = None) -> torch.Tensor:
    """silu(gate) * up; with `limit` (Step-3.5/3.7), silu(gate) <= limit and |up| <= limit,
    the clamp after the activation as transformers' Step3p7MLP applies it."""
    if limit is None:
        return F.silu(gate) * up
    return F.silu(gate).clamp(max=limit) * up.clamp(min=-limit, max=limit)


class Attention(nn.Module):
    """GQA attention over a paged KV cache (or plain causal attention when training)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        tp = get_tp()
        spec = cfg.layer(layer_idx)
        self.window = spec.sliding_window  # None: full attention
        self.head_dim = d = cfg.head_dim
        H = cfg.attention_heads(layer_idx)  # Step's sliding layers have their own count
        self.num_heads = H // tp.size
        if H % tp.size:
            raise ValueError(f"TP size {tp.size} must divide {H} heads")
        # TP above the KV heads replicates them (`kv_head_split`): rank r holds KV head
        # r * Hk // tp, which its contiguous query heads [r Hq/tp, (r+1) Hq/tp) all attend to.
        Hk = spec.num_kv_heads or cfg.num_key_value_heads
        self.num_kv_heads, kv_replicas = kv_head_split(Hk, tp.size)
        # A layer with fewer KV heads than the cache holds (MiMo-V2-Flash's full layers)
        # repeats each into consecutive cache heads: the same attention, one cache shape.
        cache_heads = kv_head_split(cfg.num_key_value_heads, tp.size)[0]
        if cache_heads % self.num_kv_heads:
            raise ValueError(f"layer {layer_idx}: {Hk} KV heads do not tile the cache's "
                             f"{cfg.num_key_value_heads} under TP {tp.size}")
        self.kv_repeat = cache_heads // self.num_kv_heads
        self.v_dim = cfg.v_head_dim or d  # zero-padded to head_dim in the cache when smaller
        self.value_scale = cfg.value_scale
        self.scale = cfg.attention_scale or d ** -0.5
        # Qwen3-Next: q_proj holds [q | gate] per head; the output is scaled by sigmoid(gate).
        self.output_gate = cfg.attn_output_gate
        qd = 2 * d if self.output_gate else d
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size, [H * qd, Hk * d, Hk * self.v_dim],
            bias=cfg.attention_bias, replicas=[1, kv_replicas, kv_replicas],
        )
        self.o_proj = RowParallelLinear(H * self.v_dim, cfg.hidden_size)
        # Step: o_proj(attn * sigmoid(g_proj(x))), one gate per head or per channel; split by
        # heads like q, so each rank gates its own heads.
        self.head_gate = cfg.head_gate
        self.g_proj = (ColumnParallelLinear(cfg.hidden_size, [H if cfg.head_gate == "head"
                                                              else H * d])
                       if cfg.head_gate is not None else None)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # MiMo-V2-Flash: a learned logit per head in each softmax's denominator (no value);
        # the checkpoint's `attention_sink_bias`, this rank's heads.
        self.sinks: nn.Parameter | None = None
        if spec.attention_sinks:
            self.sinks = nn.Parameter(torch.zeros(self.num_heads))
            self.sinks.weight_loader = components_loader([H])  # type: ignore[attr-defined]

    def _qkv(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """q [B, S, Hq, D]; k, v [B, S, cache heads, D]; the output gate (or None)."""
        B, S, _ = x.shape
        Hq, Hk, D, Dv = self.num_heads, self.num_kv_heads, self.head_dim, self.v_dim
        qkv = self.qkv_proj(x)
        gate = None
        if self.g_proj is not None:
            g = torch.sigmoid(self.g_proj(x))
            gate = (g.unsqueeze(-1).expand(B, S, Hq, D).reshape(B, S, Hq * D)
                    if self.head_gate == "head" else g)
        if self.output_gate:
            qg, kv = qkv.split([Hq * 2 * D, 2 * Hk * D], dim=-1)
            qg = qg.view(B, S, Hq, 2 * D)
            gate = torch.sigmoid(qg[..., D:].reshape(B, S, Hq * D))
            qkv = torch.cat([qg[..., :D].reshape(B, S, Hq * D), kv], dim=-1)
        if Dv == D:  # one view, no copies
            qkv = qkv.view(B, S, Hq + 2 * Hk, D)
            qk, v = qkv[:, :, : Hq + Hk], qkv[:, :, Hq + Hk:]
        else:
            qk, v = qkv.split([(Hq + Hk) * D, Hk * Dv], dim=-1)
            qk, v = qk.view(B, S, Hq + Hk, D), v.view(B, S, Hk, Dv)
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :, :Hq]), self.k_norm(qk[:, :, Hq:])], dim=2)
        qk = apply_rope(qk, *rope)
        q, k = qk[:, :, :Hq], qk[:, :, Hq:]
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if Dv < D:
            v = F.pad(v, (0, D - Dv))
        if self.kv_repeat > 1:
            k = k.repeat_interleave(self.kv_repeat, dim=2)
            v = v.repeat_interleave(self.kv_repeat, dim=2)
        return q, k, v, gate

    def _out(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """[B, S, Hq * D] attention output -> o_proj (values' padding dropped, gate applied)."""
        if self.v_dim < self.head_dim:
            B, S, _ = out.shape
            out = out.view(B, S, self.num_heads, self.head_dim)[..., : self.v_dim].reshape(
                B, S, -1)
        return self.o_proj(out if gate is None else out * gate)

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, S, 1, D]
        attn: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, Hk, D]
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q, k, v, gate = self._qkv(x, rope)
        Hk, D = k.shape[2], self.head_dim
        if attn is None:  # training / reference: causal attention over the sequence
            window = None
            if self.window is not None:
                t = torch.arange(S, device=x.device)
                d = t.view(-1, 1) - t.view(1, -1)  # query - key
                window = ((d >= 0) & (d < self.window)).view(1, 1, S, S)
            out = _attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), window,
                          self.scale, self.sinks, causal=window is None)
        else:
            assert kv_cache is not None
            # One write and one gather for K and V together (fewer ops per token).
            flat = kv_cache.view(2, -1, Hk, D)
            new_kv = torch.stack([k, v]).view(2, B * S, Hk, D).to(kv_cache.dtype)
            if attn.write_rows is not None:  # padded query slots write nowhere
                new_kv = new_kv[:, attn.write_rows]
            flat[:, attn.write_slots] = new_kv
            if attn.flex is not None:  # paged in place: no gather (flex_paged_attention.py)
                assert self.window is None and self.sinks is None, (
                    "sliding windows and sinks run under the gather backend")
                out = attn.flex.attend(q.transpose(1, 2), kv_cache, self.scale)
                return self._out(out.transpose(1, 2).reshape(B, S, -1), gate)
            mask = attn.mask if self.window is None else attn.window_mask(self.window)
            if attn.token_index is not None:  # compiled CPU graph: no context copy
                if attn.positions is not None and cpu_paged_attention.usable(q, flat):
                    out = cpu_paged_attention.paged(q, flat, attn.token_index, attn.positions,
                                                    self.scale, self.window, self.sinks)
                else:
                    out = inline_paged_attention(q, flat, attn.token_index, mask, self.scale,
                                                 self.sinks)
                return self._out(out, gate)
            # index_select on the block dim is a plain copy of contiguous blocks (several
            # times faster than advanced indexing): [2, B, L, Hk, D]. A windowed layer copies
            # only the blocks from its earliest query's window on.
            # The mask keeps what is left of the window inside the first block.
            skip = 0  # context positions before the first block any query's window reaches
            if self.window is not None and attn.min_position is not None:
                bs = kv_cache.shape[2]
                skip = max(0, attn.min_position - self.window + 1) // bs * bs
            index = (attn.block_index if not skip else
                     attn.block_index.view(B, -1)[:, skip // kv_cache.shape[2]:].reshape(-1))
            ctx = kv_cache.index_select(1, index).view(2, B, -1, Hk, D)[
                :, :, : attn.max_context_len - skip].to(q.dtype)
            if skip:
                mask = mask[..., skip:]
            out = _attend(q.transpose(1, 2), ctx[0].transpose(1, 2), ctx[1].transpose(1, 2),
                          mask, self.scale, self.sinks)
        return self._out(out.transpose(1, 2).reshape(B, S, -1), gate)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
            scale: float, sinks: torch.Tensor | None, causal: bool = False) -> torch.Tensor:
    """q [B, Hq, S, D] over k, v [B, Hk, L, D] (GQA), mask [B | 1, 1, S, L] bool (True: may
    attend; None: all, or causal). SDPA, or with `sinks` [Hq] the softmax written out with one
    extra logit per head in its denominator (transformers' MiMo-V2-Flash / gpt-oss eager form;
    SDPA has no sink input)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    B, Hq, S, D = q.shape
    Hk, L = k.shape[1], k.shape[2]
    G = Hq // Hk
    # Query head h = kv head h // G: broadcast over the group instead of copying K and V.
    scores = torch.matmul(q.view(B, Hk, G, S, D), k.unsqueeze(2).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(S, L, dtype=torch.bool, device=q.device).tril(L - S).view(1, 1, S, L)
    if mask is not None:  # [B | 1, 1, S, L] -> [B | 1, 1, 1, S, L]
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = sinks.to(scores.dtype).view(1, Hk, G, 1, 1).expand(B, Hk, G, S, 1)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(v.dtype), v.unsqueeze(2)).view(B, Hq, S, D)


def inline_paged_attention(q: torch.Tensor, flat_kv: torch.Tensor, token_index: torch.Tensor,
                           mask: torch.Tensor, scale: float,
                           sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention over the paged cache written as broadcast products and reductions, for
    inductor's CPU code generator: it fuses the `token_index` lookups into the score and
    output reductions as indirect loads, so no row's context is copied out of the cache (the
    gather path copies [2, B, L, Hk, D] per layer, then SDPA reads it again; measured on the
    default model at 16 rows x 512 positions: 14.4 vs 18.0 ms per forward). Eagerly this
    would materialise [B, S, L, Hk, G, D] products: only compiled graphs take it.

    q [B, S, Hq, D]; flat_kv [2, slots, Hk, D]; token_index [B, L] cache slot of each context
    position; mask [B, 1, S, L] bool; sinks [Hq] (or None): one more logit per head in the
    softmax's denominator. Returns [B, S, Hq * D]."""
    B, S, Hq, D = q.shape
    Hk = flat_kv.shape[2]
    G = Hq // Hk
    L = token_index.shape[1]
    k = flat_kv[0][token_index].to(q.dtype).view(B, 1, L, Hk, 1, D)
    v = flat_kv[1][token_index].to(q.dtype).view(B, 1, L, Hk, 1, D)
    scores = (q.reshape(B, S, 1, Hk, G, D) * k).sum(-1) * scale  # [B, S, L, Hk, G]
    scores = scores.masked_fill(~mask.view(B, S, L, 1, 1), float("-inf"))
    if sinks is None:
        p = torch.softmax(scores, dim=2).unsqueeze(-1)
    else:
        sink = sinks.to(scores.dtype).view(1, 1, 1, Hk, G)
        top = torch.maximum(scores.amax(dim=2, keepdim=True), sink)
        e = torch.exp(scores - top)
        p = (e / (e.sum(dim=2, keepdim=True) + torch.exp(sink - top))).unsqueeze(-1)
    return (p * v).sum(2).reshape(B, S, Hq * D)


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP block; the MLP is dense or MoE as the config says for layer
    `layer_idx` (main layers, then MTP blocks at num_hidden_layers + m)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn: nn.Module
        self.linear_attn: nn.Module | None = None
        if cfg.layer(layer_idx).attention == "linear":  # Gated DeltaNet: no KV cache, a state
            from mtpserve.workers.model.gated_deltanet import GatedDeltaNet

            assert cfg.linear is not None
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, cfg.linear, cfg.rms_norm_eps)
        elif cfg.layer(layer_idx).attention == "mla":
            from mtpserve.workers.model.mla import MLAttention  # builds on apply_rope here

            self.self_attn = MLAttention(cfg, layer_idx)
        else:
            self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp: nn.Module
        if cfg.layer(layer_idx).mlp == "moe":
            from mtpserve.workers.model.moe import MoE  # moe.py builds on MLP from here

            assert cfg.moe is not None
            # cfg: the FP8-experts rule; layer_idx: its SwiGLU clamps (Step)
            self.mlp = MoE(cfg.hidden_size, cfg.moe, cfg, layer_idx)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size,
                           limit=cfg.layer(layer_idx).swiglu_limit)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        attn: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,
    ) -> torch.Tensor:
        if self.linear_attn is not None:  # kv_cache is then the layer's LinearState (or None)
            x = x + self.linear_attn(self.input_layernorm(x),
                                     kv_cache if attn is not None else None)
        else:
            x = x + self.self_attn(self.input_layernorm(x), rope, attn, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))
