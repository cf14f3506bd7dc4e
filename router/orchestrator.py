"""Disaggregated request flow: one async function over the prefill and decode handles.

prefill(request) -> first token + KVTransferParams; the first token is streamed to the client
at once (TTFT), then decode(request, params) streams the rest. Closing the generator (client
disconnect, stop string) cancels the decode call, which aborts the request and frees its KV.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from router.types import GenerateRequest, KVTransferParams, TokenChunk

logger = logging.getLogger(__name__)


def _error(message: str) -> TokenChunk:
    return TokenChunk([], finished=True, finish_reason="error", error=message)


class DisaggOrchestrator:
    def __init__(self, prefill, decode, request_timeout_s: float = 600.0) -> None:
        self.prefill = prefill  # DeploymentHandle of PrefillServer
        self.decode = decode  # DeploymentHandle of DecodeServer
        self.request_timeout_s = request_timeout_s

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        try:
            params: KVTransferParams = await self.prefill.prefill.remote(request)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("prefill of %s failed: %s", request.request_id, e)
            yield _error(f"prefill failed: {_short(e)}")
            return
        yield TokenChunk([params.first_token_id], finished=params.finished,
                         finish_reason=params.finish_reason,
                         num_prompt_tokens=len(request.prompt_token_ids),
                         num_output_tokens=1)
        if params.finished:
            return
        gen = self.decode.options(stream=True).generate.remote(request, params)
        done = False
        try:
            async for chunk in gen:
                done = chunk.finished
                yield chunk
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("decode of %s failed: %s", request.request_id, e)
            done = True
            yield _error(f"decode failed: {_short(e)}")
        finally:
            if not done:
                gen.cancel()  # frees the decode replica's KV blocks for this request

    async def stats(self) -> dict:
        # One sample per call; with several replicas Serve routes each call to one of them.
        p, d = await asyncio.gather(self.prefill.stats.remote(), self.decode.stats.remote())
        return {"prefill": p, "decode": d}

    async def kv_probe(self, num_bytes: int) -> dict:
        """Raw send/recv of num_bytes between a prefill rank-0 sender and a decode rank 0,
        on the channel KV pulls use."""
        p = await self.prefill.stats.remote()
        return await self.decode.kv_probe.remote(p["kv_addresses"][0], num_bytes)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[-1] if text else type(e).__name__)[:300]
