"""Live decode autoscaling on a local Ray cluster: with a tight TPOT target, load takes the
decode deployment from 1 to 2 replicas, idleness brings it back to 1, and every request's
output equals the offline engine's (greedy, adaptive k on)."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from serve_cluster import local_serve

pytestmark = [pytest.mark.ray, pytest.mark.slow]

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MAX_TOKENS = 32
CONCURRENCY = 6


def decode_replicas() -> int:
    app = serve.status().applications["mtpserve"]
    states = app.deployments["DecodeServer"].replica_states
    return int(states.get("RUNNING", 0))


def wait_for(pred, deadline_s: float, what: str) -> float:
    t0 = time.monotonic()
    while not pred():
        assert time.monotonic() - t0 < deadline_s, f"timed out waiting for {what}"
        time.sleep(0.5)
    return time.monotonic() - t0


def test_decode_scales_out_under_load_and_back_when_idle(default_model) -> None:
    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(CONCURRENCY, num_chars=200)
    llm = LLM(str(default_model), num_speculative_tokens=2)
    want = [r.text for r in llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS,
                                                                  temperature=0))]
    del llm
    with local_serve() as base:
        cfg = ClusterConfig(
            model=str(default_model),
            prefill={"cpus_per_rank": 0.5, "num_kv_blocks": 256},
            decode={"cpus_per_rank": 0.5, "num_kv_blocks": 256, "autoscaling": {
                "min_replicas": 1, "max_replicas": 2, "target_tpot_ms": 1.0,
                "upscale_delay_s": 0.5, "downscale_delay_s": 3.0, "window_s": 4.0,
                "metrics_interval_s": 0.5}},
            speculation={"num_speculative_tokens": 2, "adaptive": True},
            kv_transfer={"timeout_s": 30, "hold_ttl_s": 30},
        )
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        assert decode_replicas() == 1
        stop, results, errors = threading.Event(), [], []

        def client(i: int) -> None:
            with httpx.Client(base_url=base, timeout=120) as c:
                while not stop.is_set():
                    r = c.post("/v1/completions", json={
                        "prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0})
                    if r.status_code != 200:
                        errors.append(r.text)
                        return
                    results.append((i, r.json()["choices"][0]["text"]))

        threads = [threading.Thread(target=client, args=(i,)) for i in range(CONCURRENCY)]
        for t in threads:
            t.start()
        try:
            up_s = wait_for(lambda: decode_replicas() == 2, 120, "scale-up to 2")
            n_before = len(results)
            wait_for(lambda: len(results) >= n_before + 2 * CONCURRENCY, 120,
                     "requests served by two replicas")
            metrics = httpx.get(f"{base}/metrics", timeout=30).text
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=180)
        down_s = wait_for(lambda: decode_replicas() == 1, 120, "scale-down to 1")
        assert not errors, errors[:3]
        bad = [(i, text) for i, text in results if text != want[i]]
        assert not bad, f"{len(bad)} of {len(results)} outputs differ from offline: {bad[:2]}"
        assert "vllm:spec_decode_num_draft_tokens_total" in metrics
        # The decode policy (in the Serve controller) published its decision to /metrics.
        from prometheus_client.parser import text_string_to_metric_families

        desired = [s.value for f in text_string_to_metric_families(metrics) for s in f.samples
                   if s.name == "mtpserve:autoscaling_desired_replicas"
                   and s.labels.get("deployment") == "DecodeServer"]
        assert desired == [2.0]
        print(f"scale-up after {up_s:.1f}s, scale-down after {down_s:.1f}s idle, "
              f"{len(results)} requests")

