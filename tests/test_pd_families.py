"""Prefill -> decode across TP sizes for the MoE and MLA families: 1 -> 2 and 2 -> 1 (and, in
the slow tier, 1 -> 4 over GLM-4.5's 2 KV heads, replicated on the decode ranks).

The real PrefillServer / DecodeServer classes (Serve's wrappers peeled off, as
tests/test_disagg_datapath.py). The TP-2 side runs in this process with its rank 1 a Ray actor
of a local cluster; the TP-1 side runs in a child process of its own (a process holds one TP
layout, `parallel.set_tp`, as a Serve replica does); KV over loopback gloo pairs. On tiny
random checkpoints saved by transformers' own classes: GLM-4.5 (GQA, its 2 KV heads split
across decode ranks, MoE MTP layer), Qwen3-MoE (GQA, no MTP layer: k = 0), DeepSeek-V3
(MLA: the latent replicated on every rank, pulled whole by each decode rank from one prefill
replica) and DeepSeek-V3.2 (the same slot also holding the DSA indexer's key, prompts longer
than its top-k). Disaggregated greedy (k = 2 with an MTP layer) == the single-process engine; every
pull really happened (no recompute) and every block is free on both sides well before the
hold TTL (a 2 -> 1 MLA prefill rank nobody pulls from is dropped, not left to expire).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from helpers import greedy, make_engine, run_to_completion
from tiny_models import make_hf_checkpoint, make_mimo_v2_flash_checkpoint, make_step_checkpoint

from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.messages import GenerateRequest

pytestmark = pytest.mark.ray
ray = pytest.importorskip("ray")

# family -> MTP layers in its checkpoint (Qwen3-MoE ships none).
FAMILIES = {"glm4_moe": 1, "qwen3_moe": 0, "deepseek_v3": 1, "deepseek_v32": 1, "step3p5": 1,
            "mimo_v2_flash": 1}
HOLD_TTL_S = 60.0  # far above the wait below: a block freed in time was released, not expired
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def local_ray(shared_serve) -> None:
    """The session's local Ray cluster (conftest's `shared_serve`; Serve itself unused): it
    places the TP rank actors."""
    shared_serve.url()


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pd_families")
    made = {"step3p5": make_step_checkpoint, "mimo_v2_flash": make_mimo_v2_flash_checkpoint}
    return {f: (made[f](root / f, num_mtp=n) if f in made
                else make_hf_checkpoint(root / f, f, num_mtp=n)) for f, n in FAMILIES.items()}


def cluster_config(model: Path, prefill_tp: int, decode_tp: int, k: int) -> ClusterConfig:
    return ClusterConfig(
        model=str(model), block_size=4,
        # In-process servers whose engine internals the tests read: the core on a thread.
        prefill={"tp_size": prefill_tp, "num_kv_blocks": 64, "cpus_per_rank": 1,
                 "engine_core": "thread"},
        decode={"tp_size": decode_tp, "num_kv_blocks": 96, "cpus_per_rank": 1,
                "max_num_seqs": 4, "engine_core": "thread"},
        speculation={"num_speculative_tokens": k, "adaptive": False},
        kv_transfer={"timeout_s": 30, "hold_ttl_s": HOLD_TTL_S, "host": "127.0.0.1"},
    )


def make_server(cfg: ClusterConfig, role: str):
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer

    return (PrefillServer if role == "prefill" else DecodeServer).func_or_class(cfg)


def shutdown(server) -> None:
    from mtpserve.workers.model.parallel import set_tp

    server.engine.shutdown()
    server.driver.shutdown()
    for w in server.workers:  # the TP rank actors
        ray.kill(w)
    # A replica owns its process: its TP layout and its default (control) group are the
    # process's. The next test's engines in this process start from TP 1 and no group.
    set_tp(0, 1, None)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


async def prefill_all(p, reqs: list[GenerateRequest]) -> list:
    """(first token ids, KV params) of each request, prefilled together."""
    async def one(req):
        first, params = await p.prefill(req)
        assert params is not None  # ignore_eos, max_tokens > 1: the KV is held for decode
        return list(first.token_ids), params

    return list(await asyncio.gather(*(one(r) for r in reqs)))


async def decode_all(d, jobs: list) -> list[list[int]]:
    """Each (request, KV params)'s decoded tokens, decoded together."""
    async def one(req, params):
        tokens: list[int] = []
        async for chunk in d.generate(req, params):
            assert chunk.error is None, chunk.error
            tokens += chunk.token_ids
        return tokens

    return list(await asyncio.gather(*(one(r, p) for r, p in jobs)))


def side_stats(server) -> dict:
    core = server.driver.core
    link = core.sender if core.sender is not None else core.receiver
    return {"engine": server.engine.engine.stats(), "pending": core.holds + core.inflight,
            "kv": link.stats()}


