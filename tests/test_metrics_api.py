"""`GET /metrics` in Prometheus text format over the local orchestrator: parsed with
prometheus_client's parser, the counters move by exactly a known request's drafted and
accepted tokens, and the histograms by its samples."""

from __future__ import annotations

import asyncio
import time

import httpx

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.local_orchestrator import LocalOrchestrator
from mtpserve.router.metrics_api import local_source, parse_samples, render
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.replica.metrics import EngineRecorder
from mtpserve.workers.tokenizer import load_tokenizer

MODEL = "tiny"


def value(m: dict, name: str, **labels: str) -> float:
    return m[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def test_metrics_counters_move_by_a_known_request(default_model) -> None:
    eng = AsyncEngine(Engine(EngineConfig(model=str(default_model), num_speculative_tokens=3,
                                          num_kv_blocks=256)))
    try:
        recorder = EngineRecorder(eng, role="both")
        app = create_app(IngressState(
            orchestrator=LocalOrchestrator(eng), tokenizer=load_tokenizer(str(default_model)),
            model_name=MODEL, max_model_len=eng.engine.max_model_len))
        app.state.metrics_source = local_source(recorder)
        asyncio.run(_exercise(app))
    finally:
        eng.shutdown()


async def _exercise(app) -> None:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
        before = parse_samples((await c.get("/metrics")).text)
        r = await c.post("/v1/completions", json={
            "model": MODEL, "prompt": "def fibonacci(n):", "max_tokens": 40,
            "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        stats = r.json()["choices"][0]["mtp_stats"]
        resp = await c.get("/metrics")
        assert resp.headers["content-type"].startswith("text/plain")
        after = parse_samples(resp.text)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert stats["num_drafted"] > 0
    assert delta("vllm:spec_decode_num_draft_tokens_total") == stats["num_drafted"]
    assert delta("vllm:spec_decode_num_accepted_tokens_total") == stats["num_accepted"]
    per_pos = sum(delta("vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i))
                  for i in range(3))
    assert per_pos == stats["num_accepted"]
    # One draft per round that drafted (the last round may verify none: no room left).
    assert stats["num_rounds"] - 1 <= delta("vllm:spec_decode_num_drafts_total") \
        <= stats["num_rounds"]
    assert delta("vllm:generation_tokens_total") == 40
    # Histograms of real samples: one TTFT, one request TPOT, one ITL per later token.
    assert value(after, "vllm:time_to_first_token_seconds_count") == 1
    assert value(after, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(after, "vllm:inter_token_latency_seconds_count") == 39
    assert value(after, "vllm:time_to_first_token_seconds_bucket", le="+Inf") == 1
    assert value(after, "vllm:num_requests_running") == 0

    # A request that ends at its first token (gone from the engine when the hook runs) still
    # has its TTFT timed.
    async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
        r = await c.post("/v1/completions", json={"model": MODEL, "prompt": "import os",
                                                  "max_tokens": 1, "temperature": 0})
        assert r.status_code == 200, r.text
        again = parse_samples((await c.get("/metrics")).text)
    assert value(again, "vllm:time_to_first_token_seconds_count") == 2


def test_render_aggregates_replicas_and_keeps_departed_counters() -> None:
    def snap(rid: str, t: float, drafts: int) -> dict:
        return {"replica": rid, "role": "decode", "time": t,
                "counters": {"spec_decode_num_draft_tokens": drafts}, "per_pos": [drafts, 1],
                "hists": {}, "gauges": {"num_requests_running": 3, "kv_cache_usage_perc": 0.5,
                                        "num_speculative_tokens": 2}}

    text = render({"snapshots": [snap("a", 100.0, 10), snap("b", 50.0, 5)],
                   "policy": {"DecodeServer": {"desired_replicas": 2, "predicted_tpot_s": 0.01}}},
                  MODEL, now=100.0)
    m = parse_samples(text)
    assert value(m, "vllm:spec_decode_num_draft_tokens_total") == 15  # b went away: kept
    assert value(m, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 15
    assert value(m, "vllm:num_requests_running") == 3  # gauges: fresh replicas only
    assert value(m, "mtpserve:num_speculative_tokens", replica="a", role="decode") == 2
    assert value(m, "mtpserve:autoscaling_desired_replicas", deployment="DecodeServer") == 2


def test_compile_progress_gauges_per_replica() -> None:
    """Each decode replica's compile progress as gauges labelled with the replica; the ETA
    only where it is measured; the progress itself in the stats endpoint's replica rows."""
    from mtpserve.router.metrics_api import replica_caches

    def snap(rid: str, done: int, eta: float | None) -> dict:
        gauges = {"compile_buckets_total": 47, "compile_buckets_done": done}
        if eta is not None:
            gauges["compile_eta_seconds"] = eta
        return {"replica": rid, "role": "decode", "time": 100.0, "counters": {},
                "per_pos": [], "hists": {}, "gauges": gauges,
                "compile": {"total": 47, "done": done, "eta_s": eta}}

    data = {"snapshots": [snap("decode:a", 12, 370.0), snap("decode:b", 3, None)]}
    m = parse_samples(render(data, MODEL, now=100.0))
    for rid, done in (("decode:a", 12), ("decode:b", 3)):
        assert value(m, "mtpserve:compile_buckets_total", replica=rid, role="decode") == 47
        assert value(m, "mtpserve:compile_buckets_done", replica=rid, role="decode") == done
    assert value(m, "mtpserve:compile_eta_seconds", replica="decode:a", role="decode") == 370
    assert not any(name == "mtpserve:compile_eta_seconds" and ("replica", "decode:b") in labels
                   for name, labels in m)
    rows = replica_caches(data, now=100.0)
    assert [r["compile"]["done"] for r in rows] == [12, 3]


def test_orchestrator_counters_sum_over_ingress_replicas() -> None:
    from mtpserve.router.metrics_api import orchestrator_totals, render

    now = time.time()
    data = {"snapshots": [
        {"replica": "ingress:a", "role": "ingress", "time": now, "per_pos": [], "hists": {},
         "gauges": {}, "counters": {"num_migrations": 2, "num_kv_recomputes": 1}},
        {"replica": "ingress:b", "role": "ingress", "time": now - 100, "per_pos": [],
         "hists": {}, "gauges": {}, "counters": {"num_migrations": 3, "num_kv_recomputes": 0}},
    ]}
    # Replica a asks: its live counters (newer than its last push) plus b's last push.
    local = {"num_migrations": 4, "num_kv_recomputes": 1}
    assert orchestrator_totals(data, local, "ingress:a") == {"num_migrations": 7,
                                                             "num_kv_recomputes": 1}
    text = render(data, "m", now=now)
    assert 'mtpserve:migrations_total{model_name="m"} 5.0' in text  # a went away: kept
    assert 'mtpserve:kv_recomputes_total{model_name="m"} 1.0' in text
