"""The orchestrator's prefill release reaches the replica that holds the KV (a real local Ray
cluster, two prefill replicas, the custom request router).

Requests are prefilled concurrently (spread over both replicas), the client stops after the
first token (a stop string matched it), and the orchestrator releases the holds: every prefill
replica's KV blocks are back to zero well before the TTL, released (not expired at
hold_ttl_s=30), so each release landed on its holder and not on whichever replica Serve would
pick.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from serve_cluster import call_replica, replica_actors

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

APP = "mtpserve-release"
NUM_REQUESTS = 8
# A release frees the held blocks in well under a second on a quiet machine; the TTL would take
# 30 s. The bound sits between the two, far from both (2 shared cores stall for seconds), and
# the sender's counters below say which one freed them.
RELEASE_DEADLINE_S = 10.0


@pytest.fixture(scope="module")
def app(shared_serve, default_model):
    from mtpserve.cluster.app import build_app, with_kv_secret
    from mtpserve.cluster.config import ClusterConfig

    # The secret made here is the deployment's (build_app keeps it): the driver-side
    # orchestrator below signs its direct releases with it, as the ingress does.
    cfg = with_kv_secret(ClusterConfig(
        model=str(default_model),
        prefill={"replicas": 2, "cpus_per_rank": 0.5, "num_kv_blocks": 256},
        decode={"replicas": 1, "cpus_per_rank": 0.5, "num_kv_blocks": 256},
        speculation={"num_speculative_tokens": 2, "adaptive": False},
        kv_transfer={"timeout_s": 10, "hold_ttl_s": 30},  # a release, never the TTL
    ))
    shared_serve.url()
    serve.run(build_app(cfg), name=APP, route_prefix="/release")
    yield cfg
    serve.delete(APP)


def prefill_replicas() -> dict[str, object]:
    """Replica id -> actor handle of the live prefill replicas."""
    return replica_actors("PrefillServer", app=APP)


def replica_stats(actor) -> dict:
    """`stats` of one given replica (a handle would choose the replica itself)."""
    return call_replica(actor, "stats", app=APP)


def test_release_after_a_first_token_stop_reaches_the_holding_replica(app, default_model
                                                                       ) -> None:
    from mtpserve.router.orchestrator import DisaggOrchestrator, OrchestratorConfig
    from mtpserve.workers.messages import GenerateRequest
    from mtpserve.workers.sampling_params import SamplingParams
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.prompts import held_out_prompts

    cfg = app
    actors = prefill_replicas()
    assert len(actors) == 2
    tok = load_tokenizer(str(default_model))
    prompts = [list(tok.encode(p)) for p in held_out_prompts(NUM_REQUESTS, num_chars=200)]
    # The ingress's orchestrator, here in the driver: same handles, same request router.
    orch = DisaggOrchestrator(serve.get_deployment_handle("PrefillServer", APP),
                              serve.get_deployment_handle("DecodeServer", APP),
                              OrchestratorConfig(stall_timeout_s=60,
                                                 kv_secret=cfg.kv_transfer.secret))

    async def first_token(gen) -> None:
        chunk = await gen.__anext__()
        assert chunk.token_ids and not chunk.finished

    async def main() -> tuple[dict, float]:
        gens = [orch.generate(GenerateRequest(f"rel-{i}", p, SamplingParams(
                    max_tokens=32, temperature=0.0, ignore_eos=True)))
                for i, p in enumerate(prompts)]
        await asyncio.gather(*(first_token(g) for g in gens))
        # Every request's KV is held now, on both replicas (concurrent prefills spread).
        held = {tag: replica_stats(a)["used_blocks"] for tag, a in actors.items()}
        t0 = time.monotonic()
        for g in gens:  # the first token matched a stop string: the consumer stops reading
            await g.aclose()
        while True:
            used = {tag: replica_stats(a)["used_blocks"] for tag, a in actors.items()}
            if not any(used.values()):
                return held, time.monotonic() - t0
            assert time.monotonic() - t0 < RELEASE_DEADLINE_S, f"prefill KV still held: {used}"
            await asyncio.sleep(0.02)

    before = {tag: replica_stats(a)["kv_sender"] for tag, a in actors.items()}
    held, seconds = asyncio.run(main())
    assert all(n > 0 for n in held.values()), f"requests not spread over replicas: {held}"
    assert seconds < RELEASE_DEADLINE_S
    after = {tag: replica_stats(a)["kv_sender"] for tag, a in actors.items()}
    released = sum(after[t]["released"] - before[t]["released"] for t in actors)
    expired = sum(after[t]["expired"] - before[t]["expired"] for t in actors)
    assert (released, expired) == (NUM_REQUESTS, 0)
    print(f"held blocks {held}; all released in {seconds * 1000:.0f} ms")
