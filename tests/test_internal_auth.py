"""Internal listeners are locked down (issue 33, item 6), over real stores and gloo pairs on
127.0.0.1 (no Ray):
- a KV sender with the deployment's secret ignores clients without it: they cannot drop or
  renew holds, open pairs, inject pulls into a pair, or receive KV; signed messages cannot
  be replayed; with the secret everything works, through the real replica shells too;
- the secret comes from the app builder, one per application, and appears in no repr,
  dump, stats or log line;
- the TP rendezvous store listens on loopback only and is closed once the group is formed,
  which keeps working.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing as mp
import pickle
import threading
import time
from typing import Any

import pytest
import torch

from mtpserve.workers.kv_transfer import KVReceiver, KVSender, KVTransferError, PairChannel
from mtpserve.workers.kv_transfer.auth import KVAuth, Secret
from mtpserve.workers.kv_transfer.channel import connect_store
from mtpserve.workers.kv_transfer.mailbox import MAILBOX, drop_holds, post, renew_holds

NUM_KV_HEADS, NUM_LAYERS, BLOCK_SIZE, HEAD_DIM = 4, 2, 4, 8
BLOCK_IDS = [3, 1, 4]


def cache(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, generator=g)
            for _ in range(NUM_LAYERS)]


def expected(seed: int) -> torch.Tensor:
    return torch.stack([layer[:, BLOCK_IDS] for layer in cache(seed)])


def _wait(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def _leaks(secret: Secret, text: str) -> bool:
    raw = secret.reveal()
    return raw.hex() in text or repr(raw) in text or raw.hex().upper() in text


@pytest.fixture
def secret() -> Secret:
    return Secret.generate()


def test_clients_without_the_secret_cannot_drop_open_pairs_or_pull(secret, caplog):
    caplog.set_level(logging.DEBUG)
    released: list[tuple[str, str]] = []
    sender = KVSender(secret=secret, transfer_timeout_s=5,
                      on_release=lambda rid, why: released.append((rid, why)))
    outsider, wrong = KVReceiver(), KVReceiver(secret=Secret.generate())
    member = KVReceiver(secret=secret)
    try:
        sender.hold("r1", cache(1), BLOCK_IDS, 10, 0, {})
        # Drops: unsigned, signed with another secret, and a signed one replayed.
        assert drop_holds([sender.address], "r1", 5.0)  # the post goes through...
        assert drop_holds([sender.address], "r1", 5.0, Secret.generate())
        _wait(lambda: sender.stats()["mailbox_rejected"] == 2)
        assert sender.held_request_ids() == ["r1"] and released == []  # ...and is ignored

        # Pairs and pulls: neither an outsider nor a wrong secret gets a pair, let alone KV.
        for client in (outsider, wrong):
            t0 = time.monotonic()
            with pytest.raises(KVTransferError):
                client.pull(sender.address, "r1", 0, NUM_KV_HEADS, timeout_s=1.0)
            assert time.monotonic() - t0 < 3.0
        _wait(lambda: sender.stats()["mailbox_rejected"] == 4)
        s = sender.stats()
        assert s["peers"] == 0 and s["channel_builds"] == 0 and s["transfers"] == 0

        # Members pull exactly; a member's pair ignores pulls pushed into it by anyone else.
        kv, _ = member.pull(sender.address, "r1", 0, 2, timeout_s=20)
        assert torch.equal(kv, expected(1)[..., 0:2, :])
        channel = member._links[sender.address].channel
        raw = connect_store(sender.address, 5.0)
        post(raw, channel.inbox_name(0), {"op": "pull", "request_id": "r1", "head_start": 2,
                                          "head_end": 4})
        raw.queue_push(channel.inbox_name(0), "garbage")
        server = sender._servers[member.receiver_id]
        _wait(lambda: server.channel.rejected == 2)
        kv, _ = member.pull(sender.address, "r1", 2, 4, timeout_s=20)
        assert torch.equal(kv, expected(1)[..., 2:4, :])
        _wait(lambda: released == [("r1", "acked")])
        assert sender.stats()["transfers"] == 2  # the injected pull moved nothing

        # Drops and renewals with the secret work; a replayed one is refused.
        sender.hold("r2", cache(2), BLOCK_IDS, 10, 0, {}, ttl_s=0.5)
        signed = KVAuth(secret).stamp({"op": "renew", "request_ids": ["r2"]}, MAILBOX)
        for _ in range(2):
            post(raw, MAILBOX, signed)
        _wait(lambda: sender.stats()["mailbox_rejected"] == 5)
        assert sender.stats()["renewed"] == 1
        assert renew_holds([sender.address], ["r2"], 5.0, secret)
        _wait(lambda: sender.stats()["renewed"] == 2)
        time.sleep(0.6)  # past the hold's own TTL: the renewals keep it
        assert sender.held_request_ids() == ["r2"]
        assert drop_holds([sender.address], "r2", 5.0, secret)
        _wait(lambda: ("r2", "released") in released)

        text = "\n".join(r.getMessage() for r in caplog.records)
        for stats in (sender.stats(), member.stats()):
            text += json.dumps(stats)
        assert not _leaks(secret, text)
    finally:
        for r in (outsider, wrong, member):
            r.close()
        sender.close()


def _connect(channel: PairChannel, name: str, errors: dict[str, Exception]) -> None:
    try:
        channel.connect(3.0)
    except KVTransferError as e:
        errors[name] = e


def test_a_peer_without_the_secret_fails_the_pairs_challenge(secret):
    """Whoever joins a pair's group must prove the secret over the group itself, so a
    process that raced into the rendezvous never receives the bytes signed pulls ask for."""
    import torch.distributed as dist

    server = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    address = f"127.0.0.1:{server.port}"
    for theirs in (Secret.generate(), None, secret):
        ns = f"pair/x{id(theirs)}"
        a = PairChannel(connect_store(address, 10.0), ns, 0, peer="a", auth=KVAuth(secret))
        b = PairChannel(connect_store(address, 10.0), ns, 1, peer="b", auth=KVAuth(theirs))
        errors: dict[str, Exception] = {}
        threads = [threading.Thread(target=_connect, args=(c, n, errors))
                   for c, n in ((a, "a"), (b, "b"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        if theirs is secret:
            assert not errors and a.connected and b.connected
        else:  # the member never takes the pair as connected
            assert "a" in errors and not a.connected
            if theirs is not None:  # the impostor's proof fails at the first check
                assert "does not hold the KV secret" in str(errors["b"])
        a.close()
        b.close()


def test_the_app_builder_makes_one_secret_per_application_and_shows_it_nowhere(tiny_qwen3):
    from mtpserve.cluster.app import with_kv_secret
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.router.orchestrator import OrchestratorConfig
    from mtpserve.workers.replica.tp_group import RankSpec

    base = ClusterConfig(model=str(tiny_qwen3))
    one, two = with_kv_secret(base), with_kv_secret(base)
    assert base.kv_transfer.secret is None
    assert isinstance(one.kv_transfer.secret, Secret) and one.kv_transfer.secret != (
        two.kv_transfer.secret)
    assert with_kv_secret(one).kv_transfer.secret is one.kv_transfer.secret
    from ray import cloudpickle  # how Serve ships the bound config to every replica

    shipped = cloudpickle.loads(cloudpickle.dumps(one))
    assert shipped.kv_transfer.secret == one.kv_transfer.secret
    assert pickle.loads(pickle.dumps(one.kv_transfer.secret)) == one.kv_transfer.secret
    s = one.kv_transfer.secret
    spec = RankSpec(model="m", role="decode", tp_size=1, num_kv_blocks=1, kv_secret=s)
    texts = [repr(one), str(one), one.model_dump_json(), json.dumps(one.model_dump()),
             repr(spec), str(s), repr(OrchestratorConfig.of(one))]
    assert not any(_leaks(s, t) for t in texts)
    assert OrchestratorConfig.of(one).kv_secret is s


def test_replicas_with_the_secret_serve_and_stats_do_not_show_it(tiny_qwen3, caplog):
    """The real shells, with the builder's secret: a disaggregated request equals the
    offline engine; a direct release needs the secret; stats and logs never carry it."""
    from mtpserve.cluster.app import with_kv_secret
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers.engine import Engine, EngineConfig
    from mtpserve.workers.messages import GenerateRequest
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer
    from mtpserve.workers.sampling_params import SamplingParams

    caplog.set_level(logging.DEBUG)
    cfg = with_kv_secret(ClusterConfig(
        model=str(tiny_qwen3),
        prefill={"num_kv_blocks": 64, "cpus_per_rank": 1, "engine_core": "thread"},
        decode={"num_kv_blocks": 128, "cpus_per_rank": 1, "engine_core": "thread"},
        speculation={"num_speculative_tokens": 2, "adaptive": False},
        kv_transfer={"timeout_s": 20, "hold_ttl_s": 30, "host": "127.0.0.1"},
    ))
    secret = cfg.kv_transfer.secret
    p, d = PrefillServer.func_or_class(cfg), DecodeServer.func_or_class(cfg)
    prompt = [5 + (i * 11) % 200 for i in range(20)]
    try:
        async def main() -> tuple[list[int], Any, Any, bool, bool]:
            req = GenerateRequest("a1", prompt, SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True))
            first, params = await p.prefill(req)
            tokens = list(first.token_ids)
            async for chunk in d.generate(req, params):
                assert chunk.error is None, chunk.error
                tokens += chunk.token_ids
            # A hold the decode side never pulls: released only by a signed drop.
            _, held = await p.prefill(GenerateRequest("a2", prompt[::-1], SamplingParams(
                max_tokens=8, temperature=0.0, ignore_eos=True)))
            unsigned = await asyncio.to_thread(drop_holds, held.sender_addresses, "a2", 5.0)
            sender = p.driver.core.sender
            await asyncio.to_thread(_wait, lambda: sender.stats()["mailbox_rejected"] == 1)
            still = "a2" in sender.held_request_ids()  # read, refused, still held
            signed = await asyncio.to_thread(drop_holds, held.sender_addresses, "a2", 5.0,
                                             secret)
            return tokens, await p.stats(), await d.stats(), unsigned and still, signed

        tokens, pstats, dstats, ignored, dropped = asyncio.run(main())
        e = Engine(EngineConfig(model=str(tiny_qwen3), num_speculative_tokens=2,
                                num_kv_blocks=128))
        e.add_request("o", prompt, SamplingParams(max_tokens=8, temperature=0,
                                                  ignore_eos=True))
        want: list[int] = []
        while e.has_unfinished():
            for o in e.step():
                want += o.new_token_ids
        assert tokens == want
        assert ignored and dropped
        _wait(lambda: p.driver.core.sender.held_request_ids() == [])
        assert p.driver.core.sender.stats()["mailbox_rejected"] == 1
        text = json.dumps([pstats, dstats], default=str)
        text += "\n".join(r.getMessage() for r in caplog.records)
        assert not _leaks(secret, text)
    finally:
        for s in (p, d):
            s.engine.shutdown()
            s.driver.shutdown()


# -- the TP rendezvous ------------------------------------------------------------------------


def _listening(port: int) -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:
                out.add(addr)
    return out


def _tp_rank(rank: int, path: str, conn: Any) -> None:
    import torch.distributed as dist

    from mtpserve.workers.replica.tp_group import RankCore, RankSpec
    from mtpserve.workers.replica.tp_workers import Rendezvous

    torch.set_num_threads(1)
    if rank == 0:
        rendezvous = Rendezvous()
        conn.send((rendezvous.init_method, sorted(_listening(rendezvous.port))))
        init = rendezvous.init_method
    else:
        init = conn.recv()
    spec = RankSpec(model=path, role="decode", tp_size=2, num_kv_blocks=16, block_size=4,
                    init_method=init, kv_host="127.0.0.1", kv_interface="lo", num_threads=1)
    if rank == 0:
        core = RankCore(spec, 0, store=rendezvous.client())
        assert conn.recv() == "joined"
        rendezvous.close()  # what start_group does once every rank has joined
        deadline = time.monotonic() + 10
        while _listening(rendezvous.port) and time.monotonic() < deadline:
            time.sleep(0.02)
        after = sorted(_listening(rendezvous.port))
    else:
        core = RankCore(spec, 1)
        conn.send("joined")
        after = None
    # Both groups work with the store gone (rank 1 waits here for rank 0's close).
    data = torch.full((4,), float(rank + 1))
    dist.all_reduce(data, group=core.data_group)
    control = torch.tensor([rank + 1])
    dist.all_reduce(control)
    conn.send((after, data.tolist(), control.tolist()))
    dist.barrier()


def test_tp_rendezvous_listens_on_loopback_and_closes_once_the_group_is_formed(tiny_qwen3):
    ctx = mp.get_context("spawn")
    c0, p0 = ctx.Pipe()
    c1, p1 = ctx.Pipe()
    procs = [ctx.Process(target=_tp_rank, args=(r, str(tiny_qwen3), conn), daemon=True)
             for r, conn in ((0, p0), (1, p1))]
    for p in procs:
        p.start()
    try:
        assert c0.poll(120)
        init_method, listening = c0.recv()
        assert listening == ["0100007F"], listening  # 127.0.0.1 only, not every interface
        c1.send(init_method)
        assert c1.poll(120) and c1.recv() == "joined"
        c0.send("joined")
        assert c0.poll(120) and c1.poll(120)
        (after, data0, control0), (_, data1, control1) = c0.recv(), c1.recv()
        for p in procs:
            p.join(60)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    assert after == []  # closed once the group was formed
    port = int(init_method.rsplit(":", 1)[1])
    with pytest.raises(KVTransferError):
        connect_store(f"127.0.0.1:{port}", 1.0)
    assert data0 == data1 == [3.0] * 4 and control0 == control1 == [3]
