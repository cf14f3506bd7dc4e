"""tcmalloc (else jemalloc) preloaded into the CPU engine processes mtpserve starts.

A CPU decode step allocates and frees dozens of small buffers (AOTInductor intermediates,
oneDNN scratch and primitive descriptors). glibc's malloc spends about a tenth of such a step in
its own bookkeeping (`_int_malloc`, `_int_free`, `malloc_consolidate` in `perf`), which
tcmalloc's per-thread caches avoid. Measured on the 2-core box, default model, compiled, one
thread, batch 1, three runs interleaved: k=0 192-196 tok/s with glibc, 222-258 with tcmalloc,
220-241 with jemalloc; k=2 (one pair) 260 vs 320. vLLM's CPU backend asks for the same preload.

A malloc can only replace glibc's from the start of a process, so this works through
LD_PRELOAD in the environment of processes not yet started: Serve replicas (their
runtime_env; their engine-core and compile children inherit it), and commands and benchmarks
that restart themselves under it. `MTPSERVE_MALLOC`: `auto` (default: the first library
found), `system` (glibc), or a library's path. Nothing is installed: Debian's
`libtcmalloc-minimal4` (or `libjemalloc2`) provides the library; without one every process
keeps glibc's malloc.
"""

from __future__ import annotations

import ctypes.util
import functools
import glob
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

ENV = "MTPSERVE_MALLOC"
# Most preferred first: tcmalloc measured ahead of jemalloc (module docstring).
LIBRARIES = ("tcmalloc_minimal", "tcmalloc", "jemalloc")
_SEARCH_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                "/usr/lib", "/usr/local/lib")
_MARKERS = ("libtcmalloc", "libjemalloc")


def _find_library(name: str) -> str | None:
    for d in _SEARCH_DIRS:
        hits = sorted(glob.glob(f"{d}/lib{name}.so*"))
        if hits:
            return hits[0]
    return ctypes.util.find_library(name)  # a soname; ld.so resolves it like a path


def malloc_library(setting: str | None = None) -> str | None:
    """The library to preload, or None (glibc): `setting`, else $MTPSERVE_MALLOC, else auto.
    Linux only (LD_PRELOAD is ld.so's)."""
    setting = (setting or os.environ.get(ENV) or "auto").strip()
    if setting == "system" or not sys.platform.startswith("linux"):
        return None
    if setting != "auto":
        if not Path(setting).is_file():
            raise ValueError(f"{ENV}={setting!r}: expected auto, system or a library's path")
        return setting
    for name in LIBRARIES:
        path = _find_library(name)
        if path:
            return path
    return None


@functools.cache
def preloaded() -> str | None:
    """The faster malloc this process runs on (its mapped library), or None (fixed for the
    life of a process, hence cached)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        if any(m in line for m in _MARKERS):
            return line.split()[-1]
    return None


def preload_vars(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment variables that give a new process the faster malloc: {} when none is
    found, `system` is asked for, or `env`'s LD_PRELOAD already names one."""
    env = os.environ if env is None else env
    current = env.get("LD_PRELOAD", "")
    if any(m in current for m in _MARKERS):
        return {}
    lib = malloc_library(env.get(ENV))
    return _preload(lib, current) if lib else {}


def runtime_env_vars() -> dict[str, str]:
    """For a Ray runtime_env's env_vars: the library ahead of whatever LD_PRELOAD the
    worker's node sets (Ray expands ${VAR} there, and applies env_vars before the worker
    process starts); {} when none is found here (the builder's node: one image per cluster)."""
    lib = malloc_library()
    return _preload(lib, "${LD_PRELOAD}") if lib else {}


def _preload(lib: str, rest: str) -> dict[str, str]:
    out = {"LD_PRELOAD": f"{lib}:{rest}" if rest else lib}
    if "tcmalloc" in lib:  # it reports every allocation over 1 GiB (a CPU KV pool) on stderr
        out["TCMALLOC_LARGE_ALLOC_REPORT_THRESHOLD"] = str(1 << 40)
    return out


def reexec_with_preload() -> None:
    """Restart this process (its original command line) under the faster malloc when it is not
    on one yet and a library is found: a process cannot change its malloc once started. A
    no-op otherwise. For commands and benchmarks whose engines run in their own process;
    processes they start inherit it (a peer's engine in a benchmark runs on the same malloc)."""
    if preloaded() is not None:
        return
    extra = preload_vars()
    if not extra:
        return
    logger.info("restarting under %s", extra["LD_PRELOAD"])
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], {**os.environ, **extra})


@functools.cache
def hint_once() -> None:
    """Log once per process, on CPU engines, that a faster malloc is available and unused."""
    if preloaded() is not None:
        return
    lib = malloc_library()
    if lib is not None:
        logger.info("this process runs on glibc's malloc: start it with LD_PRELOAD=%s for "
                    "~20%% faster CPU decode steps (mtpserve's own servers do so)", lib)
