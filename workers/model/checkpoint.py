"""Local Hugging Face checkpoints: tensor names, MTP naming conventions, and the inventory.

The inventory is checked before any weight is copied: an MTP tensor the config promises but
the files lack, a tensor nothing uses, or a shape that does not fit is an error naming the
tensor. A silently missing MTP module would otherwise only show up as a speed loss.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.quantization import SCALE_SUFFIX

# Tensors some exporters write that carry no weights.
_IGNORABLE = re.compile(r".*rotary_emb\.inv_freq$")

_BLOCK = [
    "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
    "self_attn.o_proj.weight", "input_layernorm.weight", "post_attention_layernorm.weight",
]
_DENSE_MLP = ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
_PROJ = ("gate_proj", "up_proj", "down_proj")
_BIAS = ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]
_QK_NORM = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
# Routed experts stacked, as Qwen3.5-MoE checkpoints store them (transformers' layout):
# gate_up_proj [E, 2 I, hidden] (gate rows, then up), down_proj [E, hidden, I].
_FUSED_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def has_fused_experts(names) -> bool:
    """Whether a checkpoint's tensor names hold stacked routed experts (`_FUSED_EXPERTS`)."""
    return any(n.endswith("." + _FUSED_EXPERTS[0]) for n in names)

# MTP-specific tensors per convention: canonical name -> name inside the module's prefix.
_MTP_NAMES = {
    "deepseek_v3": {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                    "norm": "shared_head.norm", "head": "shared_head.head",
                    "embed_tokens": "embed_tokens"},
    "mimo": {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
             "norm": "final_layernorm", "head": None, "embed_tokens": None},
    "qwen3_next": {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
                   "eh_proj": "fc", "norm": "norm", "head": None, "embed_tokens": None},
    "step3p5": {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                "norm": "shared_head.norm", "head": "shared_head.output",
                "embed_tokens": "embed_tokens"},
    "mimo_v2": {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                "norm": "final_layernorm", "head": None, "embed_tokens": None},
}
# Step's MoE layer as its checkpoints name it -> our module names (routed experts stacked:
# moe.gate_proj / moe.up_proj [E, I, hidden], moe.down_proj [E, hidden, I]).
_STEP_MOE = ((".moe.gate.weight", ".mlp.gate.weight"),
             (".moe.router_bias", ".mlp.gate.e_score_correction_bias"),
             (".moe.gate_proj.weight", ".mlp.experts.gate_proj"),
             (".moe.up_proj.weight", ".mlp.experts.up_proj"),
             (".moe.down_proj.weight", ".mlp.experts.down_proj"),
             (".share_expert.", ".mlp.shared_experts."))


def internal_name(cfg: ModelConfig, name: str) -> str:
    """Our parameter name for checkpoint tensor `name` where a family names it otherwise."""
    if name.endswith(".self_attn.attention_sink_bias"):  # MiMo-V2-Flash's sinks
        return name.removesuffix("attention_sink_bias") + "sinks"
    if cfg.mtp_naming == "mimo_v2" and ".pre_mlp_layernorm." in name:  # its MTP blocks
        return name.replace(".pre_mlp_layernorm.", ".post_attention_layernorm.")
    if cfg.model_type == "step3p5":
        for old, new in _STEP_MOE:
            if old in name:
                return name.replace(old, new)
    return name


def layer_index(cfg: ModelConfig, name: str) -> int | None:
    """The attention-layer index a tensor belongs to (main layers, then MTP blocks)."""
    m = re.match(r"(?:mtp|model\.mtp\.layers)\.(\d+)\.", name)
    if m:
        return cfg.num_hidden_layers + int(m.group(1))
    m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
    if m and not name.startswith("mtp."):
        return int(m.group(1))
    return None


