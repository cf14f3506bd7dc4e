"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash) over the paged latent cache.

Per token and layer the cache holds only the latent: `kv_a_layernorm(c_kv)` (kv_lora_rank
values) and the rotated shared rope key (qk_rope_head_dim), no head axis
(`ModelConfig.kv_cache_layout`: the vector's two halves sit in the cache's two planes).

Two forms of the same attention:
- expanded (prefill, training): the context's latents go through `kv_b_proj` into per-head
  keys/values, as transformers' `DeepseekV3Attention.expand_kv` does;
- absorbed (decode, query length <= _ABSORB_MAX_QUERY): `kv_b_proj`'s key half is folded into
  the query (q_nope @ W_UK, per head) and its value half applied after attention, so attention
  runs in latent space against the cached [c_kv | k_rope] directly (one shared "KV head") and
  nothing is expanded per context token. Per step it saves L * kv_lora * heads * (nope + v)
  multiply-adds for L context tokens; it is chosen for short queries, where that dominates.

Softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN
(transformers' `yarn_apply_mscale`). Rope on the rope part only, interleaved pairs when
`rope_interleave` (DeepSeek's layout).

TP: heads split across ranks (q_b_proj / q_proj and kv_b_proj column-parallel, o_proj
row-parallel); q_a_proj and kv_a_proj_with_mqa replicated, so every rank computes and caches
the whole latent.

DSA (DeepSeek-V3.2, GLM-5; workers/model/dsa.py): the cache slot also holds the indexer's key,
the indexer picks each query's top-k tokens, and attention runs over those only: decode and
verify rows (absorbed) gather the selected latents, so their attention costs the same at any
context length past top-k; prefill (expanded) masks the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.model.attention_metadata import AttentionMetadata
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.dsa import Indexer, Selection, select
from mtpserve.workers.model.layers import RMSNorm, apply_rope
from mtpserve.workers.model.parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    get_tp,
)
from mtpserve.workers.model.rope import yarn_get_mscale

# transformers builds q_a_layernorm / kv_a_layernorm with the RMSNorm default eps, not
# config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6
# Query lengths up to this use the absorbed form (decode rounds are k + 1 <= 8 tokens; for
# DeepSeek-V3's ranks the absorbed form costs less per query token below ~170 tokens).
_ABSORB_MAX_QUERY = 16
# DSA decode reads the indexer keys and the selected latents straight from the pages; off,
# the whole context is gathered first (the form the flex backend uses).
_SPARSE_DECODE = True


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """Rotary on interleaved pairs (x0, x1), (x2, x3), ...; output de-interleaved
    [evens', odds'] as transformers' `apply_rotary_pos_emb_interleave` (q and k alike, so
    their dot products are those of the interleaved rotation)."""
    half = cos.shape[-1] // 2
    # In x's dtype, as transformers casts cos/sin to the activations' dtype.
    c, s = cos[..., :half].to(x.dtype), sin[..., :half].to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int = 0) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        tp = get_tp().size
        if cfg.num_attention_heads % tp:
            raise ValueError(f"TP size {tp} must divide {cfg.num_attention_heads} heads")
        self.mla = mla
        self.num_heads = cfg.num_attention_heads // tp
        H, h = cfg.num_attention_heads, cfg.hidden_size
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, [H * mla.qk_head_dim])
        else:
            self.q_a_proj = ReplicatedLinear(h, mla.q_lora_rank)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(mla.q_lora_rank, [H * mla.qk_head_dim])
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, mla.latent_dim)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            mla.kv_lora_rank, [H * (mla.qk_nope_head_dim + mla.v_head_dim)])
        self.o_proj = RowParallelLinear(H * mla.v_head_dim, h)
        self.scale = mla.qk_head_dim ** -0.5
        rope = cfg.rope
        if rope.rope_type != "default" and rope.mscale_all_dim:
            assert rope.factor is not None
            self.scale *= yarn_get_mscale(rope.factor, rope.mscale_all_dim) ** 2
        self.rotate = apply_rope_interleaved if mla.rope_interleave else apply_rope
        # DSA: this layer's indexer, or (GLM-5 "shared" layers) none: the previous full layer's
        # selection is reused (`share_selection_from`).
        self.indexer: Indexer | None = None
        # Kept from the last forward only on layers a shared layer reads (its [B, 1, S, L]
        # mask is big at long contexts: nobody else keeps one past its own layer).
        self.selection: Selection | None = None
        self._feeds_shared = False
        self._source: list[MLAttention] = []  # a plain list: not a submodule
        if mla.dsa is not None and layer_idx not in mla.dsa.shared_layers:
            self.indexer = Indexer(cfg)

    def share_selection_from(self, layer: MLAttention) -> None:
        """Reuse `layer`'s top-k selection (it runs first in every forward)."""
        self._source[:] = [layer]
        layer._feeds_shared = True

    def forward(
        self,
        x: torch.Tensor,  # [B, S, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin [B, S, 1, rope_dim]
        attn: AttentionMetadata | None,
        kv_cache: torch.Tensor | None,  # [2, num_blocks, block_size, 1, latent_dim / 2]
    ) -> torch.Tensor:
        B, S, _ = x.shape
        m, Hl = self.mla, self.num_heads
        q_latent = None
        if m.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        q = q.view(B, S, Hl, m.qk_head_dim)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim],
                                                      dim=-1)
        # q and the shared k rotate together (one pass over [B, S, Hl + 1, rope_dim]).
        pe = self.rotate(torch.cat([q_pe, k_pe.unsqueeze(2)], dim=2), *rope)
        q = torch.cat([q_nope, pe[:, :, :Hl]], dim=-1)
        latent = torch.cat([self.kv_a_layernorm(c_kv), pe[:, :, Hl]], dim=-1)  # [B, S, Dl]
        index_keys = None
        if m.dsa is not None:  # the slot: [latent | indexer key | pad]
            # A shared layer has no indexer and no key: its part of the slot stays zero.
            index_keys = (self.indexer.key(x, rope).to(latent.dtype) if self.indexer is not None
                          else latent.new_zeros(B, S, m.dsa.index_head_dim))
            pad = m.cache_dim - m.latent_dim - m.dsa.index_head_dim
            latent = torch.cat([latent, index_keys] + ([latent.new_zeros(B, S, pad)]
                                                       if pad else []), dim=-1)
        mask, causal = None, True
        if attn is not None:
            assert kv_cache is not None
            half = m.cache_dim // 2
            flat = kv_cache.view(2, -1, 1, half)
            new = latent.reshape(B * S, 2, half).transpose(0, 1).unsqueeze(2)
            if attn.write_rows is not None:  # padded query slots write nowhere
                new = new[:, attn.write_rows]
            flat[:, attn.write_slots] = new.to(kv_cache.dtype)
            if (_SPARSE_DECODE and m.dsa is not None and attn.flex is None
                    and S <= _ABSORB_MAX_QUERY
                    and attn.max_context_len > m.dsa.index_topk
                    and m.latent_dim >= half):  # the indexer key lies in plane 1
                return self._sparse_decode(x, q_latent, rope, q_nope, pe[:, :, :Hl], attn,
                                           flat, kv_cache.shape[2])
            ctx = kv_cache.index_select(1, attn.block_index).view(
                2, B, -1, half)[:, :, : attn.max_context_len].to(q.dtype)
            latent = torch.cat([ctx[0], ctx[1]], dim=-1)  # [B, L, cache_dim]
            mask, causal = attn.mask, False
            if attn.flex is not None:
                # Flex reads GQA caches in place; the latent is one small vector per token,
                # so MLA gathers it under either backend, with the causal mask built here.
                ctx_pos = torch.arange(latent.shape[1], device=latent.device)
                mask = (ctx_pos <= attn.flex.positions.unsqueeze(-1)).unsqueeze(1)
        if m.dsa is not None:
            if index_keys is not None and attn is not None:
                index_keys = latent[..., m.latent_dim: m.latent_dim + m.dsa.index_head_dim]
            latent = latent[..., : m.latent_dim]
            L = latent.shape[1]
            if mask is None:  # no cache: causal over this forward; cache: every token
                mask = (torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
                        .view(1, 1, L, L) if attn is None
                        else torch.ones(B, 1, S, L, dtype=torch.bool, device=x.device))
            sel = self._select(x, q_latent, rope, index_keys, mask)
            mask, causal = sel.mask, False
            if attn is not None and S <= _ABSORB_MAX_QUERY and sel.index is not None:
                rows = sel.index + torch.arange(B, device=x.device).view(B, 1, 1) * L
                kv = latent.reshape(B * L, -1).index_select(0, rows.reshape(-1))
                return self._absorbed_sparse(q_nope, pe[:, :, :Hl],
                                             kv.view(B, S, -1, m.latent_dim), sel)
        if attn is not None and S <= _ABSORB_MAX_QUERY:
            return self._absorbed(q_nope, pe[:, :, :Hl], latent, mask)
        c, k_rot = latent.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        L = latent.shape[1]
        kv = self.kv_b_proj(c).view(B, L, Hl, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.unsqueeze(2).expand(B, L, Hl, m.qk_rope_head_dim)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=mask, is_causal=causal and S > 1, scale=self.scale,
        )
        return self.o_proj(out.transpose(1, 2).reshape(B, S, Hl * m.v_head_dim))

    def _select(self, x: torch.Tensor, q_latent: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], keys: torch.Tensor | None,
                allowed: torch.Tensor) -> Selection:
        """This layer's top-k (DSA), or the source layer's when it shares one."""
        assert self.mla.dsa is not None
        if self.indexer is None:
            sel = self._source[0].selection
            assert sel is not None, "a shared DSA layer ran before its source layer"
            return sel
        topk = self.mla.dsa.index_topk
        scores = None
        if allowed.shape[-1] > topk:  # shorter contexts select everything: skip scoring
            assert q_latent is not None and keys is not None
            scores = self.indexer.scores(x, q_latent, rope, keys)
        sel = select(scores, allowed, topk)
        if self._feeds_shared:
            self.selection = sel
        return sel

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key and value halves per local head, [Hl, nope | v, kv_lora]."""
        m = self.mla
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads,
                                                m.qk_nope_head_dim + m.v_head_dim))
        w_uk, w_uv = w.split([m.qk_nope_head_dim, m.v_head_dim], dim=1)
        return w_uk, w_uv

    def _sparse_decode(self, x: torch.Tensor, q_latent: torch.Tensor | None,
                       rope: tuple[torch.Tensor, torch.Tensor], q_nope: torch.Tensor,
                       q_rot: torch.Tensor, attn: AttentionMetadata, flat: torch.Tensor,
                       block_size: int) -> torch.Tensor:
        """DSA decode / verify rows straight from the paged cache: only the indexer keys of the
        context are read (one slice of plane 1 per token), then only the selected tokens'
        latents, so past top-k a step reads index_head_dim values per context token instead
        of the whole slot. `flat` [2, slots, 1, cache_dim / 2]."""
        m = self.mla
        assert m.dsa is not None
        B, S = q_nope.shape[:2]
        L = attn.max_context_len
        slots = attn.context_slots(B, block_size)
        allowed = (attn.mask if attn.mask is not None
                   else torch.ones(B, 1, S, L, dtype=torch.bool, device=x.device))
        keys = None
        if self.indexer is not None:
            off = m.latent_dim - m.cache_dim // 2
            keys = flat[1, slots.reshape(-1), 0, off: off + m.dsa.index_head_dim].view(
                B, L, -1)
        sel = self._select(x, q_latent, rope, keys, allowed)
        assert sel.index is not None
        k = sel.index.shape[-1]
        picked = slots.gather(1, sel.index.reshape(B, S * k)).reshape(-1)
        kv = torch.cat([flat[0, picked, 0], flat[1, picked, 0]], dim=-1)[..., : m.latent_dim]
        return self._absorbed_sparse(q_nope, q_rot, kv.view(B, S, k, -1).to(q_nope.dtype), sel)

    def _absorbed_sparse(self, q_nope: torch.Tensor, q_rot: torch.Tensor,
                         kv: torch.Tensor, sel: Selection) -> torch.Tensor:
        """Absorbed attention over each query's selected tokens only (DSA): `kv` [B, S, k,
        kv_lora + rope] holds each query's selected latents, so the cost follows top-k, not
        the context length."""
        m, Hl = self.mla, self.num_heads
        B, S = q_nope.shape[:2]
        assert sel.index is not None and sel.valid is not None
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.einsum("bshn,hnr->bshr", q_nope, w_uk)
        q = torch.cat([q_lat, q_rot], dim=-1)  # [B, S, Hl, kv_lora + rope]
        k = sel.index.shape[-1]
        kv = kv.reshape(B * S, 1, k, -1)
        out = F.scaled_dot_product_attention(
            q.reshape(B * S, 1, Hl, -1), kv, kv[..., : m.kv_lora_rank],
            attn_mask=sel.valid.reshape(B * S, 1, 1, k), scale=self.scale,
        ).view(B, S, Hl, m.kv_lora_rank)
        out = torch.einsum("bshr,hvr->bshv", out, w_uv)
        return self.o_proj(out.reshape(B, S, Hl * m.v_head_dim))

    def _absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, latent: torch.Tensor,
                  mask: torch.Tensor | None) -> torch.Tensor:
        """Attention in latent space: q_nope [B, S, Hl, nope], q_rot [B, S, Hl, rope],
        latent [B, L, kv_lora + rope] (the cache's rows), mask [B, 1, S, L]."""
        m, Hl = self.mla, self.num_heads
        B, S = q_nope.shape[:2]
        w_uk, w_uv = self._w_uk_uv()  # [Hl, *, kv_lora]
        q_lat = torch.einsum("bshn,hnr->bhsr", q_nope, w_uk)
        q = torch.cat([q_lat, q_rot.transpose(1, 2)], dim=-1)  # [B, Hl, S, kv_lora + rope]
        # Every local head attends the same single latent "head": fold the heads into query
        # rows (row h * S + s) against one KV head. SDPA's GQA form would repeat the latent
        # once per head (its math backend: the mask and head dim 576 rule out the fused
        # ones), Hl times the latent traffic; folded, the latent is read once per row block.
        kv = latent.unsqueeze(1)  # [B, 1, L, kv_lora + rope]
        rows = q.reshape(B, 1, Hl * S, q.shape[-1])
        fold_mask = None if mask is None else mask.repeat(1, 1, Hl, 1)  # [B, 1, Hl * S, L]
        out = F.scaled_dot_product_attention(
            rows, kv, kv[..., : m.kv_lora_rank], attn_mask=fold_mask, scale=self.scale,
        ).view(B, Hl, S, m.kv_lora_rank)
        out = torch.einsum("bhsr,hvr->bshv", out, w_uv)
        return self.o_proj(out.reshape(B, S, Hl * m.v_head_dim))
