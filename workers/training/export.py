"""Write our `CausalLM` as a Hugging Face folder (DeepSeek-V3 MTP naming, unfused q/k/v)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from mtpserve.workers.model.transformer import CausalLM


def _unfuse(name: str, t: torch.Tensor, sizes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    for fused, parts in (("qkv_proj", ["q_proj", "k_proj", "v_proj"]),
                         ("gate_up_proj", ["gate_proj", "up_proj"])):
        if f".{fused}." in name:
            chunks = t.split(sizes[fused], dim=0)
            return {name.replace(fused, p): c for p, c in zip(parts, chunks, strict=True)}
    return {name: t}


def hf_state_dict(model: CausalLM, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Checkpoint tensors in HF naming; MTP module m as `model.layers.{L+m}.*`. TP=1 only."""
    cfg = model.config
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [cfg.intermediate_size] * 2}
    mtp_rename = {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj",
                  "norm": "shared_head.norm", "head": "shared_head.head"}
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if name.startswith("mtp."):
            _, m, rest = name.split(".", 2)
            prefix = f"model.layers.{cfg.num_hidden_layers + int(m)}."
            if rest.startswith("block."):
                name = prefix + rest[len("block."):]
            else:
                head, leaf = rest.split(".", 1)
                name = prefix + mtp_rename.get(head, head) + "." + leaf
        for k, v in _unfuse(name, t, sizes).items():
            out[k] = v.detach().to(dtype).contiguous()
    return out


def save_hf(model: CausalLM, hf_config: dict, out: Path, dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    cfg = dict(hf_config, torch_dtype=str(dtype).removeprefix("torch."))
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(hf_state_dict(model, dtype), out / "model.safetensors", metadata={"format": "pt"})