def block_tensor_names(cfg: ModelConfig, prefix: str, layer_idx: int = 0,
                       fused_experts: bool = False) -> list[str]:
    """Checkpoint names of decoder layer `layer_idx` (its MLP dense or MoE per the config;
    `fused_experts`: routed experts stacked in two tensors, see `has_fused_experts`)."""
    names = list(_BLOCK)
    if cfg.layer(layer_idx).attention == "linear":  # Gated DeltaNet (Qwen3-Next, Qwen3.5)
        assert cfg.linear is not None
        proj = (("in_proj_qkvz", "in_proj_ba") if cfg.linear.fused_projections
                else ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"))
        names = [n for n in names if not n.startswith("self_attn.")] + [
            f"linear_attn.{n}" for n in (
                *(f"{p}.weight" for p in proj), "conv1d.weight", "dt_bias",
                "A_log", "norm.weight", "out_proj.weight")]
    elif cfg.layer(layer_idx).attention == "mla":
        assert cfg.mla is not None
        names = [n for n in names if not n.startswith("self_attn.")] + [
            f"self_attn.{n}.weight" for n in (
                ("q_proj",) if cfg.mla.q_lora_rank is None
                else ("q_a_proj", "q_a_layernorm", "q_b_proj"))
            + ("kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj")]
        if cfg.mla.dsa is not None and layer_idx not in cfg.mla.dsa.shared_layers:
            names += [f"self_attn.indexer.{n}" for n in (
                "wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias",
                "weights_proj.weight")]
    if cfg.head_gate is not None:  # Step: the output gate's own projection
        names.append("self_attn.g_proj.weight")
    if cfg.layer(layer_idx).attention_sinks:  # MiMo-V2-Flash's sliding layers
        names.append("self_attn.attention_sink_bias")
    if cfg.mtp_naming == "mimo_v2" and layer_idx >= cfg.num_hidden_layers:
        names = [n.replace("post_attention_layernorm", "pre_mlp_layernorm") for n in names]
    full = cfg.layer(layer_idx).attention != "linear"
    if cfg.attention_bias and full:
        names += _BIAS
    if cfg.qk_norm and full:
        names += _QK_NORM
    if cfg.layer(layer_idx).mlp == "moe" and cfg.model_type == "step3p5":
        names += ["moe.gate.weight", "moe.router_bias", "moe.gate_proj.weight",
                  "moe.up_proj.weight", "moe.down_proj.weight"]
        names += [f"share_expert.{p}.weight" for p in _PROJ]
    elif cfg.layer(layer_idx).mlp == "moe":
        moe = cfg.moe
        assert moe is not None
        names.append("mlp.gate.weight")
        if moe.correction_bias:
            names.append("mlp.gate.e_score_correction_bias")
        if fused_experts:
            names += list(_FUSED_EXPERTS)
        else:
            names += [f"mlp.experts.{e}.{p}.weight" for e in range(moe.num_experts)
                      for p in _PROJ]
        if moe.num_shared_experts:
            names += [f"mlp.shared_experts.{p}.weight" for p in _PROJ]
        if moe.shared_expert_gate:
            names += [f"mlp.shared_expert.{p}.weight" for p in _PROJ]
            names.append("mlp.shared_expert_gate.weight")
    else:
        names += _DENSE_MLP
    return [prefix + n for n in names]


def mtp_prefixes(cfg: ModelConfig, module: int) -> tuple[str, str]:
    """(prefix of the MTP-specific tensors, prefix of its decoder block) for module `module`."""
    if cfg.mtp_naming in ("deepseek_v3", "step3p5"):
        p = f"model.layers.{cfg.num_hidden_layers + module}."
        return p, p
    if cfg.mtp_naming == "mimo":
        p = f"model.mtp_layers.{module}."
        return p, p
    if cfg.mtp_naming == "mimo_v2":
        p = f"model.mtp.layers.{module}."
        return p, p
    return "mtp.", f"mtp.layers.{module}."


def expected_tensors(cfg: ModelConfig, fused_experts: bool = False
                     ) -> tuple[dict[str, str], dict[str, str]]:
    """Checkpoint name -> internal parameter name, as (required, optional)."""
    required: dict[str, str] = {
        "model.embed_tokens.weight": "model.embed_tokens.weight",
        "model.norm.weight": "model.norm.weight",
    }
    optional: dict[str, str] = {}
    (optional if cfg.tie_word_embeddings else required)["lm_head.weight"] = "lm_head.weight"
    for i in range(cfg.num_hidden_layers):
        for name in block_tensor_names(cfg, f"model.layers.{i}.", i, fused_experts):
            required[name] = internal_name(cfg, name)
    if cfg.mtp_naming == "qwen3_next" and cfg.num_mtp_modules > 1:
        raise NotImplementedError("Qwen3-Next MTP with more than one layer is not supported")
    names = _MTP_NAMES[cfg.mtp_naming]
    for m in range(cfg.num_mtp_modules):
        own, block = mtp_prefixes(cfg, m)
        for canon in ("enorm", "hnorm", "eh_proj", "norm"):
            required[f"{own}{names[canon]}.weight"] = f"mtp.{m}.{canon}.weight"
        for canon in ("head", "embed_tokens"):
            if names[canon]:
                optional[f"{own}{names[canon]}.weight"] = f"mtp.{m}.{canon}.weight"
        for name in block_tensor_names(cfg, block, cfg.num_hidden_layers + m, fused_experts):
            required[name] = internal_name(cfg, f"mtp.{m}.block." + name[len(block):])
    if cfg.weights_prefix != "model.":  # the text part of a multimodal checkpoint
        def moved(names: dict[str, str]) -> dict[str, str]:
            return {(cfg.weights_prefix + n[len("model."):] if n.startswith("model.") else n): i
                    for n, i in names.items()}

        required, optional = moved(required), moved(optional)
    return required, optional


@dataclass(frozen=True)
class InventoryEntry:
    tensor: str
    shape: tuple[int, ...] | None
    dtype: str | None
    status: str  # "ok" | "optional" | "missing" | "unused" | "shape mismatch: ..."
    file: str | None = None

    @property
    def is_problem(self) -> bool:
        return self.status not in ("ok", "optional")


def weight_files(path: Path) -> dict[str, Path]:
    """Tensor name -> file, for a single `model.safetensors` or a sharded index."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / fname for name, fname in weight_map.items()}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    out: dict[str, Path] = {}
    for f in files:
        with safe_open(f, framework="pt") as sf:
            for name in sf.keys():
                out[name] = f
    return out


def read_header(files: dict[str, Path]) -> dict[str, tuple[tuple[int, ...], str]]:
    """Tensor name -> (shape, dtype) without reading tensor data."""
    meta: dict[str, tuple[tuple[int, ...], str]] = {}
    for f in sorted(set(files.values())):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name != "__metadata__":
                meta[name] = (tuple(info["shape"]), info["dtype"])
    return meta


def expected_shape(cfg: ModelConfig, internal: str) -> tuple[int, ...]:
    """Full (unsharded) shape the checkpoint tensor must have."""
    internal = internal_name(cfg, internal)
    h, d = cfg.hidden_size, cfg.head_dim
    idx = layer_index(cfg, internal)
    heads = cfg.num_attention_heads if idx is None else cfg.attention_heads(idx)
    kv = cfg.num_key_value_heads
    if idx is not None and cfg.layer(idx).num_kv_heads:
        kv = cfg.layer(idx).num_kv_heads
    dv = cfg.v_head_dim or d
    if internal.endswith("self_attn.sinks"):
        return (heads,)
    leaf = internal.rsplit(".", 2)[-2:]
    key = ".".join(leaf)
    inter = cfg.intermediate_size
    mla = cfg.mla
    if mla is not None and ".self_attn.indexer." in internal:
        assert mla.dsa is not None
        n, dh = mla.dsa.index_n_heads, mla.dsa.index_head_dim
        return {"wq_b.weight": (n * dh, mla.q_lora_rank or 0), "wk.weight": (dh, h),
                "k_norm.weight": (dh,), "k_norm.bias": (dh,),
                "weights_proj.weight": (n, h)}[key]
    if mla is not None and ".self_attn." in internal:
        H = cfg.num_attention_heads
        return {
            "q_proj.weight": (H * mla.qk_head_dim, h),
            "q_a_proj.weight": (mla.q_lora_rank or 0, h),
            "q_a_layernorm.weight": (mla.q_lora_rank or 0,),
            "q_b_proj.weight": (H * mla.qk_head_dim, mla.q_lora_rank or 0),
            "kv_a_proj_with_mqa.weight": (mla.latent_dim, h),
            "kv_a_layernorm.weight": (mla.kv_lora_rank,),
            "kv_b_proj.weight": (H * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank),
            "o_proj.weight": (h, H * mla.v_head_dim),
        }[key]
    lin = cfg.linear
    if lin is not None and ".linear_attn." in internal:
        kd, vd = lin.num_key_heads * lin.key_head_dim, lin.num_value_heads * lin.value_head_dim
        return {
            "in_proj_qkvz.weight": (2 * kd + 2 * vd, h),
            "in_proj_ba.weight": (2 * lin.num_value_heads, h),
            "in_proj_qkv.weight": (2 * kd + vd, h),
            "in_proj_z.weight": (vd, h),
            "in_proj_b.weight": (lin.num_value_heads, h),
            "in_proj_a.weight": (lin.num_value_heads, h),
            "conv1d.weight": (lin.conv_dim, 1, lin.conv_kernel),
            "linear_attn.dt_bias": (lin.num_value_heads,),
            "linear_attn.A_log": (lin.num_value_heads,),
            "norm.weight": (lin.value_head_dim,),
            "out_proj.weight": (h, vd),
        }[key]
    if cfg.moe is not None:
        if internal.endswith((".experts.gate_proj", ".experts.up_proj")):  # stacked, Step
            return (cfg.moe.num_experts, cfg.moe.intermediate_size, h)
        if ".shared_expert." in internal:
            inter = cfg.moe.shared_intermediate_size
        elif internal.endswith("shared_expert_gate.weight"):
            return (1, h)
        if internal.endswith(_FUSED_EXPERTS[0]):
            return (cfg.moe.num_experts, 2 * cfg.moe.intermediate_size, h)
        if internal.endswith(_FUSED_EXPERTS[1]):
            return (cfg.moe.num_experts, h, cfg.moe.intermediate_size)
        if ".experts." in internal:
            inter = cfg.moe.intermediate_size
        elif ".shared_experts." in internal:
            inter = cfg.moe.shared_experts_width
        elif internal.endswith("mlp.gate.weight"):
            return (cfg.moe.num_experts, h)
        elif internal.endswith("e_score_correction_bias"):
            return (cfg.moe.num_experts,)
    table = {
        "q_proj.weight": (heads * d * (2 if cfg.attn_output_gate else 1), h),
        "g_proj.weight": (heads if cfg.head_gate == "head" else heads * d, h),
        "k_proj.weight": (kv * d, h),
        "v_proj.weight": (kv * dv, h),
        "q_proj.bias": (heads * d,),
        "k_proj.bias": (kv * d,),
        "v_proj.bias": (kv * dv,),
        "o_proj.weight": (h, heads * dv),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "gate_proj.weight": (inter, h),
        "up_proj.weight": (inter, h),
        "down_proj.weight": (h, inter),
        "eh_proj.weight": (h, 2 * h),
        "embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "head.weight": (cfg.vocab_size, h),
    }
    return table.get(key, (h,))  # every remaining tensor is a hidden-size norm weight


def inventory(path: str | Path, cfg: ModelConfig | None = None) -> list[InventoryEntry]:
    """Every tensor the config expects or the files hold, with its status."""
    path = Path(path)
    cfg = cfg or ModelConfig.from_pretrained(path)
    files = weight_files(path)
    meta = read_header(files)
    required, optional = expected_tensors(cfg, has_fused_experts(meta))
    entries: list[InventoryEntry] = []
    for name in sorted(set(meta) | set(required)):
        if name not in meta:
            entries.append(InventoryEntry(name, None, None, "missing"))
            continue
        shape, dtype = meta[name]
        fname = files[name].name
        internal = required.get(name) or optional.get(name)
        base = name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None
        if internal is None and base is not None and cfg.quant is not None and (
                base in required or base in optional):
            # The block scales of an FP8 weight (workers/model/quantization.py).
            want = cfg.quant.scale_shape(meta[base][0] if base in meta else (0, 0))
            status = "ok" if shape == want else f"shape mismatch: expected {want}"
        elif internal is None:
            # The vision tower of a multimodal checkpoint served by its text part.
            vision = any(name.startswith(p) for p in cfg.vision_prefixes)
            status = "ok" if _IGNORABLE.match(name) or vision else "unused"
        elif dtype == "F8_E4M3" and (cfg.quant is None or name + SCALE_SUFFIX not in meta):
            status = "fp8 weight without its weight_scale_inv / quantization_config"
        else:
            # Match the checkpoint name's leaf (q_proj, not the fused qkv_proj).
            want = expected_shape(cfg, name.replace("shared_head.head", "head").replace(
                "shared_head.output", "head"))
            if name in _renamed_eh_proj(cfg):
                want = (cfg.hidden_size, 2 * cfg.hidden_size)
            if shape != want:
                status = f"shape mismatch: expected {want}"
            else:
                status = "ok" if name in required else "optional"
        entries.append(InventoryEntry(name, shape, dtype, status, fname))
    return entries


def _renamed_eh_proj(cfg: ModelConfig) -> set[str]:
    """Checkpoint names of eh_proj under conventions that call it something else."""
    name = _MTP_NAMES[cfg.mtp_naming]["eh_proj"]
    return {f"{mtp_prefixes(cfg, m)[0]}{name}.weight" for m in range(cfg.num_mtp_modules)}


def format_problems(entries: list[InventoryEntry]) -> str:
    return "; ".join(f"{e.tensor}: {e.status}" for e in entries if e.is_problem)
