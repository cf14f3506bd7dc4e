"""Training data: Python sources split by file.

Two corpora:
- `stdlib`: the CPython standard library of the running interpreter (the first default model);
- `python`: the standard library plus the sources of permissively licensed packages installed
  in the running environment (`CORPUS_PACKAGES`), deduplicated by content.

`pip` and every library it vendors are never read (they are the held-out evaluation set): no
`_vendor`/`vendored`/`thirdparty*` folder of another package (which may hold copies of them),
and no file or folder named like one of those libraries anywhere.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import sysconfig
from dataclasses import dataclass
from pathlib import Path

EXCLUDED_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__", "testing",
                 "_vendor", "vendor", "vendored", "_vendored", "extern", "_extern",
                 "thirdparty_files", "thirdparty", "third_party"}
HELD_OUT_PERCENT = 5
MAX_FILE_BYTES = 400_000  # generated tables (unicode data, big literals) teach nothing
# Per-package cap, so a few large packages (transformers' near-copies of modeling code) do not
# make most of the corpus; files past it are dropped in md5 order (stable across machines).
MAX_SOURCE_BYTES = 16_000_000

# Packages pip vendors (pip 23-25 `pip/_vendor`): held out with pip itself.
PIP_AND_VENDORED = {
    "pip", "cachecontrol", "certifi", "chardet", "colorama", "dependency_groups", "distlib",
    "distro", "idna", "msgpack", "packaging", "pkg_resources", "platformdirs", "pygments",
    "pyparsing", "pyproject_hooks", "requests", "resolvelib", "rich", "six", "tenacity", "tomli",
    "tomli_w", "truststore", "urllib3", "webencodings", "typing_extensions",
}

# (import folder, distribution) of packages read for the `python` corpus; each is checked to
# be installed and permissively licensed when the corpus is built (see `corpus_sources`).
CORPUS_PACKAGES = [
    ("torch", "torch"), ("transformers", "transformers"), ("ray", "ray"), ("numpy", "numpy"),
    ("sympy", "sympy"), ("networkx", "networkx"), ("pydantic", "pydantic"),
    ("fastapi", "fastapi"), ("starlette", "starlette"), ("httpx", "httpx"),
    ("httpcore", "httpcore"), ("jinja2", "jinja2"), ("setuptools", "setuptools"),
    ("yaml", "pyyaml"), ("huggingface_hub", "huggingface_hub"), ("fsspec", "fsspec"),
    ("aiohttp", "aiohttp"), ("uvicorn", "uvicorn"), ("click", "click"),
    ("jsonschema", "jsonschema"), ("openai", "openai"), ("_pytest", "pytest"),
    ("anyio", "anyio"), ("attr", "attrs"), ("filelock", "filelock"), ("mpmath", "mpmath"),
    ("safetensors", "safetensors"), ("markupsafe", "markupsafe"), ("yarl", "yarl"),
    ("multidict", "multidict"), ("google/protobuf", "protobuf"), ("grpc", "grpcio"),
    ("opentelemetry", "opentelemetry-api"), ("prometheus_client", "prometheus-client"),
    ("websockets", "websockets"), ("watchfiles", "watchfiles"), ("dateutil", "python-dateutil"),
]
PERMISSIVE = ("mit", "bsd", "apache", "psf", "python software foundation", "isc", "unlicense",
              "3-clause", "2-clause")


@dataclass(frozen=True)
class Source:
    """A folder of Python files in the corpus: `label` prefixes its files' relative paths."""

    label: str
    root: Path
    licence: str


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def licence_of(dist: str) -> str | None:
    """The distribution's declared licence (SPDX expression, License field or classifiers)."""
    try:
        meta = md.metadata(dist)
    except md.PackageNotFoundError:
        return None
    text = meta.get("License-Expression") or ""
    lic = meta.get("License") or ""
    if not text and lic and len(lic) < 80:
        text = lic
    if not text:
        text = "; ".join(c.split(" :: ")[-1] for c in meta.get_all("Classifier") or []
                         if c.startswith("License ::"))
    if text:
        return text
    return lic.splitlines()[0] if lic else None


def corpus_sources(corpus: str = "stdlib") -> list[Source]:
    out = [Source("stdlib", stdlib_root(), "PSF-2.0")]
    if corpus == "stdlib":
        return out
    if corpus != "python":
        raise ValueError(f"unknown corpus {corpus!r} (stdlib | python)")
    sp = site_packages()
    for folder, dist in CORPUS_PACKAGES:
        root = sp / folder
        lic = licence_of(dist)
        if folder.split("/")[0] in PIP_AND_VENDORED or not root.is_dir() or lic is None:
            continue
        if any(word in lic.lower() for word in PERMISSIVE):
            out.append(Source(folder, root, lic))
    return out


def is_held_out(relpath: str) -> bool:
    """Held-out split by file: md5(relpath) % 100 < 5 (stable across machines)."""
    return int(hashlib.md5(relpath.encode()).hexdigest(), 16) % 100 < HELD_OUT_PERCENT


def python_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """(relative path, path) of every .py file outside test and vendored folders, sorted."""
    root = root or stdlib_root()
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if any(part in EXCLUDED_DIRS or part in PIP_AND_VENDORED for part in rel.parts[:-1]):
            continue
        if rel.stem in PIP_AND_VENDORED:
            continue
        out.append((rel.as_posix(), p))
    return out


def corpus_files(corpus: str = "stdlib") -> list[tuple[str, Path]]:
    """(labelled relative path, path) of the corpus, deduplicated by content (first kept),
    without empty or huge files. The stdlib keeps unlabelled relative paths, so its files keep
    the held-out split they always had (a few duplicate, empty or huge ones are dropped)."""
    seen: set[str] = set()
    out = []
    for src in corpus_sources(corpus):
        files = python_files(src.root)
        files.sort(key=lambda f: hashlib.md5(f[0].encode()).hexdigest())
        kept, total = [], 0
        for rel, p in files:
            try:
                data = p.read_bytes()
            except OSError:
                continue
            digest = hashlib.sha1(data).hexdigest()
            if digest in seen or not data.strip() or len(data) > MAX_FILE_BYTES:
                continue
            if src.label != "stdlib" and total + len(data) > MAX_SOURCE_BYTES:
                continue
            seen.add(digest)
            total += len(data)
            kept.append((rel if src.label == "stdlib" else f"{src.label}/{rel}", p))
        out += sorted(kept)
    return out


def split_files(root: Path | None = None, corpus: str = "stdlib") -> tuple[list[Path], list[Path]]:
    """(train files, held-out files) of a folder, or of a named corpus."""
    files = python_files(root) if root else corpus_files(corpus)
    train, held = [], []
    for rel, p in files:
        (held if is_held_out(rel) else train).append(p)
    return train, held


def read_texts(files: list[Path]) -> list[str]:
    texts = []
    for f in files:
        try:
            texts.append(f.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a handful of files are not UTF-8; skipping them is harmless
    return texts
