"""The engine core in its own process (`engine_core: process`, workers/replica/engine_core_proc.py):
the real PrefillServer / DecodeServer classes (Serve's wrappers peeled off, no Ray) with their
cores in child processes.

Covers: disaggregated greedy and seeded outputs == the offline engine (the same as with the core
on a thread); the named commands (stats, autoscaling, routing, health, release); a dead core ends
its streams with an engine error at once, fails the health check and refuses work, and the
request resumes token-exact elsewhere; a stopped (stuck) core fails the health check; replica
shutdown stops its core (over the shared-memory rings, the default, and over the socket pair);
`kill -9` of the replica leaves no orphan core.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import make_engine, run_disaggregated, run_to_completion
from test_disagg_datapath import greq, prompts

from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.messages import ERROR_ENGINE, GenerateRequest
from mtpserve.workers.replica import shm_channel
from mtpserve.workers.sampling_params import SamplingParams


def core_config(model, mode: str = "process", k: int = 2,
                channel: str = "shm") -> ClusterConfig:
    return ClusterConfig(
        model=str(model),
        prefill={"num_kv_blocks": 64, "cpus_per_rank": 1, "engine_core": mode,
                 "engine_core_channel": channel},
        decode={"num_kv_blocks": 256, "cpus_per_rank": 1, "max_num_seqs": 8,
                "engine_core": mode, "engine_core_channel": channel},
        speculation={"num_speculative_tokens": k, "adaptive": False},
        kv_transfer={"timeout_s": 20, "hold_ttl_s": 30, "host": "127.0.0.1"},
    )


@pytest.fixture(scope="module", autouse=True)
def no_core_override():
    """These tests choose each server's core themselves."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MTPSERVE_ENGINE_CORE", raising=False)
        yield


@pytest.fixture(scope="module")
def servers(tiny_qwen3, no_core_override):
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer

    cfg = core_config(tiny_qwen3)
    p = PrefillServer.func_or_class(cfg)
    try:
        d = DecodeServer.func_or_class(cfg)
    except BaseException:
        p.shutdown()
        raise
    yield p, d
    p.shutdown()
    d.shutdown()


def alive(pid: int) -> bool:
    """Running (a zombie, exited but not reaped by its new parent, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"



def test_process_cores_serve_disaggregated_exactly_as_offline(servers, tiny_qwen3) -> None:
    p, d = servers
    me = os.getpid()
    assert {p.core.pid, d.core.pid}.isdisjoint({me}) and p.core.pid != d.core.pid
    assert p.driver is None and d.engine is None  # nothing of the engine lives here
    ps = prompts(6, length=24, seed=35)
    greedy_reqs = [greq(f"g{i}", x, 12) for i, x in enumerate(ps[:4])]
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=100 + i,
                             ignore_eos=True) for i in range(2)]
    seeded_reqs = [GenerateRequest(f"s{i}", x, sp) for i, (x, sp) in
                   enumerate(zip(ps[4:], seeded, strict=True))]
    want = run_to_completion(make_engine(tiny_qwen3, 2, num_kv_blocks=256), ps,
                             [r.params for r in greedy_reqs] + seeded)

    async def main():
        got = await asyncio.gather(*(run_disaggregated(p, d, r) for r in greedy_reqs + seeded_reqs))
        # A first token that ends the request holds nothing (released in the core).
        one = await p.prefill(greq("one", ps[0], 1))
        # The first token leaves the core's step with its KV already held (no command after
        # it), the pull params in the chunk, across the process channel.
        stream = p.core.generate(greq("direct", ps[1], 4), abort_on_exit=False)
        direct = await anext(aiter(stream))
        held = (direct, await p.release("direct"))
        await d.check_health()
        await p.check_health()
        return (got, one, held, await d.core.call("stats"), await p.core.call("stats"),
                await d.record_autoscaling_stats(), await d.record_routing_stats(),
                await p.release("never-held"))

    got, one, held, ds, pst, auto, routing, released = asyncio.run(main())
    assert got == want
    assert one[1] is None and len(one[0].token_ids) == 1
    direct, direct_released = held
    assert direct.kv_transfer is not None and direct.kv_transfer.request_id == "direct"
    assert direct.kv_transfer.first_token_id == direct.token_ids[0] and direct_released
    assert ds["kv_puller"]["pulls"] == 4 + 2 and ds["kv_puller"]["failures"] == 0
    assert ds["num_waiting_for_kv"] == 0 and ds["used_blocks"] == 0
    assert pst["kv_sender"]["acked"] == 6
    assert auto["rounds"] > 0 and "pm_0" in auto  # the recorder runs in the core
    assert routing["num_requests"] == 0 and routing["prefix"] is not None
    assert released is False
    assert not p.core.failed and not d.core.failed


def test_a_stopped_core_fails_the_health_check_and_recovers(servers) -> None:
    _, d = servers
    os.kill(d.core.pid, signal.SIGSTOP)
    try:
        with pytest.raises(TimeoutError):
            asyncio.run(d.core.ping(1.0))
    finally:
        os.kill(d.core.pid, signal.SIGCONT)
    asyncio.run(d.core.ping(30.0))  # answers again: a slow core is not a dead one


def test_a_dead_core_ends_its_streams_and_the_request_resumes_token_exact(
        servers, tiny_qwen3) -> None:
    from mtpserve.workers.replica.engine_core import ReplicaUnavailableError

    p, d = servers
    prompt = prompts(1, length=24, seed=7)[0]
    n = 48
    want = run_to_completion(make_engine(tiny_qwen3, 2, num_kv_blocks=256), [prompt],
                             greq("x", prompt, n).params)[0]
    core_pid = d.core.pid

    async def main():
        sent: list[int] = []
        failure = None
        async for chunk in d.generate(greq("dies", prompt, n)):  # recomputed on decode
            if chunk.heartbeat:
                continue
            if chunk.finish_reason == "error":
                failure = chunk
                break
            sent += chunk.token_ids
            if sent and alive(core_pid):
                t_kill = time.monotonic()
                os.kill(core_pid, signal.SIGKILL)
        detect_s = time.monotonic() - t_kill
        with pytest.raises(ReplicaUnavailableError):
            await d.check_health()
        with pytest.raises(ReplicaUnavailableError):
            async for _ in d.generate(greq("refused", prompt, 4)):
                pass
        # The orchestrator's migration: prompt + tokens sent, on another replica.
        left = n - len(sent)
        resume = GenerateRequest("dies", prompt, SamplingParams(
            max_tokens=left, temperature=0, ignore_eos=True), resume_token_ids=list(sent))
        rest: list[int] = []
        async for chunk in p2_decode.generate(resume):
            assert chunk.error is None
            rest += chunk.token_ids
        return failure, sent, rest, detect_s

    from mtpserve.workers.replica.decode_server import DecodeServer

    p2_decode = DecodeServer.func_or_class(core_config(tiny_qwen3, mode="thread"))
    try:
        failure, sent, rest, detect_s = asyncio.run(main())
    finally:
        p2_decode.shutdown()
        p2_decode.driver.shutdown()
    assert failure is not None and failure.error_kind == ERROR_ENGINE, failure
    assert 0 < len(sent) < n
    assert sent + rest == want
    assert d.core.failed and d.core.proc.returncode == -signal.SIGKILL
    print(f"dead core detected after {detect_s * 1000:.1f} ms")


@pytest.mark.parametrize("channel", ["shm", "socket"])
def test_replica_shutdown_stops_its_core(tiny_qwen3, channel: str) -> None:
    """Over either channel (the servers above use shm): the core serves, then stops."""
    from mtpserve.workers.replica.prefill_server import PrefillServer

    p = PrefillServer.func_or_class(core_config(tiny_qwen3, channel=channel))
    pid = p.core.pid
    assert alive(pid)
    uses_rings = isinstance(p.core._conn, shm_channel.ShmChannel)
    assert uses_rings == (channel == "shm")
    x = prompts(1, length=24, seed=36)[0]
    want = run_to_completion(make_engine(tiny_qwen3, 2, num_kv_blocks=64), [x],
                             [greq("r", x, 1).params])
    first, held = asyncio.run(p.prefill(greq("r", x, 1)))
    assert first.token_ids == want[0] and held is None
    assert asyncio.run(p.core.call("stats"))["used_blocks"] == 0
    p.shutdown()
    assert p.core.proc.returncode == 0  # stopped politely, not killed
    assert not alive(pid)


ORPHAN_SCRIPT = """
import sys, threading
from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.replica.engine_core_proc import ProcessCore
cfg = ClusterConfig(model=sys.argv[1], prefill={"num_kv_blocks": 32, "engine_core": "process"},
                    kv_transfer={"host": "127.0.0.1"})
