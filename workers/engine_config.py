"""Engine settings and the error for requests the engine cannot take."""

from __future__ import annotations

import os
from dataclasses import dataclass
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
    num_kv_blocks: int = 1024
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    role: Literal["both", "prefill", "decode"] = "both"
    # Mixed batches: while requests are running, prefill chunks of up to
    # `mixed_prefill_tokens` tokens per step ride along their decode rounds in the same
    # forward instead of taking turns with them (running requests keep emitting every step).
    # Measured (benchmarks/prefill_burst.py): running requests' TPOT during a 2x1024-token
    # burst 30.9 -> 14.2 ms, steady TPOT unchanged; the burst's own TTFT 271 -> 678 ms.
    mixed_batches: bool = True
    mixed_prefill_tokens: int = 128
    # Automatic prefix caching (workers/prefix_cache.py): full blocks of main + MTP KV that a
    # request computed are shared by later requests with the same prefix.
    prefix_caching: bool = True
    # Draft over the N most frequent tokens only (workers.spec_decode.draft_vocab); None: all.
    draft_vocab_size: int | None = None
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
    # Paged attention: "gather" (copy each row's context, SDPA), "flex" (FlexAttention over
    # the block table, no copy) or "auto" (`resolve_attention_backend`).
    attention_backend: Literal["auto", "gather", "flex"] = "auto"


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


def resolve_attention_backend(backend: str, device: str) -> str:
    """"auto": gather everywhere for now. On CPU gather is measured (a fused paged attention
    did not beat gather + SDPA here, README lever 3); on CUDA FlexAttention over the block
    table is written and tested for equality on CPU but not yet measured on a GPU
    (`benchmarks/gpu_check.py` compares them), so auto keeps the measured path."""
    if backend == "auto":
        return "gather"
    if backend not in ("gather", "flex"):
        raise ValueError(f"attention backend {backend!r}: expected auto | gather | flex")
    return backend


class EngineError(ValueError):
    """A request the engine cannot take (too long, bad parameters)."""
