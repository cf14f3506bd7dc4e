"""A consumer slower than the engine gets what piled up as one chunk: the same tokens,
logprobs and counters as chunk by chunk, in fewer messages; a failure stays its own chunk."""

from __future__ import annotations

import asyncio

from mtpserve.workers.async_engine import AsyncEngine, coalesced
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.messages import GenerateRequest, TokenChunk, TokenLogprobs, merge_chunks
from mtpserve.workers.sampling_params import SamplingParams


def test_merge_keeps_tokens_logprobs_and_the_last_counters() -> None:
    a = TokenChunk([1, 2], num_output_tokens=2, num_drafted=2, num_accepted=1, num_rounds=1,
                   logprobs=[TokenLogprobs(1, -0.1), TokenLogprobs(2, -0.2)])
    b = TokenChunk([3], finished=True, finish_reason="length", num_output_tokens=3,
                   num_drafted=4, num_accepted=1, num_rounds=2,
                   logprobs=[TokenLogprobs(3, -0.3)])
    m = merge_chunks([a, b])
    assert m.token_ids == [1, 2, 3] and [lp.token_id for lp in m.logprobs] == [1, 2, 3]
    assert (m.finished, m.finish_reason, m.num_output_tokens, m.num_drafted, m.num_rounds) == (
        True, "length", 3, 4, 2)
    assert merge_chunks([a]) is a


def test_a_slow_consumer_gets_the_backlog_as_one_chunk(tiny_qwen3) -> None:
    eng = AsyncEngine(Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=2,
                                          num_kv_blocks=64)))

    async def run(slow: bool) -> list[TokenChunk]:
        req = GenerateRequest("r-slow" if slow else "r-fast", [5, 6, 7, 8], SamplingParams(
            max_tokens=40, temperature=0.0, ignore_eos=True))
        chunks = []
        async for c in eng.generate(req):
            chunks.append(c)
            if slow and len(chunks) == 1:
                # Fall behind: do not read again until the engine has finished the request.
                while await eng.acall(lambda e: req.request_id in e.requests):
                    await asyncio.sleep(0.01)
        return chunks

    try:
        fast = asyncio.run(run(False))
        slow = asyncio.run(run(True))
    finally:
        eng.shutdown()
    tokens = [t for c in fast for t in c.token_ids]
    assert len(tokens) == 40 and [t for c in slow for t in c.token_ids] == tokens
    assert len(fast) > 2 and len(slow) == 2  # the first chunk, then everything else at once
    assert slow[-1].finished and slow[-1].num_rounds == fast[-1].num_rounds


def test_a_paced_stream_sends_the_first_chunk_and_the_end_at_once() -> None:
    """`interval_s` holds a chunk that follows a send until the interval passed (here 60 s:
    never), but not the first chunk, nor the finished one, which takes the held ones along."""

    async def main() -> None:
        q: asyncio.Queue = asyncio.Queue()
        stream = coalesced(q, interval_s=60.0)
        q.put_nowait(TokenChunk([1], num_output_tokens=1))
        first = await asyncio.wait_for(anext(stream), 10)
        q.put_nowait(TokenChunk([2], num_output_tokens=2))
        q.put_nowait(TokenChunk([3], num_output_tokens=3))
        held = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0.3)  # an unheld chunk would be here long before
        assert not held.done()
        q.put_nowait(TokenChunk([4], finished=True, finish_reason="length",
                                num_output_tokens=4))
        last = await asyncio.wait_for(held, 10)
        assert first.token_ids == [1]
        assert last.token_ids == [2, 3, 4] and last.finished and last.num_output_tokens == 4

    asyncio.run(main())


def test_a_paced_stream_sends_what_came_in_an_interval_as_one_chunk() -> None:
    """Rounds 5 ms apart, interval 200 ms: after the first chunk the next send waits for the
    interval and carries every round that came meanwhile; unpaced, each round goes alone."""

    async def feed(q: asyncio.Queue, n: int) -> None:
        for i in range(n):
            await asyncio.sleep(0.005)
            q.put_nowait(TokenChunk([i], finished=i == n - 1,
                                    finish_reason="length" if i == n - 1 else None))

    async def run(interval_s: float) -> list[TokenChunk]:
        q: asyncio.Queue = asyncio.Queue()
        feeder = asyncio.create_task(feed(q, 20))
        chunks = [c async for c in coalesced(q, interval_s)]
        await feeder
        return chunks

    paced, unpaced = asyncio.run(run(0.2)), asyncio.run(run(0.0))
    for chunks in (paced, unpaced):
        assert [t for c in chunks for t in c.token_ids] == list(range(20))
        assert chunks[-1].finished and not any(c.finished for c in chunks[:-1])
    assert paced[0].token_ids == [0] and len(paced[1].token_ids) > 1
    assert len(paced) < len(unpaced)


def test_hop_stamps_only_when_traced_and_merges_keep_the_oldest(tiny_qwen3, monkeypatch) -> None:
    """MTPSERVE_TRACE_HOPS=1: chunks with tokens carry the engine's stamp (the streaming
    benchmark reads the hops); a merge keeps its first chunk's stamps; the SSE side adds
    `sse_out`. Off, no chunk carries anything."""
    from mtpserve.router.generation import ChoiceEvent
    from mtpserve.workers import hop_trace

    eng = AsyncEngine(Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=2,
                                          num_kv_blocks=64)))

    async def run(rid: str) -> list[TokenChunk]:
        req = GenerateRequest(rid, [5, 6, 7, 8], SamplingParams(max_tokens=12, temperature=0.0,
                                                                  ignore_eos=True))
        return [c async for c in eng.generate(req)]

    try:
        assert all(c.stamps is None for c in asyncio.run(run("off")))
        monkeypatch.setattr(hop_trace, "ENABLED", True)
        chunks = asyncio.run(run("on"))
    finally:
        eng.shutdown()
    assert chunks and all(set(c.stamps) == {"engine"} for c in chunks if c.token_ids)
    assert merge_chunks(chunks).stamps == chunks[0].stamps
    ev = ChoiceEvent(None, "x", [1], None, stamps=chunks[0].stamps)
    trace = ev.trace()
    assert trace["sse_out"] >= trace["engine"]
    assert ChoiceEvent(None, "x", [1], None).trace() is None
