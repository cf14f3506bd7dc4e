from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The test models are tiny: one thread is faster than two fighting over 2 shared cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# Engines compile decode graphs by default (compile: auto); the suite builds hundreds of
# engines, so it runs them eager and tests compiled graphs where it says so (ModelRunner(
# decode_graphs=True), compile="on" with this variable removed).
os.environ.setdefault("MTPSERVE_COMPILE", "off")
# `draft_dtype: auto` is bf16 drafts on a CPU with native bf16 and the model's dtype elsewhere:
# the suite compares seeded draws and drafts against float32 references, so it pins the
# model's dtype on every machine; tests/test_draft_dtype.py covers the bf16 drafts.
os.environ.setdefault("MTPSERVE_DRAFT_DTYPE", "model")
# Compiled graphs go to a cache private to this run (not the user's ~/.cache): tests that
# compile the same bucket of the same model load it the second time.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="mtpserve-test-compile-")
os.environ.setdefault("MTPSERVE_COMPILE_CACHE", _COMPILE_CACHE)
atexit.register(shutil.rmtree, _COMPILE_CACHE, True)
# Compiled grammars likewise (MTPSERVE_GRAMMAR_CACHE).
_GRAMMAR_CACHE = tempfile.mkdtemp(prefix="mtpserve-test-grammars-")
os.environ.setdefault("MTPSERVE_GRAMMAR_CACHE", _GRAMMAR_CACHE)
atexit.register(shutil.rmtree, _GRAMMAR_CACHE, True)

from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from helpers import COMPILED_DECODE  # noqa: E402
from serve_cluster import SharedServe  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

from mtpserve.workers.engine import Engine, EngineConfig  # noqa: E402
from mtpserve.workers.paths import default_model_path  # noqa: E402

torch.set_num_threads(1)


# The session's shared Ray/Serve cluster (tests/serve_cluster.py), once a module asked for it.
_SHARED = SharedServe()
_SHARED_MODULES = pytest.StashKey[set]()


def _module(item: pytest.Item) -> str | None:
    mod = getattr(item, "module", None)
    return mod.__name__ if mod is not None else None


def pytest_collection_modifyitems(config, items: list[pytest.Item]) -> None:
    """The modules on the shared cluster run one after another (in their usual order, from
    where the first of them stood): one cluster start serves them all, and no module of another
    cluster shape in between (test_multinode, an own `ray.init`) stops it."""
    shared = {_module(it) for it in items if "shared_serve" in getattr(it, "fixturenames", ())}
    config.stash[_SHARED_MODULES] = shared
    if not shared:
        return
    first = next(i for i, it in enumerate(items) if _module(it) in shared)
    block = [it for it in items if _module(it) in shared]
    rest = [it for it in items if _module(it) not in shared]
    items[:] = rest[:first] + block + rest[first:]


@pytest.fixture(scope="module", autouse=True)
def _stop_shared_serve_after_its_modules(request) -> None:
    """The first module after the shared block finds no Ray running: some start their own."""
    if request.module.__name__ not in request.config.stash.get(_SHARED_MODULES, set()):
        _SHARED.stop()


@pytest.fixture(scope="session")
def shared_serve() -> Iterator[SharedServe]:
    """The session's local Ray cluster with Serve, started by its first user (`.url()`) and
    stopped after the last module that uses it."""
    try:
        yield _SHARED
    finally:
        _SHARED.stop()


@pytest.fixture(scope="session")
def default_model(tiny_qwen3) -> Path:
    """The embedded trained model; a tiny random one where it is not there yet."""
    path = default_model_path()
    return path if (path / "config.json").is_file() else tiny_qwen3


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen3", "qwen3")


@pytest.fixture(scope="session")
def tiny_factory(tmp_path_factory):
    made: dict[tuple, Path] = {}

    def make(family: str = "qwen3", **kw) -> Path:
        key = (family, tuple(sorted(kw.items())))
        if key not in made:
            name = f"{family}-" + "-".join(f"{k}{v}" for k, v in sorted(kw.items()))
            made[key] = make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / name, family, **kw)
        return made[key]

    return make


@pytest.fixture(scope="session")
def chat_checkpoint(tmp_path_factory):
    """`chat_checkpoint(style, family=None, special_markers=False)`: a tiny checkpoint with the
    chat template and special tokens of `style` (tests/chat_models.py; `special_markers`: its
    markers are special tokens), built once per session."""
    from chat_models import make_chat_checkpoint

    made: dict[tuple, Path] = {}

    def make(style: str, family: str | None = None, special_markers: bool = False) -> Path:
        key = (style, family, special_markers)
        if key not in made:
            name = f"{style}-{family or 'own'}{'-special' if special_markers else ''}"
            made[key] = make_chat_checkpoint(tmp_path_factory.mktemp("chat") / name, style,
                                             family, special_markers=special_markers)
        return made[key]

    return make


@pytest.fixture
def compile_as_configured(monkeypatch) -> None:
    """Engines take their configured compile mode (the suite runs eager by default, above):
    for tests of the compiled graphs a server runs."""
    monkeypatch.delenv("MTPSERVE_COMPILE", raising=False)
    monkeypatch.delenv("MTPSERVE_DECODE_GRAPHS", raising=False)


@dataclass
class CompiledDecode:
    """A decode replica's engine started cold with compiled graphs, and the cache it filled."""

    engine: Engine
    cache_dir: Path
    cold_stats: dict[str, float]  # its start: graphs compiled, none loaded
    cold_files: int  # packages in `cache_dir` after that start


@pytest.fixture(scope="session")
def compiled_decode(tiny_qwen3, tmp_path_factory) -> CompiledDecode:
    """A decode replica's engine on tiny_qwen3 (COMPILED_DECODE settings, `compile: on`, what
    `auto` serves on CPU) that compiled its buckets into a compile cache of its own when it
    started. Later engines and servers with the same settings and `cache_dir` load those
    graphs in a fraction of a second instead of compiling them again."""
    cache = tmp_path_factory.mktemp("compile-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MTPSERVE_COMPILE", raising=False)
        mp.delenv("MTPSERVE_DECODE_GRAPHS", raising=False)
        eng = Engine(EngineConfig(model=str(tiny_qwen3), role="decode", compile="on",
                                  compile_cache_dir=str(cache), warmup_budget_s=600,
                                  **COMPILED_DECODE))
    return CompiledDecode(eng, cache, eng.runner.graphs.compile_stats(),
                          len(list(cache.glob("*.pt2"))))
