"""TP=2 == TP=1: two real processes in a gloo group run the sharded model (column/row-parallel
linears, vocab-parallel embedding and head) over their paged KV shards."""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.multiprocessing as mp
from serve_cluster import free_port

from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
from mtpserve.workers.spec_decode.draft_vocab import write_ranking

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8, 1, 77, 31]


def batches() -> list[ForwardBatch]:
    return [
        ForwardBatch("main", [PROMPT], [0], [[3, 1, 4, 6]], logit_rows=list(range(len(PROMPT)))),
        ForwardBatch("mtp", [PROMPT[1:] + [12]], [0], [[3, 1, 4, 6]], logit_rows=[10],
                     hidden_from="main", hidden_rows=[list(range(11))]),
        ForwardBatch("main", [[12, 13]], [len(PROMPT)], [[3, 1, 4, 6]], logit_rows=[0, 1]),
    ]


def _rank(rank: int, port: int, runs: list[tuple[str, int | None]], out) -> None:
    import os

    import torch.distributed as dist

    from mtpserve.workers.model.parallel import set_tp

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    set_tp(rank, 2, dist.group.WORLD)
    got = []
    for path, draft_vocab in runs:  # one group runs every case: a group start costs seconds
        runner = ModelRunner(path, num_blocks=8, block_size=4, draft_vocab_size=draft_vocab)
        results = [runner.execute(b) for b in batches()]
        got.append([r.tolist() for r in results] + [runner.kv_cache.layers[0].shape[3]])
    if rank == 0:
        out.put(got)
        out.close()
        out.join_thread()  # the result is in the pipe before this process may leave
    dist.barrier()  # neither rank leaves while the other still talks to it
    dist.destroy_process_group()
    # Skip the interpreter's teardown: with gloo's threads around it sometimes aborts
    # ("terminate called without an active exception") after the work is done.
    os._exit(0)


def test_tp2_equals_tp1(tiny_qwen3, tmp_path) -> None:
    """The full vocabulary, and a draft vocabulary: with one each rank gathers the
    vocab-parallel head once and keeps a replicated subset head, and the MTP logits still
    equal TP=1's."""
    draft_vocab = 64
    dv_path = tmp_path / "m"
    shutil.copytree(tiny_qwen3, dv_path)
    vocab = ModelRunner(dv_path, num_blocks=8, block_size=4).config.vocab_size
    write_ranking(dv_path, list(range(vocab))[::-1], "test")
    runs = [(str(tiny_qwen3), None), (str(dv_path), draft_vocab)]
    wants = []
    for path, dv in runs:
        single = ModelRunner(path, num_blocks=8, block_size=4, draft_vocab_size=dv)
        wants.append([single.execute(b) for b in batches()])
    port = free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, runs, out)) for r in range(2)]
    for p in procs:
        p.start()
    gots = out.get(timeout=180)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for (_, dv), got, want in zip(runs, gots, wants, strict=True):
        assert got[-1] == 1, dv  # each rank holds 1 of the 2 KV heads
        for g, w in zip(got[:-1], want, strict=True):
            assert torch.allclose(torch.tensor(g), w, atol=1e-4), \
                (dv, (torch.tensor(g) - w).abs().max())
    # With the draft vocabulary, the MTP row drafts only from the subset (the highest ids).
    assert wants[1][1].argmax(-1).item() >= vocab - draft_vocab


# The control/data split of a TP group (docs/architecture.md decision 10) -----------------------

_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object",
                       "scatter_object_list", "send_object_list", "recv_object_list")
_TENSOR_COLLECTIVES = ("broadcast", "all_reduce", "all_gather", "all_gather_into_tensor",
                       "reduce_scatter_tensor", "send", "recv", "reduce", "gather", "scatter")


def install_plane_checker(device: str) -> dict:
    """Wrap torch.distributed so that any control-plane traffic on the data group (an object
    collective, a host tensor, an integer flag) or any data on the control group (a float
    tensor, a device tensor) raises at once. Returns call counters per plane."""
    import torch.distributed as dist

    from mtpserve.workers.model import parallel

    seen = {"control": 0, "data": 0}

    def plane(group) -> str:
        data = parallel.get_tp().group
        return "data" if data is not None and group is data else "control"

    def tensors(args, kwargs) -> list[torch.Tensor]:
        out = []
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                out.append(a)
            elif isinstance(a, list | tuple):
                out += [x for x in a if isinstance(x, torch.Tensor)]
        return out

    def wrap(name: str, fn):
        def checked(*args, **kwargs):
            where = plane(kwargs.get("group"))
            seen[where] += 1
            if name in _OBJECT_COLLECTIVES and where == "data":
                raise AssertionError(f"object collective {name} on the data group")
            for t in tensors(args, kwargs):
                if where == "data" and (t.device.type != device or not t.is_floating_point()):
                    raise AssertionError(f"{name} of {t.dtype} on {t.device} on the data group")
                if where == "control" and (t.device.type != "cpu" or t.is_floating_point()):
                    raise AssertionError(f"{name} of {t.dtype} on {t.device} on the control "
                                         "group")
            return fn(*args, **kwargs)
        return checked

    for name in _OBJECT_COLLECTIVES + _TENSOR_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    return seen


