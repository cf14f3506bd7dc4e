"""A seeded sampled request gives the same tokens alone, batched with requests of other k,
lengths and arrival times, under preemption, through prefill -> decode (KV handed over between
two engines), after migration (resumed from prompt + emitted tokens), and on TP = 2.

Randomness is keyed by (seed, position, slot), so all of these must agree exactly for a fixed
k; only float noise from different batch shapes could flip a token, with negligible odds."""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import torch
import torch.multiprocessing as mp
from helpers import drain, make_engine

from mtpserve.workers.engine import Engine, EngineConfig, RequestOutput
from mtpserve.workers.request import Request
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.scheduler import decode_slots, draft_slots

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8, 1, 77, 31]
PARAMS = SamplingParams(max_tokens=28, temperature=1.0, top_p=0.95, seed=1234,
                        ignore_eos=True, num_speculative_tokens=3)


def engine(path, **kw) -> Engine:
    cfg = dict(num_kv_blocks=256, block_size=4, max_num_batched_tokens=64)
    return make_engine(path, 4, **{**cfg, **kw})


def run_alone(path, params: SamplingParams = PARAMS) -> tuple[list[int], list[int]]:
    """Tokens, and the cumulative token counts at round ends (where a client can resume)."""
    eng = engine(path)
    req = eng.add_request("x", PROMPT, params)
    ends = []
    while eng.has_unfinished():
        if any(o.request_id == "x" for o in eng.step()):
            ends.append(req.num_output_tokens)
    return req.output_token_ids, ends


def test_batched_and_preempted_equal_alone(tiny_qwen3) -> None:
    want, _ = run_alone(tiny_qwen3)
    g = torch.Generator().manual_seed(1)

    def other(i: int) -> tuple[list[int], SamplingParams]:
        n = int(torch.randint(3, 40, (1,), generator=g))
        prompt = torch.randint(3, 256, (n,), generator=g).tolist()
        return prompt, SamplingParams(max_tokens=10 + 7 * i, temperature=(0.0, 0.8, 1.2)[i % 3],
                                      num_speculative_tokens=(0, 1, 4, None)[i % 4],
                                      ignore_eos=True)

    # Few KV blocks: the newest requests get preempted and recomputed along the way.
    for blocks in (256, 40):
        eng = engine(tiny_qwen3, num_kv_blocks=blocks)
        for i in range(3):
            eng.add_request(f"a{i}", *other(i))
        eng.step()
        eng.step()
        req = eng.add_request("x", PROMPT, PARAMS)
        for i in range(3, 7):
            eng.step()
            eng.add_request(f"b{i}", *other(i))
        seen = [req]
        while eng.has_unfinished():
            eng.step()
            seen += eng.scheduler.running
        assert req.output_token_ids == want, blocks
        if blocks == 40:
            assert any(r.num_preemptions for r in seen), "no preemption happened"


def test_resume_after_migration_equals_alone(tiny_qwen3) -> None:
    want, ends = run_alone(tiny_qwen3)
    assert len(ends) > 4
    for cut in (ends[0], ends[2], ends[-2]):  # after the first token, mid-way, near the end
        eng = engine(tiny_qwen3)
        # The orchestrator's convention: limits count what is left after the sent tokens.
        left = replace(PARAMS, max_tokens=PARAMS.max_tokens - cut)
        req = eng.add_resumed("x", PROMPT, left, want[:cut])
        emitted = [t for o in drain(eng) for t in o.new_token_ids]
        assert req.output_token_ids == want, cut
        assert emitted == want[cut:]  # nothing repeated, nothing lost


def transfer(src: Engine, dst: Engine, rid: str, params: SamplingParams,
             first: RequestOutput) -> Request:
    """What the prefill and decode servers do, in-process: copy the KV blocks (main + MTP)
    and the drafts, then decode; the request's seed comes from its params."""
    held = src.prefilled[rid]
    r = dst.make_request(rid, PROMPT, params)
    r.output_token_ids += first.new_token_ids
    r.num_computed_tokens = held.num_computed_tokens
    r.draft_token_ids = list(held.draft_token_ids)
    r.draft_probs = held.draft_probs
    dst.add_transferred(r, max(draft_slots(held), decode_slots(r)))  # parked for its KV
    assert dst.scheduler.admit_transferred() == [r]  # blocks allocated
    n_blocks = len(held.block_ids)
    for s, d in zip(src.runner.kv_cache.layers, dst.runner.kv_cache.layers, strict=True):
        d[:, r.block_ids[:n_blocks]] = s[:, held.block_ids]
    dst.activate_transferred(r)
    src.release_prefilled(rid)
    return r


def test_prefill_then_decode_equals_alone(tiny_qwen3) -> None:
    want, _ = run_alone(tiny_qwen3)
    pre = engine(tiny_qwen3, role="prefill")
    dec = engine(tiny_qwen3, role="decode")
    pre.add_request("x", PROMPT, PARAMS)
    outs = drain(pre)
    assert [o.new_token_ids for o in outs] == [want[:1]]
    # Another request already decoding on the decode side, with a different k.
    dec.add_request("other", [9, 8, 7, 6, 5], SamplingParams(max_tokens=20, seed=3,
                                                             num_speculative_tokens=1))
    dec.step()
    req = transfer(pre, dec, "x", PARAMS, outs[0])
    drain(dec)
    assert req.output_token_ids == want
    assert pre.block_manager.num_free_blocks == 256


def _tp_rank(rank: int, port: int, path: str, out) -> None:
    import torch.distributed as dist

    from mtpserve.workers.replica.tp_group import RankCore, RankSpec, TPDriver, worker_loop

    torch.set_num_threads(1)
    spec = RankSpec(model=path, role="decode", tp_size=2, num_kv_blocks=256, block_size=4,
                    init_method=f"tcp://127.0.0.1:{port}")
    core = RankCore(spec, rank)
    if rank:
        worker_loop(core)
        dist.barrier()  # neither rank leaves while the other still talks to it
        dist.destroy_process_group()
        os._exit(0)  # skip the teardown that can abort with gloo's threads around
    driver = TPDriver(core)
    eng = Engine(EngineConfig(model=path, num_speculative_tokens=4, num_kv_blocks=256,
                              block_size=4, max_num_batched_tokens=64), runner=driver)
    req = eng.add_request("x", PROMPT, PARAMS)
    drain(eng)
    out.put(req.output_token_ids)
    out.close()
    out.join_thread()  # the result is in the pipe before this process may leave
    driver.shutdown()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_tp2_equals_tp1(tiny_qwen3) -> None:
    want, _ = run_alone(tiny_qwen3)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_tp_rank, args=(r, port, str(tiny_qwen3), out))
             for r in range(2)]
    for p in procs:
        p.start()
    got = out.get(timeout=120)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert got == want


def test_unseeded_requests_get_a_seed_that_travels() -> None:
    from mtpserve.workers.messages import GenerateRequest

    a = GenerateRequest("a", [1, 2], SamplingParams(max_tokens=4))
    b = GenerateRequest("b", [1, 2], SamplingParams(max_tokens=4, seed=7))
    pa, pb = a.params, b.params
    assert pa.seed is not None and not pa.user_seed
    assert pb.seed == 7 and pb.user_seed
    assert not pa.reproducible  # adaptive k may still tune it
    assert pb.reproducible
    r = Request("r", [1], SamplingParams())
    assert r.seed is not None and not r.reproducible
    big = Request("b", [1], SamplingParams(seed=2**70 + 5))  # API seeds are unbounded
    assert big.seed == 5 and Request("n", [1], SamplingParams(seed=-3)).seed == -3
