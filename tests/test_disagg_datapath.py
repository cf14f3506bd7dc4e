"""The prefill -> decode data path in one process (TP 1 -> 1, gloo over loopback, no Ray):
the real PrefillServer / DecodeServer classes (Serve's wrappers peeled off), their engines on
background threads, KV moving on transfer threads.

Covers: disaggregated greedy == offline engine; running streams keep decoding during a slow
pull; decode admission through the scheduler (max_num_seqs, a queue for blocks); prefill
admission by prompt only; held prefill KV freed at once on `release`.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from helpers import (
    COMPILED_DECODE,
    HandleStream,
    greedy,
    make_engine,
    run_disaggregated,
    run_to_completion,
)

from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.messages import GenerateRequest
from mtpserve.workers.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def fault_injection(monkeypatch):
    monkeypatch.setenv("MTPSERVE_ENABLE_FAULT_INJECTION", "1")


def make_servers(model, decode_max_num_seqs: int = 8, prefill_blocks: int = 64,
                 decode_blocks: int = 256, k: int = 2, kv: dict | None = None, **extra):
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer

    cfg = ClusterConfig(
        model=str(model),
        # In-process servers whose engine internals the tests read: the core on a thread.
        prefill={"num_kv_blocks": prefill_blocks, "cpus_per_rank": 1, "engine_core": "thread"},
        decode={"num_kv_blocks": decode_blocks, "cpus_per_rank": 1,
                "max_num_seqs": decode_max_num_seqs, "engine_core": "thread"},
        speculation={"num_speculative_tokens": k, "adaptive": False},
        kv_transfer={"timeout_s": 20, "hold_ttl_s": 30, "host": "127.0.0.1", **(kv or {})},
        **extra,
    )
    return PrefillServer.func_or_class(cfg), DecodeServer.func_or_class(cfg)


def shutdown(*servers) -> None:
    for s in servers:
        s.engine.shutdown()
        s.driver.shutdown()


def prompts(n: int, length: int = 20, seed: int = 0) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(length)] for _ in range(n)]



def offline(model, ps, max_tokens: int, k: int = 2) -> list[list[int]]:
    return run_to_completion(make_engine(model, k, num_kv_blocks=256), ps, greedy(max_tokens))


def greq(rid: str, prompt: list[int], max_tokens: int, temperature: float = 0.0,
         **kw) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(
        max_tokens=max_tokens, temperature=temperature, ignore_eos=True, **kw))


def test_disaggregated_greedy_equals_offline_and_frees_everything(tiny_qwen3) -> None:
    p, d = make_servers(tiny_qwen3)
    try:
        ps = prompts(3)
        want = offline(tiny_qwen3, ps, 12)

        async def main():
            return await asyncio.gather(*(run_disaggregated(p, d, greq(f"r{i}", x, 12))
                                          for i, x in enumerate(ps)))

        assert asyncio.run(main()) == want
        end = time.monotonic() + 5
        while time.monotonic() < end:
            ps_, ds_ = p.engine.engine.stats(), d.engine.engine.stats()
            if ps_["used_blocks"] == 0 and ds_["used_blocks"] == 0:
                break
            time.sleep(0.01)
        assert ps_["used_blocks"] == 0 and ds_["used_blocks"] == 0
        assert p.driver.core.holds == [] and d.driver.core.inflight == []
    finally:
        shutdown(p, d)


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "seeded"])
def test_compiled_decode_equals_the_eager_engine(tiny_qwen3, compiled_decode,
                                                 compile_as_configured, temperature) -> None:
    """What a server runs: the decode replica's engine on compiled graphs (`compile: on`, as
    `auto` on CPU), prefill eager. Greedy and seeded P/D streams equal the eager offline
    engine token for token, and the graphs really ran. The decode side has the settings of
    conftest's `compiled_decode` and loads its graphs (compiling none: seconds, not minutes)."""
    kw = dict(num_speculative_tokens=1, num_kv_blocks=48, block_size=4, max_num_seqs=1,
              max_model_len=128)
    assert kw == COMPILED_DECODE
    p, d = make_servers(tiny_qwen3, decode_max_num_seqs=1, decode_blocks=48, k=1,
                        block_size=4, max_model_len=128,
                        engine={"compile": "on", "warmup_budget_s": 600,
                                "compile_cache_dir": str(compiled_decode.cache_dir)})
    try:
        runner = d.driver.runner
        assert runner.graphs is not None and p.driver.runner.graphs is None
        stats = runner.graphs.compile_stats()
        assert stats["compiled"] == 0
        assert stats["loaded"] == compiled_decode.cold_stats["compiled"]
        replays = []

        def counted(*a, _inner=runner._run_graph):
            replays.append(1)
            return _inner(*a)

        runner._run_graph = counted
        ps = prompts(2, length=13, seed=5)
        params = [SamplingParams(max_tokens=16, temperature=temperature, top_p=0.9,
                                 seed=40 + i, ignore_eos=True) for i in range(len(ps))]
        want = run_to_completion(make_engine(tiny_qwen3, 1, num_kv_blocks=256), ps, params)

        async def main():
            return await asyncio.gather(*(
                run_disaggregated(p, d, greq(f"c{i}", x, 16, temperature=temperature, top_p=0.9,
                                   seed=40 + i)) for i, x in enumerate(ps)))

        assert asyncio.run(main()) == want
        assert len(replays) >= 10  # decode rounds ran as graphs, not eagerly
        assert runner.graphs.compile_stats()["compiled"] == 0  # nothing compiled in a request
    finally:
        shutdown(p, d)


