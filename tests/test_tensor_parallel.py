"""TP=2 == TP=1: two real processes in a gloo group run the sharded model (column/row-parallel
linears, vocab-parallel embedding and head) over their paged KV shards."""

from __future__ import annotations

import socket

import torch
import torch.multiprocessing as mp

from workers.model_runner import ForwardBatch, ModelRunner

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8, 1, 77, 31]


def batches() -> list[ForwardBatch]:
    return [
        ForwardBatch("main", [PROMPT], [0], [[3, 1, 4, 6]], logit_rows=list(range(len(PROMPT)))),
        ForwardBatch("mtp", [PROMPT[1:] + [12]], [0], [[3, 1, 4, 6]], logit_rows=[10],
                     hidden_from="main", hidden_rows=[list(range(11))]),
        ForwardBatch("main", [[12, 13]], [len(PROMPT)], [[3, 1, 4, 6]], logit_rows=[0, 1]),
    ]


def _rank(rank: int, port: int, path: str, out) -> None:
    import os

    import torch.distributed as dist

    from workers.model.parallel import set_tp

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    set_tp(rank, 2, dist.group.WORLD)
    runner = ModelRunner(path, num_blocks=8, block_size=4)
    results = [runner.execute(b) for b in batches()]
    if rank == 0:
        out.put([r.tolist() for r in results] + [runner.kv_cache.layers[0].shape[3]])
    dist.barrier()  # neither rank leaves while the other still talks to it


def test_tp2_equals_tp1(tiny_qwen3) -> None:
    single = ModelRunner(tiny_qwen3, num_blocks=8, block_size=4)
    want = [single.execute(b) for b in batches()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, str(tiny_qwen3), out)) for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got[-1] == 1  # each rank holds 1 of the 2 KV heads
    for g, w in zip(got[:-1], want, strict=True):
        assert torch.allclose(torch.tensor(g), w, atol=1e-4), (torch.tensor(g) - w).abs().max()
