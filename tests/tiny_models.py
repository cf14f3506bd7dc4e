"""Tiny random-initialised HF checkpoints (Llama, Qwen2, Qwen3) with MTP weights, for tests."""

from __future__ import annotations

import json
import tempfile
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


_DEEPSEEK = dict(
    num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1,
    n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
# Tiny configs of the families served beyond the dense ones, built with transformers' own
# classes (so config.json and tensor names are exactly what transformers writes).
HF_FAMILIES = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=2, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, norm_topk_prob=True, mlp_only_layers=[0])),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM", dict(
        num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_group=2, topk_group=1, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True, use_qk_norm=True,
        attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                              "partial_rotary_factor": 0.5})),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(_DEEPSEEK)),
    # DSA: DeepSeek-V3's tiny shape plus an indexer of 16 heads (ties in its top-k
    # improbable) keeping 6 tokens per query, so prompts of a few dozen tokens exercise it.
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", dict(
        _DEEPSEEK, index_n_heads=16, index_head_dim=16, index_topk=6)),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", dict(
        _DEEPSEEK, v_head_dim=24, n_group=1, index_n_heads=16, index_head_dim=24,
        index_topk=6)),
    "glm4_moe_lite": ("Glm4MoeLiteConfig", "Glm4MoeLiteForCausalLM", dict(
        num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, n_group=1, topk_group=1, first_k_dense_replace=1,
        n_shared_experts=1, routed_scaling_factor=1.8, norm_topk_prob=True)),
}


