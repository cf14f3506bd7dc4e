"""KV transfer between real processes over real gloo pairs on 127.0.0.1 (no Ray).

Prefill ranks run in spawned child processes driven over a pipe; decode ranks (KVReceiver)
run in the test process. Every cache and extras tensor is derived from a seed, so both sides
know exactly what must arrive.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mtpserve.workers.kv_transfer import (
    KVReceiver,
    KVSender,
    KVTransferError,
    PairChannel,
    head_range,
    pull_resharded,
    scatter_blocks,
)
from mtpserve.workers.kv_transfer.channel import MAX_PROBE_BYTES, RECEIVER_RANK, SENDER_RANK

NUM_KV_HEADS = 4
NUM_MAIN_LAYERS, NUM_MTP_LAYERS = 2, 1
NUM_BLOCKS, BLOCK_SIZE, HEAD_DIM = 10, 4, 8
BLOCK_IDS = [7, 2, 5]  # a request's block table on the prefill side
NUM_TOKENS = 10  # fills 2.5 blocks


def global_cache(seed: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """Main layers then MTP layers, all KV heads: each [2, NUM_BLOCKS, BLOCK_SIZE, H, D]."""
    g = torch.Generator().manual_seed(seed)
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    n = NUM_MAIN_LAYERS + NUM_MTP_LAYERS
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(n)]


def seed_extras(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 1)
    return {
        "draft_token_ids": torch.randint(0, 1000, (1, 3), generator=g),
        "draft_probs": torch.rand(1, 3, 16, generator=g),
        "last_hidden": torch.randn(1, 32, generator=g).to(torch.bfloat16),
    }


def payload_nbytes(dtype: torch.dtype, heads: tuple[int, int], with_extras: bool = True) -> int:
    """Bytes a pull of `heads` must move, from the shapes alone (not from any received tensor)."""
    layers = NUM_MAIN_LAYERS + NUM_MTP_LAYERS
    kv = layers * 2 * len(BLOCK_IDS) * BLOCK_SIZE * (heads[1] - heads[0]) * HEAD_DIM
    # seed_extras: int64 [1, 3] + float32 [1, 3, 16] + bfloat16 [1, 32]
    extras = 1 * 3 * 8 + 1 * 3 * 16 * 4 + 1 * 32 * 2
    return kv * dtype.itemsize + (extras if with_extras else 0)


def expected_kv(seed: int, dtype: torch.dtype, heads: tuple[int, int]) -> torch.Tensor:
    # [L, 2, n_blocks, block_size, h, D]
    return torch.stack(
        [layer[:, BLOCK_IDS, :, heads[0] : heads[1]] for layer in global_cache(seed, dtype)]
    )


# -- the prefill-side child process ---------------------------------------------------------------


def _peer_main(conn: Any) -> None:
    """Runs commands from the test: a KVSender, or one end of a bare PairChannel."""
    state: dict[str, Any] = {"releases": {}, "cond": threading.Condition()}

    def on_release(request_id: str, reason: str) -> None:
        with state["cond"]:
            state["releases"][request_id] = reason
            state["cond"].notify_all()

    def start_sender(hold_ttl_s: float, transfer_timeout_s: float) -> str:
        state["sender"] = KVSender(
            hold_ttl_s=hold_ttl_s, transfer_timeout_s=transfer_timeout_s, on_release=on_release
        )
        return state["sender"].address

    def hold(request_id: str, seed: int, dtype: str, heads: tuple[int, int], ttl_s=None) -> None:
        layers = [
            t[:, :, :, heads[0] : heads[1]].contiguous()
            for t in global_cache(seed, getattr(torch, dtype))
        ]
        state["sender"].hold(
            request_id, layers, BLOCK_IDS, NUM_TOKENS, heads[0], seed_extras(seed), ttl_s
        )

    def wait_release(request_id: str, timeout_s: float) -> str | None:
        with state["cond"]:
            state["cond"].wait_for(lambda: request_id in state["releases"], timeout_s)
            return state["releases"].get(request_id)

    def sender_stats() -> dict[str, int]:
        return state["sender"].stats()

    def drop(request_id: str) -> bool:
        return state["sender"].drop(request_id)

    def inject_fault(delay_s: float, count: int) -> None:
        state["sender"].inject_fault(delay_s, count)

    def close_sender() -> list[str]:
        state["sender"].close()
        return [t.name for t in threading.enumerate() if t is not threading.main_thread()]

    def channel_connect(address: str, generation: int, timeout_s: float) -> None:
        host, port = address.split(":")
        state["store"] = dist.TCPStore(host, int(port), None, False, timedelta(seconds=10))
        state["channel"] = PairChannel(
            state["store"], "test", SENDER_RANK, peer="test", generation=generation
        )
        state["channel"].connect(timeout_s)

    def channel_reconnect(generation: int, timeout_s: float) -> None:
        state["channel"].reconnect(generation, timeout_s)

    def channel_send(seed: int, dtype: str) -> None:
        state["channel"].send(global_cache(seed, getattr(torch, dtype))[0], 5.0, "a test tensor")

    commands = {
        f.__name__: f
        for f in (
            start_sender,
            hold,
            wait_release,
            sender_stats,
            drop,
            inject_fault,
            close_sender,
            channel_connect,
            channel_reconnect,
            channel_send,
        )
    }
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            return
        try:
            conn.send(("ok", commands[cmd](*args)))
        except Exception as e:  # reported to the test, which re-raises it
            conn.send(("error", f"{type(e).__name__}: {e}"))


class Peer:
    """A prefill-side child process and a pipe to drive it."""

    def __init__(self) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(target=_peer_main, args=(child_conn,), daemon=True)
        self.proc.start()

    def start(self, cmd: str, *args: Any) -> None:
        self.conn.send((cmd, args))

    def result(self, timeout_s: float = 30.0) -> Any:
        assert self.conn.poll(timeout_s), "peer process did not answer"
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer failed: {value}")
        return value

    def call(self, cmd: str, *args: Any, timeout_s: float = 30.0) -> Any:
        self.start(cmd, *args)
        return self.result(timeout_s)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", ()))
            except OSError:
                pass
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


@pytest.fixture(scope="module")
def prefill() -> Iterator[list[tuple[Peer, str]]]:
    """Two prefill ranks (each a KVSender in its own process): [(peer, address)]."""
    peers = [Peer(), Peer()]
    try:
        for p in peers:
            p.start("start_sender", 30.0, 5.0)
        yield [(p, p.result(60)) for p in peers]
    finally:
        for p in peers:
            p.stop()


@pytest.fixture
def receiver() -> Iterator[KVReceiver]:
    r = KVReceiver()
    yield r
    r.close()


# -- tests ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_pull_main_and_mtp_blocks_is_exact_and_releases_on_ack(prefill, receiver, dtype):
    peer, address = prefill[0]
    rid = f"exact-{dtype}"
    peer.call("hold", rid, 11, dtype, (0, NUM_KV_HEADS))

    kv, extras = receiver.pull(address, rid, 0, NUM_KV_HEADS, timeout_s=20)

    # [L_main + L_mtp, 2, n_blocks, block_size, H, D], bit-exact with what was held
    assert kv.dtype == getattr(torch, dtype)
    assert torch.equal(kv, expected_kv(11, kv.dtype, (0, NUM_KV_HEADS)))
    want = seed_extras(11)
    assert list(extras) == list(want)
    assert all(torch.equal(extras[k], want[k]) and extras[k].dtype == want[k].dtype for k in want)
    # The decode rank writes the payload into its own, different blocks.
    own = [torch.zeros(2, 6, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=kv.dtype) for _ in kv]
    scatter_blocks(own, [0, 4, 1], kv)
    assert all(torch.equal(layer[:, [0, 4, 1]], got) for layer, got in zip(own, kv, strict=True))

    assert peer.call("wait_release", rid, 10.0) == "acked"
    stats = receiver.stats()
    assert stats["transfers"] == 1 and stats[
        "bytes_received"
    ] == kv.numel() * kv.element_size() + sum(t.numel() * t.element_size() for t in want.values())


def test_reshard_prefill_tp1_to_decode_tp2(prefill):
    peer, address = prefill[0]  # one prefill rank holding every head
    peer.call("hold", "tp1-to-tp2", 21, "bfloat16", (0, NUM_KV_HEADS))
    decode = [KVReceiver(name=f"decode{r}") for r in range(2)]
    try:
        kv0, extras0 = pull_resharded(decode[0], [address], "tp1-to-tp2", NUM_KV_HEADS, 2, 0)
        assert torch.equal(kv0, expected_kv(21, torch.bfloat16, head_range(NUM_KV_HEADS, 2, 0)))
        assert torch.equal(extras0["draft_token_ids"], seed_extras(21)["draft_token_ids"])
        # Half the heads are acked: the prefill rank must keep holding the request.
        assert peer.call("wait_release", "tp1-to-tp2", 0.2) is None

        kv1, _ = pull_resharded(decode[1], [address], "tp1-to-tp2", NUM_KV_HEADS, 2, 1)
        assert torch.equal(kv1, expected_kv(21, torch.bfloat16, head_range(NUM_KV_HEADS, 2, 1)))
        assert peer.call("wait_release", "tp1-to-tp2", 10.0) == "acked"
    finally:
        for r in decode:
            r.close()


def test_reshard_prefill_tp2_to_decode_tp1(prefill, receiver):
    addresses = [address for _, address in prefill]
    for rank, (peer, _) in enumerate(prefill):
        peer.call("hold", "tp2-to-tp1", 31, "float32", head_range(NUM_KV_HEADS, 2, rank))

    kv, extras = pull_resharded(receiver, addresses, "tp2-to-tp1", NUM_KV_HEADS, 1, 0)

    assert torch.equal(kv, expected_kv(31, torch.float32, (0, NUM_KV_HEADS)))
    assert torch.equal(extras["draft_probs"], seed_extras(31)["draft_probs"])
    assert [peer.call("wait_release", "tp2-to-tp1", 10.0) for peer, _ in prefill] == ["acked"] * 2
    assert receiver.stats()["channels"] == 2


def test_unknown_request_fails_fast_and_channel_stays_usable(prefill, receiver):
    peer, address = prefill[1]
    t0 = time.monotonic()
    with pytest.raises(KVTransferError, match="'no-such-request' is not held"):
        receiver.pull(address, "no-such-request", 0, 2, timeout_s=20)
    assert time.monotonic() - t0 < 5.0  # an error reply, not the 20 s timeout

    peer.call("hold", "after-unknown", 41, "float32", (2, 4))
    with pytest.raises(KVTransferError, match=r"heads \[0, 4\).*not in \[2, 4\)"):
        receiver.pull(address, "after-unknown", 0, 4, timeout_s=20)
    kv, _ = receiver.pull(address, "after-unknown", 2, 4, timeout_s=20)
    assert torch.equal(kv, expected_kv(41, torch.float32, (2, 4)))
    assert receiver.stats()["channel_rebuilds"] == 0


def test_ttl_expiry_releases_the_blocks(prefill, receiver):
    peer, address = prefill[1]
    peer.call("hold", "never-pulled", 51, "float32", (2, 4), 0.3)
    assert peer.call("wait_release", "never-pulled", 10.0) == "expired"
    with pytest.raises(KVTransferError, match="not held"):
        receiver.pull(address, "never-pulled", 2, 4, timeout_s=20)


def test_channel_timeout_is_clear_and_rebuilt_channel_works():
    """A bare PairChannel: a recv that the peer never answers, then a rebuild."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=10), wait_for_workers=False)
    peer = Peer()
    try:
        peer.start("channel_connect", f"127.0.0.1:{store.port}", 0, 30.0)
        channel = PairChannel(store, "test", RECEIVER_RANK, peer="prefill test", generation=0)
        channel.connect(30.0)
        peer.result()
        peer.start("channel_send", 61, "bfloat16")  # a gloo send completes with its recv
        buf = torch.empty_like(global_cache(61, torch.bfloat16)[0])
        channel.recv(buf, 5.0, "a test tensor")
        peer.result()
        assert torch.equal(buf, global_cache(61, torch.bfloat16)[0])

        t0 = time.monotonic()
        with pytest.raises(
            KVTransferError, match=r"prefill test .*recv of KV of request 'r9'.* timed out"
        ):
            channel.recv(buf, 0.5, "KV of request 'r9'")
        assert time.monotonic() - t0 < 3.0
        assert channel.broken and not channel.connected

        peer.start("channel_reconnect", 1, 30.0)
        channel.reconnect(1, 30.0)
        peer.result()
        peer.start("channel_send", 62, "bfloat16")
        channel.recv(buf, 5.0, "a test tensor")
        peer.result()
        assert torch.equal(buf, global_cache(62, torch.bfloat16)[0])
        assert channel.connected and channel.generation == 1
        channel.close()
    finally:
        peer.stop()