def test_prefix_cached_on_both_sides_pulls_only_missing_blocks(tiny_qwen3) -> None:
    """A second request sharing a long prefix: the prefill replica computes only its suffix,
    the decode replica pulls only the blocks it does not hold, the tokens are unchanged."""
    p, d = make_servers(tiny_qwen3)
    try:
        prefix = prompts(1, length=65, seed=9)[0]
        ps = [prefix + x for x in prompts(2, length=6, seed=10)]
        want = offline(tiny_qwen3, ps, 10)
        received = []
        got = []
        for i, x in enumerate(ps):
            before = d.driver.core.receiver.stats()["bytes_received"]
            got.append(asyncio.run(run_disaggregated(p, d, greq(f"r{i}", x, 10))))
            received.append(d.driver.core.receiver.stats()["bytes_received"] - before)
        assert got == want
        kv = d.driver.core.receiver.stats()
        # 65 shared tokens = 4 blocks of 16 and the lookahead token of the last one.
        assert p.engine.engine.block_manager.cache_hits == 64
        assert d.engine.engine.block_manager.cache_hits == 64
        per_block = kv["bytes_saved"] / 4
        assert per_block > 0 and received[1] <= received[0] - 4 * per_block + 1024, received
        assert _wait_free(p, 2.0) < 2.0
    finally:
        shutdown(p, d)


def test_running_streams_keep_decoding_during_a_slow_pull(tiny_qwen3) -> None:
    p, d = make_servers(tiny_qwen3)
    try:
        a, b = prompts(2, seed=1)
        stamps: dict[str, list[float]] = {"A": [], "B": []}

        def on_chunk(rid, chunk):
            stamps[rid].append(time.monotonic())

        async def main():
            task_a = asyncio.create_task(run_disaggregated(p, d, greq("A", a, 400), on_chunk))
            while len(stamps["A"]) < 3:  # A is decoding
                await asyncio.sleep(0.005)
            await d.inject_fault(pull_delay_s=1.0, count=1)
            t_b = time.monotonic()
            out_b = await run_disaggregated(p, d, greq("B", b, 8), on_chunk)
            return t_b, out_b, await task_a

        t_b, out_b, out_a = asyncio.run(main())
        first_b = stamps["B"][0]
        assert first_b - t_b >= 1.0  # B's pull really was delayed
        during = [t for t in stamps["A"] if t_b < t < first_b]
        # A emitted many rounds while B's KV was on its way (the engine thread never waited).
        assert len(during) >= 10, len(during)
        assert len(out_a) == 400 and len(out_b) == 8
    finally:
        shutdown(p, d)


