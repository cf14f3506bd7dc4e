"""TP=2 == TP=1: two real processes in a gloo group run the sharded model (column/row-parallel
linears, vocab-parallel embedding and head) over their paged KV shards; TP 4 (and, slow, 8)
over 2 KV heads == TP 1, each rank holding one replicated KV head."""

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


def _spec(path: str, port: int, role: str = "prefill", tp_size: int = 2):
    from mtpserve.workers.replica.tp_group import RankSpec

    return RankSpec(model=path, role=role, tp_size=tp_size, num_kv_blocks=64, block_size=4,
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


def _replicated_rank(rank: int, port: int, path: str, tp: int, prompts: list, out) -> None:
    """One rank of a TP group above the model's KV heads: rank 0 drives the forwards of
    `batches()` and then a greedy engine; the others follow."""
    from mtpserve.workers.replica.tp_group import RankCore, TPDriver, worker_loop

    torch.set_num_threads(1)
    core = RankCore(_spec(path, port, tp_size=tp), rank)
    if rank:
        worker_loop(core)
        out.put(("worker", rank, core.failed))
        torch.distributed.barrier()
        return
    driver = TPDriver(core)
    logits = [driver.execute(b).tolist() for b in batches()]
    layout = tuple(core.runner.kv_cache.layers[0].shape[3:])
    tokens = _greedy_tokens(driver, path, prompts)
    driver.shutdown()
    out.put(("driver", 0, (logits, layout, tokens)))
    torch.distributed.barrier()


def _replicated_kv_heads_equal_tp1(path: str, tp: int) -> None:
    """TP `tp` over a model with fewer KV heads == TP 1: the forwards' logits (fp32) and the
    greedy tokens (k = 2, prefix caching on), each rank's cache holding one KV head."""
    prompts = [PROMPT, [9, 8, 7, 6, 5, 4, 3], PROMPT + [1, 2, 3, 4, 5]]
    single = ModelRunner(path, num_blocks=8, block_size=4)
    want = [single.execute(b) for b in batches()]
    want_tokens, _ = _greedy_tokens(None, path, prompts, caching=False)
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_replicated_rank, args=(r, port, path, tp, prompts, out))
             for r in range(tp)]
    for p in procs:
        p.start()
    got = {(kind, rank): x for kind, rank, x in (out.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert not any(got[("worker", r)] for r in range(1, tp))
    logits, layout, (tokens, hits) = got[("driver", 0)]
    assert layout == (1, single.config.head_dim)  # one (replicated) KV head per rank
    for g, w in zip(logits, want, strict=True):
        assert torch.allclose(torch.tensor(g), w, atol=1e-4), (torch.tensor(g) - w).abs().max()
    assert tokens == want_tokens
    assert hits == 8  # the third prompt reused PROMPT's first two blocks


def test_tp4_replicates_the_2_kv_heads_and_equals_tp1(tiny_qwen3) -> None:
    """4 query heads, 2 KV heads: rank r holds query head r and KV head r // 2."""
    _replicated_kv_heads_equal_tp1(str(tiny_qwen3), 4)


# Slow tier: 8 ranks on 2 cores; test_tp4_replicates_the_2_kv_heads_and_equals_tp1 runs the
# same replicated-head code path (1 query head per rank there, 2 here).
@pytest.mark.slow
def test_tp8_replicates_the_2_kv_heads_and_equals_tp1(tmp_path) -> None:
    from tiny_models import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path / "q8", "qwen3", num_mtp=1, num_attention_heads=8)
    _replicated_kv_heads_equal_tp1(str(path), 8)


def test_kv_head_split_and_the_fused_qkv_shards() -> None:
    """The rank's KV heads and the rows of the fused q/k/v weight it loads, at TP above the
    KV heads: K and V are the replicated head's, q the rank's own heads."""
    from mtpserve.workers.model.config import kv_head_split
    from mtpserve.workers.model.parallel import ColumnParallelLinear, construction_tp

    assert [kv_head_split(2, tp) for tp in (1, 2, 4, 8)] == [(2, 1), (1, 1), (1, 2), (1, 4)]
    assert kv_head_split(4, 8) == (1, 2) and kv_head_split(8, 4) == (2, 1)
    with pytest.raises(ValueError, match="must divide the model's 2 KV heads or be a multiple"):
        kv_head_split(2, 3)
    H, Hk, D, tp = 8, 2, 4, 8
    full = [torch.arange(n * D).float().view(n * D, 1) + 1000 * i for i, n in
            enumerate((H, Hk, Hk))]
    for rank in range(tp):
        with construction_tp(rank, tp):
            qkv = ColumnParallelLinear(1, [H * D, Hk * D, Hk * D],
                                       replicas=[1, tp // Hk, tp // Hk])
        for part, t in enumerate(full):
            qkv.weight.weight_loader(qkv.weight, t, part)
        q, k, v = qkv.weight.data.split(qkv.local_sizes)
        head = rank * Hk // tp
        assert torch.equal(q, full[0][rank * D:(rank + 1) * D])
        assert torch.equal(k, full[1][head * D:(head + 1) * D])
        assert torch.equal(v, full[2][head * D:(head + 1) * D])
        assert qkv.replicated and qkv.shard_start(1) == head * D


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
