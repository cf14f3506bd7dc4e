"""FP8 block-quantized checkpoints (DeepSeek-V3 / R1, GLM FP8 releases).

`quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [bo, bi],
"activation_scheme": "dynamic"}`: each quantized linear weight `X.weight` [out, in] is stored
as float8_e4m3fn with `X.weight_scale_inv` [ceil(out / bo), ceil(in / bi)] (fp32), and the
real weight is `weight * scale_inv` block by block (DeepSeek's `weight_dequant`).

Served by dequantizing at load, to the serving dtype, before TP sharding (so a block that
straddles two ranks' slices is still scaled right); except on CUDA devices that run the
blockwise FP8 scaled matmul (workers/model/fp8.py: 128x128 blocks, bf16 serving,
a Hopper (sm90) device and a load-time probe), where the plain linears keep their FP8 weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mtpserve.workers.model.rope import UnsupportedConfig

SCALE_SUFFIX = "_scale_inv"


@dataclass(frozen=True)
class FP8BlockConfig:
    block: tuple[int, int]  # (rows, cols) of one scale block

    def describe(self) -> str:
        if tuple(self.block) != (128, 128):
            return (f"fp8 e4m3, {self.block[0]}x{self.block[1]} weight blocks (dequantized "
                    "to the serving dtype at load)")
        return ("fp8 e4m3, 128x128 weight blocks (plain linears kept fp8 with a blockwise "
                "scaled matmul on Hopper (sm90) CUDA serving bf16, routed experts "
                "kept fp8 where their TP slice is on the 128 grid and dequantized at use; "
                "kv_b_proj and every other device dequantized to the serving dtype at load)")

    def scale_shape(self, weight_shape: tuple[int, ...]) -> tuple[int, int]:
        out, inp = weight_shape
        return (-(-out // self.block[0]), -(-inp // self.block[1]))


def parse_quantization(cfg: dict[str, Any]) -> FP8BlockConfig | None:
    """The checkpoint's quantization, or None; refuses any other scheme by name."""
    quant = cfg.get("quantization_config")
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise UnsupportedConfig(f"quantization_config {quant!r} is not supported")
    method = quant.get("quant_method", "?")
    if method != "fp8":
        raise UnsupportedConfig(f"quantization_config (quant_method {method!r}) is not "
                                "supported (fp8 with weight blocks only)")
    fmt = quant.get("fmt", "e4m3")
    block = quant.get("weight_block_size")
    if fmt != "e4m3" or not block or len(block) != 2:
        raise UnsupportedConfig(f"quantization_config fp8 with fmt {fmt!r}, weight_block_size "
                                f"{block!r} is not supported (e4m3 with 2-D weight blocks only)")
    if quant.get("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedConfig(f"quantization_config activation_scheme "
                                f"{quant['activation_scheme']!r} is not supported")
    return FP8BlockConfig((int(block[0]), int(block[1])))


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor,
               block: tuple[int, int]) -> torch.Tensor:
    """fp32 weight of an FP8 block-quantized one."""
    out, inp = weight.shape
    s = scale_inv.float().repeat_interleave(block[0], 0)[:out].repeat_interleave(block[1], 1)
    return weight.float() * s[:, :inp]


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 weight, scale_inv) with each block's max mapped to e4m3's max (for tests and
    tools: the inverse of `dequantize` up to fp8 rounding)."""
    out, inp = weight.shape
    bo, bi = block
    rows, cols = -(-out // bo), -(-inp // bi)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32)
    padded[:out, :inp] = weight.float()
    blocks = padded.view(rows, bo, cols, bi)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12)
    scale_inv = amax / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale_inv[:, None, :, None]).view(rows * bo, cols * bi)[:out, :inp]
    return q.to(torch.float8_e4m3fn), scale_inv
