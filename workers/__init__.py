"""The engine: model, MTP speculative decoding, paged KV, scheduler. Never imports Ray."""

from __future__ import annotations

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams"]

if TYPE_CHECKING:
    from mtpserve.workers.llm import LLM
    from mtpserve.workers.sampling_params import SamplingParams


def __getattr__(name: str):
    # Lazy so that `import mtpserve.workers.kv_transfer` does not pull in the whole engine.
    if name == "LLM":
        from mtpserve.workers.llm import LLM

        return LLM
    if name == "SamplingParams":
        from mtpserve.workers.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
