"""Request migration, retries and deadlines of `router.orchestrator` without Ray.

The orchestrator under test is the real one; its two Serve handles are replaced by in-process
handles over a real engine (`AsyncEngine`), with the failures Serve reports (errors named like
Ray's: the orchestrator matches them by class name). Decode replicas emulate the KV path by
recomputing, which for greedy decoding gives the same tokens. Outputs are compared with the
offline engine: the client must see every token exactly once.
"""

from __future__ import annotations

import asyncio
import inspect
import json
from types import SimpleNamespace

import pytest
from helpers import HandleStream

from mtpserve.router.errors import APIError
from mtpserve.router.orchestrator import DisaggOrchestrator, OrchestratorConfig, resumed
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.llm import LLM
from mtpserve.workers.messages import GenerateRequest, KVTransferParams, TokenChunk
from mtpserve.workers.sampling_params import SamplingParams

MAX_TOKENS = 40


class ActorDiedError(Exception):
    """Named like ray.exceptions.ActorDiedError."""


class KVTransferFailed(RuntimeError):
    """Named like workers.replica.decode_server.KVTransferFailed."""


class BackPressureError(Exception):
    """Named like ray.serve.exceptions.BackPressureError."""


class _Response:
    def __init__(self, coro) -> None:
        self.task = asyncio.ensure_future(coro)

    def __await__(self):
        return self.task.__await__()

    def cancel(self) -> None:
        self.task.cancel()



class Handle:
    """A Serve-like handle: round-robin over replicas, dead ones included (Serve keeps routing to
    a dead replica for a moment)."""

    def __init__(self, replicas: list) -> None:
        self.replicas = replicas
        self.next = 0

    def options(self, **_: object) -> Handle:
        return self

    def __getattr__(self, name: str) -> SimpleNamespace:
        def remote(*args, **kwargs):
            replica = self.replicas[self.next % len(self.replicas)]
            self.next += 1
            out = getattr(replica, name)(*args, **kwargs)
            return HandleStream(out) if inspect.isasyncgen(out) else _Response(out)

        return SimpleNamespace(remote=remote)


class Prefill:
    def __init__(self, engine: AsyncEngine, fail: int = 0) -> None:
        self.engine = engine
        self.fail = fail  # calls that fail like a dead replica
        self.held: set[str] = set()
        self.calls = 0
        self.ids: list[str] = []  # request ids of the prefill calls, in order
        self.renewals = 0
        self.renewable = True  # False: a hold whose lease cannot be extended (lost)

    async def prefill(self, req: GenerateRequest
                      ) -> tuple[TokenChunk, KVTransferParams | None]:
        self.calls += 1
        self.ids.append(req.request_id)
        if self.fail:
            self.fail -= 1
            raise ActorDiedError("The actor died unexpectedly before finishing this task.")
        gen = self.engine.generate(req)
        first = await gen.__anext__()
        await gen.aclose()
        if first.finished:
            return first, None
        self.held.add(req.request_id)
        # No sender stores to reach: releases go through `release` (the Serve path).
        return first, KVTransferParams(req.request_id, [], 1, 2, 0,
                                       len(req.prompt_token_ids), first.token_ids[0], 2)

    async def release(self, request_id: str, target_replica: str | None = None) -> bool:
        found = request_id in self.held
        self.held.discard(request_id)
        return found

    async def renew(self, request_id: str, target_replica: str | None = None) -> bool:
        self.renewals += 1
        return self.renewable and request_id in self.held