def test_decode_admission_bounds_running_and_queues_for_blocks(tiny_qwen3) -> None:
    max_seqs = 2
    p, d = make_servers(tiny_qwen3, decode_max_num_seqs=max_seqs, decode_blocks=12)
    try:
        ps = prompts(max_seqs + 4, seed=2)
        want = offline(tiny_qwen3, ps, 16)
        eng = d.engine.engine
        seen = {"running": 0, "seqs": 0, "waiting_reported": 0, "awaiting": 0}
        step = eng.step

        def observed_step():  # records what the real scheduler admitted
            seen["running"] = max(seen["running"], len(eng.scheduler.running))
            seen["seqs"] = max(seen["seqs"], eng.scheduler.num_seqs)
            # The autoscaling signal counts requests queued for KV as waiting demand.
            awaiting = len(eng.scheduler.awaiting_kv) + len(eng.scheduler.receiving)
            if awaiting > seen["awaiting"]:
                seen["awaiting"] = awaiting
                report = d.recorder.autoscaling_stats(eng.stats())
                seen["waiting_reported"] = report["waiting"]
            return step()

        eng.step = observed_step

        async def main():
            return await asyncio.gather(*(run_disaggregated(p, d, greq(f"q{i}", x, 16))
                                          for i, x in enumerate(ps)))

        assert asyncio.run(main()) == want
        assert 1 <= seen["running"] <= max_seqs and seen["seqs"] <= max_seqs
        assert seen["awaiting"] >= 1 and seen["waiting_reported"] >= seen["awaiting"]
    finally:
        shutdown(p, d)


def test_prefill_admits_by_prompt_when_the_window_exceeds_its_cache(tiny_qwen3) -> None:
    # Window 512 tokens = 32 blocks; prefill has 8 blocks (128 tokens), decode 64.
    p, d = make_servers(tiny_qwen3, prefill_blocks=8, decode_blocks=64)
    try:
        prompt = prompts(1, length=40, seed=3)[0]
        window_rest = 512 - len(prompt)  # what the API sends for chat without max_tokens
        req = GenerateRequest("w", prompt, SamplingParams(max_tokens=window_rest,
                                                          temperature=0.0))

        async def main():
            _, params = await p.prefill(req)
            # Decode only the first few tokens, then leave (the disconnect path).
            n = 0
            agen = d.generate(req, params)
            async for chunk in agen:
                n += len(chunk.token_ids)
                if n >= 4 or chunk.finished:
                    break
            await agen.aclose()
            return params, n

        params, n = asyncio.run(main())
        assert params.num_computed_tokens == len(prompt) and n >= 1
    finally:
        shutdown(p, d)


def _wait_free(server, deadline_s: float) -> float:
    t0 = time.monotonic()
    while server.engine.engine.block_manager.num_used_blocks:
        assert time.monotonic() - t0 < deadline_s, "prefill KV blocks still held"
        time.sleep(0.005)
    return time.monotonic() - t0


def test_release_frees_held_prefill_kv_at_once(tiny_qwen3) -> None:
    p, d = make_servers(tiny_qwen3)
    try:
        ps = prompts(2, seed=4)

        async def main():
            _, params = await p.prefill(greq("x", ps[0], 8))
            assert p.engine.engine.block_manager.num_used_blocks > 0
            t0 = time.monotonic()
            assert await p.release("x") is True
            freed_after = time.monotonic() - t0
            again = await p.release("x")
            return params, freed_after, again

        params, freed_after, again = asyncio.run(main())
        assert params is not None and again is False
        assert _wait_free(p, 1.0) < 1.0 and freed_after < 1.0
        assert p.driver.core.holds == [] and not p.driver.core._released
        # A pull of a released request is refused: decode reports an error, never hangs.

        async def pull_released():
            chunks = [c async for c in d.generate(greq("x", ps[0], 8), params)]
            return chunks[-1]

        last = asyncio.run(pull_released())
        assert last.finish_reason == "error" and last.error_kind == "kv_transfer"
        assert d.engine.engine.block_manager.num_used_blocks == 0
    finally:
        shutdown(p, d)


# The orchestrator's release calls, over in-process stand-ins for Serve handles ------------------


