"""The decode graphs a serving engine's warm-up left for later, compiled in a child process.

A replica's warm-up compiles the likeliest buckets within `warmup_budget_s` (on a 2-core CPU
about four AOTInductor packages in the default 90 s) and a restart only loads what the
on-disk compile cache holds, so without this every bucket past the first start's budget (a
batch of 2 or 4 at k = 2, a long context) would run eagerly for good. Instead the replica
starts one low-priority child that builds the same runner (same weights, KV shapes and
settings, so the same cache names) and compiles the remaining buckets, likeliest first,
into the compile cache; the engine adopts each package between steps as it appears
(`BackgroundCompile.adopt`: a load and one warm-up run on the scratch block, well under a
second). Compiling happens once per machine: the next start loads everything.

CPU, TP = 1, ahead-of-time packages only (a TP group's ranks build each bucket in step,
and a CUDA graph must be captured in its own process).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from mtpserve.workers.child_process import child_env
from mtpserve.workers.model.compile_cache import codegen_threads
from mtpserve.workers.model.decode_graph import DecodeGraphs, GraphKey

logger = logging.getLogger(__name__)

# How often the engine looks for packages the child finished.
ADOPT_EVERY_S = 1.0
# The child's niceness: serving keeps the cores first.
NICENESS = 10


class BackgroundCompile:
    """The child compiling `pending` for `graphs`, and the adoption of what it built."""

    def __init__(self, graphs: DecodeGraphs, pending: list[GraphKey],
                 runner_args: dict, warmup_args: dict) -> None:
        self.graphs = graphs
        # Named once here: a later look is a stat per bucket, not a build of its inputs.
        self.pending = {k: graphs.package_path(k) for k in pending}
        self.adopted = 0
        self.started_at = time.time()  # wall clock, as package mtimes (compile progress)
        self._next = time.monotonic() + ADOPT_EVERY_S
        fd, self._spec = tempfile.mkstemp(prefix="mtpserve-compile-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump({"runner": runner_args, "warmup": warmup_args,
                       "fingerprint": graphs.aot.fingerprint,
                       "codegen_threads": codegen_threads()}, f)
        self.proc: subprocess.Popen | None = subprocess.Popen(
            [sys.executable, "-m", "mtpserve.workers.model.background_compile", self._spec,
             str(os.getpid())], env=child_env())
        logger.info("compiling %d more decode graph(s) in the background (pid %d)",
                    len(self.pending), self.proc.pid)

    @property
    def done(self) -> bool:
        return not self.pending or self.proc is None

    @property
    def running(self) -> bool:
        """The child is still compiling."""
        return self.proc is not None and self.proc.poll() is None

    def probe(self) -> list[GraphKey]:
        """The pending buckets whose package is in the cache now (finished, not adopted yet).
        The first sighting of each records when it finished (the package's mtime: it is
        renamed into place once written) in `graphs.ready_at` and
        `graphs.background_finished`, so progress moves while the engine is idle. Engine
        thread only."""
        ready = []
        for key, path in self.pending.items():
            if key not in self.graphs.ready_at:
                try:
                    mtime = path.stat().st_mtime
                except FileNotFoundError:
                    continue
                self.graphs.ready_at[key] = mtime
                self.graphs.background_finished.append(mtime)
            ready.append(key)
        return ready

    def compiling(self) -> list[GraphKey]:
        """What the child is building now: the first pending bucket without a package (it
        compiles them one at a time, in `pending`'s order: `DecodeGraphs.warmup_keys`)."""
        if not self.running:
            return []
        return next(([k] for k in self.pending if k not in self.graphs.ready_at), [])

    def adopt(self, run_bucket: Callable[[GraphKey], None] | None = None,
              force: bool = False) -> int:
        """Load every pending bucket whose package is in the cache now (at most once per
        ADOPT_EVERY_S unless `force`); returns how many. Engine thread only."""
        now = time.monotonic()
        if self.done or (not force and now < self._next):
            return 0
        self._next = now + ADOPT_EVERY_S
        exited = self.proc.poll() is not None  # read first: what it finished is on disk
        ready = self.probe()
        for key in ready:
            (run_bucket or self.graphs.warm_bucket)(key)
            del self.pending[key]
        self.adopted += len(ready)
        if ready:
            logger.info("adopted %d background-compiled decode graph(s), %d pending",
                        len(ready), len(self.pending))
        if exited or not self.pending:
            self._finish()
        return len(ready)

    def _finish(self) -> None:
        if self.proc is not None and self.proc.poll() not in (None, 0):
            logger.warning("background compile exited with %s; %d bucket(s) stay eager",
                           self.proc.returncode, len(self.pending))
        self.stop()

    def stop(self) -> None:
        """Stop the child (a replica shutting down) and forget the buckets it had left."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self.proc = None
        if os.path.exists(self._spec):
            os.unlink(self._spec)


def main(argv: list[str]) -> int:
    from mtpserve.workers.child_process import die_with_parent
    from mtpserve.workers.model_runner import ModelRunner

    spec_path, parent_pid = argv[0], int(argv[1])
    # Started from whichever thread ran the warm-up: the watchdog only (see die_with_parent).
    die_with_parent(parent_pid, death_signal=False)
    os.nice(NICENESS)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s background-compile "
                        "%(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    Path(spec_path).unlink(missing_ok=True)  # a one-shot handoff: nothing left in /tmp
    torch.set_num_threads(1)
    # Kernels for the replica's thread count (the packages it looks for), built by one thread.
    from torch._inductor import config as inductor_config

    inductor_config.cpp.threads = spec["codegen_threads"]
    args = dict(spec["runner"])
    for k in ("dtype", "mtp_dtype"):
        if args.get(k) is not None:
            args[k] = getattr(torch, args[k])
    runner = ModelRunner(**args)
    if runner.graphs is None or runner.graphs.aot is None:
        logger.error("this runner builds no compile-cache packages")
        return 2
    if runner.graphs.aot.fingerprint != spec["fingerprint"]:
        # Other weights, shapes or code than the replica's: its packages would never load.
        logger.error("the compile cache fingerprint differs from the replica's; stopping")
        return 3
    w = spec["warmup"]
    runner.warmup_graphs(w["batch_sizes"], w["query_lens"], w["max_context"],
                         w["mtp_modules"], budget_s=None, log=logger.info)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
