from __future__ import annotations

import atexit
import os
import shutil
import sys
import tempfile
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
# Compiled graphs go to a cache private to this run (not the user's ~/.cache): tests that
# compile the same bucket of the same model load it the second time.
_COMPILE_CACHE = tempfile.mkdtemp(prefix="mtpserve-test-compile-")
os.environ.setdefault("MTPSERVE_COMPILE_CACHE", _COMPILE_CACHE)
atexit.register(shutil.rmtree, _COMPILE_CACHE, True)

import torch  # noqa: E402
from tiny_models import make_tiny_checkpoint  # noqa: E402

from mtpserve.workers.paths import default_model_path  # noqa: E402

torch.set_num_threads(1)


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
