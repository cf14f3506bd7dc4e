"""The ingress's view of generation: one protocol, implemented by the disaggregated
orchestrator (Serve handles) and by the in-process one (tests, `mtpserve generate`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol, runtime_checkable

from mtpserve.workers.messages import GenerateRequest, TokenChunk


@runtime_checkable
class Orchestrator(Protocol):
    """What the ingress calls; one implementation drives prefill + decode Serve handles."""

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]: ...

    async def stats(self) -> dict: ...

    async def kv_probe(self, num_bytes: int) -> dict: ...
