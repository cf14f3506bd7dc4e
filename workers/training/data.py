"""Training data: the CPython standard library of the running interpreter, split by file."""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}
HELD_OUT_PERCENT = 5


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_held_out(relpath: str) -> bool:
    """Held-out split by file: md5(relpath) % 100 < 5 (stable across machines)."""
    return int(hashlib.md5(relpath.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def python_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every .py file outside test folders, sorted."""
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        out.append((rel.as_posix(), p))
    return out


def split_files(root: Path | None = None) -> tuple[list[Path], list[Path]]:
    """(train files, held-out files)."""
    train, held = [], []
    for rel, p in python_files(root):
        (held if is_held_out(rel) else train).append(p)
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a handful of stdlib files are not UTF-8; skipping them is harmless
    return texts