def _side_main(conn, cfg: ClusterConfig, role: str) -> None:
    """The TP-1 side in a process of its own, driven over a pipe: prefill or decode a batch,
    stats, exit."""
    import os

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    server = make_server(cfg, role)
    conn.send("ready")
    try:
        while True:
            cmd, arg = conn.recv()
            if cmd == "exit":
                return
            try:
                if cmd == "prefill":
                    out = asyncio.run(prefill_all(server, arg))
                elif cmd == "decode":
                    out = asyncio.run(decode_all(server, arg))
                else:
                    out = side_stats(server)
                conn.send(("ok", out))
            except Exception as e:  # re-raised in the test
                conn.send(("error", f"{type(e).__name__}: {e}"))
    finally:
        server.engine.shutdown()
        server.driver.shutdown()


class ChildSide:
    """A PrefillServer or DecodeServer (TP 1) in a spawned process."""

    def __init__(self, cfg: ClusterConfig, role: str) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_side_main, args=(child, cfg, role), daemon=True)
        self.proc.start()
        assert self.conn.poll(180), "the child server did not start"
        assert self.conn.recv() == "ready"

    def call(self, cmd: str, arg=None, timeout_s: float = 120.0):
        self.conn.send((cmd, arg))
        assert self.conn.poll(timeout_s), f"the child server did not answer {cmd}"
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"child server: {value}")
        return value

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("exit", None))
            except OSError:
                pass
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in (13, 6, 21)]


# The default tier runs one case per direction and per cache shape (MLA's replicated latent
# 1 -> 2, with and without DSA, GQA MoE 2 -> 1); the other ten are the slow tier. Each
# family's P/D exactness at TP=1 is also test_model_families.py's
# test_disaggregated_equals_offline.
_DEFAULT_CASES = {("deepseek_v3", 1, 2), ("glm4_moe", 2, 1), ("deepseek_v32", 1, 2)}


@pytest.mark.parametrize(("family", "prefill_tp", "decode_tp"), [
    pytest.param(f, p, d, marks=() if (f, p, d) in _DEFAULT_CASES else pytest.mark.slow,
                 id=f"{p}-{d}-{f}")
    for p, d in [(1, 2), (2, 1)] for f in FAMILIES] + [
    # GQA's 2 KV heads replicated on 4 decode ranks (2 per head, each pulling it from the one
    # prefill rank); slow: 4 decode ranks on 2 cores. The replicated head's code path is
    # test_tensor_parallel.py's TP 4 == TP 1 and test_kv_transfer_packing.py's plans.
    pytest.param("glm4_moe", 1, 4, marks=pytest.mark.slow, id="1-4-glm4_moe")])
def test_disaggregated_across_tp_sizes_equals_offline(local_ray, ckpts, family, prefill_tp,
                                                      decode_tp) -> None:
    path, k = ckpts[family], 2 if FAMILIES[family] else 0
    ps = prompts()
    want = run_to_completion(make_engine(path, k, num_kv_blocks=96, block_size=4), ps,
                             greedy(MAX_TOKENS))
    cfg = cluster_config(path, prefill_tp, decode_tp, k)
    reqs = [GenerateRequest(f"r{i}", x, greedy(MAX_TOKENS)) for i, x in enumerate(ps)]
    local_role = "prefill" if prefill_tp == 2 else "decode"
    child = ChildSide(cfg, "decode" if local_role == "prefill" else "prefill")
    local = None
    try:
        local = make_server(cfg, local_role)
        if local_role == "prefill":
            firsts = asyncio.run(prefill_all(local, reqs))
            rest = child.call("decode", [(r, params) for r, (_, params) in zip(
                reqs, firsts, strict=True)])
        else:
            firsts = child.call("prefill", reqs)
            rest = asyncio.run(decode_all(local, [(r, params) for r, (_, params) in zip(
                reqs, firsts, strict=True)]))
        assert [f + r for (f, _), r in zip(firsts, rest, strict=True)] == want

        def both() -> tuple[dict, dict]:
            theirs, mine = child.call("stats"), side_stats(local)
            return (mine, theirs) if local_role == "prefill" else (theirs, mine)

        # The prefill frees a hold on its sender thread when the last decode rank acked or
        # dropped it: allow it a moment, far below the hold TTL.
        end = time.monotonic() + 10
        pst, dst = both()
        while pst["engine"]["used_blocks"] + dst["engine"]["used_blocks"] and (
                time.monotonic() < end):
            time.sleep(0.05)
            pst, dst = both()
        assert pst["engine"]["used_blocks"] == dst["engine"]["used_blocks"] == 0, (pst, dst)
        assert pst["pending"] == dst["pending"] == []
        # Decode rank 0 pulled every request: MLA's latent from one prefill replica, GQA's
        # heads from every prefill rank that holds some of them.
        mla = family in ("deepseek_v3", "deepseek_v32")
        per_request = 1 if mla else max(prefill_tp // decode_tp, 1)
        assert dst["kv"]["pulls"] == len(ps) * per_request
        # Prefill rank 0 served every decode rank that pulls from it.
        assert pst["kv"]["held"] == 0 and pst["kv"]["transfers"] == len(ps) * (
            decode_tp if prefill_tp == 1 else 1)
    finally:
        child.close()
        if local is not None:
            shutdown(local)
