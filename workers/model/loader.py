"""Build a `CausalLM` from a local HF folder and load (and shard) its weights."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from mtpserve.workers.model import fp8
from mtpserve.workers.model.checkpoint import (
    expected_tensors,
    format_problems,
    has_fused_experts,
    inventory,
    weight_files,
)
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.moe import Experts
from mtpserve.workers.model.quantization import SCALE_SUFFIX, dequantize
from mtpserve.workers.model.transformer import CausalLM

logger = logging.getLogger(__name__)

# Checkpoint projection name -> (fused parameter, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


class CheckpointError(ValueError):
    """The checkpoint does not match its config; the message names each bad tensor."""


_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_PART = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}
# Stacked experts (Qwen3.5-MoE): gate_up_proj [E, 2 I, hidden], down_proj [E, hidden, I];
# Step: gate_proj and up_proj [E, I, hidden] apart.
_STACKED = re.compile(r"(.*\.experts)\.(gate_up_proj|gate_proj|up_proj|down_proj)$")
_STACKED_PARAM = {"gate_up_proj": "w13", "gate_proj": "w13", "up_proj": "w13", "down_proj": "w2"}


def _per_expert(internal: str, tensor: torch.Tensor, shard: object
                ) -> list[tuple[torch.Tensor, object]]:
    """(tensor, shard id) loads of one checkpoint tensor: itself, or a stacked experts tensor
    cut into each expert's gate, up and down (the shard ids of per-expert tensors), so
    `Experts.weight_loader` keeps its per-rank slicing for both layouts."""
    m = _STACKED.match(internal)
    if m is None:
        return [(tensor, shard)]
    part = {"down_proj": None, "gate_proj": 0, "up_proj": 1}
    if m.group(2) in part:
        return [(tensor[e], (e, part[m.group(2)])) for e in range(tensor.shape[0])]
    inter = tensor.shape[1] // 2
    return [(tensor[e, p * inter:(p + 1) * inter], (e, p))
            for e in range(tensor.shape[0]) for p in (0, 1)]


def _fused_target(internal: str) -> tuple[str, object]:
    """(parameter, shard id) a checkpoint tensor loads into: fused projections by part,
    routed experts into the stacked `experts.w13` / `experts.w2` by (expert, part)."""
    m = _EXPERT.match(internal)
    if m:
        param, part = _EXPERT_PART[m.group(3)]
        return f"{m.group(1)}.{param}", (int(m.group(2)), part)
    m = _STACKED.match(internal)
    if m:  # all experts in one tensor: `_per_expert` cuts it
        return f"{m.group(1)}.{_STACKED_PARAM[m.group(2)]}", None
    parts = internal.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard
    return internal, None


def build_model(cfg: ModelConfig, present: set[str], dtype: torch.dtype,
                device: str | torch.device) -> CausalLM:
    """The (TP-sharded, if `set_tp` or `parallel.construction_tp` set it) `CausalLM` a
    checkpoint with tensors `present` loads into, its parameters allocated on `device` in
    `dtype` (the memory plan builds it on `meta`). DeepSeek-V3 repeats the embedding / head
    per MTP module; a module without its own shares the main model's."""
    from mtpserve.workers.model.parallel import ParallelLMHead, VocabParallelEmbedding

    _, optional = expected_tensors(cfg, has_fused_experts(present))
    owned = {optional[n] for n in present if n in optional}
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg)
            for m, mod in enumerate(model.mtp):
                if f"mtp.{m}.head.weight" in owned:
                    mod.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
                if f"mtp.{m}.embed_tokens.weight" in owned:
                    mod.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
    finally:
        torch.set_default_dtype(prev)
    return model


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> CausalLM:
    """Load a checkpoint into a (TP-sharded, if `set_tp` was called) `CausalLM`.

    Raises `CheckpointError` naming every missing, unused or mis-shaped tensor.
    """
    path = Path(path)
    cfg = ModelConfig.from_pretrained(path)
    entries = inventory(path, cfg)
    problems = format_problems(entries)
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match its config: {problems}")
    present = {e.tensor for e in entries if e.shape is not None}
    required, optional = expected_tensors(cfg, has_fused_experts(present))

    model = build_model(cfg, present, dtype, device)

    params = dict(model.named_parameters(remove_duplicate=False))
    files = weight_files(path)
    by_file: dict[Path, list[str]] = {}
    for name in present:
        if name in required or name in optional:
            by_file.setdefault(files[name], []).append(name)
    def target_of(internal: str) -> tuple[str, object]:
        target, shard = _fused_target(internal)
        if target not in params:  # an unfused projection (MLA's q_proj)
            return internal, None
        return target, shard

    path_, reason = fp8.select_path(cfg.quant, dtype, device)
    kept = _fp8_linears(model, cfg, present, files, required, optional, target_of, device) \
        if path_ == fp8.SCALED_MM else {}
    # Routed experts that keep their fp8 values (`fp8.keep_experts_fp8`, decided when the
    # Experts modules were built), by module name.
    fp8_experts = {n: m for n, m in model.named_modules() if isinstance(m, Experts) and m.fp8}
    with torch.no_grad():
        for f, names in by_file.items():
            with safe_open(f, framework="pt") as sf:
                for name in names:
                    internal = required.get(name) or optional[name]
                    target, shard = target_of(internal)
                    param = params[target]
                    tensor = sf.get_tensor(name)
                    scale = name + SCALE_SUFFIX
                    if cfg.quant is not None and scale in files:
                        with safe_open(files[scale], framework="pt") as sc:
                            scale_inv = sc.get_tensor(scale)
                        module = target.removesuffix(".weight")
                        experts = fp8_experts.get(target.rpartition(".")[0])
                        if module in kept:  # fp8 values load as they are (exact in bf16)
                            linear, local = kept[module]
                            fp8.local_scale(linear, scale_inv.to(local.device), shard, local)
                        elif experts is not None and shard is not None:
                            # One expert part at a time: its fp8 values and its blocks, no
                            # wider copy of the expert tensor.
                            try:
                                experts.scale_loader(param, scale_inv, shard)
                            except ValueError as e:
                                raise CheckpointError(f"{scale}: {e}") from e
                        elif experts is not None:
                            raise CheckpointError(f"{name}: stacked fp8 experts are not "
                                                  "supported (per-expert tensors only)")
                        else:
                            tensor = dequantize(tensor, scale_inv, cfg.quant.block)
                    try:
                        for one, one_shard in _per_expert(internal, tensor, shard):
                            param.weight_loader(param, one, one_shard)
                    except ValueError as e:
                        raise CheckpointError(f"{name}: {e}") from e
        for module, (linear, local) in kept.items():
            parent, _, child = module.rpartition(".")
            model.get_submodule(parent).register_module(
                child, fp8.Fp8BlockLinear.from_linear(linear, local))
    if cfg.quant is not None:
        model.quant_path = (f"{path_} ({reason}): {len(kept)} linears kept fp8"
                            if kept else f"{fp8.DEQUANTIZED} ({reason})")
        if fp8_experts:
            model.quant_path += (f"; {len(fp8_experts)} expert layers kept fp8 (dequantized "
                                 "at use)")
        logger.info("%s: fp8 weights %s", path, model.quant_path)
    return model.eval()


