"""Model configuration read from a Hugging Face `config.json` (frozen, engine-side)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from mtpserve.workers.model.families import FAMILIES, NORMALISE, LayerSpec, MLAConfig, MoEConfig
from mtpserve.workers.model.families.base import (
    MTP_DEPTH_KEYS,
    MTP_SIZE_KEYS,
    LinearAttentionConfig,
    mtp_depth,
)
from mtpserve.workers.model.quantization import FP8BlockConfig, parse_quantization
from mtpserve.workers.model.rope import RopeConfig, UnsupportedConfig, parse_rope

MTPNaming = Literal["deepseek_v3", "mimo", "qwen3_next", "step3p5", "mimo_v2"]

logger = logging.getLogger(__name__)

# Multimodal checkpoints served by their text part: model_type -> the text model's type.
_TEXT_PART = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "step3p7": "step3p5"}
# Where each multimodal checkpoint keeps its text model's tensors, and its vision tower's.
_TEXT_PREFIX = {"step3p7": "model."}
_VISION_PREFIXES = {"step3p7": ("vision_model.", "vit_large_projector.")}

# Families we know of but do not serve yet, with the reason (named by `check` and `up`).
_NOT_YET: dict[str, str] = {
    "deepseek_v4": "DeepSeek-V4's hyper-connections (4 residual streams), compressed sparse "
                   "attention (CSA / HCA with its compressor and indexer), hash-routed MoE and "
                   "its mtp.{i} e_proj / h_proj MTP layout are not implemented",
}


@dataclass(frozen=True)
class ModelConfig:
    """What the dense decoder and its MTP module(s) need; derived from `config.json`."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    num_mtp_modules: int = 0
    mtp_naming: MTPNaming = "deepseek_v3"
    eos_token_ids: tuple[int, ...] = ()
    rope: RopeConfig = field(default_factory=RopeConfig)
    # One entry per attention layer: main layers, then one per MTP module (its block).
    layers: tuple[LayerSpec, ...] = ()
    moe: MoEConfig | None = None
    mla: MLAConfig | None = None  # set: every layer is MLA (head_dim is then the rope dim)
    quant: FP8BlockConfig | None = None
    # Hybrid models (Qwen3-Next): the Gated DeltaNet layers' shape; gated full attention and
    # (1 + w) norms (workers/model/gated_deltanet.py).
    linear: LinearAttentionConfig | None = None
    attn_output_gate: bool = False
    zero_centred_norm: bool = False
    # Where the decoder's tensors live in the checkpoint ("model.language_model." for the
    # text part of a multimodal checkpoint); internal names always start with "model.".
    weights_prefix: str = "model."
    # Tensors of a multimodal checkpoint's vision tower (ignored: the text model is served).
    vision_prefixes: tuple[str, ...] = ()
    # Step: the output gate's own g_proj ("head" | "channel"), the softmax scale, and one rope
    # per `LayerSpec.rope` index (index 0 is `rope`).
    head_gate: str | None = None
    attention_scale: float | None = None
    ropes: tuple[RopeConfig, ...] = ()
    # MiMo-V2-Flash: 128-dim values under 192-dim keys (zero-padded in the cache), scaled.
    v_head_dim: int | None = None
    value_scale: float = 1.0
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_attention_layers(self) -> int:
        """Main layers plus one decoder block per MTP module, each with its own KV cache."""
        return self.num_hidden_layers + self.num_mtp_modules

    @property
    def is_hybrid(self) -> bool:
        """Some layers are linear attention: each request also holds a recurrent state."""
        return any(s.attention == "linear" for s in self.layers)

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.layers) if s.attention == "linear"]

    def state_bytes_per_request(self, dtype_size: int = 4) -> int:
        """Bytes of one state slot: conv window + recurrent state of every linear layer
        (the recurrent state is kept in fp32, like transformers' reference)."""
        if self.linear is None:
            return 0
        lin = self.linear
        conv = lin.conv_dim * (lin.conv_kernel - 1) * dtype_size
        rec = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim * 4
        return (conv + rec) * len(self.linear_layers)

    @property
    def rotary_dim(self) -> int:
        return self.rope.rotary_dim(self.head_dim)

    def kv_cache_layout(self, tp_size: int) -> tuple[int, int]:
        """(heads, dim) of one rank's paged cache, shaped [2, blocks, block_size, heads, dim].

        GQA: the rank's KV heads, K in plane 0 and V in plane 1 (one replicated head when
        TP exceeds the KV heads, `kv_head_split`). MLA: one replicated "head"
        holding the per-token latent (normed c_kv + rotated shared rope key, `latent_dim`
        values) split in two halves over the two planes, so the cache keeps one shape for
        every family (KV bytes per token are exactly the latent's) and every TP rank holds
        the whole latent (its heads all read it)."""
        if self.mla is not None:
            if self.mla.dsa is None and self.mla.latent_dim % 2:  # DSA pads its slot even
                raise UnsupportedConfig(f"MLA latent of odd size {self.mla.latent_dim}")
            return 1, self.mla.cache_dim // 2
        return kv_head_split(self.num_key_value_heads, tp_size)[0], self.head_dim

    @property
    def num_cache_heads(self) -> int:
        """Heads of the whole paged cache (what KV transfer splits across TP ranks): the KV
        heads for GQA, 1 for MLA's latent (which every rank holds whole)."""
        return self.kv_cache_layout(1)[0]

    def attention_heads(self, index: int) -> int:
        """Query heads of attention layer `index` (Step's sliding layers have their own)."""
        return self.layer(index).num_heads or self.num_attention_heads

    def layer(self, index: int) -> LayerSpec:
        """Attention layer `index` (main layers, then the MTP modules' blocks)."""
        return self.layers[index] if self.layers else LayerSpec()

    def describe(self) -> list[str]:
        """The model's inventory, one line per item (printed by `mtpserve check`)."""
        lines = [f"family: {self.model_type}"]
        kinds: dict[str, list[int]] = {}
        for i in range(self.num_hidden_layers):
            spec = self.layer(i)
            window = f" (window {spec.sliding_window})" if spec.sliding_window else ""
            kinds.setdefault(f"{spec.attention.upper()}{window} + {spec.mlp}", []).append(i)
        for kind, idx in kinds.items():
            lines.append(f"layers {_ranges(idx)}: {kind} ({len(idx)})")
        if self.mla is not None:
            lines.append(f"attention: {self.num_attention_heads} heads, {self.mla.describe()}")
            if self.mla.dsa is not None:
                lines.append(self.mla.dsa.describe() + "; the indexer's keys page with the "
                             "latent; forwards run eagerly (no compiled graphs yet)")
                lines.append(_dsa_kernels_line())
        else:
            other = sorted({self.attention_heads(i) for i in range(self.num_attention_layers)}
                           - {self.num_attention_heads})
            few_kv = sorted({s.num_kv_heads for s in self.layers if s.num_kv_heads})
            lines.append(f"attention: {self.num_attention_heads} heads"
                         + "".join(f" ({h} in windowed layers)" for h in other)
                         + f", {self.num_key_value_heads} KV heads"
                         + "".join(f" ({h} in full layers, repeated into the cache)"
                                   for h in few_kv)
                         + f", head dim {self.head_dim}"
                         + (f", value head dim {self.v_head_dim} (zero-padded in the cache)"
                            if self.v_head_dim and self.v_head_dim != self.head_dim else "")
                         + (f", values x{self.value_scale:g}" if self.value_scale != 1.0
                            else "")
                         + (", attention sinks in windowed layers"
                            if any(s.attention_sinks for s in self.layers) else "")
                         + (", qk-norm" if self.qk_norm else "")
                         + (", qkv bias" if self.attention_bias else "")
                         + (f", sigmoid output gate per {self.head_gate}" if self.head_gate
                            else "")
                         + (f", scale {self.attention_scale:.4g}" if self.attention_scale
                            else ""))
        if self.moe is not None:
            lines.append(f"MoE: {self.moe.describe()}")
        if self.linear is not None:
            pattern = "".join("L" if self.layer(i).attention == "linear" else "F"
                              for i in range(self.num_hidden_layers))
            lines.append(f"layer pattern (L linear, F full): {pattern}")
            lines.append(f"linear attention: {self.linear.describe()}; full attention: "
                         "output gate, (1 + w) norms")
            lines.append(f"state per request: {self.state_bytes_per_request()} bytes fp32 "
                         f"({len(self.linear_layers)} linear layers; one state slot per "
                         "running request)")
            lines.append(_linear_kernels_line())
            lines.append("prefix caching: off for hybrid models (no state checkpoints)")
            lines.append("disaggregated serving: the state slot travels with the KV "
                         "(prefill -> decode, re-sharded by heads when TP sizes differ)")
        for m in range(self.num_mtp_modules):
            spec = self.layer(self.num_hidden_layers + m)
            window = f" (window {spec.sliding_window})" if spec.sliding_window else ""
            lines.append(f"MTP module {m} ({self.mtp_naming} naming): "
                         f"{spec.attention.upper()}{window} + {spec.mlp} block")
        if not self.num_mtp_modules:
            lines.append("MTP modules: none")
        if len(self.ropes) > 1:
            for r, rope in enumerate(self.ropes):
                idx = [i for i in range(self.num_attention_layers) if self.layer(i).rope == r]
                lines.append(f"rope (layers {_ranges(idx)}): {rope.describe()}")
        else:
            lines.append(f"rope: {self.rope.describe()}")
        clamps = sorted({(s.swiglu_limit, s.shared_swiglu_limit) for s in self.layers
                         if s.swiglu_limit or s.shared_swiglu_limit}, key=str)
        if clamps:
            lines.append("SwiGLU clamps (MLP / routed, shared): " + ", ".join(
                f"{a or '-'} / {b or '-'}" for a, b in clamps))
        lines.append(f"quantization: {self.quant.describe() if self.quant else 'none'}")
        return lines

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type", "llama")
        weights_prefix = "model."
        vision: tuple[str, ...] = ()
        if model_type in _TEXT_PART and "text_config" in cfg:
            weights_prefix = _TEXT_PREFIX.get(model_type, "model.language_model.")
            vision = _VISION_PREFIXES.get(model_type, ("model.visual.",))
            cfg = _text_part(cfg)
            model_type = cfg["model_type"]
        else:
            cfg = _lift_mtp_keys(cfg)
        if model_type in NORMALISE:
            cfg = NORMALISE[model_type](cfg)
        if model_type in _NOT_YET:
            raise UnsupportedConfig(f"model_type {model_type!r}: {_NOT_YET[model_type]}")
        family = FAMILIES.get(model_type)
        if family is None:
            raise UnsupportedConfig(
                f"unsupported model_type {model_type!r}; supported: {sorted(FAMILIES)}"
            )
        fields = family(cfg)
        _refuse_unknown_math(cfg, mla=fields.mla is not None,
                             hybrid=fields.linear is not None,
                             dsa=fields.mla is not None and fields.mla.dsa is not None,
                             sliding=any(s.sliding_window for s in fields.layers))
        ropes = tuple(parse_rope({**cfg, "rope_parameters": r}) for r in fields.ropes)
        rope = ropes[0] if ropes else parse_rope(cfg)
        quant = parse_quantization(cfg)
        heads = cfg["num_attention_heads"]
        # MTP module count under each published convention (top level or text_config).
        n_mtp, key = mtp_depth(cfg)
        if key == "mtp_num_hidden_layers":
            naming = "qwen3_next"
        else:
            naming = {"mimo": "mimo", "step3p5": "step3p5",
                      "mimo_v2_flash": "mimo_v2"}.get(model_type, "deepseek_v3")
        naming = cfg.get("mtp_naming", naming)
        _check_mtp_sizes(cfg, n_mtp, fields.layers[cfg["num_hidden_layers"]:], fields.moe)
        eos_ids = _eos_ids(cfg.get("eos_token_id"))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            # Qwen3.5-MoE has no dense MLP, and no intermediate_size.
            intermediate_size=(cfg.get("intermediate_size", 0)
                               if all(s.mlp == "moe" for s in fields.layers)
                               else cfg["intermediate_size"]),
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads", heads),
            # MLA: the rotary dim (transformers' DeepseekV3Config sets head_dim to it).
            head_dim=(fields.mla.qk_rope_head_dim if fields.mla else
                      cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope.theta,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            attention_bias=fields.attention_bias,
            qk_norm=fields.qk_norm,
            num_mtp_modules=n_mtp,
            mtp_naming=naming,
            eos_token_ids=eos_ids,
            rope=rope,
            layers=fields.layers,
            moe=fields.moe,
            mla=fields.mla,
            quant=quant,
            linear=fields.linear,
            attn_output_gate=fields.attn_output_gate,
            zero_centred_norm=fields.zero_centred_norm,
            weights_prefix=weights_prefix,
            vision_prefixes=vision,
            head_gate=fields.head_gate,
            attention_scale=fields.attention_scale,
            ropes=ropes,
            v_head_dim=fields.v_head_dim,
            value_scale=fields.value_scale,
            raw=cfg,
        )

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        cfg_file = Path(path) / "config.json"
        if not cfg_file.is_file():
            raise FileNotFoundError(f"{cfg_file} not found: not a Hugging Face checkpoint folder")
        cfg = cls.from_dict(json.loads(cfg_file.read_text()))
        # Chat models often list their end-of-turn token(s) only in generation_config.json.
        gen_file = Path(path) / "generation_config.json"
        if gen_file.is_file():
            extra = _eos_ids(json.loads(gen_file.read_text()).get("eos_token_id"))
            merged = cfg.eos_token_ids + tuple(t for t in extra if t not in cfg.eos_token_ids)
            cfg = replace(cfg, eos_token_ids=merged)
        return cfg


