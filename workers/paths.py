"""Where the embedded default model lives."""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_MODEL_NAME = "tiny-code-mtp"
REPO_ROOT = Path(__file__).resolve().parent.parent


def default_model_path() -> Path:
    """The embedded default checkpoint (`models/tiny-code-mtp`), or `$MTPSERVE_MODEL`."""
    env = os.environ.get("MTPSERVE_MODEL")
    return Path(env) if env else REPO_ROOT / "models" / DEFAULT_MODEL_NAME
