"""A model's architecture from its Hugging Face `config.json` (no weights): parameter counts,
FLOPs per token and KV bytes per token, for the roofline replica model.

Understood: dense GQA transformers (Qwen3, MiMo, Llama-like), DeepSeek-style MLA attention
(`kv_lora_rank`) and routed-expert MoE layers (`n_routed_experts`), MTP layers
(`num_nextn_predict_layers`: one transformer layer plus the 2h x h projection each, sharing the
embedding and the head), FP8 weights (`quantization_config.quant_method == "fp8"`). Norms and
biases are ignored (well under 0.1% of the parameters). `weight_bytes` (1 for FP8) prices the
bytes a forward reads; the memory a replica's weights take comes from the engine's memory plan
(`planned_weight_bytes`, workers/memory_plan.py: the model built on the meta device per TP rank)
wherever the engine can build the config, and from the parameter count otherwise.

| shipped config | source of the numbers |
|---|---|
| `mimo-7b-like.json` | XiaomiMiMo/MiMo-7B-RL config.json, MiMo-7B report |
| `qwen3-32b-like.json` | Qwen/Qwen3-32B config.json (MTP layer hypothetical) |
| `deepseek-v3-like.json` | deepseek-ai/DeepSeek-V3 config.json, DeepSeek-V3 report |
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path

from mtpserve.cluster.sim.hardware import DATA_DIR

SHIPPED = {"mimo-7b-like": "mimo-7b-like.json", "qwen3-32b-like": "qwen3-32b-like.json",
           "deepseek-v3-like": "deepseek-v3-like.json"}


@dataclass(frozen=True)
class ModelArch:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    mtp_layers: int
    weight_bytes: int  # 2 (bf16) or 1 (fp8)
    kv_dtype_bytes: int = 2
    # MLA (DeepSeek): KV latent rank, rope dims, q low-rank; 0 = plain GQA attention.
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_dim: int = 0
    qk_nope_dim: int = 0
    v_head_dim: int = 0
    # MoE: routed experts (0 = dense), experts per token, expert FFN width, shared experts,
    # leading dense layers.
    n_experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    n_shared: int = 0
    first_dense: int = 0
    defaults: tuple[tuple[str, object], ...] = ()  # the JSON's `mtpserve_sim` block
    # The config.json text: the engine's memory plan (workers/memory_plan.py) gives the bytes
    # a TP rank holds (`planned_weight_bytes`) where the engine can build the model.
    config_text: str = field(default="", compare=False, repr=False)

    def planned_weight_bytes(self, tp: int) -> float | None:
        """Weight bytes of one TP rank as the engine allocates them (bf16 serving; FP8
        checkpoints as the engine keeps them, so routed experts count at bf16 unless their
        construction keeps them FP8), or None where the engine would not build it."""
        return _planned_weight_bytes(self.config_text, tp) if self.config_text else None

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    # Parameters ------------------------------------------------------------------------------
    def attn_params(self) -> int:
        h = self.hidden
        if self.mla:
            qd = self.qk_nope_dim + self.qk_rope_dim
            q = h * self.q_lora_rank + self.q_lora_rank * self.heads * qd if self.q_lora_rank \
                else h * self.heads * qd
            kv = h * (self.kv_lora_rank + self.qk_rope_dim) \
                + self.kv_lora_rank * self.heads * (self.qk_nope_dim + self.v_head_dim)
            return q + kv + self.heads * self.v_head_dim * h
        return h * self.heads * self.head_dim * 2 + 2 * h * self.kv_heads * self.head_dim

    def dense_mlp_params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def expert_params(self) -> int:
        return 3 * self.hidden * self.moe_intermediate

    def moe_mlp_params(self, active: bool) -> int:
        routed = self.top_k if active else self.n_experts
        return (routed + self.n_shared) * self.expert_params() + self.hidden * self.n_experts

    def layer_params(self, i: int, active: bool = False) -> int:
        mlp = (self.moe_mlp_params(active) if self.moe and i >= self.first_dense
               else self.dense_mlp_params())
        return self.attn_params() + mlp

    def mtp_layer_params(self, active: bool = False) -> int:
        # eh_proj (concat of hidden and embedding -> hidden) + one layer like the last one.
        return 2 * self.hidden * self.hidden + self.layer_params(self.layers - 1, active)

    def embed_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        body = sum(self.layer_params(i) for i in range(self.layers))
        head = 0 if self.tied else self.embed_params()
        return self.embed_params() + head + body + self.mtp_layers * self.mtp_layer_params()

    def active_body_params(self) -> int:
        """Parameters one token's main-model forward multiplies (no embedding, no head)."""
        return sum(self.layer_params(i, active=True) for i in range(self.layers))

    def touched_experts(self, tokens: float) -> float:
        """Expected distinct routed experts a layer's `tokens` tokens use (uniform routing)."""
        return self.n_experts * (1 - (1 - self.top_k / self.n_experts) ** max(tokens, 1))

    def body_weight_bytes(self, tokens: float) -> float:
        """Weight bytes of the main layers one forward over `tokens` tokens reads: dense
        layers whole, MoE layers only the experts the tokens route to."""
        active = self.active_body_params() * self.weight_bytes
        if not self.moe:
            return active
        extra = (self.touched_experts(tokens) - self.top_k) * self.expert_params()
        return active + (self.layers - self.first_dense) * extra * self.weight_bytes

    def mtp_weight_bytes(self, tokens: float) -> float:
        """One MTP layer's weights read by a forward over `tokens` tokens."""
        layer = self.mtp_layer_params(active=True)
        if self.moe:
            layer += (self.touched_experts(tokens) - self.top_k) * self.expert_params()
        return layer * self.weight_bytes

    # Per token -------------------------------------------------------------------------------
    def kv_bytes_per_token_layer(self) -> int:
        if self.mla:  # the compressed latent and the rope key, shared by all heads
            return (self.kv_lora_rank + self.qk_rope_dim) * self.kv_dtype_bytes
        return 2 * self.kv_heads * self.head_dim * self.kv_dtype_bytes

    def kv_bytes_per_token(self) -> int:
        """Main + MTP KV of one token, whole model (every layer, every head)."""
        return (self.layers + self.mtp_layers) * self.kv_bytes_per_token_layer()

    def attn_flops_per_query_ctx(self) -> float:
        """FLOPs of one query token attending one context token, one layer (QK^T and AV)."""
        if self.mla:  # absorbed MLA: scores and values over the latent
            return 2 * self.heads * (2 * self.kv_lora_rank + self.qk_rope_dim)
        return 4 * self.heads * self.head_dim

    def setting(self, key: str, default: object) -> object:
        return dict(self.defaults).get(key, default)


