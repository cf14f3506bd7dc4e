"""Engine settings and the error for requests the engine cannot take."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from mtpserve.workers.model import shm_collectives

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # "auto": bfloat16 on CUDA, float32 on CPU (`resolve_dtype`).
    dtype: str = "auto"
    device: str = "cpu"
    num_speculative_tokens: int = 2
    adaptive_k: bool = False
    block_size: int = 16
    # None: 1024 off CUDA; on CUDA the KV pool is sized from `kv_cache_memory_fraction`
    # (`kv_blocks_for_memory`) once the weights are loaded.
    num_kv_blocks: int | None = None
    # CUDA: the share of the device's memory this engine may use in all (like vLLM's
    # gpu_memory_utilization); the KV pool gets what is left of it after the weights, the
    # peak activations of a forward, captured graphs and staging buffers. Unused when
    # num_kv_blocks is given, and on CPU.
    kv_cache_memory_fraction: float = 0.9
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    role: Literal["both", "prefill", "decode"] = "both"
    # Mixed batches: while requests are running, prefill chunks of up to
    # `mixed_prefill_tokens` tokens per step ride along their decode rounds in the same
    # forward instead of taking turns with them (running requests keep emitting every step).
    # Measured (benchmarks/prefill_burst.py): running requests' TPOT during a 2x1024-token
    # burst 30.9 -> 14.2 ms, steady TPOT unchanged; the burst's own TTFT 271 -> 678 ms.
    # With compiled decode graphs the step runs the round in its graph and the chunks in
    # their own forward (`Engine._step`).
    mixed_batches: bool = True
    mixed_prefill_tokens: int = 128
    # Intra-op threads of a step that only prefills (no decode rows in it); 0: unchanged. A
    # decode replica prefilling a lone prompt itself (conditional disaggregation) has nothing
    # else to run then, so it can borrow a core for the compute-bound prefill while its decode
    # rounds (fixed per-op cost, slower with more threads) stay on its own.
    prefill_threads: int = 0
    # Automatic prefix caching (workers/prefix_cache.py): full blocks of main + MTP KV that a
    # request computed are shared by later requests with the same prefix.
    prefix_caching: bool = True
    # Draft over the N most frequent tokens only (workers.spec_decode.draft_vocab); None: all.
    draft_vocab_size: int | None = None
    # The MTP module(s)' and their head's dtype (`resolve_draft_dtype`): "auto", "model" or
    # a dtype name. Greedy outputs never depend on it; a seeded sampled output is reproduced
    # by the same draft dtype (its drafts and q are part of the draw).
    draft_dtype: str = "auto"
    # Compiled fixed-shape decode graphs (workers/model/decode_graph.py): "auto" turns them on
    # where they were measured faster (see `compile_enabled`); MTPSERVE_COMPILE overrides.
    compile: Literal["auto", "on", "off"] = "auto"
    # Warm-up compiles the likeliest decode buckets first, within this many seconds; a bucket
    # it did not reach runs eagerly (nothing compiles inside a request).
    warmup_budget_s: float = 90.0
    # Compiled graphs kept between starts (workers.model.compile_cache); None: the default
    # folder, "": no cache.
    compile_cache_dir: str | None = None
    # A start that found some of its graphs in the cache (a restart, an added replica)
    # compiles new ones for at most this long after loading them: such starts take seconds.
    warmup_restart_budget_s: float = 0.0
    # A decode replica compiles the buckets warm-up left in a child process and adopts them as
    # they finish (CPU, TP = 1: workers/model/background_compile.py).
    background_compile: bool = False
    # Paged attention: "gather" (copy each row's context, SDPA), "flex" (FlexAttention over
    # the block table, no copy) or "auto" (`resolve_attention_backend`).
    attention_backend: Literal["auto", "gather", "flex"] = "auto"
    # Structured outputs: grammars not compiled before compile off the engine thread, at most
    # this many at once (the rest queue); a request whose grammar is not ready within the
    # timeout fails alone (the others never wait for it). 0: compile on the engine thread at
    # admission (every stream waits; kept to measure against).
    grammar_compile_workers: int = 2
    grammar_compile_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction {self.kv_cache_memory_fraction}: "
                             "expected a fraction in (0, 1]")
        if self.num_kv_blocks is None and torch.device(self.device).type != "cuda":
            object.__setattr__(self, "num_kv_blocks", DEFAULT_NUM_KV_BLOCKS)


DEFAULT_NUM_KV_BLOCKS = 1024  # off CUDA, when num_kv_blocks is not given


CompileMode = Literal["auto", "on", "off"]


def compile_mode(mode: str) -> str:
    """The configured mode unless `MTPSERVE_COMPILE` (auto | on | off) overrides it (the older
    MTPSERVE_DECODE_GRAPHS=1 means on)."""
    env = os.environ.get("MTPSERVE_COMPILE")
    if env is None and os.environ.get("MTPSERVE_DECODE_GRAPHS") == "1":
        env = "on"
    mode = env or mode
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"compile mode {mode!r}: expected auto | on | off")
    return mode


def compile_enabled(mode: str, device: str, tp_size: int = 1) -> bool:
    """Whether decode forwards run as compiled graphs. `MTPSERVE_COMPILE` (auto | on | off)
    overrides the configured mode (and the older MTPSERVE_DECODE_GRAPHS=1 means on).

    auto: on for CPU, where graphs were measured 1.3-2x faster per decode step at TP = 1
    (README, engine benchmarks) and faster at TP = 2 too (README, "TP on CPU"); off on CUDA
    (not yet measured here). TP > 1 compiles only where its collectives can sit in a graph:
    same-node CPU ranks with shared-memory collectives (NCCL/gloo collectives stay eager)."""
    mode = compile_mode(mode)
    if tp_size > 1 and not (shm_collectives.enabled() and shm_collectives.available(device)):
        return False
    return mode == "on" or (mode == "auto" and device == "cpu")


def resolve_dtype(dtype: str, device: str) -> str:
    """"auto": bfloat16 on CUDA (half the bytes of every weight and KV read, the format GPU
    checkpoints ship in), float32 on CPU (measured here: this CPU has no fast bf16 GEMV, and
    the CPU tests compare with float32 references). Any other value is kept."""
    if dtype == "auto":
        return "bfloat16" if torch.device(device).type == "cuda" else "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: expected auto | {' | '.join(DTYPES)}")
    return dtype


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bf16 GEMMs natively (AVX512-BF16 / AMX, through oneDNN)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN
        return False


def resolve_draft_dtype(draft_dtype: str, dtype: str, device: str,
                        model: str | Path | None = None) -> str:
    """The MTP module(s)' dtype for a model running in `dtype` (resolved) on `device`.

    "model": `dtype`. "auto": bfloat16 where the model runs in float32 on a CPU with native
    bf16, else `dtype` -- except that a bf16 checkpoint (`model`'s config says so) served in
    float32 where the bf16-weight kernel runs (workers/model/bf16_weights.py) keeps `dtype`:
    its float32 MTP linears stream the same bf16 bytes through that kernel. A draft step
    reads the MTP layer and its LM head, bound by their bytes at small batch. Measured on
    the default model, one process, interleaved, 10 held-out prompts: bf16 drafts over
    float32 weights (before the kernel) lifted k = 1 batch-1 speculative efficiency from 0.62
    to 0.70; with the kernel, float32 drafts over it beat bf16 drafts at batch 1 (k = 1: 580
    -> 658 tok/s at 1 thread, 584 -> 610 at 2; k = 3: 711 -> 771 at 2) and lost 5% at batch
    10, k = 2 (2049 -> 1944: its MTP rows pass the kernel's row limit). Outputs never
    change: the main model verifies every draft in `dtype`, and rejection sampling uses the
    q the draft was drawn from. Any other value is kept. `MTPSERVE_DRAFT_DTYPE` (model | a
    dtype) replaces what "auto" means, so a test suite can run every engine with the model's
    dtype whatever CPU runs it (seeded draws then compare across machines)."""
    if draft_dtype == "auto":
        draft_dtype = os.environ.get("MTPSERVE_DRAFT_DTYPE", "auto")
    if draft_dtype == "model":
        return dtype
    if draft_dtype == "auto":
        cpu = torch.device(device).type == "cpu"
        if not (cpu and dtype == "float32" and cpu_has_native_bf16()):
            return dtype
        return dtype if _streams_bf16_weights(model) else "bfloat16"
    if draft_dtype not in DTYPES:
        raise ValueError(f"draft dtype {draft_dtype!r}: expected auto | model | "
                         f"{' | '.join(DTYPES)}")
    return draft_dtype


def _streams_bf16_weights(model: str | Path | None) -> bool:
    """Whether `model` (None: the embedded one) is a bf16 checkpoint whose float32 linears
    the bf16-weight kernel serves on this CPU."""
    from mtpserve.workers.model import bf16_weights
    from mtpserve.workers.paths import default_model_path

    cfg = Path(model or default_model_path()) / "config.json"
    try:
        saved = json.loads(cfg.read_text())
    except (OSError, ValueError):
        return False
    return (saved.get("torch_dtype") or saved.get("dtype")) == "bfloat16" and (
        bf16_weights.available())


def fused_greedy_rounds(config: EngineConfig) -> bool | None:
    """Whether the engine's runner runs each all-greedy k = 1 round as one compiled graph
    (workers/model/greedy_round.py); None: the runner's default (`MTPSERVE_GREEDY_ROUNDS`,
    off unless 1). On by default for a CPU engine at a fixed k = 1 that is not a
    disaggregated replica (adaptive k runs rounds step by step, so those engines do not
    compile round graphs they would not use; a decode or prefill replica keeps only
    dynamic-shape packages, which a restart with more rows loads without compiling). Measured
    on the default model, one process, fused vs step by step interleaved, 2 threads: batch 1
    611 -> 753 tok/s, 2: 997 -> 1154, 4: 1016 -> 1251, 10: 1254 -> 1307; 1 thread, batch 1:
    697 -> 821. `MTPSERVE_GREEDY_ROUNDS=0` turns it off."""
    if os.environ.get("MTPSERVE_GREEDY_ROUNDS") is not None:
        return None
    if (config.num_speculative_tokens == 1 and not config.adaptive_k and config.role == "both"
            and torch.device(config.device).type == "cpu"):
        return True
    return None


def resolve_attention_backend(backend: str, device: str) -> str:
    """"auto": flex on CUDA, gather elsewhere.

    CUDA never takes the padded gather: it copies every row's context, padded to the longest
    block table, out of the cache in every layer and then needs SDPA's masked GQA path (no
    flash kernel), so one long request makes the whole batch copy its context per layer.
    FlexAttention reads the block table in place (flex_paged_attention.py); it is exact
    against gather on CPU (tests/test_flex_paged_attention.py) and `benchmarks/gpu_check.py`
    measures both on the first GPU run. On CPU gather stays: measured here, flex's eager
    reference materialises [B, H, S, num_blocks * block_size] scores and a compiled CPU flex
    recompiles per table width (tests/test_gpu_path_by_construction.py prints both)."""
    if backend == "auto":
        return "flex" if torch.device(device).type == "cuda" else "gather"
    if backend not in ("gather", "flex"):
        raise ValueError(f"attention backend {backend!r}: expected auto | gather | flex")
    return backend


@dataclass(frozen=True)
class KVMemoryBudget:
    """What a device holds besides the KV pool, in bytes (`kv_blocks_for_memory`)."""

    total: int  # the device's memory (torch.cuda.mem_get_info()[1])
    weights: int  # parameters and buffers of the loaded model
    activations: int  # peak transient memory of the largest forward (a profiled prefill)
    graphs: int  # captured CUDA graphs' pool (or the reserve for them, before capture)
    staging: int  # staging buffers on the device: KV pull lanes, send buffers, NCCL
    free: int | None = None  # free device memory once the weights are loaded (None: all)
    # Allocated beside the weights before sizing, so already outside `free`: a hybrid model's
    # state pool (slots + verify buffers, workers/state_pool.py StateCache.nbytes).
    states: int = 0


def kv_blocks_for_memory(budget: KVMemoryBudget, fraction: float, bytes_per_block: int,
                         min_blocks: int = 8, extra_blocks: int = 1) -> int:
    """KV blocks this process may allocate: its own budget, `fraction * total` minus weights,
    states, activations, graphs and staging (vLLM's gpu_memory_utilization: a share per
    process, so other processes' memory does not count against it), and never more than the
    device has free beside the activations, graphs and staging still to come (a GPU shared
    with another process; the weights and states are already outside `free`).
    `extra_blocks` are allocated next to the pool but never handed out (KVCache's scratch
    block). Raises when fewer than `min_blocks` fit: an engine that cannot hold one
    request must not start."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"kv_cache_memory_fraction {fraction}: expected (0, 1]")
    later = budget.activations + budget.graphs + budget.staging
    used = budget.weights + budget.states + later
    room = int(fraction * budget.total) - used
    if budget.free is not None:
        room = min(room, budget.free - later)
    blocks = max(room, 0) // bytes_per_block - extra_blocks
    if blocks < min_blocks:
        gib = 2**30
        raise ValueError(
            f"kv_cache_memory_fraction {fraction} of {budget.total / gib:.1f} GiB leaves "
            f"{max(room, 0) / gib:.2f} GiB for the KV cache after {used / gib:.2f} GiB of "
            f"weights, states, activations, graphs and staging"
            + ("" if budget.free is None else f" ({budget.free / gib:.2f} GiB free)")
            + f": {blocks} blocks of {bytes_per_block} bytes, fewer than {min_blocks}; "
            "lower what shares the GPU, raise the fraction or set num_kv_blocks")
    return blocks


class EngineError(ValueError):
    """A request the engine cannot take (too long, bad parameters)."""
