"""Three Ray nodes on one machine (`ray.cluster_utils.Cluster`): a head with Serve's proxy and
the ingress, a prefill node and a decode node, placed by custom resources (the chart's role
pinning). The prefill and decode replicas land on different nodes, KV crosses between their
raylets over gloo, and the output is the single-process engine's."""

from __future__ import annotations

import httpx
import pytest
from serve_cluster import free_port

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


def test_prefill_and_decode_on_different_nodes_equal_offline(default_model) -> None:
    from ray.cluster_utils import Cluster

    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(2, num_chars=200)
    want = [r.text for r in LLM(str(default_model), num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0))]
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1, resources={"mtpserve-prefill": 1})
    cluster.add_node(num_cpus=1, resources={"mtpserve-decode": 1})
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ClusterConfig(
            model=str(default_model),
            prefill={"cpus_per_rank": 0.5, "num_kv_blocks": 128,
                     "resources": {"mtpserve-prefill": 1}},
            decode={"cpus_per_rank": 0.5, "num_kv_blocks": 128,
                    "resources": {"mtpserve-decode": 1}},
            speculation={"num_speculative_tokens": 2, "adaptive": False},
            kv_transfer={"timeout_s": 30, "hold_ttl_s": 30},
            auth={"admin_api_key": "admin-sekret"},
        )
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        got = []
        for p in prompts:
            r = httpx.post(f"{base}/v1/completions", json={"prompt": p, "max_tokens": 16,
                                                           "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
        s = httpx.get(f"{base}/v1/mtpserve/stats",
                      headers={"Authorization": "Bearer admin-sekret"}, timeout=30).json()
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert "mtpserve-prefill" in nodes[s["prefill"]["node_id"]]
        assert "mtpserve-decode" in nodes[s["decode"]["node_id"]]
        assert s["prefill"]["node_id"] != s["decode"]["node_id"]
        assert s["decode"]["kv_receiver"]["pulls"] >= len(prompts)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def test_decode_node_removed_mid_stream_streams_migrate(default_model) -> None:
    """Two decode replicas on two nodes; one node goes away while 4 streams run: every stream
    completes, token for token the offline engine's, the lost ones resumed on the other node."""
    import concurrent.futures

    from ray.cluster_utils import Cluster

    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(4, num_chars=200)
    max_tokens = 320  # long enough that every stream is still running when the node goes
    want = [r.text for r in LLM(str(default_model), num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))]
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "resources": {"mtpserve-ingress": 1}})
    cluster.add_node(num_cpus=1, resources={"mtpserve-prefill": 1, "mtpserve-decode": 1})
    doomed = cluster.add_node(num_cpus=1, resources={"mtpserve-decode": 1})
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        port = free_port()
        # The proxy and the ingress stay on the head: only a decode node goes away.
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": port})
        cfg = ClusterConfig(
            model=str(default_model), ingress={"resources": {"mtpserve-ingress": 1}},
            prefill={"cpus_per_rank": 0.25, "num_kv_blocks": 128,
                     "resources": {"mtpserve-prefill": 1}},
            decode={"replicas": 2, "cpus_per_rank": 0.25, "num_kv_blocks": 256,
                    "resources": {"mtpserve-decode": 1}},
            speculation={"num_speculative_tokens": 2, "adaptive": False},
            kv_transfer={"timeout_s": 30, "hold_ttl_s": 30},
            migration={"stall_timeout_s": 20},
            auth={"admin_api_key": "admin-sekret"},
        )
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        started = concurrent.futures.ThreadPoolExecutor(4)
        first_chunks: set[int] = set()

        def stream(i: int, p: str) -> str:
            import json

            text = ""
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        assert "error" not in data, data
                        text += data["choices"][0]["text"]
                        first_chunks.add(i)
            return text

        futures = [started.submit(stream, i, p) for i, p in enumerate(prompts)]
        while len(first_chunks) < len(prompts):  # every stream is under way
            assert not any(f.done() for f in futures), [f.result() for f in futures]
        cluster.remove_node(doomed, allow_graceful=False)  # a node lost, not drained
        got = [f.result(timeout=300) for f in futures]
        assert got == want
        s = httpx.get(f"{base}/v1/mtpserve/stats",
                      headers={"Authorization": "Bearer admin-sekret"}, timeout=60).json()
        assert s["orchestrator"]["num_migrations"] >= 1
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()