def resolve_config_path(name_or_path: str) -> Path:
    if name_or_path in SHIPPED:
        return DATA_DIR / SHIPPED[name_or_path]
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no model config at {name_or_path!r} (shipped: "
                                f"{', '.join(SHIPPED)})")
    return path


def load_arch(name_or_path: str) -> ModelArch:
    path = resolve_config_path(name_or_path)
    return arch_from_config(json.loads(path.read_text()), path.stem)


@functools.lru_cache(maxsize=64)
def _planned_weight_bytes(config_text: str, tp: int) -> float | None:
    from mtpserve.workers.memory_plan import PlanSettings, plan_memory
    from mtpserve.workers.model.config import ModelConfig

    try:
        cfg = ModelConfig.from_dict(json.loads(config_text))
        plan = plan_memory("<config.json>", PlanSettings(tp_size=tp), cfg, suggest=False)
    except (ValueError, KeyError, NotImplementedError):  # a family or key the engine refuses
        return None
    return None if plan.per_rank is None else float(plan.per_rank.weight_bytes)


def arch_from_config(cfg: dict, name: str = "model") -> ModelArch:
    # Some configs nest the language model (multimodal wrappers).
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    quant = (cfg.get("quantization_config") or {}).get("quant_method", "")
    experts = int(cfg.get("n_routed_experts") or cfg.get("num_experts")
                  or cfg.get("num_local_experts") or 0)  # transformers 5 writes the last
    inter = int(cfg.get("intermediate_size") or 0)
    return ModelArch(
        name=name, hidden=hidden, layers=int(cfg["num_hidden_layers"]), heads=heads,
        kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads), intermediate=inter,
        vocab=int(cfg["vocab_size"]), tied=bool(cfg.get("tie_word_embeddings", False)),
        mtp_layers=int(cfg.get("num_nextn_predict_layers") or 0),
        weight_bytes=1 if quant == "fp8" else 2,
        kv_lora_rank=int(cfg.get("kv_lora_rank") or 0),
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        qk_rope_dim=int(cfg.get("qk_rope_head_dim") or 0),
        qk_nope_dim=int(cfg.get("qk_nope_head_dim") or 0),
        v_head_dim=int(cfg.get("v_head_dim") or 0),
        n_experts=experts, top_k=int(cfg.get("num_experts_per_tok") or 0),
        moe_intermediate=int(cfg.get("moe_intermediate_size") or inter),
        n_shared=int(cfg.get("n_shared_experts") or 0),
        first_dense=int(cfg.get("first_k_dense_replace") or 0) if experts else 0,
        defaults=tuple(sorted((cfg.get("mtpserve_sim") or {}).items())),
        config_text=json.dumps(cfg, sort_keys=True),
    )
