"""The ingress scaled out under load (`slow`): 256 concurrent streams through Serve's proxy and
two ingress replicas into one prefill and one decode replica, on a local Ray cluster over real
HTTP. No stream may fail, every one must be the offline engine's greedy text, and a run without
faults must count no migration (a busy but live decode replica is not a failed one)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from serve_cluster import local_serve

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

STREAMS = 256
MAX_TOKENS = 8  # short outputs: the load is in the number of streams, not their length
ADMIN = {"Authorization": "Bearer admin-sekret"}


async def stream(client: httpx.AsyncClient, prompt: str) -> list[int]:
    """One stream's token ids (text would hide an EOS passed with ignore_eos: the API skips
    special tokens); raises on a non-200 answer, an error event, a short or unfinished
    stream."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    ids: list[int] = []
    tokens, done = None, False
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                data = json.loads(line[6:])
                if "error" in data:
                    raise RuntimeError(f"error event: {data['error']}")
                ids += data["choices"][0]["token_ids"] if data.get("choices") else []
                tokens = data["usage"]["completion_tokens"] if data.get("usage") else tokens
    if not done or tokens != MAX_TOKENS or len(ids) != MAX_TOKENS:
        raise RuntimeError(f"stream ended early: [DONE] {done}, {tokens} tokens, {ids}")
    return ids


def ingress_counters(t_end: float, deadline_s: float = 30.0) -> list[dict]:
    """Both ingress replicas' orchestrator counters from the metrics hub, once each replica
    has pushed them after `t_end` (they push every second), so none is missed."""
    from mtpserve.workers.replica.metrics import HUB_NAME, HUB_NAMESPACE

    hub = ray.get_actor(HUB_NAME, namespace=HUB_NAMESPACE)
    end = time.monotonic() + deadline_s
    while True:
        snaps = [s for s in ray.get(hub.collect.remote(), timeout=30)["snapshots"]
                 if s["role"] == "ingress"]
        if len(snaps) == 2 and all(s["time"] > t_end for s in snaps):
            return [s["counters"] for s in snaps]
        assert time.monotonic() < end, f"ingress counters not pushed after the run: {snaps}"
        time.sleep(0.2)


def test_256_streams_through_two_ingress_replicas_no_errors_no_migrations(default_model
                                                                          ) -> None:
    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(STREAMS, num_chars=256)
    want = [r.output_token_ids for r in LLM(str(default_model), num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))]
    cfg = ClusterConfig(
        model=str(default_model),
        prefill={"cpus_per_rank": 0.5, "num_kv_blocks": 512},
        decode={"cpus_per_rank": 1, "max_num_seqs": 32, "num_kv_blocks": 1024},
        ingress={"replicas": 2, "cpus": 0.25},
        speculation={"num_speculative_tokens": 2, "adaptive": False},
        # Serve queues requests for a busy prefill or decode deployment per caller (each
        # ingress replica); the default 64 would answer part of 128 streams per replica 429.
        limits={"max_queued_requests": STREAMS},
        auth={"admin_api_key": "admin-sekret"},
    )
    with local_serve(num_cpus=4) as base:
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        app = serve.status().applications["mtpserve"]
        assert app.deployments["OpenAIIngress"].replica_states.get("RUNNING") == 2

        async def run_all() -> list[list[int] | BaseException]:
            limits = httpx.Limits(max_connections=STREAMS + 8)
            async with httpx.AsyncClient(base_url=base, timeout=300, limits=limits) as client:
                return await asyncio.gather(*(stream(client, p) for p in prompts),
                                            return_exceptions=True)

        t0 = time.monotonic()
        got = asyncio.run(run_all())
        seconds, t_end = time.monotonic() - t0, time.time()
        errors = [f"{i}: {g!r}" for i, g in enumerate(got) if isinstance(g, BaseException)]
        assert not errors, f"{len(errors)} of {STREAMS} streams failed: {errors[:5]}"
        wrong = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
        assert not wrong, (f"{len(wrong)} streams differ from offline, e.g. "
                           f"{[(got[i], want[i]) for i in wrong[:3]]}")
        counters = ingress_counters(t_end)
        totals = {k: sum(c.get(k, 0) for c in counters) for k in counters[0]}
        assert totals["num_migrations"] == 0, totals
        # The user's view: the admin stats sum the same counters over both replicas.
        s = httpx.get(f"{base}/v1/mtpserve/stats", headers=ADMIN, timeout=60).json()
        assert s["orchestrator"]["num_migrations"] == 0, s["orchestrator"]
        print(f"{STREAMS} streams x {MAX_TOKENS} tokens in {seconds:.1f}s; ingress counters "
              f"{totals}")
