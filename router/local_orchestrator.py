"""Single-process orchestrator: one engine does prefill and decode (tests, `--local`)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.messages import GenerateRequest, TokenChunk


class LocalOrchestrator:
    def __init__(self, engine: AsyncEngine) -> None:
        self.engine = engine

    def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        return self.engine.generate(request)

    async def stats(self) -> dict:
        return {"engine": await self.engine.acall(lambda e: e.stats())}

    async def kv_probe(self, num_bytes: int) -> dict:
        raise NotImplementedError("a single-process engine has no KV channel to probe")
