"""Engine defaults that depend on the device: dtype auto (bf16 on CUDA, fp32 on CPU) and the
attention backend (auto = the measured gather path)."""

from __future__ import annotations

import pytest
import torch

from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.engine_config import resolve_attention_backend, resolve_dtype


def test_dtype_auto_is_bf16_on_cuda_and_fp32_on_cpu() -> None:
    assert resolve_dtype("auto", "cuda") == "bfloat16"
    assert resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float32", "cuda") == "float32"  # an explicit dtype is kept
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("fp8", "cuda")
    assert EngineConfig(model="m").dtype == "auto"
    assert ClusterConfig().dtype == "auto"


def test_attention_backend_auto_is_gather_on_cpu_and_flex_on_cuda() -> None:
    # CPU: the padded gather measured faster; CUDA never pads and gathers (issue: a long
    # request would make every row of the batch copy its KV per layer).
    assert resolve_attention_backend("auto", "cpu") == "gather"
    assert resolve_attention_backend("auto", "cuda") == "flex"
    assert resolve_attention_backend("flex", "cpu") == "flex"
    with pytest.raises(ValueError, match="backend"):
        resolve_attention_backend("flash", "cuda")


def test_default_engine_on_cpu_runs_float32(tiny_qwen3) -> None:
    eng = Engine(EngineConfig(model=str(tiny_qwen3), num_kv_blocks=16))
    assert eng.runner.kv_cache.buffers[0].dtype == torch.float32
    assert next(eng.runner.model.parameters()).dtype == torch.float32
    assert eng.runner.attention_backend == "gather"