def _spec(path: str, port: int, role: str = "prefill"):
    from mtpserve.workers.replica.tp_group import RankSpec

    return RankSpec(model=path, role=role, tp_size=2, num_kv_blocks=64, block_size=4,
                    init_method=f"tcp://127.0.0.1:{port}", kv_host="127.0.0.1",
                    kv_interface="lo", num_threads=1)


def _split_rank(rank: int, port: int, path: str, prompts: list, out, shm: bool) -> None:
    import os

    from mtpserve.workers.model.parallel import get_tp
    from mtpserve.workers.replica.tp_group import RankCore, TPDriver, worker_loop

    os.environ["MTPSERVE_SHM_COLLECTIVES"] = "1" if shm else "0"
    torch.set_num_threads(1)
    seen = install_plane_checker("cpu")
    core = RankCore(_spec(path, port), rank)
    if rank:
        worker_loop(core)
        seen["shm"] = get_tp().shm.calls if get_tp().shm else 0
        out.put(("worker", seen, core.failed))
        torch.distributed.barrier()  # neither rank leaves while the other still talks to it
        return

    driver = TPDriver(core)
    got = _greedy_tokens(driver, path, prompts)
    driver.ping()  # the health ping is control traffic too
    driver.shutdown()
    seen["shm"] = get_tp().shm.calls if get_tp().shm else 0
    out.put(("driver", seen, got))
    torch.distributed.barrier()


def _greedy_tokens(runner, path: str, prompts: list[list[int]], caching: bool = True
                   ) -> tuple[list[list[int]], int]:
    """Each prompt's greedy tokens (k = 2), collected from the streamed outputs, and the
    prefix-cache hits (tokens). The first two prompts run together, the rest after them (so
    they can reuse their prefixes). `runner`: a TP driver, or None for a single process."""
    from mtpserve.workers.engine import Engine, EngineConfig
    from mtpserve.workers.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=path, num_speculative_tokens=2, block_size=4,
                                 num_kv_blocks=64, prefix_caching=caching), runner=runner)
    got: list[list[int]] = [[] for _ in prompts]
    for wave in (range(min(2, len(prompts))), range(2, len(prompts))):
        for i in wave:
            engine.add_request(str(i), prompts[i], SamplingParams(
                max_tokens=10, temperature=0, ignore_eos=True))
        while engine.has_unfinished():
            for o in engine.step():
                got[int(o.request_id)] += o.new_token_ids
    return got, engine.block_manager.cache_hits


# gloo-data is the slow tier: the sharded model over a gloo data group is test_tp2_equals_tp1's,
# and the plane checks are the same code as shm-data's (the default data path on a CPU node).
@pytest.mark.parametrize("shm", [pytest.param(False, marks=pytest.mark.slow), True],
                         ids=["gloo-data", "shm-data"])
