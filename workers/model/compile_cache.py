"""On-disk cache of compiled decode graphs (AOTInductor packages), so a restarted or added
replica loads its graphs in a fraction of a second each instead of compiling them again.

Why AOTInductor and not inductor's own FX graph cache: on CPU the graphs are frozen (weights
folded in as constants, linears pre-packed for oneDNN), and inductor's cache bypasses frozen
graphs whose constants are oneDNN tensors ("mkldnn tensors unpickleable"); without freezing the
cache works but decode ran at eager speed. An AOTInductor package holds the frozen, packed graph
as a shared library with its constants, and loading it is a `dlopen`. Measured on the default
model (batch 1, S = 1 bucket): export 1 s, compile 40 s, load 0.1 s; a call costs 4.5 ms vs
5.8 ms through `torch.compile` in the same process (no dynamo frame or guards: the wrapper is
C++), outputs equal within 6e-6.

A package is only valid for the exact weights, model code, shapes and CPU it was built from:
the file name hashes the weights as loaded (after dtype, layout and draft-vocab changes), the
source of the model code, the torch version, the CPU's vector ISA, the bucket and every
argument's shape, dtype and stride. A stale entry is therefore never loaded; it is simply not
found. Entries are written to a temporary name and renamed, so replicas sharing a folder never
load a half-written file.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mtpserve.workers.model.aoti_runner import load_package

log = logging.getLogger(__name__)

ENV_DIR = "MTPSERVE_COMPILE_CACHE"
# What a compiled graph's code is made of: every module of workers/model/ (layers, MoE, MLA,
# DSA, rope, the families' config readers...) and the KV cache; a change to any of them
# invalidates the cached packages.
_MODEL_CODE = ("model/*.py", "model/families/*.py", "kv_cache.py")


def default_cache_dir() -> Path:
    """`MTPSERVE_COMPILE_CACHE`, else `$XDG_CACHE_HOME/mtpserve/compile` (~/.cache/...)."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mtpserve" / "compile"


def _code_digest() -> bytes:
    h = hashlib.blake2b(digest_size=16)
    root = Path(__file__).resolve().parents[1]  # workers/
    for pattern in _MODEL_CODE:
        for p in sorted(root.glob(pattern)):
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
    return h.digest()


def model_fingerprint(model: torch.nn.Module, *extra: object) -> str:
    """A digest of the weights as loaded (values, shapes, strides, dtypes), the model code,
    torch and the CPU ISA, plus `extra` (e.g. block size, compile settings)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in model.state_dict(keep_vars=False).items():
        t = t.detach()
        h.update(f"{name}{tuple(t.shape)}{t.stride()}{t.dtype}".encode())
        h.update(t.cpu().contiguous().view(torch.uint8).numpy())  # copies only strided ones
    h.update(_code_digest())
    isa = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends, "cpu") else ""
    h.update(f"{torch.__version__}|{platform.machine()}|{isa}|{extra!r}".encode())
    return h.hexdigest()


def _describe(args: tuple) -> str:
    out = []
    for a in args:
        if isinstance(a, (list, tuple)):
            out.append("[" + _describe(tuple(a)) + "]")
        elif isinstance(a, torch.Tensor):
            out.append(f"{tuple(a.shape)}{a.stride()}{a.dtype}{a.device.type}")
        else:
            out.append(repr(a))
    return ",".join(out)


def codegen_threads() -> int:
    """The thread count inductor's C++ code generator builds CPU kernels for
    (`config.cpp.threads`, else torch's current count). Kernels built for one thread have no
    OpenMP regions, so a package runs well only at the count it was built for (on this 2-core
    box a 2-thread engine on 1-thread kernels decoded 32 rows 1.6x slower): part of every
    package's name."""
    from torch._inductor.utils import parallel_num_threads

    return parallel_num_threads()


class AOTGraphCache:
    """Compiles a module for one set of example arguments into an AOTInductor package under
    `root`, or loads the package an earlier process left there. Counts both, so a test (and
    the warm-up log) can tell a warm start from a cold one."""

    def __init__(self, root: Path, fingerprint: str,
                 configure: Callable[[], object] | None = None) -> None:
        self.root = Path(root)
        self.fingerprint = fingerprint
        self.configure = configure  # context manager factory with the inductor settings
        self.compiled = 0
        self.loaded = 0
        self.compile_s = 0.0
        self.load_s = 0.0

    def path_for(self, name: str, args: tuple) -> Path:
        h = hashlib.blake2b(f"{self.fingerprint}|{name}|{_describe(args)}|"
                            f"threads={codegen_threads()}".encode(), digest_size=12).hexdigest()
        return self.root / f"{name}-{h}.pt2"

    def get(self, name: str, module: torch.nn.Module, args: tuple,
            dynamic_shapes: tuple | None = None) -> Callable:
        """The compiled callable for `module(*args)`; tensors in `args` may be mutated by the
        module (the KV cache), which the package does in place as the eager module does.
        `dynamic_shapes` (torch.export's spec): the package accepts those dims at any size
        in their ranges (`args` are then only the example it is traced at)."""
        path = self.path_for(name, args)
        if path.is_file():
            try:
                t0 = time.perf_counter()
                fn = load_package(path, default_cache_dir() / "ext")
                self.load_s += time.perf_counter() - t0
                self.loaded += 1
                return fn
            except Exception as e:  # a corrupt or foreign file: rebuild it
                log.warning("compile cache entry %s unusable (%s); compiling again", path, e)
        t0 = time.perf_counter()
        ep = self._export(module, args, dynamic_shapes)
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=".pt2")
        os.close(fd)
        try:
            cm = self.configure() if self.configure else contextlib.nullcontext()
            with cm:
                torch._inductor.aoti_compile_and_package(
                    ep, package_path=tmp,
                    inductor_configs={"freezing": True,
                                      "aot_inductor.package_constants_in_so": True})
            os.chmod(tmp, 0o644)  # mkstemp makes it private; replicas may run as other users
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        fn = load_package(path, default_cache_dir() / "ext")
        self.compile_s += time.perf_counter() - t0
        self.compiled += 1
        return fn

    @staticmethod
    def _export(module: torch.nn.Module, args: tuple, dynamic_shapes: tuple | None = None):
        # Export traces with fake tensors (nothing is written to the KV cache) and needs
        # tensors created outside inference mode.
        def plain(a):
            if isinstance(a, (list, tuple)):
                return type(a)(plain(x) for x in a)
            # Only metadata matters to a fake-tensor trace; no copy of the cache's data.
            return (torch.empty_like(a) if isinstance(a, torch.Tensor) and a.is_inference()
                    else a)

        with torch.inference_mode(False), torch.no_grad():
            return torch.export.export(module, plain(args), dynamic_shapes=dynamic_shapes,
                                       strict=False)
