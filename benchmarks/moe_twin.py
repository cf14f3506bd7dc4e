"""The default model (qwen3 + one MTP layer) written as a GLM-4.5 (`glm4_moe`) checkpoint that
computes the same function, so engines that run MTP only for MoE families (vLLM has no MTP for
qwen3) and our own MoE path can be measured on the same weights.

    python -m mtpserve.benchmarks.moe_twin OUT_DIR [--src MODEL_DIR]

Layers below `first_k_dense_replace` stay dense. The last main layer and the MTP layer become
MoE layers of two routed experts with top-1 routing: expert 0 holds the dense MLP, expert 1 and
the shared expert are zero, the router's weight is zero (both sigmoid scores 0.5) and its
correction bias (+1 for expert 0) always picks expert 0, whose weight normalises to exactly 1
(`norm_topk_prob`, scaling 1.0). GLM-4.5's attention with `use_qk_norm`, no bias and full
rotary (`partial_rotary_factor` 1) is qwen3's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from mtpserve.workers.paths import default_model_path

_MOE_PARTS = ("gate_proj", "up_proj", "down_proj")


def write_glm4_moe(dst: str | Path, src: str | Path | None = None,
                   moe_layers: int = 1) -> Path:
    """Write the twin of `src` (default: the embedded model) to `dst`; the last `moe_layers`
    main layers and every MTP layer become MoE layers."""
    src, dst = Path(src or default_model_path()), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    if cfg.get("model_type") != "qwen3":
        raise ValueError(f"{src}: a qwen3 checkpoint is needed, not {cfg.get('model_type')}")
    n = cfg["num_hidden_layers"]
    mtp = cfg.get("num_nextn_predict_layers", 0)
    first_moe = n - moe_layers
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    embed = weights["model.embed_tokens.weight"]
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.items():
        parts = name.split(".")
        layer = int(parts[2]) if name.startswith("model.layers.") else -1
        if layer >= first_moe and parts[3] == "mlp":
            proj = parts[4]
            prefix = ".".join(parts[:4])
            out[f"{prefix}.experts.0.{proj}.weight"] = t
            out[f"{prefix}.experts.1.{proj}.weight"] = torch.zeros_like(t)
            out[f"{prefix}.shared_experts.{proj}.weight"] = torch.zeros_like(t)
            continue
        out[name] = t
    for layer in range(first_moe, n + mtp):
        prefix = f"model.layers.{layer}.mlp"
        out[f"{prefix}.gate.weight"] = torch.zeros(2, cfg["hidden_size"], dtype=embed.dtype)
        out[f"{prefix}.gate.e_score_correction_bias"] = torch.tensor([1.0, 0.0])
    for layer in range(n, n + mtp):  # DeepSeek's MTP layout carries its embedding and head
        out[f"model.layers.{layer}.embed_tokens.weight"] = embed
        out[f"model.layers.{layer}.shared_head.head.weight"] = embed
    out["lm_head.weight"] = embed
    dst.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().clone() for k, v in out.items()},
              str(dst / "model.safetensors"), metadata={"format": "pt"})
    twin = {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
        "intermediate_size": cfg["intermediate_size"], "num_hidden_layers": n,
        "num_attention_heads": cfg["num_attention_heads"],
        "num_key_value_heads": cfg["num_key_value_heads"], "head_dim": cfg["head_dim"],
        "max_position_embeddings": cfg["max_position_embeddings"],
        "rope_theta": cfg.get("rope_theta", 10000.0), "partial_rotary_factor": 1.0,
        "rms_norm_eps": cfg["rms_norm_eps"], "attention_bias": False, "use_qk_norm": True,
        "hidden_act": "silu", "tie_word_embeddings": False,
        "bos_token_id": cfg.get("bos_token_id"), "eos_token_id": cfg.get("eos_token_id"),
        "n_routed_experts": 2, "num_experts_per_tok": 1,
        "moe_intermediate_size": cfg["intermediate_size"], "n_shared_experts": 1,
        "n_group": 1, "topk_group": 1, "first_k_dense_replace": first_moe,
        "norm_topk_prob": True, "routed_scaling_factor": 1.0,
        "num_nextn_predict_layers": mtp, "torch_dtype": cfg.get("torch_dtype", "float32"),
    }
    if "mtpserve" in cfg:  # serving defaults (token healing) travel with the weights
        twin["mtpserve"] = cfg["mtpserve"]
    (dst / "config.json").write_text(json.dumps(twin, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    return dst


def write_without_mtp(dst: str | Path, src: str | Path | None = None) -> Path:
    """`src` (default: the embedded model) without its MTP layers: the plain qwen3 checkpoint
    engines that reject unknown layers (vLLM's qwen3) load."""
    src, dst = Path(src or default_model_path()), Path(dst)
    cfg = json.loads((src / "config.json").read_text())
    n = cfg["num_hidden_layers"]
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    keep = {k: v.contiguous() for k, v in weights.items()
            if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= n)}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(keep, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg["num_nextn_predict_layers"] = 0
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (src / f).is_file():
            shutil.copy(src / f, dst / f)
    return dst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--src", type=Path, default=None)
    ap.add_argument("--moe-layers", type=int, default=1)
    args = ap.parse_args()
    print(write_glm4_moe(args.out, args.src, args.moe_layers))


if __name__ == "__main__":
    main()