core = ProcessCore(cfg, "prefill", None)
print(core.pid, flush=True)
threading.Event().wait()
"""


def test_kill_9_of_the_replica_leaves_no_orphan_core(tiny_qwen3) -> None:
    shell = subprocess.Popen([sys.executable, "-c", ORPHAN_SCRIPT, str(tiny_qwen3)],
                             stdout=subprocess.PIPE, text=True)
    try:
        pid = int(shell.stdout.readline())
        assert alive(pid)
        shell.kill()  # SIGKILL: no handler, no atexit, no shutdown of the core
        shell.wait()
        deadline = time.monotonic() + 30  # a bound on a hang, not a speed check
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(pid)
    finally:
        if shell.poll() is None:
            shell.kill()


@pytest.mark.ray
def test_a_tp2_decode_core_process_serves_exactly_as_offline(tiny_qwen3) -> None:
    """Decode TP = 2 with its core in a child process: rank 1 is a Ray actor of the replica,
    which hosts the rendezvous the core joins as rank 0; prefill (TP 1) in its own core."""
    ray = pytest.importorskip("ray")
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer

    cfg = ClusterConfig(
        model=str(tiny_qwen3),
        prefill={"num_kv_blocks": 64, "cpus_per_rank": 1, "engine_core": "process"},
        decode={"tp_size": 2, "num_kv_blocks": 128, "cpus_per_rank": 1, "max_num_seqs": 4,
                "engine_core": "process"},
        speculation={"num_speculative_tokens": 2, "adaptive": False},
        kv_transfer={"timeout_s": 30, "hold_ttl_s": 60, "host": "127.0.0.1"},
    )
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    p = d = None
    try:
        p = PrefillServer.func_or_class(cfg)
        d = DecodeServer.func_or_class(cfg)
        assert len(d.workers) == 1 and len(d.kv_addresses) == 2
        ps = prompts(3, length=20, seed=2)
        want = run_to_completion(make_engine(tiny_qwen3, 2, num_kv_blocks=256), ps,
                                 greq("x", ps[0], 10).params)

        async def main():
            got = await asyncio.gather(*(run_disaggregated(p, d, greq(f"t{i}", x, 10))
                                         for i, x in enumerate(ps)))
            await d.check_health()
            return got, await d.core.call("stats")

        got, stats = asyncio.run(main())
        assert got == want
        assert stats["kv_puller"]["pulls"] == 3 and stats["kv_puller"]["failures"] == 0
    finally:
        for s in (p, d):
            if s is not None:
                s.shutdown()
        ray.shutdown()
    assert d.core.proc.returncode == 0 and d.core.workers == []  # rank 1's actor killed