def _randomise(model: torch.nn.Module) -> None:
    """Spread the weights so norms, biases and routing all matter (and routing has no
    near-ties that float rounding could flip)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)


def make_hf_checkpoint(
    path: Path,
    family: str,
    num_mtp: int = 0,
    seed: int = 0,
    vocab_size: int = 256,
    num_layers: int = 2,
    max_positions: int = 512,
    distinct_mtp_heads: bool = False,
    **overrides,
) -> Path:
    """A random checkpoint saved by transformers' own class; with `num_mtp`, MTP layers
    under the DeepSeek-V3/GLM names `model.layers.{L + m}.{enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head, embed_tokens}` + the decoder block, the block being
    the real layer type at that index (taken from the same class built with L + m layers).
    `distinct_mtp_heads`: each module's embedding and head differ from the main model's and
    from each other (noise on the copies), so a draft tells which module's head made it."""
    import transformers
    from safetensors.torch import load_file

    cfg_name, model_name, extra = HF_FAMILIES[family]
    cfg_cls, model_cls = getattr(transformers, cfg_name), getattr(transformers, model_name)
    kw = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
              num_hidden_layers=num_layers, num_attention_heads=4, max_position_embeddings=
              max_positions, tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1,
              eos_token_id=2, **extra)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).eval()
    _randomise(model)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if not num_mtp:
        return path
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = num_mtp
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors = load_file(path / "model.safetensors")
    torch.manual_seed(seed + 1)
    longer = model_cls(cfg_cls(**{**kw, "num_hidden_layers": num_layers + num_mtp})).eval()
    _randomise(longer)
    with tempfile.TemporaryDirectory() as tmp:  # saved, so the tensors carry hub names
        longer.save_pretrained(tmp, safe_serialization=True)
        sd = load_file(Path(tmp) / "model.safetensors")
    h = kw["hidden_size"]
    g = torch.Generator().manual_seed(seed + 2)
    for m in range(num_mtp):
        i = num_layers + m
        p = f"model.layers.{i}."
        for name, t in sd.items():
            if name.startswith(p):
                tensors[name] = t.clone()
        tensors[p + "enorm.weight"] = torch.rand(h, generator=g) + 0.5
        tensors[p + "hnorm.weight"] = torch.rand(h, generator=g) + 0.5
        tensors[p + "shared_head.norm.weight"] = torch.rand(h, generator=g) + 0.5
        tensors[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
        # The published checkpoints repeat the main embedding and head per MTP layer.
        tensors[p + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors[p + "shared_head.head.weight"] = tensors["lm_head.weight"].clone()
        if distinct_mtp_heads:
            for name in ("embed_tokens.weight", "shared_head.head.weight"):
                t = tensors[p + name]
                t += torch.randn(t.shape, generator=g) * t.std()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


def make_step_checkpoint(path: Path, num_mtp: int = 1, seed: int = 0,
                         vocab_size: int = 256, mtp_sliding: bool = False,
                         limits: tuple[float, float] = (0.3, 0.5)) -> Path:
    """A random Step-3.7 checkpoint saved by transformers' `Step3p7ForConditionalGeneration`
    (its text model, `step3p5`, and a one-block vision tower): 4 layers (full, sliding x 3,
    window 6), sliding layers with 6 query heads and full ones 4 (2 KV heads), rope theta 5e6
    and partial rotary 0.5 on full layers, 1e4 and full rotary on sliding ones, layers 0-1
    dense and 2-3 MoE (4 experts, top-2, a shared expert), SwiGLU clamps (`limits`: routed,
    shared) on layers 2-3, and `num_mtp` MTP layers at `model.layers.{4 + i}` with their own
    `shared_head.{norm, output}` (MoE blocks; sliding when `mtp_sliding`). The hub's legacy
    layout is what is passed in (lists padded with the MTP layers), as the released config
    writes it; transformers saves its own."""
    import transformers
    from safetensors.torch import load_file

    n = 4
    types = ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]
    mtp_types = ["sliding_attention" if mtp_sliding else "full_attention"] * num_mtp

    def text(layers: list[str], mtp: int) -> dict:
        total = len(layers)
        routed, shared = limits
        return dict(
            model_type="step3p5", vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
            moe_intermediate_size=32, share_expert_dim=48, num_hidden_layers=total - mtp,
            num_attention_heads=4, num_attention_groups=2, head_dim=16,
            attention_other_setting={"num_attention_heads": 6, "num_attention_groups": 2},
            layer_types=layers, sliding_window=6,
            rope_theta=[5e6 if t == "full_attention" else 1e4 for t in layers],
            partial_rotary_factors=[0.5 if t == "full_attention" else 1.0 for t in layers],
            moe_num_experts=4, moe_top_k=2, moe_layers_enum=",".join(
                str(i) for i in range(2, total)),
            swiglu_limits=[0, 0] + [routed] * (total - 2),
            swiglu_limits_shared=[0, 0] + [shared] * (total - 2),
            num_nextn_predict_layers=mtp, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

    vision = dict(width=16, layers=1, heads=2, image_size=28, patch_size=14,
                  max_position_embeddings=4)

    def build(layers: list[str], mtp: int):
        torch.manual_seed(seed)
        cfg = transformers.Step3p7Config(text_config=text(layers, mtp), vision_config=vision)
        model = transformers.Step3p7ForConditionalGeneration(cfg).eval()
        _randomise(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):  # (1 + w) norms: spread w around 0
                    p.uniform_(-0.5, 0.5)
        return model

    model = build(types + mtp_types, num_mtp)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if not num_mtp:
        return path
    tensors = load_file(path / "model.safetensors")
    longer = build(types + mtp_types, 0)  # the MTP blocks as main layers n.. of a longer model
    with tempfile.TemporaryDirectory() as tmp:
        longer.save_pretrained(tmp, safe_serialization=True)
        sd = load_file(Path(tmp) / "model.safetensors")
    h = 64
    g = torch.Generator().manual_seed(seed + 2)
    for m in range(num_mtp):
        p = f"model.layers.{n + m}."
        for name, t in sd.items():
            if name.startswith(p):
                tensors[name] = t.clone()
        for norm in ("enorm", "hnorm", "shared_head.norm"):
            tensors[p + norm + ".weight"] = torch.rand(h, generator=g) - 0.5
        tensors[p + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
        # transformers' MtpModel drops this head and uses lm_head: the same values here.
        tensors[p + "shared_head.output.weight"] = tensors["lm_head.weight"].clone()
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


def make_mimo_v2_flash_checkpoint(path: Path, num_mtp: int = 1, seed: int = 0,
                                  vocab_size: int = 256) -> Path:
    """A random MiMo-V2-Flash checkpoint saved by transformers' `MiMoV2FlashForCausalLM`:
    4 layers (full, sliding, sliding, full; window 5), 4 query heads of 24 (values 16, scaled
    by 0.707), 1 KV head in full layers and 2 in sliding ones with their sinks, partial rope
    (8 of 24 dims) at theta 5e6 / 1e4, layer 0 dense and 1-3 MoE (4 experts, top-2), and
    `num_mtp` MTP layers under `model.mtp.layers.{i}` as SGLang loads them (a sliding block
    with a sink and a dense MLP, `pre_mlp_layernorm`, enorm / hnorm / eh_proj /
    final_layernorm), `num_nextn_predict_layers` in config.json. Returns the path; the longer
    model whose layer 4 + i is MTP block i is saved beside it (`mimo_mtp_blocks(path)`, for
    the reference)."""
    import transformers
    from safetensors.torch import load_file

    n = 4
    types = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
    kinds = ["dense", "sparse", "sparse", "sparse"]
    rope = {t: {"rope_type": "default", "rope_theta": th, "partial_rotary_factor": 0.334}
            for t, th in (("full_attention", 5e6), ("sliding_attention", 1e4))}

    def build(layer_types: list[str], mlp: list[str]):
        torch.manual_seed(seed)
        cfg = transformers.MiMoV2FlashConfig(
            vocab_size=vocab_size, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=1,
            head_dim=24, v_head_dim=16, sliding_window=5, layer_types=layer_types,
            mlp_layer_types=mlp, n_routed_experts=4, num_experts_per_tok=2,
            rope_parameters=rope, max_position_embeddings=512, rms_norm_eps=1e-6,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
        model = transformers.MiMoV2FlashForCausalLM(cfg).eval()
        _randomise(model)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".sinks"):
                    p.uniform_(-1.0, 1.0)
        return model

    model = build(types, kinds)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    if not num_mtp:
        return path
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = num_mtp
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    longer = build(types + ["sliding_attention"] * num_mtp, kinds + ["dense"] * num_mtp)
    longer.save_pretrained(mimo_mtp_blocks(path), safe_serialization=True)
    sd = load_file(mimo_mtp_blocks(path) / "model.safetensors")
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed + 2)
    h = 64
    for m in range(num_mtp):
        src, dst = f"model.layers.{n + m}.", f"model.mtp.layers.{m}."
        for name, t in sd.items():
            if name.startswith(src):
                tensors[dst + name[len(src):].replace(
                    "post_attention_layernorm", "pre_mlp_layernorm")] = t.clone()
        for norm in ("enorm", "hnorm", "final_layernorm"):
            tensors[f"{dst}{norm}.weight"] = torch.rand(h, generator=g) + 0.5
        tensors[f"{dst}eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors",
              metadata={"format": "pt"})
    return path


def mimo_mtp_blocks(path: Path) -> Path:
    """Where make_mimo_v2_flash_checkpoint saves the model holding its MTP blocks."""
    return path.parent / (path.name + "-mtp-blocks")