class Decode:
    def __init__(self, engine: AsyncEngine, prefill: Prefill) -> None:
        self.engine = engine
        self.prefill = prefill
        self.die_after: int | None = None  # chunks; then this replica is dead for good
        self.fail_after: int | None = None  # chunks; fails every stream, stays alive
        self.freeze_after: int | None = None  # chunks; then silent forever
        self.busy_for: tuple[float, float] | None = None  # (seconds, heartbeat period) first
        self.kv_fail = 0
        self.kv_fail_async = False  # fail as the pull does after admission: an error chunk
        self.kv_fail_kind = "kv_transfer"  # that chunk's error_kind
        self.dead = False
        self.streams = 0

    async def generate(self, req: GenerateRequest, params: KVTransferParams | None):
        if self.dead:
            raise ActorDiedError("The actor died unexpectedly before finishing this task.")
        self.streams += 1
        if params is not None:
            if self.kv_fail:
                self.kv_fail -= 1
                message = ("KV transfer of r0 failed on rank 0 (peer 10.0.0.1:29500): timed out "
                           "after 1.0s")
                if not self.kv_fail_async:
                    raise KVTransferFailed(message)
                yield TokenChunk([], finished=True, finish_reason="error", error=message,
                                 error_kind=self.kv_fail_kind)
                return
            self.prefill.held.discard(params.request_id)  # the pull acknowledges the hold
        if self.busy_for is not None:  # alive but slow to start: heartbeats, no tokens
            until = asyncio.get_running_loop().time() + self.busy_for[0]
            while asyncio.get_running_loop().time() < until:
                await asyncio.sleep(self.busy_for[1])
                yield TokenChunk([], heartbeat=True)
        skip = params is not None  # the prefill side already sent the first token
        sent = 0
        async for chunk in self.engine.generate(req):
            ids = chunk.token_ids[1:] if skip else chunk.token_ids
            skip = False
            if not ids and not chunk.finished:
                continue
            for limit, action in ((self.die_after, "die"), (self.fail_after, "fail"),
                                  (self.freeze_after, "freeze")):
                if limit is not None and sent >= limit:
                    if action == "freeze":
                        await asyncio.sleep(3600)
                    self.dead = action == "die"
                    raise ActorDiedError("The actor died unexpectedly before finishing this "
                                         "task.")
            sent += 1
            yield TokenChunk(ids, chunk.finished, chunk.finish_reason,
                             num_output_tokens=chunk.num_output_tokens,
                             num_drafted=chunk.num_drafted, num_accepted=chunk.num_accepted,
                             num_rounds=chunk.num_rounds)


@pytest.fixture(scope="module")
def engine(default_model):
    eng = AsyncEngine(Engine(EngineConfig(model=str(default_model), num_speculative_tokens=2,
                                          num_kv_blocks=512)))
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def prompts(default_model) -> list[list[int]]:
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.prompts import held_out_prompts

    tok = load_tokenizer(str(default_model))
    return [list(tok.encode(p)) for p in held_out_prompts(4, num_chars=200)]


@pytest.fixture(scope="module")
def offline(default_model, prompts) -> list[list[int]]:
    llm = LLM(str(default_model), num_speculative_tokens=2)
    res = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0,
                                               ignore_eos=True))
    return [r.output_token_ids for r in res]


def build(engine, num_decode=2, prefill_fail=0, **cfg):
    prefill = Prefill(engine, fail=prefill_fail)
    decodes = [Decode(engine, prefill) for _ in range(num_decode)]
    config = OrchestratorConfig(**({"retry_backoff_s": 0.01, "stall_timeout_s": 5.0} | cfg))
    return DisaggOrchestrator(Handle([prefill]), Handle(decodes), config), prefill, decodes


