"""Where the package data lives: the embedded default model and the Serve configs.

The package root (the repository root in a source checkout, `site-packages/mtpserve` in a
wheel install) holds `models/` and `configs/`, so both are found from any working directory."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-code-mtp"
PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def default_model_path() -> Path:
    """The embedded default checkpoint (`models/tiny-code-mtp`), or `$MTPSERVE_MODEL`."""
    env = os.environ.get("MTPSERVE_MODEL")
    return Path(env) if env else PACKAGE_ROOT / "models" / DEFAULT_MODEL_NAME


def config_path(name: str) -> Path:
    """A shipped Serve config (`configs/<name>`)."""
    return PACKAGE_ROOT / "configs" / name
