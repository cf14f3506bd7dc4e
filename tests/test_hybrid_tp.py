"""Hybrid (Qwen3-Next) models under tensor parallelism: TP = 2 == TP = 1.

Two real processes in a gloo group run the sharded model (Gated DeltaNet key/value heads and
their conv + recurrent states split by rank, gated full attention by heads, MoE by expert
slices) on the tiny random checkpoints of tests/test_qwen3_next.py (Qwen3-Next: fused
projections) and tests/test_hybrid_qwen3_5_moe.py (Qwen3.5-MoE: unfused projections, stacked
experts): the logits of chunked prefill (past the delta rule's 64-token chunk, the second
chunk resuming the first's state), batched decode steps, a verify row, the state kept after
its second token and the MTP layer == TP 1's; the engine's greedy tokens (k = 2, state slots
on the control plane, each verify round's kept state on every rank) == TP 1's, slots free
afterwards.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from serve_cluster import free_port
from test_qwen3_next import make_qwen3_next_checkpoint
from tiny_tokenizer import VOCAB_SIZE

from mtpserve.workers.model_runner import ForwardBatch, ModelRunner


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("hybrid_tp") / "ckpt")


@pytest.fixture(scope="module")
def moe35(tmp_path_factory) -> Path:
    """Qwen3.5-MoE with stacked experts: unfused DeltaNet projections (`in_proj_qkv` cut per
    q | k | v component) and stacked expert tensors cut per expert, then per rank."""
    from test_hybrid_qwen3_5_moe import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("hybrid_tp_moe35"), stacked=True)[0]


def _tokens() -> tuple[list[int], list[int]]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB_SIZE, (170,), generator=g).tolist(),
            torch.randint(0, VOCAB_SIZE, (20,), generator=g).tolist())


def _run_script(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefill in two chunks through slot 3, decode steps batched with another request's
    prefill in slot 5, a 4-token verify row, keep the state after its 2nd token, go on."""
    tokens, other = _tokens()
    blocks, blocks_other = list(range(30)), list(range(40, 44))
    out = []
    for start, end in ((0, 70), (70, 150)):
        out.append(runner.execute(ForwardBatch("main", [tokens[start:end]], [start], [blocks],
                                               list(range(end - start)), state_slots=[3])))
    for pos in range(150, 153):
        out.append(runner.execute(ForwardBatch(
            "main", [[tokens[pos]], other], [pos, 0], [blocks, blocks_other],
            [0, 20 + len(other) - 1], state_slots=[3, 5])))
    out.append(runner.execute(ForwardBatch("main", [tokens[153:157]], [153], [blocks],
                                           list(range(4)), state_slots=[3])))
    runner.keep_states([0], [1])
    out.append(runner.execute(ForwardBatch("main", [[tokens[155]]], [155], [blocks], [0],
                                           state_slots=[3])))
    # The MTP module (full attention) over the main model's last hidden states.
    out.append(runner.execute(ForwardBatch("mtp", [[tokens[156]]], [155], [blocks], [0],
                                           hidden_from="main", hidden_rows=[[0]])))
    return out


def _runner_rank(rank: int, port: int, path: str, out) -> None:
    import os

    import torch.distributed as dist

    from mtpserve.workers.model.parallel import set_tp

    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    set_tp(rank, 2, dist.group.WORLD)
    runner = ModelRunner(path, num_blocks=64, block_size=8, num_state_slots=8)
    results = _run_script(runner)
    if rank == 0:
        st = runner.state_cache
        i = st.layers[0]
        out.put(([r.tolist() for r in results],
                 (tuple(st.conv[i].shape), tuple(st.recurrent[i].shape))))
        out.close()
        out.join_thread()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # skip a teardown that gloo's threads sometimes abort


def _spawn(target, args_of_rank, n: int = 2, timeout_s: float = 240.0) -> list:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args_of_rank(r), out)) for r in range(n)]
    for p in procs:
        p.start()
    got = [out.get(timeout=timeout_s)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    return got


@pytest.mark.parametrize("model", ["ckpt", "moe35"], ids=["qwen3_next", "qwen3_5_moe"])
def test_tp2_logits_and_kept_states_equal_tp1(request, model: str) -> None:
    path = request.getfixturevalue(model)
    want = _run_script(ModelRunner(path, num_blocks=64, block_size=8, num_state_slots=8))
    port = free_port()
    [(got, shapes)] = _spawn(_runner_rank, lambda r: (r, port, str(path)))
    # Rank 0 holds half the conv channels (2 * 16 + 32 = 64 -> 32) and 2 of 4 value heads.
    assert shapes == ((9, 32, 3), (9, 2, 8, 8))
    for j, (g, w) in enumerate(zip(got, want, strict=True)):
        err = (torch.tensor(g) - w).abs().max().item()
        assert err <= 1e-4, f"forward {j}: {err}"


PROMPT_LENS = (7, 75, 19)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _greedy(path: str, runner=None) -> tuple[list[list[int]], dict]:
    from mtpserve.workers.engine import Engine, EngineConfig
    from mtpserve.workers.sampling_params import SamplingParams

    engine = Engine(EngineConfig(model=path, num_speculative_tokens=2, block_size=4,
                                 num_kv_blocks=96, max_num_batched_tokens=40,
                                 max_num_seqs=4), runner=runner)
    reqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=12, temperature=0,
                                                          ignore_eos=True))
            for i, p in enumerate(_prompts())]
    while engine.has_unfinished():
        engine.step()
    return [r.output_token_ids for r in reqs], engine.stats()


def _engine_rank(rank: int, port: int, path: str, out) -> None:
    from mtpserve.workers.replica.tp_group import RankCore, RankSpec, TPDriver, worker_loop

    torch.set_num_threads(1)
    spec = RankSpec(model=path, role="prefill", tp_size=2, num_kv_blocks=96, block_size=4,
                    init_method=f"tcp://127.0.0.1:{port}", kv_host="127.0.0.1",
                    kv_interface="lo", num_threads=1, num_state_slots=4)
    core = RankCore(spec, rank)
    if rank:
        worker_loop(core)
        torch.distributed.barrier()
        return
    driver = TPDriver(core)
    got, stats = _greedy(path, driver)
    driver.shutdown()
    out.put((got, stats["state_slots_used"], stats["used_blocks"]))
    torch.distributed.barrier()


def test_tp2_engine_greedy_with_drafts_equals_tp1(ckpt) -> None:
    """k = 2 through a TP-2 group (state slots travel with each forward on the control plane;
    every rank keeps its state shard at each row's last accepted token) == TP 1."""
    want, stats = _greedy(str(ckpt))
    assert stats["state_slots_used"] == 0
    port = free_port()
    [(got, slots_used, blocks_used)] = _spawn(_engine_rank, lambda r: (r, port, str(ckpt)))
    assert got == want
    assert slots_used == 0 and blocks_used == 0


def test_forward_batch_with_state_slots_round_trips() -> None:
    from mtpserve.workers.replica.control_plane import decode_batch, encode_batch

    for b in (ForwardBatch("main", [[1, 2, 3], [4]], [0, 7], [[0, 1], [2]], logit_rows=[2, 3],
                           state_slots=[5, 0]),
              ForwardBatch("main", [[9]], [3], [[1]], logit_rows=[0])):
        assert decode_batch(encode_batch(b)) == b
