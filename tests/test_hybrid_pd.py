"""Hybrid (Qwen3-Next) models served disaggregated: the prefill ships each request's
recurrent + conv state (its state slot) with the full-attention layers' KV over the pair's
gloo channel; the decode rank installs it in the slot its engine gave the request.

The real PrefillServer / DecodeServer classes (Serve's wrappers peeled off, TP 1 -> 1,
loopback gloo, as tests/test_disagg_datapath.py) on the tiny random Qwen3-Next checkpoint of
tests/test_qwen3_next.py: disaggregated greedy (k = 2, prompts past the delta rule's 64-token
chunk and the prefill chunk) == the offline engine == transformers; seeded sampling ==
offline; every KV block and state slot free on both sides afterwards; a decode replica
killed mid-stream migrates token-exact through the real orchestrator. The state re-sharding
between TP layouts is checked on tensors (`install_states`).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    HandleStream,
    greedy,
    hf_greedy,
    make_engine,
    run_disaggregated,
    run_to_completion,
)
from test_qwen3_next import make_qwen3_next_checkpoint
from tiny_tokenizer import VOCAB_SIZE

from mtpserve.cluster.config import ClusterConfig
from mtpserve.workers.kv_transfer.states import install_states, state_extras
from mtpserve.workers.messages import GenerateRequest
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.state_pool import StateCache


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_qwen3_next_checkpoint(tmp_path_factory.mktemp("hybrid_pd") / "ckpt")


def make_servers(model: Path, k: int = 2, **extra):
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer

    cfg = ClusterConfig(
        model=str(model), block_size=4,
        # In-process servers whose engine internals the tests read: the core on a thread.
        prefill={"num_kv_blocks": 96, "cpus_per_rank": 1, "max_num_batched_tokens": 40,
                 "engine_core": "thread"},
        decode={"num_kv_blocks": 96, "cpus_per_rank": 1, "max_num_seqs": 4,
                "engine_core": "thread"},
        speculation={"num_speculative_tokens": k, "adaptive": False},
        kv_transfer={"timeout_s": 20, "hold_ttl_s": 30, "host": "127.0.0.1"},
        **extra,
    )
    return PrefillServer.func_or_class(cfg), DecodeServer.func_or_class(cfg)


def shutdown(*servers) -> None:
    for s in servers:
        s.engine.shutdown()
        s.driver.shutdown()



def run_all(p, d, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    async def main():
        return await asyncio.gather(*(run_disaggregated(p, d, GenerateRequest(f"r{i}", x, params))
                                      for i, x in enumerate(prompts)))

    return asyncio.run(main())


def wait_all_free(p, d, deadline_s: float = 5.0) -> tuple[dict, dict]:
    """Both engines' stats once nothing is held (the prefill frees a hold when the decode
    side acks it, on its sender thread: the last release may land just after the stream)."""
    end = time.monotonic() + deadline_s
    while True:
        ps, ds = p.engine.engine.stats(), d.engine.engine.stats()
        if (ps["used_blocks"] == ds["used_blocks"] == 0
                and ps["state_slots_used"] == ds["state_slots_used"] == 0):
            return ps, ds
        if time.monotonic() > end:
            return ps, ds
        time.sleep(0.01)


PROMPT_LENS = (7, 75, 19)  # 75: past the 64-token delta-rule chunk and the 40-token prefill


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in PROMPT_LENS]


def test_disaggregated_greedy_equals_offline_and_transformers(ckpt, prompts) -> None:
    ref = transformers.Qwen3NextForCausalLM.from_pretrained(ckpt).eval()
    want = [hf_greedy(ref, x, 12) for x in prompts]
    offline = run_to_completion(make_engine(ckpt, 2, num_kv_blocks=96, block_size=4,
                                            max_num_batched_tokens=40), prompts, greedy(12))
    assert offline == want
    p, d = make_servers(ckpt)
    try:
        assert run_all(p, d, prompts, greedy(12)) == want
        ps, ds = wait_all_free(p, d)
        for side in (ps, ds):
            assert side["used_blocks"] == 0 and side["state_slots_used"] == 0, side
            assert side["state_slots_total"] > 0
        assert p.driver.core.holds == [] and d.driver.core.inflight == []
        p.engine.engine.block_manager.check_integrity([])
        d.engine.engine.block_manager.check_integrity([])
        # The first decode round verified the drafts the prefill shipped.
        assert d.engine.engine.totals["drafted"] > 0
    finally:
        shutdown(p, d)


def test_disaggregated_seeded_sampling_equals_offline(ckpt, prompts) -> None:
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=123,
                            ignore_eos=True)
    want = run_to_completion(make_engine(ckpt, 2, num_kv_blocks=96, block_size=4,
                                         max_num_batched_tokens=40), prompts, params)
    p, d = make_servers(ckpt)
    try:
        assert run_all(p, d, prompts, params) == want
        ps, ds = wait_all_free(p, d)
        assert ps["state_slots_used"] == ds["state_slots_used"] == 0
    finally:
        shutdown(p, d)


def _shard(cache: StateCache, slot: int, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Rank `rank` of `tp`'s state extras cut from a TP-1 slot: the conv window's q, k and v
    channels and the recurrent state's value heads, each split in `tp` equal parts (the
    layout a sharded Gated DeltaNet holds)."""
    lin = cache.linear
    key = lin.num_key_heads * lin.key_head_dim
    out = {}
    for name, t in state_extras(cache, slot).items():
        if name.startswith("state.conv."):
            parts = torch.split(t, [key, key, t.shape[0] - 2 * key])
            out[name] = torch.cat([c.chunk(tp)[rank] for c in parts])
        else:
            out[name] = t.chunk(tp)[rank]
    return out