def kv_head_split(num_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(KV heads per rank, ranks holding each KV head) of a GQA layer under TP `tp_size`.

    TP divides the KV heads: each rank holds num_kv / tp of them, once. TP above them and a
    multiple of them: as vLLM does, each rank holds one KV head, replicated on tp / num_kv
    ranks (rank r holds head r * num_kv // tp, the head its num_heads / tp query heads attend
    to), so each rank's KV cache holds tp / num_kv times its share of the model's KV."""
    if tp_size < 1 or num_kv_heads < 1:
        raise ValueError(f"TP size {tp_size} over {num_kv_heads} KV heads")
    if num_kv_heads % tp_size == 0:
        return num_kv_heads // tp_size, 1
    if tp_size % num_kv_heads == 0:
        return 1, tp_size // num_kv_heads
    raise ValueError(
        f"TP size {tp_size} must divide the model's {num_kv_heads} KV heads or be a multiple "
        f"of them (then each rank holds one replicated KV head)")


def _text_part(cfg: dict[str, Any]) -> dict[str, Any]:
    """The text model's config of a multimodal checkpoint (Qwen3.5): `text_config`, with the
    top level's token ids / tying where the text config lacks them. Its multimodal rope
    sections (`mrope_section`, `mrope_interleaved`) are dropped: a text-only request has the
    same position on all three axes, where M-RoPE is plain RoPE."""
    logger.info("%s: serving the text model; the vision tower (%s) is ignored",
                cfg["model_type"], ", ".join(f"{p}*" for p in _VISION_PREFIXES.get(
                    cfg["model_type"], ("model.visual.",))))
    text = dict(cfg["text_config"])
    text.setdefault("model_type", _TEXT_PART[cfg["model_type"]])
    for key in ("eos_token_id", "bos_token_id", "tie_word_embeddings"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    # The MTP depth / sizes may sit at the top level instead (either place counts).
    _merge_mtp_keys(text, cfg)
    rope = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(rope, dict):
        rope = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
        text["rope_parameters" if "rope_parameters" in text else "rope_scaling"] = rope
    return text


def _lift_mtp_keys(cfg: dict[str, Any]) -> dict[str, Any]:
    """`cfg` with the MTP depth and MTP-specific sizes (`MTP_DEPTH_KEYS`, `MTP_SIZE_KEYS`)
    that `text_config` holds copied to the top level, where every family reads them (Qwen3.5 /
    Qwen3.8 write `text_config.mtp_num_hidden_layers`). A key set differently in both places
    is refused by name: which of the two the checkpoint's weights follow is unknowable."""
    text = cfg.get("text_config")
    if not isinstance(text, dict):
        return cfg
    out = dict(cfg)
    out["text_config"] = text = dict(text)  # the caller's dicts stay as they were
    _merge_mtp_keys(out, text)
    return out


def _merge_mtp_keys(top: dict[str, Any], text: dict[str, Any]) -> None:
    """Copy the MTP keys set in one of `top` / `text` (the top level and `text_config`) into
    the other, in place; a key set differently in both is refused by name."""
    for key in MTP_DEPTH_KEYS + MTP_SIZE_KEYS:
        a, b = top.get(key), text.get(key)
        if a is not None and b is not None and a != b:
            raise UnsupportedConfig(f"{key} is {a!r} at the top level but {b!r} under "
                                    "text_config")
        if a is not None or b is not None:
            top[key] = text[key] = a if a is not None else b


def _check_mtp_sizes(cfg: dict[str, Any], n_mtp: int, mtp_layers: tuple[LayerSpec, ...],
                     moe: MoEConfig | None) -> None:
    """MTP-specific MoE sizes: served when they equal the main layers' (the MTP block is
    built from the model's MoE config); an MTP block of its own expert count is refused."""
    n = cfg.get("mtp_num_experts")
    if n is None or not n_mtp:
        return
    if moe is None or any(s.mlp != "moe" for s in mtp_layers) or int(n) != moe.num_experts:
        have = f"{moe.num_experts} experts" if moe is not None else "no experts"
        raise UnsupportedConfig(f"mtp_num_experts={n}: MTP blocks with their own expert count "
                                f"are not supported (the MTP block is built like the main "
                                f"layers: {have})")


def _eos_ids(eos: Any) -> tuple[int, ...]:
    """`eos_token_id` as a tuple: HF configs hold one id, a list, or null."""
    if eos is None:
        return ()
    return tuple(int(t) for t in eos) if isinstance(eos, list) else (int(eos),)


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[str] = []
    start = prev = idx[0]
    for i in idx[1:] + [None]:  # type: ignore[list-item]
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


def _refuse_unknown_math(cfg: dict[str, Any], mla: bool = False, hybrid: bool = False,
                         dsa: bool = False, sliding: bool = False) -> None:
    """Config keys that change the model's math and that we do not implement: refused by name
    (serving such a model as if they were absent would be silently wrong). `sliding`: the
    family read its sliding-window layers (`LayerSpec.sliding_window`)."""
    if cfg.get("use_sliding_window") and not sliding:
        raise UnsupportedConfig(f"use_sliding_window (sliding_window "
                                f"{cfg.get('sliding_window')}) is not supported for "
                                f"{cfg.get('model_type')!r} (families with windowed layers: "
                                "qwen2, qwen3, mimo, step3p5, mimo_v2_flash)")
    allowed = {"full_attention", "linear_attention"} if hybrid else {"full_attention"}
    if sliding:
        allowed.add("sliding_attention")
    if dsa:  # DeepSeek-V3.2 / GLM-5 name every DSA layer so
        allowed.add("indexed_attention")
    other = sorted({t for t in cfg.get("layer_types") or [] if t not in allowed})
    if other:
        raise UnsupportedConfig(f"layer_types {other} are not supported (full_attention only)")
    for key in ("index_topk", "index_n_heads", "index_head_dim"):
        if cfg.get(key) is not None and not dsa:
            raise UnsupportedConfig(f"{key}: a DSA (sparse attention) indexer in a "
                                    f"{cfg.get('model_type')!r} model is not supported "
                                    "(DSA is served for deepseek_v32 and glm_moe_dsa)")
    if cfg.get("kv_lora_rank") is not None and not mla:
        raise UnsupportedConfig(f"kv_lora_rank: MLA attention in a {cfg.get('model_type')!r} "
                                "model is not supported")
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedConfig(f"hidden_act {act!r} is not supported (silu only)")
    for key in ("mlp_bias", "attn_logit_softcapping", "final_logit_softcapping"):
        if cfg.get(key):
            raise UnsupportedConfig(f"{key}={cfg[key]!r} is not supported")


def _linear_kernels_line() -> str:
    """Which delta-rule path a replica on this host would pick (gated_deltanet's selection)."""
    import torch

    from mtpserve.workers.model.gated_deltanet import select_linear_attention_backend

    here = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        backend, why = select_linear_attention_backend(here)
    except (RuntimeError, ValueError) as e:  # MTPSERVE_LINEAR_ATTENTION asks the impossible
        return f"linear attention kernels on this host ({here}): refused: {e}"
    return f"linear attention kernels on this host ({here}): {backend} ({why})"


def _dsa_kernels_line() -> str:
    """Which sparse-attention path a DSA replica on this host would take (dsa.py's probe)."""
    import torch

    from mtpserve.workers.model.dsa import sparse_attention_backend

    here = "cuda" if torch.cuda.is_available() else "cpu"
    backend, why = sparse_attention_backend(here)
    return f"DSA sparse attention on this host ({here}): {backend} ({why})"
