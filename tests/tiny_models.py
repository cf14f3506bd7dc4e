"""Tiny random-initialised HF checkpoints (Llama, Qwen2, Qwen3) with MTP weights, for tests."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtpserve.workers.model.checkpoint import expected_shape, expected_tensors
from mtpserve.workers.model.config import ModelConfig

FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
}


def make_tiny_checkpoint(
    path: Path,
    family: str = "qwen3",
    num_mtp: int = 1,
    mtp_naming: str | None = None,
    tie: bool = True,
    seed: int = 0,
    vocab_size: int = 256,
    num_layers: int = 2,
    max_positions: int = 512,
) -> Path:
    """Save a random HF model (main weights through `transformers`) plus random MTP tensors."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(seed)
    hf_cfg = cfg_cls(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, max_position_embeddings=max_positions, rope_theta=10000.0,
        tie_word_embeddings=tie, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
    )
    model = model_cls(hf_cfg).eval()
    with torch.no_grad():  # random norms so norm weights are exercised
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            if name.endswith(".bias"):
                p.normal_(0, 0.1)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    cfg = json.loads((path / "config.json").read_text())
    if num_mtp:
        if mtp_naming == "qwen3_next":
            cfg["mtp_num_hidden_layers"] = num_mtp
        else:
            cfg["num_nextn_predict_layers"] = num_mtp
        if mtp_naming:
            cfg["mtp_naming"] = mtp_naming
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    mcfg = ModelConfig.from_dict(cfg)
    from safetensors.torch import load_file

    tensors = load_file(path / "model.safetensors")
    required, _ = expected_tensors(mcfg)
    g = torch.Generator().manual_seed(seed + 1)
    for name in required:
        if name in tensors:
            continue
        shape = expected_shape(mcfg, name)
        if "proj" in name.rsplit(".", 2)[-2] or name.endswith(("input_proj.weight", "fc.weight")):
            if name.endswith(("eh_proj.weight", "input_proj.weight", "fc.weight")):
                shape = (mcfg.hidden_size, 2 * mcfg.hidden_size)
            tensors[name] = torch.randn(shape, generator=g) * 0.08
        else:
            tensors[name] = torch.rand(shape, generator=g) + 0.5
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path
