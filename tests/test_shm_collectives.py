"""Shared-memory collectives of same-node CPU TP ranks == gloo's, in real processes: the same
bits on every rank, slots reused across many calls of changing shapes, tensors past the slot
size through the fallback group, and no segment left in /dev/shm."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from serve_cluster import free_port

from mtpserve.workers.model import shm_collectives

pytestmark = pytest.mark.skipif(not shm_collectives.available("cpu"),
                                reason="shared-memory collectives need an x86-64 CPU")

SLOT = 4096  # bytes: 1024 fp32 per rank, so the last shape below takes the fallback


def _shapes() -> list[tuple[int, ...]]:
    return [(1, 8), (3, 16), (1, 8), (2, 5, 7), (1000,), (40, 40), (3, 16)] * 7


def _rank(rank: int, size: int, port: int, out) -> None:
    import torch.distributed as dist

    from mtpserve.workers.model.shm_collectives import ShmCollectives

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    shm = ShmCollectives.create(dist.group.WORLD, rank, size, SLOT, fallback=dist.group.WORLD)
    results = []
    g = torch.Generator().manual_seed(rank)
    for i, shape in enumerate(_shapes()):
        x = torch.randn(shape, generator=g)
        want = x.clone()
        dist.all_reduce(want)
        got = shm.all_reduce(x)
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x)
        gathered = shm.all_gather_last(x)
        results.append((i, torch.allclose(got, want, atol=1e-6), got.tolist(),
                        torch.equal(gathered, torch.cat(parts, -1))))
    out.put((rank, shm.calls, results))
    out.close()
    out.join_thread()  # the result is in the pipe before this process may leave
    shm.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


# 3 ranks (a group size no config uses; the slot layout and the reductions are the same code
# as for 2) is the slow tier.
@pytest.mark.parametrize("size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_shm_collectives_equal_gloo(size: int) -> None:
    before = {f for f in os.listdir("/dev/shm") if f.startswith("mtpserve-tp-")}
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_rank, args=(r, size, port, out)) for r in range(size)]
    for p in procs:
        p.start()
    got = dict((rank, (calls, res)) for rank, calls, res in (out.get(timeout=120)
                                                             for _ in procs))
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    big = sum(1 for s in _shapes() if torch.Size(s).numel() * 4 > SLOT)
    for rank, (calls, res) in got.items():
        # Every small tensor went through shared memory (2 collectives each), big ones not.
        assert calls == 2 * (len(_shapes()) - big), (rank, calls)
        for i, close, _, gathered in res:
            assert close and gathered, (rank, i)
    for i in range(len(_shapes())):  # every rank holds the same bits (sum in rank order)
        assert all(got[0][1][i][2] == got[r][1][i][2] for r in range(size))
    after = {f for f in os.listdir("/dev/shm") if f.startswith("mtpserve-tp-")}
    assert after == before  # rank 0 unlinked the segment once every rank had mapped it


def _dying_rank(rank: int, port: int, out) -> None:
    import time

    import torch.distributed as dist

    from mtpserve.workers.model.shm_collectives import ShmCollectives

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    shm = ShmCollectives.create(dist.group.WORLD, rank, 2, SLOT, timeout_s=600)
    shm.all_reduce(torch.ones(4))  # both ranks take part once
    if rank == 1:
        os._exit(0)  # gone before the next collective
    t0 = time.monotonic()
    try:
        shm.all_reduce(torch.ones(4))
        out.put(("returned", time.monotonic() - t0))
    except RuntimeError as e:
        out.put((str(e), time.monotonic() - t0))
    out.close()
    out.join_thread()
    os._exit(0)


def test_a_dead_peer_fails_the_collective_fast() -> None:
    """A rank that exits leaves its peer waiting in a collective: the peer raises within
    about a second (pid check while it sleeps), not at the 600 s timeout."""
    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_dying_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    what, seconds = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
    assert "exited during a shared-memory collective" in what, what
    assert seconds < 10, seconds
