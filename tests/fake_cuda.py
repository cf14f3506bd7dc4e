"""The fake-CUDA tier's harness: the engine's CUDA code paths on this CPU-only machine.

Inside `fake_cuda()` tensors are `FakeTensor`s: shapes, dtypes and devices propagate through
every op without data, a `cuda` tensor needs no GPU, and what a GPU run would break on fails
here too:
- an op mixing a `cuda` and a `cpu` tensor raises `FakeTensorDeviceMismatchError` (a host
  tensor that reached a device op: the P/D bug of issue 41);
- a read of a tensor's values into Python (`.item()`, `.tolist()`, `bool(t)`, ...) raises
  `DataDependentOutputException`: on CUDA each is a device sync. The one counted sync of a
  round (`host_sync.to_host`) goes through the device seam, whose fake `read_host` returns
  values the test supplies (`FakeRuntime.values`) and records each call.
CUDA runtime objects (streams, events, allocator stats) come from `FakeRuntime` through the
seam (workers/device.py). Two torch bindings that open a CUDA device guard before dispatch
(`Tensor.copy_`, `Tensor.to`) are routed to their aten ops, which fake tensors implement.
Checkpoint files are read outside fake mode (file I/O, not device code) and their tensors
enter as host tensors, as a real load's do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.attention.flex_attention
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.overrides import TorchFunctionMode

import mtpserve.workers.model.loader as loader
from mtpserve.workers.device import use_runtime
from mtpserve.workers.model import flex_paged_attention

CUDA = torch.device("cuda", 0)


def zeros(n: int, reason: str) -> list[int]:
    return [0] * n


@dataclass
class FakeRuntime:
    """The device seam's runtime for fake `cuda` tensors. `values(n, reason)` gives the n
    integers a counted host sync reads (default: zeros, i.e. every draft rejected and token 0);
    `reads` records (reason, n) of each."""

    values: Callable[[int, str], list[int]] = zeros
    reads: list[tuple[str, int]] = field(default_factory=list)
    total_memory: int = 80 << 30
    compute_capability: tuple[int, int] = (9, 0)

    def name(self, device: torch.device) -> str:
        return "fake-cuda"

    def capability(self, index: int) -> tuple[int, int]:
        return self.compute_capability

    def current_index(self) -> int:
        return 0

    def new_stream(self, device: torch.device) -> Any:
        return object()

    def on_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record_event(self, device: torch.device) -> Any:
        return None

    def synchronize(self, device: torch.device) -> None:
        pass

    def sync_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def event_done(self, event: Any) -> bool:
        return True

    def read_host(self, packed: torch.Tensor, reason: str) -> list:
        assert packed.device.type == "cuda" and packed.dim() == 1 and packed.dtype == torch.long
        n = packed.shape[0]
        self.reads.append((reason, n))
        out = list(self.values(n, reason))
        assert len(out) == n
        return out

    def mem_get_info(self, device: torch.device) -> tuple[int, int]:
        return self.total_memory, self.total_memory

    def memory_allocated(self, device: torch.device) -> int:
        return 0

    memory_reserved = max_memory_allocated = memory_allocated

    def reset_peak_memory_stats(self, device: torch.device) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def _to_target(t: torch.Tensor, args: tuple, kwargs: dict
               ) -> tuple[torch.device | None, torch.dtype | None]:
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args:
        if isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, str | torch.device | int):
            device = a
        elif isinstance(a, torch.Tensor):
            device, dtype = a.device, a.dtype
    if device is None:
        return None, dtype
    device = torch.device(device)
    return (CUDA if device.type == "cuda" and device.index is None else device), dtype


aten = torch.ops.aten


def _basic(t: torch.Tensor, index: Any) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
    """`t[index]` as torch's binding applies it: ints select, slices slice, None adds a dim,
    Ellipsis skips dims; tensor / list indices are returned per dim of the sliced view for
    one `aten.index` (ints before advanced indices: torch's order, not numpy's)."""
    items = list(index) if isinstance(index, tuple) else [index]
    used = sum(1 for i in items if i is not None and i is not Ellipsis)
    out, dim, adv = t, 0, []
    for i in items:
        if i is None:
            out = aten.unsqueeze.default(out, dim)
            adv.append(None)
            dim += 1
        elif i is Ellipsis:
            skip = t.dim() - used
            adv += [None] * skip
            dim += skip
        elif isinstance(i, bool):
            raise NotImplementedError("bool index")
        elif isinstance(i, int) or (isinstance(i, torch.SymInt)):
            out = aten.select.int(out, dim, i)
        elif isinstance(i, slice):
            step = 1 if i.step is None else i.step
            out = aten.slice.Tensor(out, dim, i.start, i.stop, step)
            adv.append(None)
            dim += 1
        else:
            idx = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=out.device)
            adv.append(idx)
            dim += 1
    while adv and adv[-1] is None:
        adv.pop()
    return out, adv


def _getitem(t: torch.Tensor, index: Any) -> torch.Tensor:
    out, adv = _basic(t, index)
    return aten.index.Tensor(out, adv) if adv else out


def _setitem(t: torch.Tensor, index: Any, value: Any) -> None:
    view, adv = _basic(t, index)
    if adv:
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value, dtype=t.dtype, device=t.device)
        aten.index_put_.default(view, adv, value)
    elif isinstance(value, torch.Tensor):
        aten.copy_.default(view, value)
    else:
        aten.fill_.Scalar(view, value)


# Dtype casts bind like `.to` (a device guard first).
_CASTS = {torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
          torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16,
          torch.Tensor.long: torch.long, torch.Tensor.int: torch.int32,
          torch.Tensor.short: torch.int16, torch.Tensor.char: torch.int8,
          torch.Tensor.byte: torch.uint8, torch.Tensor.bool: torch.bool}


class HostRead(RuntimeError):
    """A read of device values on the host outside the counted sync."""


class _DeviceGuardFree(TorchFunctionMode):
    """The Tensor methods whose Python bindings open a CUDA device guard before dispatch
    (which a CPU-only torch cannot, fake tensor or not) as their aten ops: `copy_`, `to` and
    the dtype casts, `cpu` / `cuda`, `contiguous`, `~`, indexing."""

    def __init__(self, fake: FakeTensorMode) -> None:
        super().__init__()
        self.fake = fake

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.contiguous:
            t = args[0]
            fmt = kwargs.get("memory_format", torch.contiguous_format)
            return t if t.is_contiguous(memory_format=fmt) else aten.clone.default(
                t, memory_format=fmt)
        if func is torch.Tensor.__invert__:
            return aten.bitwise_not.default(args[0])
        if func is torch.Tensor.__getitem__:
            return _getitem(*args)
        if func is torch.Tensor.__setitem__:
            return _setitem(*args)
        if func is torch.Tensor.copy_:
            dst, src = args[0], args[1]
            if isinstance(src, FakeTensor) and not isinstance(dst, FakeTensor):
                raise HostRead("a device -> host copy into a host tensor (a sync outside "
                               "host_sync.to_host)")
            return aten.copy_.default(dst, src)
        if func is torch.Tensor.cpu:
            func, args = torch.Tensor.to, (args[0], "cpu")
        elif func in _CASTS:
            func, args = torch.Tensor.to, (args[0], _CASTS[func])
        if func is torch.Tensor.to:
            t = args[0]
            device, dtype = _to_target(t, args[1:], kwargs)
            if isinstance(t, FakeTensor) and device is not None and device.type == "cpu":
                # A fake host tensor: its values are what a read would need the device for.
                return self.fake.from_tensor(torch.empty(t.shape, dtype=dtype or t.dtype))
            if ((device is None or device == t.device) and (dtype is None or dtype == t.dtype)
                    and not kwargs.get("copy", False)):
                return t
            return torch.ops.aten._to_copy.default(t, dtype=dtype or t.dtype,
                                                   device=device or t.device)
        if func is torch.Tensor.cuda:
            return torch.ops.aten._to_copy.default(args[0], device=CUDA)
        return func(*args, **kwargs)


class _HostFile:
    """safetensors' `safe_open`, read outside fake mode: checkpoint tensors are host data."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        from safetensors import safe_open

        with unset_fake_temporarily():
            self._ctx = safe_open(*args, **kwargs)
            self._file = self._ctx.__enter__()

    def __enter__(self) -> _HostFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._ctx.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._file, name)
        if not callable(attr):
            return attr

        def outside(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return attr(*args, **kwargs)

        return outside


def _touches_cuda(args: tuple, kwargs: dict) -> bool:
    for x in pytree.tree_leaves((args, kwargs)):
        if isinstance(x, FakeTensor):
            return True
        if isinstance(x, torch.device) and x.type == "cuda":
            return True
        if isinstance(x, str) and x.startswith("cuda"):
            return True
    return False


class _FakeCUDAMode(FakeTensorMode):
    """Fake tensors for the device, real ones for the host: an op that touches no fake tensor
    and names no `cuda` device runs for real, so host metadata (block tables, positions)
    computes as it does on a GPU machine; anything read back from the device is a fake host
    tensor, whose values a read cannot have."""

    _guard_free = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not _touches_cuda(args, kwargs):
            if kwargs.get("pin_memory"):  # no pinned allocator without CUDA: plain host memory
                kwargs = {**kwargs, "pin_memory": False}
            return func(*args, **kwargs)
        if self._guard_free:
            return super().__torch_dispatch__(func, types, args, kwargs)
        # Fake rules and decompositions call Tensor methods too (`copy_`): same bindings.
        self._guard_free = True
        try:
            with _DeviceGuardFree(self):
                return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self._guard_free = False


def _register_hops() -> None:
    """Higher-order ops register their fake rule for FakeTensorMode itself, not subclasses."""
    from torch._higher_order_ops.flex_attention import flex_attention as flex_hop

    if _FakeCUDAMode not in flex_hop.python_key_table:
        flex_hop.py_impl(_FakeCUDAMode)(flex_hop.python_key_table[FakeTensorMode])


@contextlib.contextmanager
def fake_cuda(values: Callable[[int, str], list[int]] = zeros) -> Iterator[FakeRuntime]:
    """Run the block with fake tensors, `cuda` a device, and the fake runtime in the seam."""
    _register_hops()
    rt = FakeRuntime(values)
    mp = pytest.MonkeyPatch()
    mp.setattr(loader, "safe_open", _HostFile)
    # Triton kernels need a GPU: flex attention runs its eager reference, same op, same shapes.
    # (and calls its op directly: the eager reference otherwise traces it with dynamo).
    mp.setattr(flex_paged_attention, "_compiled_flex", flex_paged_attention.flex_attention)
    mp.setattr(torch.nn.attention.flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    try:
        fake = _FakeCUDAMode(allow_non_fake_inputs=True)
        # No autograd: a backward graph on fake CUDA tensors would open a CUDA device guard
        # in C++ (an abort, not an exception); the engine runs under inference mode anyway.
        with use_runtime(rt), torch.no_grad(), fake, _DeviceGuardFree(fake):
            yield rt
    finally:
        mp.undo()