class _Method:
    def __init__(self, fn, stream: bool) -> None:
        self.fn, self.stream = fn, stream

    def remote(self, *args, **kwargs):
        if self.stream:
            return HandleStream(self.fn(*args, **kwargs))
        return asyncio.ensure_future(self.fn(*args, **kwargs))


class LocalHandle:
    """What the orchestrator uses of a DeploymentHandle, calling a server in this process."""

    def __init__(self, server, stream: bool = False) -> None:
        self.server, self.stream = server, stream

    def options(self, stream: bool = False, **_):
        return LocalHandle(self.server, stream)

    def __getattr__(self, name: str):
        return _Method(getattr(self.server, name), self.stream)


@pytest.mark.parametrize("case", ["first_token_stop", "disconnect_between_stages"])
def test_prefill_blocks_back_to_zero_within_1s_when_decode_never_pulls(tiny_qwen3, case) -> None:
    from mtpserve.router.orchestrator import DisaggOrchestrator

    p, d = make_servers(tiny_qwen3)
    try:
        orch = DisaggOrchestrator(LocalHandle(p), LocalHandle(d))
        req = greq(f"s-{case}", prompts(1, seed=5)[0], 16)

        async def main() -> float:
            gen = orch.generate(req)
            first = await gen.__anext__()  # the first token reached the client ...
            assert first.token_ids and not first.finished
            assert p.engine.engine.block_manager.num_used_blocks > 0  # ... its KV is held
            # ... and the consumer stops reading: a stop string matched the first token, or
            # the client disconnected before decode started. Both close the generator here.
            t0 = time.monotonic()
            await gen.aclose()
            while p.engine.engine.block_manager.num_used_blocks:
                assert time.monotonic() - t0 < 1.0, "prefill KV still held after 1 s"
                await asyncio.sleep(0.005)
            return time.monotonic() - t0

        assert asyncio.run(main()) < 1.0
        assert p.driver.core.sender.stats()["released"] == 1
        assert d.engine.engine.block_manager.num_used_blocks == 0
    finally:
        shutdown(p, d)


def test_prefill_waiting_for_held_blocks_sleeps_and_resumes_on_release(tiny_qwen3) -> None:
    # 8 prefill blocks of 16 tokens: a held 100-token prompt (7 blocks) leaves too few for
    # a second one, which must wait without spinning and start as soon as the hold goes.
    p, d = make_servers(tiny_qwen3, prefill_blocks=8)
    try:
        a, b = prompts(2, length=100, seed=6)

        async def main():
            await p.prefill(greq("held", a, 8))
            second = asyncio.create_task(p.prefill(greq("waits", b, 8)))
            await asyncio.sleep(0.2)
            assert not second.done()  # no blocks for it while "held" is held
            cpu0, t0 = time.process_time(), time.monotonic()
            await asyncio.sleep(1.0)
            busy = (time.process_time() - cpu0) / (time.monotonic() - t0)
            assert not second.done()
            assert await p.release("held")
            _, params = await asyncio.wait_for(second, 10)
            return busy, params

        busy, params = asyncio.run(main())
        assert busy < 0.3, f"the waiting prefill engine burnt {busy:.0%} of a core"
        assert params is not None and params.request_id == "waits"
    finally:
        shutdown(p, d)


def test_decode_stream_sends_heartbeats_while_the_request_waits(tiny_qwen3) -> None:
    """While its KV pull is delayed the decode stream sends heartbeat chunks (no tokens), so
    the orchestrator does not take a live, busy replica for a stalled one."""
    p, d = make_servers(tiny_qwen3, migration={"stall_timeout_s": 0.8})
    try:
        req = greq("hb", prompts(1, seed=7)[0], 6)
        want = offline(tiny_qwen3, [req.prompt_token_ids], 6)[0]

        async def main():
            first, params = await p.prefill(req)
            await d.inject_fault(pull_delay_s=1.0)
            chunks = [c async for c in d.generate(req, params)]
            return list(first.token_ids), chunks

        first, chunks = asyncio.run(main())
        beats = [c for c in chunks if c.heartbeat]
        assert beats and all(not c.token_ids and not c.finished for c in beats)
        assert first + [t for c in chunks for t in c.token_ids] == want
    finally:
        shutdown(p, d)
