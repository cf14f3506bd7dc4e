"""Faults on the KV data path stay contained (issue 33, items 3-5), over real gloo pairs on
127.0.0.1 in one process (no Ray):
- the sender's accept loop survives malformed mailbox messages; a loop that dies anyway
  fails the replica's health check (`TPDriver.ping`);
- a transfer past its deadline aborts its pair only, frees the pull lane, and the next pull
  of that sender works: through the polled completion path NCCL pairs use (forced on gloo)
  and through gloo's own wait;
- a decode replica keeps renewing the prefill hold of a request that waits in its queue
  longer than hold_ttl_s, so the request is pulled, not recomputed.
"""

from __future__ import annotations

import asyncio
import ctypes
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from mtpserve.workers.kv_transfer import KVReceiver, KVSender
from mtpserve.workers.kv_transfer.channel import POLL_COMPLETION_ENV, connect_store
from mtpserve.workers.kv_transfer.mailbox import MAILBOX, post
from mtpserve.workers.kv_transfer.puller import KVPuller
from mtpserve.workers.replica.tp_commands import PullKV

NUM_KV_HEADS, NUM_LAYERS = 4, 3
NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 10, 4, 8
BLOCK_IDS = [7, 2, 5]
NUM_TOKENS = 10


def cache(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g)
            for _ in range(NUM_LAYERS)]


def expected(seed: int) -> torch.Tensor:
    return torch.stack([layer[:, BLOCK_IDS] for layer in cache(seed)])


def hold(sender: KVSender, rid: str, seed: int) -> None:
    sender.hold(rid, cache(seed), BLOCK_IDS, NUM_TOKENS, 0, {})


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    r = KVReceiver()
    yield r
    r.close()


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _kill_thread(thread: threading.Thread) -> None:
    """Raise SystemExit inside `thread` (delivered at its next Python bytecode): the loop
    under test dies for real, past its `except Exception`."""
    n = ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident),
                                                   ctypes.py_object(SystemExit))
    assert n == 1


# -- item 4: supervised data-path threads -----------------------------------------------------


def test_malformed_mailbox_messages_are_skipped_and_pulls_still_work(receiver):
    sender = KVSender(transfer_timeout_s=5)
    try:
        store = connect_store(sender.address, 5.0)
        store.queue_push(MAILBOX, "this is not json")
        store.queue_push(MAILBOX, "[1, 2, 3]")
        post(store, MAILBOX, {"no": "op"})
        post(store, MAILBOX, {"op": "connect", "receiver": ["not", "a", "str"],
                              "generation": "x"})
        post(store, MAILBOX, {"op": "renew", "request_ids": "not-a-list"})
        post(store, MAILBOX, {"op": "warp-drive"})
        _wait(lambda: sender.stats()["mailbox_rejected"] == 6)
        for i in range(2):
            hold(sender, f"after-{i}", 10 + i)
            kv, _ = receiver.pull(sender.address, f"after-{i}", 0, NUM_KV_HEADS, timeout_s=20)
            assert torch.equal(kv, expected(10 + i))
        assert sender.healthy() is None
        # The receiver's pull returns with the data; the sender counts the ack when it reads
        # it, a moment later.
        _wait(lambda: sender.stats()["acked"] == 2)
    finally:
        sender.close()


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the kill itself
def test_a_dead_accept_loop_fails_the_replicas_health_check(tiny_qwen3):
    from mtpserve.workers.replica.tp_group import RankCore, RankSpec, TPDriver

    spec = RankSpec(model=str(tiny_qwen3), role="prefill", tp_size=1, num_kv_blocks=16,
                    block_size=4, kv_host="127.0.0.1", kv_interface="lo", num_threads=1)
    driver = TPDriver(RankCore(spec, 0))
    try:
        sender = driver.core.sender
        driver.ping()  # healthy
        accept = next(t for t in threading.enumerate()
                      if t.name == f"{sender.name}-kv-accept")
        _kill_thread(accept)  # pending until the loop runs Python again:
        post(connect_store(sender.address, 5.0), MAILBOX, {"op": "wake"})  # to bytecode
        accept.join(10)
        assert not accept.is_alive()
        assert "accept loop died" in (sender.healthy() or "")
        with pytest.raises(RuntimeError, match="KV data path"):
            driver.ping()
    finally:
        driver.shutdown()


@pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the kill itself
def test_a_dead_pull_lane_fails_health(receiver):
    own = [torch.zeros(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
    puller = KVPuller(receiver, own, tp_size=1, rank=0, max_concurrent=1)
    try:
        assert puller.healthy() is None
        lane = puller._threads[0]
        _kill_thread(lane)  # pending until the lane runs Python again: a job wakes it
        puller.submit(PullKV("x", ["127.0.0.1:1"], [0], NUM_KV_HEADS, 1.0))
        lane.join(10)
        assert "1 of 1 KV pull lanes died" == puller.healthy()
    finally:
        puller.close()


# -- item 5: real deadlines ------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["polled", "gloo-wait"])
def test_a_stuck_peer_fails_within_the_deadline_and_only_its_pair(monkeypatch, mode):
    """A sender that never sends the bytes (stalled after the header): the pull fails within
    its deadline, only that pair is aborted and rebuilt, the lane serves the next pull at
    once, a concurrent pull from another sender is untouched, and the stuck sender's next
    pull works."""
    if mode == "polled":  # the NCCL control flow: is_completed() polled against the deadline
        monkeypatch.setenv(POLL_COMPLETION_ENV, "1")
    stuck, other = KVSender(transfer_timeout_s=10), KVSender(transfer_timeout_s=10)
    receiver = KVReceiver()
    own = [torch.zeros(2, 16, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(NUM_LAYERS)]
    puller = KVPuller(receiver, own, tp_size=1, rank=0, max_concurrent=2)
    try:
        for s, rid, seed in ((stuck, "warm-a", 1), (other, "warm-b", 2)):  # both pairs built
            hold(s, rid, seed)
            receiver.pull(s.address, rid, 0, NUM_KV_HEADS, timeout_s=20)
        builds = receiver.stats()["channel_builds"]
        pair_b = receiver._links[other.address].channel
        gen_b = pair_b.generation
        assert pair_b.poll_work is (mode == "polled")

        hold(stuck, "stuck", 3)
        hold(other, "beside", 4)
        stuck.inject_fault(60.0, 1)  # its next send never comes (until the pair is replaced)
        deadline_s = 1.0
        t0 = time.monotonic()
        puller.submit(PullKV("stuck", [stuck.address], [0, 1, 2], NUM_KV_HEADS, deadline_s))
        puller.submit(PullKV("beside", [other.address], [3, 4, 5], NUM_KV_HEADS, 20.0))
        _wait(lambda: puller.result("beside") is not None)
        assert puller.take("beside").ok  # the other pair is unaffected
        _wait(lambda: puller.result("stuck") is not None)
        elapsed = time.monotonic() - t0
        res = puller.take("stuck")
        assert not res.ok and "timed out" in res.error, res.error
        assert elapsed < deadline_s + 1.0, elapsed  # the deadline (+ slack), not the stall

        # The lane is free at once: the next job (from the same, still stalled sender: a new
        # generation replaces its stuck pair) runs and lands exactly.
        hold(stuck, "next", 5)
        puller.submit(PullKV("next", [stuck.address], [6, 7, 8], NUM_KV_HEADS, 20.0))
        _wait(lambda: puller.result("next") is not None, 25)
        res = puller.take("next")
        assert res.ok, res.error
        assert all(torch.equal(layer[:, [6, 7, 8]], w)
                   for layer, w in zip(own, expected(5), strict=True))
        s = receiver.stats()
        assert s["channel_builds"] + s["channel_rebuilds"] == builds + 1  # the stuck pair only
        assert receiver._links[other.address].channel is pair_b and pair_b.generation == gen_b
        _wait(lambda: stuck.stats()["failed"] == 1)  # the stuck transfer released as failed
        assert puller.healthy() is None and stuck.healthy() is None
    finally:
        puller.close()
        receiver.close()
        stuck.close()
        other.close()


def test_wait_work_polls_against_the_deadline():
    """The polled wait itself, on a transfer no one answers: TimeoutError at the deadline
    (not at the group's own 10 s timeout); the pair then aborts and the next op refuses."""
    import torch.distributed as dist

    from mtpserve.workers.kv_transfer.channel import KVTransferError, PairChannel, wait_work

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    a = PairChannel(connect_store(address, 10.0), "t", 0, peer="a")
    b = PairChannel(connect_store(address, 10.0), "t", 1, peer="b")
    threads = [threading.Thread(target=c.connect, args=(10.0,)) for c in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    work = b._group.broadcast([torch.empty(16, dtype=torch.uint8)], opts)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="polled"):
        wait_work(work, 0.3, poll=True)
    assert 0.3 <= time.monotonic() - t0 < 1.0
    b.poll_work = True
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="timed out.*channel marked broken"):
        b.recv(torch.empty(16, dtype=torch.uint8), 0.3, "bytes nobody sends")
    assert time.monotonic() - t0 < 1.0 and b.broken and not b.connected
    a.close()


# -- item 3: the hold's lease while decode queues the request ---------------------------------


def test_a_hold_outlives_its_ttl_while_the_request_waits_in_the_decode_queue(tiny_qwen3,
                                                                             monkeypatch):
    """hold_ttl_s = 1 s; decode runs one sequence at a time and the first request's pull
    takes 3 s, so the second waits in the decode queue three TTLs. Both are pulled (not
    recomputed, not failed) and equal the offline engine; nothing expired on prefill."""
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers.engine import Engine, EngineConfig
    from mtpserve.workers.messages import GenerateRequest
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer
    from mtpserve.workers.sampling_params import SamplingParams

    monkeypatch.setenv("MTPSERVE_ENABLE_FAULT_INJECTION", "1")
    cfg = ClusterConfig(
        model=str(tiny_qwen3),
        prefill={"num_kv_blocks": 64, "cpus_per_rank": 1, "engine_core": "thread"},
        decode={"num_kv_blocks": 128, "cpus_per_rank": 1, "max_num_seqs": 1,
                "engine_core": "thread"},
        speculation={"num_speculative_tokens": 2, "adaptive": False},
        kv_transfer={"timeout_s": 20, "hold_ttl_s": 1.0, "host": "127.0.0.1"},
    )
    p, d = PrefillServer.func_or_class(cfg), DecodeServer.func_or_class(cfg)
    prompts = [[(7 * i + 3 * j) % 240 + 3 for j in range(20)] for i in range(2)]
    try:
        async def one(i: int) -> list[int]:
            req = GenerateRequest(f"q{i}", prompts[i], SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True))
            first, params = await p.prefill(req)
            tokens = list(first.token_ids)
            async for chunk in d.generate(req, params):
                assert chunk.error is None, chunk.error
                tokens += chunk.token_ids
            return tokens

        async def main():
            await d.inject_fault(pull_delay_s=3.0, count=1)  # the first pull takes 3 s
            first = asyncio.create_task(one(0))
            while not d.driver.core.inflight:  # q0 holds the only sequence slot
                await asyncio.sleep(0.01)
            return await asyncio.gather(first, one(1))

        got = asyncio.run(main())
        e = Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=2,
                                num_kv_blocks=128))
        for i, x in enumerate(prompts):
            e.add_request(f"o{i}", x, SamplingParams(max_tokens=8, temperature=0,
                                                     ignore_eos=True))
        want = {f"o{i}": [] for i in range(2)}
        while e.has_unfinished():
            for o in e.step():
                want[o.request_id] += o.new_token_ids
        assert got == [want["o0"], want["o1"]]
        s = p.driver.core.sender.stats()
        assert s["expired"] == 0 and s["acked"] == 2 and s["renewed"] >= 2, s
    finally:
        for s in (p, d):
            s.engine.shutdown()
            s.driver.shutdown()