@pytest.mark.parametrize(("src_tp", "dst_tp"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_state_resharding_between_tp_layouts(ckpt, src_tp: int, dst_tp: int) -> None:
    """A random state, sharded as prefill TP `src_tp` holds it, installed by every decode rank
    of `dst_tp` from the prefill ranks `pull_plan` names == that rank's shard of the same
    state; a wrong set of prefill ranks is refused."""
    dst = _check_state_resharding(ModelConfig.from_pretrained(ckpt), src_tp, dst_tp)
    if src_tp == 2 and dst_tp == 1:
        src = _shard_all(ModelConfig.from_pretrained(ckpt), src_tp)
        with pytest.raises(ValueError, match="do not cover"):
            install_states(dst, 0, [(1, src[1])], src_tp, dst_tp, 0)


# A hybrid model with 2 KV heads and linear heads that split 8 ways (Qwen3-Next: 2 KV heads,
# 16 key / 32 value linear heads).
_REPLICATED_NEXT = dict(
    model_type="qwen3_next", vocab_size=256, hidden_size=64, intermediate_size=96,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
    linear_num_value_heads=16, linear_num_key_heads=8, linear_key_head_dim=8,
    linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=48, decoder_sparse_step=1,
    max_position_embeddings=512, mtp_num_hidden_layers=1, full_attention_interval=4)


@pytest.mark.parametrize(("src_tp", "dst_tp"),
                         [(1, 4), (4, 1), (2, 8), (8, 2), (4, 8), (8, 4), (4, 4)])
def test_state_resharding_with_replicated_kv_heads(src_tp: int, dst_tp: int) -> None:
    """TP above the 2 KV heads: a KV head is held by several prefill ranks whose state shards
    differ; the hybrid pull plan (`pull_plan(..., states=True)`, what the puller uses) names
    the replicas each decode rank's state share needs, and the installed state is exact."""
    _check_state_resharding(ModelConfig.from_dict(_REPLICATED_NEXT), src_tp, dst_tp)


def _shard_all(cfg: ModelConfig, tp: int) -> list[dict[str, torch.Tensor]]:
    whole = StateCache(cfg, 2, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for i in whole.layers:
        whole.conv[i].copy_(torch.randn(whole.conv[i].shape, generator=g))
        whole.recurrent[i].copy_(torch.randn(whole.recurrent[i].shape, generator=g))
    return [_shard(whole, 1, tp, r) for r in range(tp)]


def _check_state_resharding(cfg: ModelConfig, src_tp: int, dst_tp: int) -> StateCache:
    from mtpserve.workers.kv_transfer.resharding import pull_plan

    whole = StateCache(cfg, 2, torch.float32, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    for i in whole.layers:
        whole.conv[i].copy_(torch.randn(whole.conv[i].shape, generator=g))
        whole.recurrent[i].copy_(torch.randn(whole.recurrent[i].shape, generator=g))
    src = [_shard(whole, 1, src_tp, r) for r in range(src_tp)]
    for rank in range(dst_tp):
        plan = pull_plan(cfg.num_cache_heads, src_tp, dst_tp, rank, states=True)
        dst = StateCache(cfg, 2, torch.float32, torch.device("cpu"))
        for i in dst.layers:  # the decode rank's slot holds only its own shard
            dst.conv[i] = dst.conv[i][:, : dst.conv[i].shape[1] // dst_tp].contiguous()
            dst.recurrent[i] = dst.recurrent[i][:, : cfg.linear.num_value_heads // dst_tp]
        install_states(dst, 0, [(s.src_rank, src[s.src_rank]) for s in plan], src_tp,
                       dst_tp, rank)
        want = _shard(whole, 1, dst_tp, rank)
        for i in dst.layers:
            assert torch.equal(dst.conv[i][0], want[f"state.conv.{i}"])
            assert torch.equal(dst.recurrent[i][0], want[f"state.rec.{i}"])
    return dst


# A killed decode replica: the orchestrator resumes its streams elsewhere -------------------------

class ActorDiedError(Exception):
    """Named like ray.exceptions.ActorDiedError (the orchestrator matches errors by name)."""



class RoundRobin:
    """What the orchestrator uses of a DeploymentHandle, over servers in this process (a dead
    one included: Serve keeps routing to a dead replica for a moment)."""

    def __init__(self, servers: list) -> None:
        self.servers, self.next = servers, 0

    def options(self, **_):
        return self

    def __getattr__(self, name: str):
        def remote(*args, **kwargs):
            server = self.servers[self.next % len(self.servers)]
            self.next += 1
            out = getattr(server, name)(*args, **kwargs)
            return HandleStream(out) if hasattr(out, "__anext__") else asyncio.ensure_future(out)

        return type("Method", (), {"remote": staticmethod(remote)})


class Dying:
    """A real decode server whose streams die after `after` chunks, after which it stays dead
    (a killed actor); its side of each stream is closed, which aborts the request there."""

    def __init__(self, server, after: int) -> None:
        self.server, self.after, self.dead = server, after, False

    async def generate(self, req, params=None, **kw):
        if self.dead:
            raise ActorDiedError("The actor died unexpectedly before finishing this task.")
        inner = self.server.generate(req, params, **kw)
        try:
            sent = 0
            async for chunk in inner:
                if sent >= self.after:
                    self.dead = True
                    raise ActorDiedError("The actor died unexpectedly before finishing this "
                                         "task.")
                sent += 1
                yield chunk
        finally:
            await inner.aclose()


def test_killed_decode_replica_migrates_token_exact(ckpt, prompts) -> None:
    """Decode replica A dies mid-stream; the orchestrator resumes each stream on B from prompt
    + tokens sent (B prefills it: a fresh state from position 0): the client's tokens ==
    offline, and every state slot and block is free on A, B and the prefill."""
    from mtpserve.router.orchestrator import DisaggOrchestrator, OrchestratorConfig
    from mtpserve.workers.replica.decode_server import DecodeServer

    want = run_to_completion(make_engine(ckpt, 2, num_kv_blocks=96, block_size=4,
                                         max_num_batched_tokens=40), prompts, greedy(12))
    p, a = make_servers(ckpt)
    b = DecodeServer.func_or_class(a.cfg)
    dying = Dying(a, after=1)
    try:
        orch = DisaggOrchestrator(RoundRobin([p]), RoundRobin([dying, b]), OrchestratorConfig(
            retry_backoff_s=0.01, stall_timeout_s=20.0))

        async def collect(i: int, x: list[int]) -> list[int]:
            out = []
            async for chunk in orch.generate(GenerateRequest(f"m{i}", x, greedy(12))):
                assert chunk.error is None, chunk.error
                out += chunk.token_ids
            return out

        async def main():
            return await asyncio.gather(*(collect(i, x) for i, x in enumerate(prompts)))

        assert asyncio.run(main()) == want
        assert dying.dead and orch.num_migrations >= 1
        for server in (p, a, b):
            end = time.monotonic() + 5
            while (s := server.engine.engine.stats())["state_slots_used"] or s["used_blocks"]:
                assert time.monotonic() < end, s
                time.sleep(0.01)
    finally:
        shutdown(p, a, b)


def test_prefill_holds_beyond_its_state_slots_wait_for_a_release(ckpt, prompts) -> None:
    """A prefill engine's held requests keep their state slots until released, outside the
    scheduler's max_num_seqs: with every slot held, the next prompt waits (as for KV blocks)
    and is prefilled once a hold is released."""
    eng = make_engine(ckpt, 2, num_kv_blocks=96, block_size=4, role="prefill", max_num_seqs=2)
    for i, x in enumerate(prompts):
        eng.add_request(f"h{i}", x, greedy(4))
    for _ in range(20):
        eng.step()
    assert sorted(eng.prefilled) == ["h0", "h1"]  # the third waits for a slot
    assert eng.stats()["state_slots_used"] == 2 and eng.has_unfinished()
    assert eng.release_prefilled("h0")
    while eng.has_unfinished():
        eng.step()
    assert sorted(eng.prefilled) == ["h1", "h2"]
    for rid in ("h1", "h2"):
        assert eng.release_prefilled(rid)
    assert eng.stats()["state_slots_used"] == 0 and eng.stats()["used_blocks"] == 0
    eng.block_manager.check_integrity([])


def test_a_runner_with_fewer_state_slots_than_max_num_seqs_is_refused(ckpt) -> None:
    from mtpserve.workers.engine import Engine, EngineConfig, EngineError
    from mtpserve.workers.model_runner import ModelRunner

    runner = ModelRunner(ckpt, num_blocks=32, block_size=4, num_state_slots=2)
    with pytest.raises(EngineError, match="2 state slots, max_num_seqs is 4"):
        Engine(EngineConfig(model=str(ckpt), num_kv_blocks=32, block_size=4, max_num_seqs=4),
               runner=runner)
