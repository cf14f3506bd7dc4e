"""Three Ray nodes on one machine (`ray.cluster_utils.Cluster`): a head with Serve's proxy and
the ingress, a prefill node and a decode node, placed by custom resources (the chart's role
pinning). The prefill and decode replicas land on different nodes, KV crosses between their
raylets over gloo, and the output is the single-process engine's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import httpx
import pytest
from serve_cluster import free_port

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")


@contextlib.contextmanager
def ray_nodes(head: dict[str, float], nodes: list[dict[str, float]]) -> Iterator[tuple]:
    """A head node (Serve's proxy there only) and one-CPU worker nodes offering `nodes`' custom
    resources, on this machine; yields (cluster, worker nodes, base URL); always stopped."""
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": head})
    added = [cluster.add_node(num_cpus=1, resources=r) for r in nodes]
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly",
                    http_options={"host": "127.0.0.1", "port": port})
        yield cluster, added, f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def pinned_config(model, cpus: float, decode_replicas: int = 1, **extra):
    """Prefill and decode replicas pinned to the nodes offering their role's resource."""
    from mtpserve.cluster.config import ClusterConfig

    return ClusterConfig(
        model=str(model),
        prefill={"cpus_per_rank": cpus, "num_kv_blocks": 128,
                 "resources": {"mtpserve-prefill": 1}},
        decode={"replicas": decode_replicas, "cpus_per_rank": cpus, "num_kv_blocks": 256,
                "resources": {"mtpserve-decode": 1}},
        speculation={"num_speculative_tokens": 2, "adaptive": False},
        kv_transfer={"timeout_s": 30, "hold_ttl_s": 30},
        auth={"admin_api_key": "admin-sekret"}, **extra)


def test_prefill_and_decode_on_different_nodes_equal_offline(default_model) -> None:
    from mtpserve.cluster.app import build_app
    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(2, num_chars=200)
    want = [r.text for r in LLM(str(default_model), num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0))]
    with ray_nodes({}, [{"mtpserve-prefill": 1}, {"mtpserve-decode": 1}]) as (_, _, base):
        serve.run(build_app(pinned_config(default_model, 0.5)), name="mtpserve",
                  route_prefix="/")
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


def test_decode_node_removed_mid_stream_streams_migrate(default_model) -> None:
    """Two decode replicas on two nodes; one node goes away while 4 streams run: every stream
    completes, token for token the offline engine's, the lost ones resumed on the other node."""
    import concurrent.futures
    import json

    from mtpserve.cluster.app import build_app
    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(4, num_chars=200)
    max_tokens = 320  # long enough that every stream is still running when the node goes
    want = [r.text for r in LLM(str(default_model), num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))]
    # The proxy and the ingress stay on the head: only a decode node goes away.
    nodes = [{"mtpserve-prefill": 1, "mtpserve-decode": 1}, {"mtpserve-decode": 1}]
    with ray_nodes({"mtpserve-ingress": 1}, nodes) as (cluster, added, base):
        cfg = pinned_config(default_model, 0.25, decode_replicas=2,
                            ingress={"resources": {"mtpserve-ingress": 1}},
                            migration={"stall_timeout_s": 20})
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        started = concurrent.futures.ThreadPoolExecutor(4)
        first_chunks: set[int] = set()

        def stream(i: int, p: str) -> str:
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
        cluster.remove_node(added[1], allow_graceful=False)  # a node lost, not drained
        got = [f.result(timeout=300) for f in futures]
        assert got == want
        s = httpx.get(f"{base}/v1/mtpserve/stats",
                      headers={"Authorization": "Bearer admin-sekret"}, timeout=60).json()
        assert s["orchestrator"]["num_migrations"] >= 1