def _fp8_linears(model: CausalLM, cfg: ModelConfig, present: set[str], files: dict[str, Path],
                 required: dict[str, str], optional: dict[str, str],
                 target_of: Callable[[str], tuple[str, object]],
                 device: str | torch.device) -> dict[str, tuple[torch.nn.Module, torch.Tensor]]:
    """module name -> (linear, its local block scales to fill) for the linears that keep
    their FP8 weights: every checkpoint part of the linear has a `weight_scale_inv` and the
    local shard lies on the 128 grid (`fp8.eligible`). Experts, kv_b_proj, norms, embeddings
    and any linear with an unscaled part are dequantized as on CPU."""
    parts: dict[str, int] = {}
    for name in present:
        internal = required.get(name) or optional.get(name)
        if internal is None or name + SCALE_SUFFIX not in files:
            continue
        target, _ = target_of(internal)
        if target.endswith(".weight"):
            module = target.removesuffix(".weight")
            parts[module] = parts.get(module, 0) + 1
    kept = {}
    for module, n in parts.items():
        try:
            linear = model.get_submodule(module)
        except AttributeError:
            continue
        if fp8.keeps_fp8(module, linear, n):
            out, inp = linear.weight.shape
            kept[module] = (linear, torch.ones(out // fp8.GROUP, inp // fp8.GROUP,
                                               dtype=torch.float32, device=device))
    return kept