def test_tp2_engine_keeps_control_and_data_planes_apart(tiny_qwen3, shm: bool) -> None:
    """TP=2 with prefix caching == TP=1 without (a later prompt extends an earlier one).
    The activations travel over the gloo data group, or (the default on a CPU node) through
    shared memory, in which case these small forwards put nothing on the data group."""
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3], PROMPT + [1, 2, 3, 4, 5]]
    want, _ = _greedy_tokens(None, str(tiny_qwen3), prompts, caching=False)
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_split_rank, args=(r, port, str(tiny_qwen3), prompts, out, shm))
             for r in range(2)]
    for p in procs:
        p.start()
    got = dict((kind, (seen, x)) for kind, seen, x in (out.get(timeout=180) for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    seen0, (tokens, hits) = got["driver"]
    seen1, worker_failed = got["worker"]
    assert tokens == want  # TP=2 == TP=1, greedy
    assert hits == 8  # the third prompt reused PROMPT's first two blocks
    assert not worker_failed
    for seen in (seen0, seen1):  # both planes carried traffic, and none of it crossed over
        assert seen["control"] > 0, seen
        if shm:
            assert seen["shm"] > 0 and seen["data"] == 0, seen
        else:
            assert seen["data"] > 0 and seen["shm"] == 0, seen


def _health_rank(rank: int, port: int, path: str, events, deadline_s: float) -> None:
    import asyncio
    import os
    import time

    from mtpserve.workers.async_engine import AsyncEngine
    from mtpserve.workers.engine import Engine, EngineConfig
    from mtpserve.workers.replica.tp_group import RankCore, TPDriver, worker_loop

    torch.set_num_threads(1)
    core = RankCore(_spec(path, port), rank)
    if rank:
        events.put(("pid", os.getpid()))
        worker_loop(core)
        return
    driver = TPDriver(core)
    engine = AsyncEngine(Engine(EngineConfig(model=path, num_speculative_tokens=2, block_size=4,
                                             num_kv_blocks=64), runner=driver))

    async def check() -> str:
        await engine.ping(lambda e: driver.ping(), deadline_s)
        return "ok"

    events.put(("healthy", asyncio.run(check())))
    assert events_get(events, "killed")
    t0 = time.monotonic()
    try:
        result = asyncio.run(check())
    except Exception as e:  # what Serve's health check would see
        result = type(e).__name__
    events.put(("after_kill", (result, time.monotonic() - t0)))


def events_get(q, kind: str):
    while True:
        k, v = q.get(timeout=120)
        if k == kind:
            return v
        q.put((k, v))  # someone else's message


def test_killed_tp_worker_fails_check_health_within_its_deadline(tiny_qwen3) -> None:
    import os
    import signal

    ctx = mp.get_context("spawn")
    to_parent, to_rank0 = ctx.Queue(), ctx.Queue()
    port, deadline = free_port(), 5.0
    rank0 = ctx.Process(target=_health_rank, args=(0, port, str(tiny_qwen3),
                                                   _Duplex(to_parent, to_rank0), deadline))
    rank1 = ctx.Process(target=_health_rank, args=(1, port, str(tiny_qwen3),
                                                   _Duplex(to_parent, to_rank0), deadline))
    rank0.start()
    rank1.start()
    try:
        msgs = dict(to_parent.get(timeout=180) for _ in range(2))
        assert msgs["healthy"] == "ok"
        os.kill(msgs["pid"], signal.SIGKILL)
        rank1.join(timeout=30)
        to_rank0.put(("killed", True))
        kind, (result, elapsed) = to_parent.get(timeout=60)
        assert kind == "after_kill"
        # Within the deadline, not hung on the dead peer (the group's own timeouts run to
        # minutes); the slack absorbs the stalls of 2 shared cores.
        assert result != "ok" and elapsed < 2 * deadline, (result, elapsed)
    finally:
        for p in (rank0, rank1):
            if p.is_alive():
                p.kill()


class _Duplex:
    """put() goes to the parent, get() reads what the parent sent (picklable for spawn)."""

    def __init__(self, up, down) -> None:
        self.up, self.down = up, down

    def put(self, item) -> None:
        self.up.put(item)

    def get(self, timeout=None):
        return self.down.get(timeout=timeout)


def test_forward_batch_encoding_round_trips() -> None:
    from mtpserve.workers.replica.control_plane import decode_batch, encode_batch

    for b in batches() + [ForwardBatch("main", [[1, 2, 3], [4]], [0, 7], [[0, 1], [2]],
                                       logit_rows=[2, 3])]:
        assert decode_batch(encode_batch(b)) == b


def test_a_rank0_exception_mid_forward_fails_the_group_at_once() -> None:
    """Rank 0 raising inside a forward it already broadcast leaves the other ranks in that
    forward's collectives: the driver marks the group failed, starts no further collective
    (no desynchronised pairing), fails its health check, and the replica refuses new work."""
    from types import SimpleNamespace

    from mtpserve.workers.replica.replica import EngineReplica, ReplicaUnavailableError
    from mtpserve.workers.replica.tp_group import TPDriver

    sent: list[str] = []

    class Runner:
        config = kv_cache = None

        def execute(self, batch):
            raise RuntimeError("out of memory in layer 3")

    control = SimpleNamespace(send_forward=lambda b: sent.append("forward"),
                              send_op=lambda *a: sent.append("op"),
                              send_object=lambda o: sent.append("object"))
    core = SimpleNamespace(runner=Runner(), spec=SimpleNamespace(tp_size=2), control=control,
                           failed=False, num_pending=1, close=lambda: None)
    driver = TPDriver(core)
    with pytest.raises(RuntimeError, match="out of memory"):
        driver.execute(ForwardBatch("main", [[1]], [0], [[0]], [0]))
    assert driver.failed and sent == ["forward"]
    for call in (lambda: driver.execute(ForwardBatch("main", [[1]], [0], [[0]], [0])),
                 driver.ping, lambda: driver.run("hold")):
        with pytest.raises(RuntimeError, match="failed earlier"):
            call()
    assert driver.poll() == []  # nothing completes any more, and the engine loop never spins
    assert sent == ["forward"]  # nothing more went to the other ranks
    replica = EngineReplica.__new__(EngineReplica)
    replica.driver = driver
    with pytest.raises(ReplicaUnavailableError):
        replica._check_alive()
