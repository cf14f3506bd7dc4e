"""FP8 block-quantized linears kept in FP8 on CUDA (DeepSeek-V3 / R1 128x128 weight blocks).

The checkpoint's weight [N, K] is float8_e4m3fn with `weight_scale_inv` [N / 128, K / 128]
(decoding factors: real = fp8 * scale). At run time each token's activations are quantized
per group of 128 columns (DeepSeek's `act_quant`: scale = amax / 448), and
`torch.nn.functional.scaled_mm` multiplies with recipes (BlockWise1x128, BlockWise128x128),
the layouts torch 2.13 checks in `_check_scaled_mm_sizes_v2` (torch/_meta_registrations.py):
scale_a [M, K / 128] with stride [1, M]; scale_b [L4, N / 128] with stride [1, L4],
L4 = K / 128 rounded up to 4; mat_b column-major (the weight's transpose view).

`select_path` keeps FP8 only where it is known to work: a Hopper (sm90) device (torch 2.13
dispatches the 1x128 x 128x128 block-scaled GEMM to its sm90 CUTLASS kernel only; Ada's fp8
tensor cores have no block-scaled recipe there), bf16 serving, 128x128 blocks, and a probe
that runs the kernel on the device, eagerly and under `torch.compile` (decode runs compiled
graphs), at several row counts, and matches `blockwise_reference`; everything else
dequantizes at load (quantization.py). Rows are padded to `M_ALIGN` (the column-major
activation scales' leading dimension is M: cuBLASLt wants 16-byte multiples).
Written without a GPU to hand: the probe is the guard for a kernel or layout torch refuses.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from mtpserve.workers.device import runtime
from mtpserve.workers.model.parallel import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    _all_reduce,
)
from mtpserve.workers.model.quantization import FP8BlockConfig, dequantize

if TYPE_CHECKING:
    from mtpserve.workers.model.config import ModelConfig

FP8 = torch.float8_e4m3fn
E4M3_MAX = torch.finfo(FP8).max
GROUP = 128  # the activation group and weight block edge the kernel takes
M_ALIGN = 16  # activation rows padded to a multiple (decode's 1-4 rows: at most 15 extra)
BLOCKWISE_MAJOR = 9  # compute capability major the block-scaled recipe dispatches on
SCALED_MM = "fp8 scaled_mm"
DEQUANTIZED = "dequantized"


def quantize_activation(x: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 x, fp32 scales [M, K / group]) of a [M, K] activation, per token and column group."""
    m, k = x.shape
    g = x.float().reshape(m, k // group, group)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / E4M3_MAX
    return (g / scale.unsqueeze(-1)).reshape(m, k).to(FP8), scale


def blockwise_reference(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                        block: tuple[int, int] = (GROUP, GROUP)) -> torch.Tensor:
    """What the scaled matmul computes, in plain fp32 torch: the dequantized weight times the
    activations after their 1 x 128 fp8 round trip (accumulation order aside)."""
    shape = x.shape
    q, s = quantize_activation(x.reshape(-1, shape[-1]), block[1])
    xq = (q.float().view(q.shape[0], -1, block[1]) * s.unsqueeze(-1)).view(q.shape)
    y = F.linear(xq, dequantize(weight, scale_inv, block))
    return y.view(*shape[:-1], weight.shape[0])


def _scale_b(scale_inv: torch.Tensor) -> torch.Tensor:
    """The weight scales in the layout scaled_mm wants: [L4, N / 128], stride [1, L4]."""
    nb, kb = scale_inv.shape
    l4 = -(-kb // 4) * 4
    padded = torch.zeros(nb, l4, dtype=torch.float32, device=scale_inv.device)
    padded[:, :kb] = scale_inv.float()
    return padded.t()


def scaled_mm_linear(x2d: torch.Tensor, weight: torch.Tensor, scale_b: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """[M, K] activations (any float dtype) times an fp8 [N, K] weight on the kernel, rows
    padded to `M_ALIGN` (zero rows: their scales clamp to 1e-12 / 448, their outputs are
    dropped)."""
    m = x2d.shape[0]
    pad = -m % M_ALIGN
    if pad:
        x2d = F.pad(x2d, (0, 0, 0, pad))
    q, s = quantize_activation(x2d)
    y = F.scaled_mm(q, weight.t(), s.t().contiguous().t(), F.ScalingType.BlockWise1x128,
                    scale_b, F.ScalingType.BlockWise128x128, output_dtype=out_dtype)
    return y[:m] if pad else y


class Fp8BlockLinear(nn.Module):
    """A plain (column-, row-parallel or replicated) linear whose local weight stays FP8 with
    its 128x128 block scales. `use_scaled_mm=False` computes with the dequantized weight, the
    same product the unconverted linear gives (the fallback)."""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor,
                 bias: torch.Tensor | None = None, *, all_reduce: bool = False,
                 use_scaled_mm: bool | None = None) -> None:
        super().__init__()
        n, k = weight.shape
        if n % GROUP or k % GROUP or tuple(scale_inv.shape) != (n // GROUP, k // GROUP):
            raise ValueError(f"fp8 weight {tuple(weight.shape)} with scales "
                             f"{tuple(scale_inv.shape)} is not on the 128x128 grid")
        self.weight = nn.Parameter(weight.to(FP8), requires_grad=False)
        self.register_buffer("weight_scale_inv", scale_inv.float().contiguous())
        self.register_buffer("scale_b", _scale_b(self.weight_scale_inv), persistent=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.all_reduce = all_reduce  # a row-parallel linear's partial sums
        # The kernel is CUDA-only; elsewhere (CPU tests) the dequantized product.
        self.use_scaled_mm = weight.is_cuda if use_scaled_mm is None else use_scaled_mm

    @classmethod
    def from_linear(cls, linear: nn.Module, scale_inv: torch.Tensor,
                    use_scaled_mm: bool | None = None) -> Fp8BlockLinear:
        """Convert a loaded linear whose weight holds the checkpoint's fp8 values (exact in
        the serving dtype) and whose local block scales are `scale_inv`."""
        row = isinstance(linear, RowParallelLinear)
        return cls(linear.weight.data, scale_inv, linear.bias,
                   all_reduce=row and linear.reduce, use_scaled_mm=use_scaled_mm)

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's signature
        # `.to(dtype)` (e.g. lower_mtp_precision) casts every float tensor; the weight keeps
        # its fp8 values (exact in any wider float) and the scales stay fp32, as scaled_mm needs.
        super()._apply(fn, recurse)
        self.weight.data = self.weight.data.to(FP8)
        self.weight_scale_inv = self.weight_scale_inv.float()
        self.scale_b = self.scale_b.float()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        if self.use_scaled_mm:
            y = scaled_mm_linear(x.reshape(-1, shape[-1]), self.weight, self.scale_b, x.dtype)
            y = y.view(*shape[:-1], -1)
        else:  # the ops of the linear it replaced: the bias inside F.linear unless reduced
            w = dequantize(self.weight, self.weight_scale_inv, (GROUP, GROUP)).to(x.dtype)
            if not self.all_reduce:
                return F.linear(x, w, self.bias)
            y = F.linear(x, w)
        if self.all_reduce:
            y = _all_reduce(y)
        return y if self.bias is None else y + self.bias


# --- routed experts ----------------------------------------------------------------------

# Devices whose float8 storage and indexing the expert path was checked on (meta: a memory
# plan builds the model there and must get the layout the load will).
_FP8_EXPERT_DEVICES = ("cuda", "cpu", "meta")


def keep_experts_fp8(cfg: ModelConfig, tp_size: int, device_type: str) -> bool:
    """Whether routed experts keep the checkpoint's FP8 values and 128x128 block scales
    (`moe.Experts`, dequantized at use) rather than being dequantized at load: an FP8
    128x128-block checkpoint whose per-rank expert slice (intermediate / tp) and hidden size
    lie on the 128 grid, on a device listed above. A pure function of its arguments, applied
    when `Experts` is built, so a meta-device model gets the same parameters as a load."""
    q, moe = cfg.quant, cfg.moe
    if q is None or moe is None or tuple(q.block) != (GROUP, GROUP):
        return False
    if device_type not in _FP8_EXPERT_DEVICES or cfg.hidden_size % GROUP:
        return False
    return moe.intermediate_size % tp_size == 0 and (moe.intermediate_size // tp_size) % GROUP == 0


# --- which linears, and loading their block scales -------------------------------------------

def _local_out(linear: nn.Module) -> list[tuple[int, int]]:
    """(full, local) output rows per checkpoint part of a linear."""
    if isinstance(linear, ColumnParallelLinear):
        return list(zip(linear.full_sizes, linear.local_sizes, strict=True))
    return [(linear.weight.shape[0], linear.weight.shape[0])]


def eligible(name: str, linear: nn.Module) -> bool:
    """A plain linear whose local shard, every fused part of it, lies on the 128 grid.
    `kv_b_proj` stays dequantized: the absorbed MLA decode reads its weight per head; so does
    the MTP `eh_proj` (one small matrix per module), whose weight dtype `forward_mtp` reads as
    the MTP module's dtype."""
    if name.endswith(("kv_b_proj", "eh_proj")) or not isinstance(
            linear, ColumnParallelLinear | RowParallelLinear | ReplicatedLinear):
        return False
    n, k = linear.weight.shape
    return n % GROUP == 0 and k % GROUP == 0 and all(
        local % GROUP == 0 for _, local in _local_out(linear))


def num_parts(linear: nn.Module) -> int:
    return len(linear.full_sizes) if isinstance(linear, ColumnParallelLinear) else 1


def keeps_fp8(name: str, linear: nn.Module, scaled_parts: int) -> bool:
    """The loader's rule (and the memory plan's): a linear stays FP8 when it is `eligible`
    and every checkpoint part of it (`scaled_parts` of them) carries block scales."""
    return eligible(name, linear) and scaled_parts == num_parts(linear)


def local_scale(linear: nn.Module, scale_inv: torch.Tensor, shard_id: object,
                out: torch.Tensor) -> None:
    """Copy this rank's blocks of one checkpoint part's `weight_scale_inv` into `out`
    [N_local / 128, K_local / 128], slicing as the linear's `weight_loader` slices rows and
    columns (eligible linears only, so every slice falls on block boundaries)."""
    if isinstance(linear, ColumnParallelLinear):
        part = shard_id or 0
        local = linear.local_sizes[part] // GROUP
        offset = sum(linear.local_sizes[:part]) // GROUP
        # `shard_start`: a part held whole by several ranks (K / V at TP above the KV heads)
        # starts at its shard's rows, not at tp_rank * local.
        out.narrow(0, offset, local).copy_(
            scale_inv.narrow(0, linear.shard_start(part) // GROUP, local))
    elif isinstance(linear, RowParallelLinear):
        local = linear.local_in // GROUP
        out.copy_(scale_inv.narrow(1, linear.tp_rank * local, local))
    else:
        out.copy_(scale_inv)


def select_path(quant: FP8BlockConfig | None, dtype: torch.dtype,
                device: str | torch.device) -> tuple[str, str]:
    """(path, reason): SCALED_MM where the device runs the blockwise kernel, else DEQUANTIZED."""
    if quant is None:
        return DEQUANTIZED, "not quantized"
    device = torch.device(device)
    if device.type != "cuda":
        return DEQUANTIZED, f"{device.type} device"
    if tuple(quant.block) != (GROUP, GROUP):
        return DEQUANTIZED, f"{quant.block[0]}x{quant.block[1]} blocks (128x128 only)"
    if dtype != torch.bfloat16:
        return DEQUANTIZED, f"serving dtype {dtype} (bf16 only)"
    if not hasattr(F, "scaled_mm"):
        return DEQUANTIZED, "this torch has no F.scaled_mm"
    rt = runtime()
    index = device.index if device.index is not None else rt.current_index()
    cap = rt.capability(index)
    if cap[0] != BLOCKWISE_MAJOR:
        return DEQUANTIZED, (f"compute capability {cap[0]}.{cap[1]}: torch {torch.__version__}"
                             "'s block-scaled fp8 GEMM runs on sm90 only")
    problem = _probe(index)
    if problem:
        return DEQUANTIZED, problem
    return SCALED_MM, f"compute capability {cap[0]}.{cap[1]}"


@functools.cache
def _probe(index: int) -> str | None:
    """None if the blockwise kernel runs on this device, eagerly and compiled, at decode and
    prefill row counts (PROBE_ROWS: unpadded, padded and past one pad block), and matches the
    plain-torch reference on an M x 256 x 384 product; else why not."""
    device = torch.device("cuda", index)
    from mtpserve.workers.model.quantization import quantize

    g = torch.Generator().manual_seed(0)
    w = torch.randn(384, 256, generator=g) * 0.05
    wq, s = quantize(w, (GROUP, GROUP))
    mod = Fp8BlockLinear(wq.to(device), s.to(device), use_scaled_mm=True)
    for mode in ("eager", "compiled"):
        fn = mod if mode == "eager" else torch.compile(mod, fullgraph=True, dynamic=False)
        for m in PROBE_ROWS:
            x = torch.randn(m, 256, generator=g)
            ref = blockwise_reference(x, wq, s)
            try:
                got = fn(x.to(device, torch.bfloat16)).float().cpu()
            except Exception as e:  # noqa: BLE001 - any refusal means: dequantize instead
                return (f"scaled_mm ({mode}, {m} rows) refused: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:160]}")
            err = ((got - ref).abs().max() / ref.abs().max()).item()
            if not err <= 2e-2:  # bf16 output rounding is ~4e-3 relative
                return (f"scaled_mm probe ({mode}, {m} rows) off by {err:.3g} (relative) from "
                        "the reference")
    return None


PROBE_ROWS = (1, 3, M_ALIGN, M_ALIGN + 1)