def _wait_stopped(pid: int, timeout_s: float = 10.0) -> None:
    """Until the kernel reports `pid` stopped (state T): on a loaded machine SIGSTOP's effect
    is not instant, and the test needs a sender that really cannot answer."""
    deadline = time.monotonic() + timeout_s
    while open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] not in ("T", "t"):
        assert time.monotonic() < deadline, "the sender did not stop"
        time.sleep(0.01)


def test_frozen_then_dead_sender_gives_clear_errors_and_a_rebuilt_channel(receiver):
    peer = Peer()
    try:
        address = peer.call("start_sender", 30.0, 5.0, timeout_s=60)
        for i in range(4):
            peer.call("hold", f"f{i}", 70 + i, "float32", (0, NUM_KV_HEADS))
        receiver.pull(address, "f0", 0, NUM_KV_HEADS, timeout_s=20)

        os.kill(peer.proc.pid, signal.SIGSTOP)  # a sender that never answers
        _wait_stopped(peer.proc.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(KVTransferError, match=rf"{address} did not answer.*'f1'"):
                receiver.pull(address, "f1", 0, NUM_KV_HEADS, timeout_s=1.0)
            assert time.monotonic() - t0 < 3.0
        finally:
            os.kill(peer.proc.pid, signal.SIGCONT)

        kv, _ = receiver.pull(address, "f2", 0, NUM_KV_HEADS, timeout_s=20)
        assert torch.equal(kv, expected_kv(72, torch.float32, (0, NUM_KV_HEADS)))
        assert receiver.stats()["channel_builds"] == 2  # a fresh store link and generation
        # The abandoned pull was never acked: the sender frees its blocks as failed.
        assert peer.call("wait_release", "f1", 10.0) == "failed"

        peer.proc.kill()  # a sender that dies
        peer.proc.join(10)
        t0 = time.monotonic()
        with pytest.raises(KVTransferError, match=address):
            receiver.pull(address, "f3", 0, NUM_KV_HEADS, timeout_s=20)
        with pytest.raises(KVTransferError, match=address):
            receiver.pull(address, "f3", 0, NUM_KV_HEADS, timeout_s=20)
        assert time.monotonic() - t0 < 5.0
    finally:
        peer.stop()


def test_close_leaves_no_threads_and_frees_the_port():
    before = set(threading.enumerate())
    released: list[tuple[str, str]] = []
    acked = threading.Event()

    def on_release(request_id: str, reason: str) -> None:
        released.append((request_id, reason))
        acked.set()

    sender = KVSender(on_release=on_release, transfer_timeout_s=5)
    receiver = KVReceiver()
    layers = [t.contiguous() for t in global_cache(81, torch.float32)]
    sender.hold("c1", layers, BLOCK_IDS, NUM_TOKENS, 0, {})
    sender.hold("c2", layers, BLOCK_IDS, NUM_TOKENS, 0, {})
    kv, extras = receiver.pull(sender.address, "c1", 0, NUM_KV_HEADS, timeout_s=20)
    assert extras == {} and torch.equal(kv, expected_kv(81, torch.float32, (0, NUM_KV_HEADS)))
    assert acked.wait(10)
    assert sender.stats()["held"] == 1 and sender.held_request_ids() == ["c2"]

    receiver.close()
    sender.close()

    assert released == [("c1", "acked"), ("c2", "failed")]
    assert set(threading.enumerate()) <= before
    with pytest.raises(dist.DistError):
        dist.TCPStore(
            "127.0.0.1", int(sender.address.split(":")[1]), None, False, timedelta(seconds=1)
        )


def test_idle_pair_is_closed_and_the_next_pull_reconnects_transparently():
    sender = KVSender(transfer_timeout_s=5, pair_idle_s=0.3)
    receiver = KVReceiver()
    try:
        layers = [t.contiguous() for t in global_cache(91, torch.float32)]
        for rid in ("i1", "i2"):
            sender.hold(rid, layers, BLOCK_IDS, NUM_TOKENS, 0, {})
        receiver.pull(sender.address, "i1", 0, NUM_KV_HEADS, timeout_s=20)
        deadline = time.monotonic() + 10
        while sender.stats()["peers"] and time.monotonic() < deadline:
            time.sleep(0.02)  # polls a real condition: the idle pair thread has exited
        assert sender.stats()["peers"] == 0

        kv, _ = receiver.pull(sender.address, "i2", 0, NUM_KV_HEADS, timeout_s=20)

        assert torch.equal(kv, expected_kv(91, torch.float32, (0, NUM_KV_HEADS)))
        stats = receiver.stats()
        assert (stats["failures"], stats["channel_rebuilds"], stats["transfers"]) == (0, 1, 2)
    finally:
        receiver.close()
        sender.close()


# -- bandwidth probe and counters -----------------------------------------------------------------


def test_probe_returns_the_requested_bytes_and_a_positive_bandwidth(prefill, receiver):
    _, address = prefill[0]
    for size in (1 << 20, 3):  # the second reuses a prefix of the first's buffers
        got = receiver.probe(address, size, timeout_s=20)
        assert set(got) == {"bytes", "seconds", "gib_per_s"} and got["bytes"] == size
        assert got["seconds"] > 0 and got["gib_per_s"] > 0
        assert got["gib_per_s"] == pytest.approx(size / got["seconds"] / 2**30)
    stats = receiver.stats()
    assert (stats["probes"], stats["probe_bytes"]) == (2, (1 << 20) + 3)
    assert stats["pulls"] == stats["bytes_received"] == stats["failures"] == 0  # kept apart

    for bad in (0, -1, MAX_PROBE_BYTES + 1):  # refused before touching the channel
        with pytest.raises(ValueError, match="probe size"):
            receiver.probe(address, bad)
    assert receiver.stats()["probe_failures"] == 0


def test_probes_and_pulls_interleave_on_one_channel(prefill, receiver):
    peer, address = prefill[1]
    before = peer.call("sender_stats")
    for i, seed in enumerate((101, 102)):
        peer.call("hold", f"mix{i}", seed, "bfloat16", (0, NUM_KV_HEADS))

    # probe, pull, probe, pull: each must find its own bytes in the one ordered stream
    assert receiver.probe(address, 256 << 10, timeout_s=20)["bytes"] == 256 << 10
    kv0, extras0 = receiver.pull(address, "mix0", 0, NUM_KV_HEADS, timeout_s=20)
    assert receiver.probe(address, 4099, timeout_s=20)["bytes"] == 4099
    kv1, _ = receiver.pull(address, "mix1", 0, NUM_KV_HEADS, timeout_s=20)

    assert torch.equal(kv0, expected_kv(101, torch.bfloat16, (0, NUM_KV_HEADS)))
    assert torch.equal(extras0["draft_probs"], seed_extras(101)["draft_probs"])
    assert torch.equal(kv1, expected_kv(102, torch.bfloat16, (0, NUM_KV_HEADS)))
    assert [peer.call("wait_release", f"mix{i}", 10.0) for i in range(2)] == ["acked"] * 2
    stats = receiver.stats()
    assert (stats["channel_builds"], stats["channel_rebuilds"], stats["failures"]) == (1, 0, 0)
    assert (stats["pulls"], stats["probes"]) == (2, 2)
    # The pair thread serves in order, so both probes are counted once mix1 is released.
    after = peer.call("sender_stats")
    assert after["probes"] - before["probes"] == 2
    assert after["probe_bytes_sent"] - before["probe_bytes_sent"] == (256 << 10) + 4099
    pulled = 2 * payload_nbytes(torch.bfloat16, (0, NUM_KV_HEADS))
    assert after["bytes_sent"] - before["bytes_sent"] == pulled  # probes not in the KV count


def test_probe_timeout_breaks_the_channel_and_the_next_op_rebuilds_it():
    sender = KVSender(transfer_timeout_s=5)
    receiver = KVReceiver()
    try:
        assert receiver.probe(sender.address, 1024, timeout_s=20)["bytes"] == 1024
        with pytest.raises(KVTransferError, match="probe"):
            # Far too short for the control round trip: fails like a pull deadline would.
            receiver.probe(sender.address, 1 << 20, timeout_s=1e-4)
        assert receiver.probe(sender.address, 1024, timeout_s=20)["bytes"] == 1024
        stats = receiver.stats()
        assert (stats["probe_failures"], stats["probes"], stats["failures"]) == (1, 2, 0)
        # Rebuilt in a new generation (or, on a starved CPU, the whole link dropped and rebuilt).
        assert stats["channel_builds"] + stats["channel_rebuilds"] == 2
    finally:
        receiver.close()
        sender.close()


def test_stats_grow_by_exactly_the_payload_of_a_pull(prefill, receiver):
    peer, address = prefill[0]
    peer.call("hold", "count-full", 111, "bfloat16", (0, NUM_KV_HEADS))
    peer.call("hold", "count-half", 112, "float32", (0, NUM_KV_HEADS))
    sent0 = peer.call("sender_stats")["bytes_sent"]

    receiver.pull(address, "count-full", 0, NUM_KV_HEADS, timeout_s=20)
    s1 = receiver.stats()
    full = payload_nbytes(torch.bfloat16, (0, NUM_KV_HEADS))
    assert full == 3 * 2 * 3 * 4 * 4 * 8 * 2 + 280  # 4888: pins the shape arithmetic
    assert (s1["bytes_received"], s1["pulls"], s1["transfers"]) == (full, 1, 1)
    assert s1["pull_seconds"] > 0
    assert peer.call("wait_release", "count-full", 10.0) == "acked"
    assert peer.call("sender_stats")["bytes_sent"] - sent0 == full  # counted before release

    receiver.pull(address, "count-half", 1, 3, timeout_s=20, with_extras=False)
    s2 = receiver.stats()
    half = payload_nbytes(torch.float32, (1, 3), with_extras=False)
    assert s2["bytes_received"] - s1["bytes_received"] == half
    assert s2["pulls"] == 2 and s2["pull_seconds"] > s1["pull_seconds"]
    # Achieved KV bandwidth, as the serve benchmark computes it.
    assert s2["bytes_received"] / s2["pull_seconds"] > 0


# -- the decode rank's transfer thread and the prefill side's explicit release ---------------------


def test_puller_receives_resharded_kv_into_its_blocks_and_reuses_its_buffer(prefill, receiver):
    from mtpserve.workers.kv_transfer.puller import KVPuller
    from mtpserve.workers.replica.tp_commands import PullKV

    addresses = [address for _, address in prefill]
    own = [torch.zeros(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(
        NUM_MAIN_LAYERS + NUM_MTP_LAYERS)]
    done = threading.Event()
    puller = KVPuller(receiver, own, tp_size=1, rank=0, on_done=done.set)
    try:
        for seed, blocks in ((41, [6, 0, 3]), (42, [1, 2, 4])):  # the 2nd reuses the buffer
            rid = f"puller-{seed}"
            for rank, (peer, _) in enumerate(prefill):  # prefill TP 2 -> decode TP 1
                peer.call("hold", rid, seed, "float32", head_range(NUM_KV_HEADS, 2, rank))
            done.clear()
            puller.submit(PullKV(rid, addresses, blocks, NUM_KV_HEADS, 20.0))
            assert done.wait(20)
            res = puller.take(rid)
            assert res.ok, res.error
            want = expected_kv(seed, torch.float32, (0, NUM_KV_HEADS))
            assert all(torch.equal(layer[:, blocks], w) for layer, w in zip(own, want,
                                                                            strict=True))
            assert torch.equal(res.extras["draft_probs"], seed_extras(seed)["draft_probs"])
            assert res.extras["draft_probs"].device.type == "cpu"
        assert puller.stats()["pulls"] == 2
    finally:
        puller.close()


def test_puller_reports_a_failed_pull_without_dying(prefill, receiver):
    from mtpserve.workers.kv_transfer.puller import KVPuller
    from mtpserve.workers.replica.tp_commands import PullKV

    own = [torch.zeros(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(
        NUM_MAIN_LAYERS + NUM_MTP_LAYERS)]
    done = threading.Event()
    puller = KVPuller(receiver, own, tp_size=1, rank=0, on_done=done.set)
    try:
        puller.submit(PullKV("never-held", [prefill[0][1]], [0, 1, 2], NUM_KV_HEADS, 10.0))
        assert done.wait(20)
        res = puller.take("never-held")
        assert not res.ok and "never-held" in res.error
        assert puller.stats()["failures"] == 1
    finally:
        puller.close()


def test_pulls_run_concurrently_on_their_own_lanes(prefill, receiver):
    """A slow pull (from one prefill rank) does not hold back another (from the other one):
    each lane has its own thread and buffer, and both land exactly in their blocks."""
    from mtpserve.workers.kv_transfer.puller import KVPuller
    from mtpserve.workers.replica.tp_commands import PullKV

    own = [torch.zeros(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(
        NUM_MAIN_LAYERS + NUM_MTP_LAYERS)]
    puller = KVPuller(receiver, own, tp_size=1, rank=0, max_concurrent=2)
    try:
        (peer0, addr0), (peer1, addr1) = prefill
        peer0.call("hold", "slow-one", 71, "float32", (0, NUM_KV_HEADS))
        peer1.call("hold", "fast-one", 72, "float32", (0, NUM_KV_HEADS))
        puller.inject_fault(delay_s=2.0, count=1)  # the first job to start sleeps first
        puller.submit(PullKV("slow-one", [addr0], [0, 1, 2], NUM_KV_HEADS, 20.0))
        time.sleep(0.2)  # the first lane has taken the slow job
        puller.submit(PullKV("fast-one", [addr1], [3, 4, 5], NUM_KV_HEADS, 20.0))
        deadline = time.monotonic() + 30
        while puller.result("fast-one") is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert puller.result("slow-one") is None  # still sleeping: the fast one went first
        while puller.num_finished(["slow-one"]) < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        for rid, seed, blocks in (("slow-one", 71, [0, 1, 2]), ("fast-one", 72, [3, 4, 5])):
            res = puller.take(rid)
            assert res.ok, res.error
            want = expected_kv(seed, torch.float32, (0, NUM_KV_HEADS))
            assert all(torch.equal(layer[:, blocks], w) for layer, w in zip(own, want,
                                                                            strict=True))
    finally:
        puller.close()


def _puller(receiver, lanes: int):
    from mtpserve.workers.kv_transfer.puller import KVPuller

    own = [torch.zeros(2, 16, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM) for _ in range(
        NUM_MAIN_LAYERS + NUM_MTP_LAYERS)]
    return KVPuller(receiver, own, tp_size=1, rank=0, max_concurrent=lanes), own


def _wait_results(puller, rids: list[str], timeout_s: float = 30.0) -> float:
    t0 = time.monotonic()
    while puller.num_finished(rids) < len(rids):
        assert time.monotonic() - t0 < timeout_s
        time.sleep(0.01)
    return time.monotonic() - t0


def test_concurrent_pulls_from_one_slow_sender_all_complete(prefill, receiver):
    """The pair serves one pull at a time; a pull's timeout starts when it has the pair, so a
    pull queued behind a slow (but live) one still gets its whole time."""
    from mtpserve.workers.replica.tp_commands import PullKV

    puller, own = _puller(receiver, lanes=3)
    try:
        peer, address = prefill[0]
        for i in range(3):
            peer.call("hold", f"slow-{i}", 90 + i, "float32", (0, NUM_KV_HEADS))
        peer.call("inject_fault", 1.2, 3)  # every send of the three takes 1.2 s
        for i in range(3):
            puller.submit(PullKV(f"slow-{i}", [address], [3 * i, 3 * i + 1, 3 * i + 2],
                                 NUM_KV_HEADS, 2.0))
        _wait_results(puller, [f"slow-{i}" for i in range(3)])
        for i in range(3):  # 3 x 1.2 s > 2 s: the last waited longer than its timeout
            res = puller.take(f"slow-{i}")
            assert res.ok, res.error
            want = expected_kv(90 + i, torch.float32, (0, NUM_KV_HEADS))
            assert all(torch.equal(layer[:, 3 * i : 3 * i + 3], w)
                       for layer, w in zip(own, want, strict=True))
    finally:
        puller.close()


def test_pulls_queued_on_a_frozen_sender_fail_together_others_complete(prefill, receiver):
    """A frozen prefill rank costs its queued pulls one timeout together, not one each, and
    a pull from another rank completes meanwhile."""
    from mtpserve.workers.replica.tp_commands import PullKV

    puller, _ = _puller(receiver, lanes=4)
    frozen = Peer()
    try:
        address = frozen.call("start_sender", 30.0, 5.0, timeout_s=60)
        for i in range(3):
            frozen.call("hold", f"frozen-{i}", 60 + i, "float32", (0, NUM_KV_HEADS))
        healthy, healthy_address = prefill[0]
        healthy.call("hold", "healthy", 69, "float32", (0, NUM_KV_HEADS))
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        _wait_stopped(frozen.proc.pid)
        try:
            for i in range(3):
                puller.submit(PullKV(f"frozen-{i}", [address], [i], NUM_KV_HEADS, 1.5))
            puller.submit(PullKV("healthy", [healthy_address], [5, 6, 7], NUM_KV_HEADS, 20.0))
            assert _wait_results(puller, ["healthy"]) < 5.0
            elapsed = _wait_results(puller, [f"frozen-{i}" for i in range(3)])
        finally:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        assert puller.take("healthy").ok
        assert not any(puller.take(f"frozen-{i}").ok for i in range(3))
        assert elapsed < 1.5 + 0.5 + 2.5, elapsed  # one timeout (+ grace), not three
    finally:
        puller.close()
        frozen.stop()


def test_live_pairs_stay_within_the_budget_lru_closed(prefill):
    """max_links: opening a pair past the budget closes the least recently used idle one
    (the sender is told); pulling from its sender again opens it anew."""
    r = KVReceiver(max_links=1)
    try:
        (a, addr_a), (b, addr_b) = prefill
        for i, (peer, addr) in enumerate([(a, addr_a), (b, addr_b), (a, addr_a)]):
            peer.call("hold", f"budget-{i}", 30 + i, "float32", (0, NUM_KV_HEADS))
            kv, _ = r.pull(addr, f"budget-{i}", 0, NUM_KV_HEADS, timeout_s=20)
            assert torch.equal(kv, expected_kv(30 + i, torch.float32, (0, NUM_KV_HEADS)))
            assert r.stats()["channels"] == 1
        s = r.stats()
        assert s["pairs_closed"] == 2 and s["channel_builds"] == 3
    finally:
        r.close()


def test_drop_releases_a_hold_at_once_and_refuses_later_pulls(prefill, receiver):
    peer, address = prefill[0]
    peer.call("hold", "dropped", 51, "float32", (0, NUM_KV_HEADS))
    assert peer.call("drop", "dropped") is True
    assert peer.call("wait_release", "dropped", 1.0) == "released"
    assert peer.call("drop", "dropped") is False  # nothing held any more
    with pytest.raises(KVTransferError, match="not held"):
        receiver.pull(address, "dropped", 0, NUM_KV_HEADS, timeout_s=10)


def test_sender_store_takes_the_first_free_port_of_its_range():
    """kv_transfer.store_port_range: a fixed range a firewall can open between nodes."""
    import socket

    for base in range(42000, 43000, 7):  # two adjacent free ports; the first one we then hold
        busy = socket.socket()
        try:
            busy.bind(("127.0.0.1", base))
            busy.listen()
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", base + 1))
        except OSError:
            busy.close()
            continue
        try:
            sender = KVSender(port=(base, base + 1))
            try:
                assert sender.address == f"127.0.0.1:{base + 1}"
            finally:
                sender.close()
            with pytest.raises(RuntimeError, match="no free KV store port"):
                KVSender(port=(base, base))
        finally:
            busy.close()
        return
    pytest.skip("no two adjacent free ports found")


def test_sender_store_listens_on_its_address_only():
    """The rendezvous store binds the node's KV address, not every interface (issue 18)."""
    sender = KVSender(host="127.0.0.1")
    try:
        port = int(sender.address.rsplit(":", 1)[1])
        listening = set()
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            try:
                rows = open(table).read().splitlines()[1:]
            except OSError:
                continue
            for row in rows:
                local, state = row.split()[1], row.split()[3]
                addr, p = local.rsplit(":", 1)
                if state == "0A" and int(p, 16) == port:  # 0A: LISTEN
                    listening.add(addr)
        assert listening == {"0100007F"}, listening  # 127.0.0.1 only (little-endian hex)
    finally:
        sender.close()


def test_renew_extends_a_hold_past_its_ttl():
    """A renewed lease outlives the original TTL; an unknown request cannot be renewed."""
    released: list[tuple[str, str]] = []
    sender = KVSender(on_release=lambda rid, why: released.append((rid, why)),
                      hold_ttl_s=0.3, transfer_timeout_s=5)
    receiver = KVReceiver()
    try:
        layers = [t.contiguous() for t in global_cache(91, torch.float32)]
        sender.hold("leased", layers, BLOCK_IDS, NUM_TOKENS, 0, {})
        assert sender.renew("leased", 30.0) and not sender.renew("unknown")
        deadline = time.monotonic() + 0.9  # three original TTLs
        while time.monotonic() < deadline:
            assert sender.held_request_ids() == ["leased"], released
            time.sleep(0.05)
        kv, _ = receiver.pull(sender.address, "leased", 0, NUM_KV_HEADS, timeout_s=20)
        assert torch.equal(kv, expected_kv(91, torch.float32, (0, NUM_KV_HEADS)))
    finally:
        receiver.close()
        sender.close()


def test_kept_send_buffers_stay_within_the_senders_budget():
    """Each pair keeps its pack buffer for its next pull only while the sum over pairs stays
    within send_buffer_budget_bytes; the pulls are exact either way."""
    layers = [t.contiguous() for t in global_cache(95, torch.float32)]
    one = sum(t[:, BLOCK_IDS].numel() * 4 for t in layers)  # one payload (no extras)
    sender = KVSender(prepack=False, transfer_timeout_s=5, send_buffer_budget_bytes=one + 64)
    receivers = [KVReceiver(), KVReceiver()]
    try:
        for i, r in enumerate(receivers):
            sender.hold(f"buf-{i}", layers, BLOCK_IDS, NUM_TOKENS, 0, {})
            kv, _ = r.pull(sender.address, f"buf-{i}", 0, NUM_KV_HEADS, timeout_s=20)
            assert torch.equal(kv, expected_kv(95, torch.float32, (0, NUM_KV_HEADS)))
        assert 0 < sender.send_buffer_bytes() <= one + 64  # the second pair freed its buffer
    finally:
        for r in receivers:
            r.close()
        sender.close()


def test_drop_posted_to_the_store_releases_the_hold():
    """The orchestrator's direct release: a `drop` posted to the sender's store frees the
    hold without any call through the prefill replica; an unreachable store says False."""
    from mtpserve.workers.kv_transfer.mailbox import drop_holds

    released = threading.Event()
    reasons: list[str] = []

    def on_release(rid: str, why: str) -> None:
        reasons.append(why)
        released.set()

    sender = KVSender(on_release=on_release, transfer_timeout_s=5)
    try:
        layers = [t.contiguous() for t in global_cache(97, torch.float32)]
        sender.hold("direct", layers, BLOCK_IDS, NUM_TOKENS, 0, {})
        assert drop_holds([sender.address], "direct", 5.0)
        assert released.wait(10) and reasons == ["released"]
        assert sender.held_request_ids() == []
    finally:
        sender.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert not drop_holds([closed], "direct", 2.0)
