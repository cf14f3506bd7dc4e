from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from tiny_tokenizer import make_tokenizer

from mtpserve.router.errors import APIError
from mtpserve.router.generation import Choice, ChoiceSet
from mtpserve.workers.messages import GenerateRequest, TokenChunk
from mtpserve.workers.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tokenizer(tmp_path_factory.mktemp("tok"))))


class ScriptedOrchestrator:
    """Replays fixed chunks per request as fast as it is asked; records closed streams."""

    def __init__(self, chunks: list[TokenChunk]) -> None:
        self.chunks = chunks
        self.closed: list[str] = []

    async def generate(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        try:
            for chunk in self.chunks:
                yield chunk
                await asyncio.sleep(0)
            await asyncio.sleep(3600)  # a backend that never ends by itself
        finally:
            self.closed.append(request.request_id)


def choices(tokenizer, n: int, stop: list[str] = ()) -> list[Choice]:
    return [Choice(i, GenerateRequest(f"r-{i}", tokenizer.encode("def"),
                                      SamplingParams(max_tokens=50)), tokenizer,
                   list(stop)) for i in range(n)]


async def drain(cs: ChoiceSet) -> list:
    events = []
    try:
        while (ev := await cs.next_event()) is not None:
            events.append(ev)
    finally:
        await cs.close()
    return events


def test_events_keep_their_own_finish_state_when_the_pump_runs_ahead(tokenizer):
    ids = tokenizer.encode("hello world café")
    chunks = [TokenChunk(ids[:2]), TokenChunk(ids[2:4]),
              TokenChunk(ids[4:], finished=True, finish_reason="length", num_rounds=3)]
    orch = ScriptedOrchestrator(chunks)

    async def run():
        cs = ChoiceSet(orch, choices(tokenizer, 2))
        cs.start()
        await cs.wait_first()
        await asyncio.sleep(0.05)  # every pump has queued all its chunks before we read one
        return cs, await drain(cs)

    cs, events = asyncio.run(run())
    for c in cs.choices:
        mine = [e for e in events if e.choice is c]
        assert "".join(e.text for e in mine) == "hello world café"
        assert [e.finish_reason for e in mine] == [None, None, "length"]
        assert c.mtp_stats().num_rounds == 3


def test_stop_string_closes_the_upstream(tokenizer):
    ids = tokenizer.encode("def value STOP more")
    orch = ScriptedOrchestrator([TokenChunk([i]) for i in ids])

    async def run():
        cs = ChoiceSet(orch, choices(tokenizer, 1, stop=["STOP"]))
        cs.start()
        return cs, await drain(cs)

    cs, events = asyncio.run(run())
    assert cs.choices[0].text == "def value "
    assert events[-1].finish_reason == "stop"
    assert orch.closed == ["r-0"]  # aborted upstream, not left running


def test_error_chunk_raises_and_close_cancels_the_other_choices(tokenizer):
    class Orch(ScriptedOrchestrator):
        async def generate(self, request):
            if request.request_id == "r-1":
                yield TokenChunk([], finished=True, finish_reason="error", error="replica died")
                return
            async for c in super().generate(request):
                yield c

    orch = Orch([TokenChunk(tokenizer.encode("x"))])

    async def run():
        cs = ChoiceSet(orch, choices(tokenizer, 2))
        cs.start()
        with pytest.raises(APIError) as e:
            await cs.wait_first()
        await cs.close()
        return e.value

    err = asyncio.run(run())
    assert err.status == 500 and "replica died" in err.message
    assert orch.closed == ["r-0"]  # the healthy choice's stream was closed, not leaked


def test_logprobs_render_per_chunk_in_both_formats(tokenizer):
    from mtpserve.workers.messages import TokenLogprobs

    ids = tokenizer.encode(" hello world café")
    lps = [TokenLogprobs(t, -0.5 * (i + 1), [(t, -0.5 * (i + 1)), (ids[0], -9.0)])
           for i, t in enumerate(ids)]
    req = GenerateRequest("r", tokenizer.encode("def"), SamplingParams(max_tokens=50, logprobs=1))
    c = Choice(0, req, tokenizer, [])
    c.feed(TokenChunk(ids[:2], logprobs=lps[:2]))
    c.feed(TokenChunk(ids[2:], finished=True, finish_reason="length", logprobs=lps[2:]))
    assert c.logprobs == lps
    streamed = [c.completion_logprobs(lps[:2]), c.completion_logprobs(lps[2:])]
    tokens = [t for part in streamed for t in part.tokens]
    offsets = [o for part in streamed for o in part.text_offset]
    assert "".join(tokens) == c.text  # per-token texts rebuild the completion
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert [v for part in streamed for v in part.token_logprobs] == [e.logprob for e in lps]
    chat = Choice(0, req, tokenizer, []).chat_logprobs(lps)
    assert [e.logprob for e in chat.content] == [e.logprob for e in lps]
    assert all(e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
               for e in chat.content)
    # Not requested: nothing rendered.
    plain = Choice(0, GenerateRequest("p", [1], SamplingParams(max_tokens=5)), tokenizer, [])
    assert plain.completion_logprobs(lps) is None and plain.chat_logprobs(lps) is None