def request(i: int, ids: list[int], **kw) -> GenerateRequest:
    return GenerateRequest(f"r{i}", ids, SamplingParams(**(
        {"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True} | kw)))


async def collect(orch, req: GenerateRequest) -> list[int]:
    """The client's view: every token once, counters consistent, one finished chunk."""
    tokens: list[int] = []
    finished = 0
    async for chunk in orch.generate(req):
        assert not chunk.heartbeat, "heartbeats stay between the orchestrator and decode"
        tokens += chunk.token_ids
        assert chunk.num_output_tokens == len(tokens)
        assert chunk.num_prompt_tokens == len(req.prompt_token_ids)
        finished += chunk.finished
    assert finished == 1
    return tokens


def run(coro):
    return asyncio.run(coro)


def test_no_fault_equals_offline(engine, prompts, offline) -> None:
    orch, prefill, _ = build(engine)

    async def main():
        return await asyncio.gather(*(collect(orch, request(i, p))
                                      for i, p in enumerate(prompts)))

    assert run(main()) == offline
    assert prefill.held == set() and orch.num_migrations == 0


def test_decode_death_mid_stream_migrates(engine, prompts, offline) -> None:
    orch, prefill, (a, b) = build(engine)
    a.die_after = 3  # every stream on replica a dies mid-generation, a stays dead

    async def main():
        return await asyncio.gather(*(collect(orch, request(i, p))
                                      for i, p in enumerate(prompts)))

    assert run(main()) == offline  # no token lost or repeated, same greedy text
    assert a.dead and orch.num_migrations >= 1
    assert prefill.held == set()
    assert engine.engine.stats()["used_blocks"] == 0


def test_migration_limit_then_error(engine, prompts) -> None:
    orch, _, decodes = build(engine, max_migrations=2)
    for d in decodes:
        d.fail_after = 2

    with pytest.raises(APIError) as err:
        run(collect(orch, request(0, prompts[0])))
    assert err.value.status == 503 and err.value.code == "migration_limit_reached"
    assert sum(d.streams for d in decodes) == 3  # first attempt + 2 migrations


@pytest.mark.parametrize("when", ["at_admission", "after_admission"])
def test_kv_failure_recompute(engine, prompts, offline, when) -> None:
    orch, prefill, (a, b) = build(engine)
    a.kv_fail = b.kv_fail = 1
    a.kv_fail_async = b.kv_fail_async = when == "after_admission"
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert orch.num_kv_recomputes == 1 and orch.num_migrations == 0
    assert prefill.held == set()  # released at once, not at the hold TTL


@pytest.mark.parametrize("when", ["at_admission", "after_admission"])
def test_kv_failure_policy_fail(engine, prompts, when) -> None:
    orch, prefill, (a, b) = build(engine, kv_failure_policy="fail")
    a.kv_fail = b.kv_fail = 1
    a.kv_fail_async = b.kv_fail_async = when == "after_admission"
    with pytest.raises(APIError) as err:
        run(collect(orch, request(0, prompts[0])))
    assert err.value.code == "kv_transfer_failed" and "timed out after 1.0s" in err.value.message
    # The client sees no internal address (the log keeps the full text).
    assert "10.0.0.1" not in json.dumps(err.value.body()) and "<internal>" in err.value.message
    assert prefill.held == set()


def test_error_kind_not_wording_marks_a_kv_failure(engine, prompts, offline) -> None:
    # An engine error that merely mentions a KV transfer is a decode failure: it migrates,
    # although the KV policy is "fail".
    orch, prefill, (a, b) = build(engine, kv_failure_policy="fail")
    a.kv_fail = b.kv_fail = 1
    a.kv_fail_async = b.kv_fail_async = True
    a.kv_fail_kind = b.kv_fail_kind = "engine"
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert orch.num_kv_recomputes == 0 and orch.num_migrations == 1
    assert prefill.held == set()


def test_resumed_counts_min_tokens_from_the_resume_point() -> None:
    req = GenerateRequest("r", [1, 2], SamplingParams(max_tokens=10, min_tokens=4))
    assert (resumed(req, [7, 8, 9], 1).params.min_tokens,
            resumed(req, [7] * 6, 2).params.min_tokens) == (1, 0)
    assert resumed(req, [7, 8, 9], 1).params.max_tokens == 7


def test_prefill_retried_then_recomputed_on_decode(engine, prompts, offline) -> None:
    orch, prefill, _ = build(engine, prefill_fail=1)
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert prefill.calls == 2 and orch.num_prefill_retries == 1
    # The retry has its own id: it cannot collide with (or release) the first attempt's hold.
    assert len(set(prefill.ids)) == 2 and prefill.ids[1] == prefill.ids[0] + "#p1"
    assert prefill.held == set()  # the retry's hold was released after its pull
    orch, prefill, _ = build(engine, prefill_fail=2)  # both tries fail: decode recomputes
    assert run(collect(orch, request(1, prompts[1]))) == offline[1]


def test_frozen_decode_replica_is_left_behind(engine, prompts, offline) -> None:
    orch, _, (a, b) = build(engine, stall_timeout_s=1.0)
    a.freeze_after = 4
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert orch.num_migrations == 1


def test_request_timeout_is_enforced(engine, prompts) -> None:
    orch, _, decodes = build(engine, request_timeout_s=1.5, stall_timeout_s=30.0)
    for d in decodes:
        d.freeze_after = 2

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(APIError) as err:
            await collect(orch, request(0, prompts[0]))
        return err.value, loop.time() - t0

    err, took = run(main())
    assert err.status == 504 and err.code == "request_timeout"
    assert took < 15.0  # the 1.5 s request timeout, not the 30 s stall timeout (with slack)
    assert engine.engine.stats()["used_blocks"] == 0


def test_client_leaving_after_first_token_releases_prefill(engine, prompts) -> None:
    orch, prefill, _ = build(engine)

    async def main():
        gen = orch.generate(request(0, prompts[0]))
        first = await gen.__anext__()
        assert prefill.held == {"r0"}
        await gen.aclose()
        await asyncio.sleep(0.05)  # the release runs in the background
        return first

    assert len(run(main()).token_ids) == 1
    assert prefill.held == set()


def test_busy_decode_is_retried_within_the_window(engine, prompts, offline) -> None:
    orch, _, decodes = build(engine, retry_window_s=5.0)
    _busy_then_serve(decodes, 3)
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert orch.num_migrations == 0


def test_seeded_sampling_survives_migration(engine, prompts) -> None:
    kw = {"temperature": 1.0, "seed": 1234}
    orch, _, _ = build(engine)
    want = run(collect(orch, request(0, prompts[2], **kw)))
    orch, _, (a, b) = build(engine)
    a.die_after = b.die_after = None
    a.fail_after = 5
    got = run(collect(orch, request(0, prompts[2], **kw)))
    assert orch.num_migrations >= 1
    assert got == want


def _busy_then_serve(decodes: list, refusals: int, check=None) -> list:
    """Every decode replica refuses the first `refusals` offers with BackPressureError (calling
    `check()` at each), then serves; returns the KV params of every offer."""
    offered: list[KVTransferParams | None] = []
    real = decodes[0].generate
    left = {"n": refusals}

    async def refuse_then_serve(req, params):
        offered.append(params)
        if left["n"]:
            left["n"] -= 1
            if check:
                check()
            raise BackPressureError("queue full")
        async for chunk in real(req, params):
            yield chunk

    for d in decodes:
        d.generate = refuse_then_serve
    return offered


def test_busy_decode_keeps_the_prefill_hold(engine, prompts, offline) -> None:
    """Backpressure is not failure: while every decode replica refuses with BackPressureError,
    the prefill keeps the KV and the same transfer is offered again (no release, no
    recompute, no migration)."""
    orch, prefill, decodes = build(engine, retry_window_s=5.0)

    def still_held() -> None:
        assert prefill.held == {"r0"}

    offered = _busy_then_serve(decodes, 3, still_held)
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert len(offered) == 4 and all(p is not None and p.request_id == "r0" for p in offered)
    assert (orch.num_busy_retries, orch.num_kv_recomputes, orch.num_migrations) == (3, 0, 0)
    assert prefill.held == set()  # the successful pull acknowledged it


def test_busy_decode_past_the_hold_renews_its_lease(engine, prompts, offline) -> None:
    """A hold that would expire while decode is busy gets its lease renewed on the holding
    prefill replica: the same transfer is offered until decode takes it, nothing recomputed."""
    orch, prefill, decodes = build(engine, retry_window_s=5.0, kv_hold_ttl_s=0.5,
                                   kv_timeout_s=0.45)
    offered = _busy_then_serve(decodes, 6)
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert all(p is not None for p in offered) and prefill.renewals >= 1
    assert (orch.num_kv_recomputes, orch.num_migrations) == (0, 0)
    assert prefill.held == set()


def test_busy_decode_past_a_lost_hold_recomputes(engine, prompts, offline) -> None:
    """Once the hold would expire and its lease cannot be renewed, the KV is released and the
    request recomputed on decode."""
    orch, prefill, decodes = build(engine, retry_window_s=5.0, kv_hold_ttl_s=0.5,
                                   kv_timeout_s=0.45)
    prefill.renewable = False
    offered = _busy_then_serve(decodes, 6)
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert offered[0] is not None and offered[-1] is None  # recomputed without the KV
    assert prefill.held == set() and orch.num_migrations == 0


def test_a_release_refused_by_a_full_queue_is_retried(engine, prompts) -> None:
    """Backpressure on the prefill side does not drop a release: a client leaving after the
    first token still frees the prefill's KV once the queue has room."""
    orch, prefill, _ = build(engine)
    real = prefill.release
    refusals = {"n": 2}

    async def busy_then_release(request_id, target_replica=None):
        if refusals["n"]:
            refusals["n"] -= 1
            raise BackPressureError("queue full")
        return await real(request_id, target_replica)

    prefill.release = busy_then_release

    async def main():
        gen = orch.generate(request(0, prompts[0]))
        await gen.__anext__()
        assert prefill.held == {"r0"}
        await gen.aclose()
        for _ in range(100):  # the release retries in the background
            if not prefill.held:
                break
            await asyncio.sleep(0.02)

    run(main())
    assert prefill.held == set() and refusals["n"] == 0


def test_a_live_replica_that_sends_heartbeats_is_not_migrated(engine, prompts, offline) -> None:
    """Busy for longer than the stall timeout, but sending heartbeats: it keeps the request
    (no migration), the client sees no empty chunk, the output is exact; a replica that is
    silent as long is migrated (test_frozen_... above)."""
    orch, prefill, decodes = build(engine, num_decode=1, stall_timeout_s=0.6,
                                   kv_timeout_s=0.1)
    decodes[0].busy_for = (1.5, 0.2)
    assert run(collect(orch, request(0, prompts[0]))) == offline[0]
    assert orch.num_migrations == 0 and decodes[0].streams == 1


def test_a_request_that_failed_on_its_own_inputs_is_never_migrated(engine, prompts) -> None:
    """A decode stream that ends with error kind "request" (the request's own inputs broke
    the step) is the client's 400 at once: another replica would fail it too."""
    orch, prefill, (a, b) = build(engine)
    a.kv_fail = b.kv_fail = 1
    a.kv_fail_async = b.kv_fail_async = True
    a.kv_fail_kind = b.kv_fail_kind = "request"
    with pytest.raises(APIError) as err:
        run(collect(orch, request(0, prompts[0])))
    assert err.value.status == 400
    assert orch.num_migrations == 0 and a.streams + b.streams == 1
    assert prefill.held == set()
