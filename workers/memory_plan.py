"""A device memory plan per TP rank from `config.json` alone (`mtpserve check --tp-size N
--gpu-memory-gib G`): will the model fit, and how much KV is left?

The model is built on the meta device by the engine's own construction code (`CausalLM`, under
`construction_tp` for one rank's shard), so parameter shapes and dtypes are what a rank of the
engine allocates; nothing is read but `config.json` (and the checkpoint's tensor headers when
its weights are there). Per rank, in bytes:

- weights: the meta model's parameters and buffers, by dtype, main model and MTP modules
  apart. FP8 block checkpoints: the plain linears the loader keeps FP8 on CUDA
  (`fp8.eligible`, bf16 serving, 128x128 blocks) are swapped for `Fp8BlockLinear`s as the
  loader swaps them (1 byte per weight plus fp32 block scales); whatever else the model
  builds (routed experts, unless their construction keeps them FP8) counts at the serving
  dtype, as the engine loads it.
- KV per token: `kv_bytes_per_block` (workers/model_runner.py), which the engine's KV sizing
  uses, over `cfg.kv_cache_layout` (GQA heads of the rank, or MLA's whole latent).
- hybrid models: the state slots (`StateCache`, built on meta: `max_num_seqs` slots + a
  scratch one) and the verify buffers the pool allocates beside them for the per-position
  states a verify forward keeps (`state_pool.verify_state_bytes`, the function the engine's
  pool and KV sizing use: `max_num_seqs * k` recurrent states and conv inputs per linear
  layer).
- the CUDA graph reserve (`graph_memory.DEFAULT_GRAPH_RESERVE`, 0 for hybrids, which run
  eagerly), and an activation peak (`activation_bytes`, its formula in the docstring).
- the KV pool: `kv_blocks_for_memory` (the engine's function) over those numbers and
  `kv_cache_memory_fraction` of the device; `fits` when it holds at least one request of
  `max_model_len` tokens (and the engine's floor of 8 blocks).

What it does not count: KV transfer staging on the device (pull lanes, send buffers within
`kv_transfer.send_buffer_budget_mib`), NCCL's own buffers, the CUDA context (~0.5 GiB, outside
the allocator but inside `total`); the engine measures the real activation peak at start.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from mtpserve.workers.engine_config import (
    DTYPES,
    EngineConfig,
    KVMemoryBudget,
    kv_blocks_for_memory,
)
from mtpserve.workers.graph_memory import DEFAULT_GRAPH_RESERVE
from mtpserve.workers.model import fp8
from mtpserve.workers.model.checkpoint import expected_tensors, has_fused_experts, read_header
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    construction_tp,
)
from mtpserve.workers.model.quantization import SCALE_SUFFIX

GIB = 1 << 30
MIN_KV_BLOCKS = 8  # kv_blocks_for_memory's floor: an engine below it does not start
DEFAULT_FRACTION = EngineConfig.__dataclass_fields__["kv_cache_memory_fraction"].default
TP_CANDIDATES = (1, 2, 4, 8, 16, 32, 64)
# config.json only: families whose published checkpoints give each MTP module its own
# embedding and head (`model.layers.{L}.embed_tokens`, `.shared_head.head`).
OWN_MTP_HEAD_TYPES = ("deepseek_v3",)
# Checkpoint projection -> the fused parameter the loader loads it into (loader._FUSED).
_FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
          "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}
_LINEARS = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, fp8.Fp8BlockLinear)


@dataclass(frozen=True)
class PlanSettings:
    """What the plan is for (the engine's defaults where not given)."""

    tp_size: int = 1
    gpu_memory_bytes: int | None = None  # one rank's device; None: no capacity, no verdict
    dtype: str = "bfloat16"
    max_num_seqs: int = EngineConfig.max_num_seqs
    num_speculative_tokens: int = EngineConfig.num_speculative_tokens
    max_num_batched_tokens: int = EngineConfig.max_num_batched_tokens
    block_size: int = EngineConfig.block_size
    kv_cache_memory_fraction: float = DEFAULT_FRACTION
    max_model_len: int | None = None  # None: the model's max_position_embeddings


@dataclass
class RankPlan:
    """One rank's bytes (every rank of a TP group builds the same shapes)."""

    weight_bytes: int
    weight_bytes_by_dtype: dict[str, int]
    main_weight_bytes_by_dtype: dict[str, int]
    mtp_weight_bytes_by_dtype: dict[str, int]
    kv_bytes_per_token: int
    kv_bytes_per_block: int
    profile_tokens: int
    activation_bytes: int
    graph_reserve_bytes: int
    state_slots: int
    state_bytes: int
    verify_state_bytes: int
    budget_bytes: int | None = None
    kv_cache_bytes: int | None = None
    kv_blocks: int | None = None
    kv_capacity_tokens: int | None = None
    experts_fp8_bytes: int | None = None  # weight_bytes were routed experts kept FP8


@dataclass
class MemoryPlan:
    model: str
    family: str
    settings: PlanSettings
    weights_source: str  # "checkpoint headers" | "config.json"
    fp8: str  # how FP8 weights are counted
    per_rank: RankPlan | None
    fits: bool | None
    message: str
    max_model_len: int
    suggestions: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    experts_fp8: bool = False  # the model's construction keeps routed experts FP8

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "family": self.family, **asdict(self.settings),
                "max_model_len": self.max_model_len, "weights_source": self.weights_source,
                "fp8": self.fp8, "fits": self.fits, "message": self.message,
                "suggestions": self.suggestions, "notes": self.notes,
                "per_rank": None if self.per_rank is None else asdict(self.per_rank)}

    def lines(self) -> list[str]:
        s, r = self.settings, self.per_rank
        mem = ("no device memory given" if s.gpu_memory_bytes is None else
               f"{_g(s.gpu_memory_bytes)} per GPU, kv_cache_memory_fraction "
               f"{s.kv_cache_memory_fraction:g}")
        out = [f"memory plan: {self.family}, TP {s.tp_size}, {s.dtype}, {mem}; "
               f"max_num_seqs {s.max_num_seqs}, k {s.num_speculative_tokens}, "
               f"max_model_len {self.max_model_len} (weights from {self.weights_source})"]
        if r is not None:
            out.append(f"  weights per rank   {_g(r.weight_bytes)}: main "
                       f"{_by_dtype(r.main_weight_bytes_by_dtype)}; MTP "
                       f"{_by_dtype(r.mtp_weight_bytes_by_dtype) or 'none'}")
            out.append(f"  fp8                {self.fp8}")
            out.append(f"  activations        {_g(r.activation_bytes)} (estimated peak of a "
                       f"{r.profile_tokens}-token forward: activation_bytes)")
            out.append(f"  CUDA graph reserve {_g(r.graph_reserve_bytes)}"
                       + (" (DEFAULT_GRAPH_RESERVE, the first start's guess)"
                          if r.graph_reserve_bytes else " (hybrid models run eagerly)"))
            if r.state_slots:
                out.append(f"  state slots        {_g(r.state_bytes)} ({r.state_slots} slots "
                           "+ 1 scratch)")
                out.append(f"  verify states      {_g(r.verify_state_bytes)} (max_num_seqs x "
                           f"k = {s.max_num_seqs * s.num_speculative_tokens} "
                           "per-position states per linear layer)")
            out.append(f"  KV per token       {r.kv_bytes_per_token} bytes "
                       f"({r.kv_bytes_per_block} per block of {s.block_size})")
            if r.kv_capacity_tokens is not None:
                out.append(f"  KV cache           {_g(r.kv_cache_bytes)} of {_g(r.budget_bytes)}"
                           f": {r.kv_blocks} blocks = {r.kv_capacity_tokens} tokens")
        out += [f"  note: {n}" for n in self.notes]
        verdict = {True: "fits", False: "does not fit", None: "no verdict"}[self.fits]
        out.append(f"{verdict}: {self.message}")
        out += [f"  would fit: {x}" for x in self.suggestions]
        return out


