"""Building the project's small C++ CPU operators (AVX-512 kernels registered with torch's
dispatcher, so compiled graphs call them as opaque ops): once per machine, in the compile
cache, with the compiler inductor already needs."""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def build_root() -> Path:
    from mtpserve.workers.model.compile_cache import default_cache_dir

    return default_cache_dir() / "extensions"


def has_avx512() -> bool:
    isa = torch.backends.cpu.get_cpu_capability()
    return isa.startswith("AVX512") or isa == "AMX"


@functools.cache
def build(name: str, source: str, what: str) -> bool:
    """Build and load the operators of `source` (library `name`); False, logged once, where
    that fails (no compiler, a read-only cache, header drift): `what` says what is lost."""
    from torch.utils.cpp_extension import load_inline

    tag = torch.__version__.replace("+", "_").replace(".", "_")
    build_dir = build_root() / f"{name}-{tag}"
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        load_inline(f"mtpserve_{name}_{tag}", cpp_sources=[source], is_python_module=False,
                    extra_cflags=["-O3", "-mavx512f", "-mavx512bw", "-mfma"],
                    build_directory=str(build_dir))
    except Exception as e:
        log.warning("%s unavailable: building the kernel in %s failed (%s)", what, build_dir,
                    str(e).splitlines()[0] if str(e) else e)
        return False
    return True
