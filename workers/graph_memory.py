"""The memory CUDA graphs take, measured, for the next KV pool sizing.

The KV pool is sized when the runner is built (`ModelRunner.size_kv_pool`), before warm-up
compiles and captures the decode graphs, so their memory pool must be reserved ahead. A
guess (`DEFAULT_GRAPH_RESERVE`) serves the first start of a (model, dtype, block size, TP,
backend, GPU, torch) combination; every capture then measures what the graphs really took
(the allocator's reserved bytes before and after: the graphs' private pool holds their
intermediates) and records the largest in the compile cache folder, which replicas keep
between starts, so later starts reserve the measured bytes plus a margin instead.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_GRAPH_RESERVE = 1 << 30  # the first start's guess, before anything was measured
MARGIN = 1.1  # over the measured bytes: another capture order may fragment the pool more
FILE = "graph-memory.json"


def record_key(model_path: str | Path, *parts: object) -> str:
    """What the graphs' memory depends on: the model's config and the given parts (dtype,
    block size, TP, attention backend, GPU name, torch version)."""
    cfg = Path(model_path) / "config.json"
    text = cfg.read_text() if cfg.is_file() else str(model_path)
    return hashlib.sha256(json.dumps([text, *map(str, parts)]).encode()).hexdigest()[:32]


class GraphMemoryRecord:
    """Measured graph memory per key, in `folder`/graph-memory.json (None: not kept)."""

    def __init__(self, folder: str | Path | None) -> None:
        self.path = Path(folder) / FILE if folder else None

    def _read(self) -> dict[str, int]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):  # a torn write from a killed start: measure again
            return {}
        return {k: int(v) for k, v in data.items()} if isinstance(data, dict) else {}

    def reserve(self, key: str) -> int:
        """Bytes to reserve for the graphs: the measured maximum plus a margin, else the
        default guess."""
        measured = self._read().get(key)
        return DEFAULT_GRAPH_RESERVE if measured is None else int(measured * MARGIN)

    def store(self, key: str, nbytes: int) -> None:
        """Keep the largest measurement of `key` (written atomically; best effort: a
        read-only cache folder only costs the next start its measured reserve)."""
        if self.path is None:
            return
        data = self._read()
        if data.get(key, -1) >= nbytes:
            return
        data[key] = int(nbytes)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
            tmp.replace(self.path)
        except OSError as e:
            log.warning("could not record the CUDA graphs' memory in %s: %s", self.path, e)