def _g(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _by_dtype(d: dict[str, int]) -> str:
    return ", ".join(f"{k} {_g(v)}" for k, v in sorted(d.items(), key=lambda kv: -kv[1]))


# --- the checkpoint as the plan sees it ------------------------------------------------------

@dataclass(frozen=True)
class CheckpointView:
    """Which tensors the checkpoint holds and which carry FP8 block scales: from the
    safetensors headers when the weights are there, else assumed from config.json."""

    present: frozenset[str]
    quantized: frozenset[str]
    source: str


def checkpoint_view(path: str | Path, cfg: ModelConfig) -> CheckpointView:
    path = Path(path)
    files = _weight_files(path)
    if files:
        meta = read_header(files)
        return CheckpointView(frozenset(meta),
                              frozenset(n for n in meta if n + SCALE_SUFFIX in meta),
                              "checkpoint headers")
    required, optional = expected_tensors(cfg)
    present = set(required)
    if cfg.model_type in OWN_MTP_HEAD_TYPES and cfg.mtp_naming == "deepseek_v3":
        # The published DeepSeek-V3 checkpoints repeat the embedding and head in each MTP
        # layer (the loader then builds them per module): assumed present.
        present |= set(optional) - {"lm_head.weight"}
    quantized = ({n for n in present if n.endswith("proj.weight")} if cfg.quant else set())
    return CheckpointView(frozenset(present), frozenset(quantized), "config.json")


def _weight_files(path: Path) -> dict[str, Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / f for name, f in weight_map.items()
                if (path / f).is_file()}
    if not any(path.glob("*.safetensors")):
        return {}
    from mtpserve.workers.model.checkpoint import weight_files

    return weight_files(path)


# --- the meta model --------------------------------------------------------------------------

def fp8_path(cfg: ModelConfig, dtype: torch.dtype) -> tuple[bool, str]:
    """(plain linears kept FP8?, why): the loader's `fp8.select_path` on a CUDA device that
    runs the blockwise kernel (Hopper, sm90), which the plan assumes."""
    if cfg.quant is None:
        return False, "not quantized"
    if tuple(cfg.quant.block) != (fp8.GROUP, fp8.GROUP):
        return False, f"{cfg.quant.block[0]}x{cfg.quant.block[1]} blocks (128x128 only)"
    if dtype != torch.bfloat16:
        return False, f"serving dtype {dtype} (bf16 only)"
    return True, "assuming a Hopper (sm90) GPU (the load-time probe passes)"


def build_rank_model(cfg: ModelConfig, view: CheckpointView, dtype: torch.dtype,
                     tp_size: int, rank: int = 0) -> torch.nn.Module:
    """One TP rank's `CausalLM` on the meta device, built as `load_model` builds it (same
    default dtype, the MTP modules' own head / embedding when the checkpoint has them, the
    FP8 linears swapped for `Fp8BlockLinear`). Raises ValueError where the engine's layers
    refuse the TP size."""
    from mtpserve.workers.model.loader import build_model

    with construction_tp(rank, tp_size):
        model = build_model(cfg, set(view.present), dtype, "meta")
        keep, _ = fp8_path(cfg, dtype)
        if keep:
            _swap_fp8_linears(model, cfg, view)
    return model


def _swap_fp8_linears(model: torch.nn.Module, cfg: ModelConfig, view: CheckpointView) -> None:
    """The loader's `_fp8_linears` + swap on meta: a linear keeps FP8 when every checkpoint
    part of it has block scales and `fp8.eligible` takes it."""
    required, optional = expected_tensors(cfg, has_fused_experts(view.present))
    modules = dict(model.named_modules())
    parts: dict[str, int] = {}
    for name in view.quantized:
        internal = required.get(name) or optional.get(name)
        if internal is None or not internal.endswith(".weight"):
            continue
        mod = internal.removesuffix(".weight")
        parent, _, leaf = mod.rpartition(".")
        fused = f"{parent}.{_FUSED.get(leaf, leaf)}"
        target = fused if fused in modules else mod
        if target in modules:
            parts[target] = parts.get(target, 0) + 1
    for name, n in parts.items():
        linear = modules[name]
        if fp8.keeps_fp8(name, linear, n):  # the loader's rule
            out, inp = linear.weight.shape
            scale = torch.ones(out // fp8.GROUP, inp // fp8.GROUP, dtype=torch.float32)
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).register_module(
                child, fp8.Fp8BlockLinear.from_linear(linear, scale, use_scaled_mm=True))


def weight_bytes(model: torch.nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """(main, MTP) bytes by dtype of the parameters and buffers (shared tensors once, under
    the main model when the MTP modules share them)."""
    main: dict[str, int] = {}
    mtp: dict[str, int] = {}
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        d = mtp if name.startswith("mtp.") else main
        key = str(t.dtype).removeprefix("torch.")
        d[key] = d.get(key, 0) + t.numel() * t.element_size()
    return main, mtp


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    from mtpserve.workers.model.moe import Experts

    return [m for m in model.modules() if isinstance(m, Experts)]


def experts_kept_fp8(model: torch.nn.Module) -> bool:
    return any(p.dtype == fp8.FP8 for e in _experts(model) for p in e.parameters())


def experts_fp8_saving(model: torch.nn.Module) -> int:
    """Bytes saved were the routed experts' weights FP8 with fp32 128x128 block scales."""
    saved = 0
    for e in _experts(model):
        for p in e.parameters(recurse=False):
            if p.dtype == fp8.FP8 or p.dim() != 3:
                continue
            n, rows, cols = p.shape
            scales = n * math.ceil(rows / fp8.GROUP) * math.ceil(cols / fp8.GROUP) * 4
            saved += p.numel() * (p.element_size() - 1) - scales
    return saved


# --- activations, states ---------------------------------------------------------------------

def activation_bytes(model: torch.nn.Module, cfg: ModelConfig, tokens: int, logit_rows: int,
                     dtype: torch.dtype) -> int:
    """Estimated peak of one forward of `tokens` tokens on this rank (the engine measures
    the real one at start, `ModelRunner.size_kv_pool`):

        tokens * e * (4 * hidden + 1.5 * W)            residual stream, norms, widest linear
      + tokens * top_k * 2 * hidden * e                MoE: tokens gathered per expert + out
      + tokens * num_experts * 4 * 2                   MoE: fp32 router scores
      + logit_rows * vocab * 4 * 2                     fp32 logits, gathered + local

    e = the dtype's size, W = the widest output of any linear of the rank (gate_up, qkv,
    MLA's kv_b_proj, ...), logit_rows = max_num_seqs * (k + 1) (a verify forward)."""
    e = torch.empty((), dtype=dtype).element_size()
    widest = max((m.weight.shape[0] for name, m in model.named_modules()
                  if isinstance(m, _LINEARS) and not name.endswith("eh_proj")), default=0)
    n = tokens * e * (4 * cfg.hidden_size + int(1.5 * widest))
    if cfg.moe is not None:
        n += tokens * cfg.moe.top_k * 2 * cfg.hidden_size * e
        n += tokens * cfg.moe.num_experts * 4 * 2
    return n + logit_rows * cfg.vocab_size * 4 * 2


def verify_state_bytes(cfg: ModelConfig, tp_size: int, rows: int, k: int,
                       dtype: torch.dtype) -> int:
    """A rank's verify buffers for `rows` rows of k drafts over every linear layer: the
    engine's own formula (`state_pool.verify_state_bytes`: recurrent states [rows, k, Hv / tp,
    Dk, Dv] fp32 and conv inputs [rows, conv_dim / tp, K - 1 + k] in the model dtype)."""
    from mtpserve.workers.state_pool import verify_state_bytes as pool_verify_state_bytes

    with construction_tp(0, tp_size):
        return pool_verify_state_bytes(cfg, rows, k, dtype)


# --- the plan --------------------------------------------------------------------------------

def plan_memory(path: str | Path, settings: PlanSettings, cfg: ModelConfig | None = None,
                suggest: bool = True) -> MemoryPlan:
    """The memory plan of the model in `path` (a folder with config.json) for `settings`."""
    from mtpserve.workers.model_runner import kv_bytes_per_block
    from mtpserve.workers.state_pool import StateCache

    cfg = cfg or ModelConfig.from_pretrained(path)
    view = checkpoint_view(path, cfg)
    s = settings
    if s.dtype not in DTYPES:
        raise ValueError(f"dtype {s.dtype!r}: expected one of {sorted(DTYPES)}")
    dtype = DTYPES[s.dtype]
    max_len = min(s.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    k = s.num_speculative_tokens if cfg.num_mtp_modules else 0
    notes: list[str] = []
    if s.num_speculative_tokens and not cfg.num_mtp_modules:
        notes.append("the model has no MTP module: planned with k = 0")
    keep, why = fp8_path(cfg, dtype)
    plan = MemoryPlan(model=str(path), family=cfg.model_type, settings=s,
                      weights_source=view.source, fp8="not quantized", per_rank=None,
                      fits=None, message="", max_model_len=max_len, notes=notes)
    try:
        model = build_rank_model(cfg, view, dtype, s.tp_size)
    except ValueError as e:  # the engine's layers refuse this TP size
        plan.fits = False
        plan.message = f"TP {s.tp_size} cannot be built: {e}"
        if suggest:
            plan.suggestions = _suggestions(path, cfg, plan)
        return plan
    plan.experts_fp8 = experts_kept_fp8(model)
    if cfg.quant is not None:
        experts = ("routed experts kept fp8" if plan.experts_fp8 else
                   f"routed experts dequantized to {s.dtype} (what the engine loads today)"
                   if cfg.moe else "")
        plan.fp8 = (f"plain linears kept fp8 + fp32 block scales ({why})" if keep else
                    f"every weight dequantized to {s.dtype} ({why})")
        plan.fp8 += f"; {experts}" if experts else ""
        if view.source == "config.json":
            plan.notes.append("config.json only: every *_proj weight assumed to carry "
                              "128x128 block scales, as the published FP8 checkpoints do")
    if view.source == "config.json" and any(m.head is not None for m in model.mtp):
        plan.notes.append("config.json only: each MTP module assumed to have its own embedding "
                          "and head, as the published checkpoints of this family do")
    main, mtp = weight_bytes(model)
    total: dict[str, int] = {}
    for d in (main, mtp):
        for key, v in d.items():
            total[key] = total.get(key, 0) + v
    with construction_tp(0, s.tp_size):
        per_block = kv_bytes_per_block(cfg, s.block_size, dtype)
        state_bytes = 0
        if cfg.is_hybrid:
            state_bytes = StateCache(cfg, s.max_num_seqs, dtype,
                                     torch.device("meta")).slot_bytes
    rows = s.max_num_seqs * (k + 1)
    profile = max(s.max_num_batched_tokens, rows)  # engine_core.rank_spec's profile_tokens
    r = RankPlan(
        weight_bytes=sum(total.values()), weight_bytes_by_dtype=total,
        main_weight_bytes_by_dtype=main, mtp_weight_bytes_by_dtype=mtp,
        kv_bytes_per_token=per_block // s.block_size, kv_bytes_per_block=per_block,
        profile_tokens=profile,
        activation_bytes=activation_bytes(model, cfg, profile, rows, dtype),
        graph_reserve_bytes=0 if cfg.is_hybrid else DEFAULT_GRAPH_RESERVE,
        state_slots=s.max_num_seqs if cfg.is_hybrid else 0, state_bytes=state_bytes,
        verify_state_bytes=verify_state_bytes(cfg, s.tp_size, s.max_num_seqs, k, dtype))
    if cfg.quant is not None and cfg.moe is not None and not plan.experts_fp8:
        r.experts_fp8_bytes = r.weight_bytes - experts_fp8_saving(model)
    plan.per_rank = r
    if s.gpu_memory_bytes is None:
        plan.message = "give --gpu-memory-gib for the KV capacity and a verdict"
        return plan
    _capacity(r, s)
    need = max(MIN_KV_BLOCKS, -(-max_len // s.block_size))
    plan.fits = r.kv_blocks >= need
    used = r.weight_bytes + _reserved(r)
    if plan.fits:
        plan.message = (f"{r.kv_capacity_tokens} KV tokens per replica "
                        f"({r.kv_capacity_tokens // max_len} requests of max_model_len "
                        f"{max_len}); {_g(r.kv_cache_bytes)} of the rank's {_g(r.budget_bytes)} "
                        f"budget is KV")
    else:
        plan.message = (
            f"a rank's budget is {_g(r.budget_bytes)} ({s.kv_cache_memory_fraction:g} x "
            f"{_g(s.gpu_memory_bytes)}); weights {_g(r.weight_bytes)} + activations, graphs "
            f"and states {_g(_reserved(r))} = {_g(used)} leave {_g(r.kv_cache_bytes)} for KV: "
            f"{r.kv_capacity_tokens} tokens, fewer than one request of max_model_len "
            f"{max_len} ({need} blocks of {s.block_size})")
        if suggest:
            plan.suggestions = _suggestions(path, cfg, plan)
    return plan


def _reserved(r: RankPlan) -> int:
    return r.activation_bytes + r.verify_state_bytes + r.graph_reserve_bytes + r.state_bytes


def _capacity(r: RankPlan, s: PlanSettings, weights: int | None = None) -> None:
    """KV blocks by the engine's own rule (`kv_blocks_for_memory`; the state slots and the
    verify buffers as the pool's states, as `ModelRunner.size_kv_pool` counts them)."""
    assert s.gpu_memory_bytes is not None
    budget = KVMemoryBudget(total=s.gpu_memory_bytes,
                            weights=r.weight_bytes if weights is None else weights,
                            activations=r.activation_bytes, graphs=r.graph_reserve_bytes,
                            staging=0, states=r.state_bytes + r.verify_state_bytes)
    try:
        blocks = kv_blocks_for_memory(budget, s.kv_cache_memory_fraction, r.kv_bytes_per_block,
                                      min_blocks=0)
    except ValueError:  # less room than the scratch block
        blocks = 0
    r.budget_bytes = int(s.kv_cache_memory_fraction * s.gpu_memory_bytes)
    r.kv_blocks = blocks
    r.kv_cache_bytes = blocks * r.kv_bytes_per_block
    r.kv_capacity_tokens = blocks * s.block_size


def _suggestions(path: str | Path, cfg: ModelConfig, plan: MemoryPlan) -> list[str]:
    """What would fit: the smallest TP size, routed experts kept FP8 (an FP8 checkpoint whose
    experts the engine dequantizes), a smaller max_num_seqs."""
    s = plan.settings
    out: list[str] = []
    if s.gpu_memory_bytes is None:
        return out
    r = plan.per_rank
    # Per-rank bytes only shrink with more ranks: a smaller TP cannot fit where this one was
    # built and does not (one this TP size could not build might).
    for tp in TP_CANDIDATES:
        if tp == s.tp_size or (r is not None and tp < s.tp_size):
            continue
        other = plan_memory(path, replace(s, tp_size=tp), cfg, suggest=False)
        if other.fits:
            o = other.per_rank
            out.append(f"TP {tp}: {_g(o.weight_bytes)} of weights and "
                       f"{o.kv_capacity_tokens} KV tokens per rank"
                       + (" (a replica is one placement group, STRICT_PACK: one node with "
                          f"{tp} GPUs)" if tp > 8 else ""))
            break
    else:
        out.append(f"no TP size in {list(TP_CANDIDATES)} fits")
    if r is not None and r.experts_fp8_bytes is not None:
        trial = RankPlan(**{**asdict(r), "weight_bytes": r.experts_fp8_bytes})
        _capacity(trial, s)
        need = max(MIN_KV_BLOCKS, -(-plan.max_model_len // s.block_size))
        verdict = "fits" if trial.kv_blocks >= need else "still does not fit"
        out.append(f"routed experts kept FP8 (1 byte + block scales; the engine dequantizes "
                   f"them today): {_g(r.experts_fp8_bytes)} of weights per rank, "
                   f"{trial.kv_capacity_tokens} KV tokens: {verdict} at TP {s.tp_size}")
    if cfg.quant is not None and s.dtype != "bfloat16":
        out.append("--dtype bfloat16: FP8 linears stay FP8 only when serving bf16")
    # max_num_seqs sizes activations and (hybrids) states, never the weights.
    if r is not None and s.max_num_seqs > 1 and r.weight_bytes + r.graph_reserve_bytes < (
            s.kv_cache_memory_fraction * s.gpu_memory_bytes):
        n = s.max_num_seqs // 2
        while n >= 1:
            other = plan_memory(path, replace(s, max_num_seqs=n), cfg, suggest=False)
            if other.fits:
                out.append(f"max_num_seqs {n}: {other.per_rank.kv_capacity_tokens} KV tokens")
                break
            n //= 2
    return out


def plan_settings_from_gib(gib: float | None, **kw: Any) -> PlanSettings:
    return PlanSettings(gpu_memory_bytes=None if gib is None else int(gib * GIB), **kw)
