"""Three Ray nodes on one machine (`ray.cluster_utils.Cluster`): a head with Serve's proxy and
the ingress, a prefill node and a decode node, placed by custom resources (the chart's role
pinning). The app starts the way a user starts it: `serve run CONFIG --address ...` in its own
process, CONFIG being configs/local-cpu.yaml with the roles pinned. The prefill and decode
replicas land on different nodes, KV crosses between their raylets over gloo, and the output is
the single-process engine's."""

from __future__ import annotations

import contextlib
import functools
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from serve_cluster import APP, free_port

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

START_TIMEOUT_S = 300.0  # two engines loading on 2 shared cores, three raylets


@contextlib.contextmanager
def ray_nodes(head: dict[str, float], nodes: list[dict[str, float]]) -> Iterator[tuple]:
    """A head node and one-CPU worker nodes offering `nodes`' custom resources, on this
    machine; this process attached as a driver; yields (cluster, worker nodes); always
    stopped (Serve first)."""
    from ray.cluster_utils import Cluster

    if ray.is_initialized():  # an earlier module's in-process replica auto-started Ray
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": head})
    added = [cluster.add_node(num_cpus=1, resources=r) for r in nodes]
    try:
        ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
        yield cluster, added
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            cluster.shutdown()


def pinned_config(model, cpus: float, port: int, decode_replicas: int = 1, **extra) -> dict:
    """configs/local-cpu.yaml with the prefill and decode replicas pinned to the nodes offering
    their role's resource, Serve's proxy on the head only, on 127.0.0.1:`port`."""
    from mtpserve.benchmarks.local_server import variant_config
    from mtpserve.workers.paths import config_path

    over = {"model": str(model),
            "prefill": {"cpus_per_rank": cpus, "num_kv_blocks": 128,
                        "resources": {"mtpserve-prefill": 1}},
            "decode": {"replicas": decode_replicas, "cpus_per_rank": cpus,
                       "num_kv_blocks": 256, "resources": {"mtpserve-decode": 1},
                       # Every prompt crosses the nodes: no prefill on an idle decode replica.
                       "max_local_prefill_length": 0},
            "speculation": {"num_speculative_tokens": 2, "adaptive": False},
            "kv_transfer": {"timeout_s": 30, "hold_ttl_s": 30},
            "auth": {"admin_api_key": "admin-sekret"}, **extra}
    cfg = variant_config(config_path("local-cpu.yaml"), over, port)
    assert cfg["proxy_location"] == "HeadOnly"  # the proxy (and the URL) stay on the head
    return cfg


@contextlib.contextmanager
def serve_run(cfg: dict, address: str, workdir: Path) -> Iterator[str]:
    """`serve run CONFIG --address ADDRESS`, as a user types it, until the application is
    RUNNING (its own output on failure); yields the base URL; stopped with Ctrl-C (SIGINT),
    which makes `serve run` shut Serve down, as it does for a user."""
    path = workdir / "serve-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = workdir / "serve-run.log"
    serve_cli = Path(sys.executable).with_name("serve")  # ray[serve]'s console script
    with open(log, "w") as out:
        proc = subprocess.Popen([str(serve_cli), "run", str(path), "--address", address],
                                stdout=out, stderr=subprocess.STDOUT, cwd=workdir)
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            app = serve.status().applications.get(APP)
            if app is not None and app.status == "RUNNING":
                break
            tail = "\n".join(log.read_text().splitlines()[-40:])
            assert proc.poll() is None, f"serve run exited with {proc.returncode}:\n{tail}"
            assert app is None or app.status != "DEPLOY_FAILED", f"{app.message}\n{tail}"
            assert time.monotonic() < deadline, f"not RUNNING after {START_TIMEOUT_S}s:\n{tail}"
            time.sleep(0.5)
        yield f"http://127.0.0.1:{cfg['http_options']['port']}"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def admin_stats(base: str, deadline_s: float = 60.0) -> dict:
    """/v1/mtpserve/stats as the admin. Right after a node is lost Serve may still route the
    call to a replica that was on it (a 500); it stops within seconds."""
    end = time.monotonic() + deadline_s
    while True:
        r = httpx.get(f"{base}/v1/mtpserve/stats",
                      headers={"Authorization": "Bearer admin-sekret"}, timeout=60)
        if r.status_code == 200:
            return r.json()
        assert time.monotonic() < end, f"stats still failing: {r.status_code} {r.text[:300]}"
        time.sleep(0.5)


def test_prefill_and_decode_on_different_nodes_equal_offline(default_model, tmp_path) -> None:
    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(2, num_chars=200)
    want = [r.text for r in LLM(str(default_model), num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=16, temperature=0))]
    # The proxy's port is picked once the nodes run: the cluster's own processes take
    # random ports while they start, and one picked before them can be taken meanwhile.
    with (ray_nodes({}, [{"mtpserve-prefill": 1}, {"mtpserve-decode": 1}]) as (cluster, _),
          serve_run(pinned_config(default_model, 0.5, free_port()), cluster.address,
                    tmp_path) as base):
        got = []
        for p in prompts:
            r = httpx.post(f"{base}/v1/completions", json={"prompt": p, "max_tokens": 16,
                                                           "temperature": 0}, timeout=120)
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["text"])
        assert got == want
        s = admin_stats(base)
        nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
        assert "mtpserve-prefill" in nodes[s["prefill"]["node_id"]]
        assert "mtpserve-decode" in nodes[s["decode"]["node_id"]]
        assert s["prefill"]["node_id"] != s["decode"]["node_id"]
        assert s["decode"]["kv_receiver"]["pulls"] >= len(prompts)


# Slow tier: a second three-node cluster. The default tier keeps cross-node KV (above) and
# streams migrating off a killed decode replica (test_reliability).
@pytest.mark.slow
def test_decode_node_removed_mid_stream_streams_migrate(default_model, tmp_path) -> None:
    """Two decode replicas on two nodes; one node goes away while 4 streams run: every stream
    completes, token for token the offline engine's, the lost ones resumed on the other node."""
    import concurrent.futures
    import json

    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(4, num_chars=200)
    max_tokens = 320  # long enough that every stream is still running when the node goes
    want = [r.text for r in LLM(str(default_model), num_speculative_tokens=2).generate(
        prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))]
    # The proxy and the ingress stay on the head: only a decode node goes away.
    nodes = [{"mtpserve-prefill": 1, "mtpserve-decode": 1}, {"mtpserve-decode": 1}]
    cfg = functools.partial(pinned_config, default_model, 0.25, decode_replicas=2,
                            ingress={"resources": {"mtpserve-ingress": 1}},
                            migration={"stall_timeout_s": 20})
    with (ray_nodes({"mtpserve-ingress": 1}, nodes) as (cluster, added),
          serve_run(cfg(free_port()), cluster.address, tmp_path) as base):
        started = concurrent.futures.ThreadPoolExecutor(4)
        tokens = [0] * len(prompts)

        def stream(i: int, p: str) -> str:
            text = ""
            body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                    "ignore_eos": True, "return_token_ids": True}
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        data = json.loads(line[6:])
                        assert "error" not in data, data
                        text += data["choices"][0]["text"]
                        tokens[i] += len(data["choices"][0]["token_ids"])
            return text

        futures = [started.submit(stream, i, p) for i, p in enumerate(prompts)]
        # Every stream is decoding: past the prefill's first token, its decode replica has
        # sent a token, so losing that replica is a migration (not a quiet retry of a call
        # that had not started).
        while min(tokens) < 2:
            assert not any(f.done() for f in futures), [f.result() for f in futures]
        cluster.remove_node(added[1], allow_graceful=False)  # a node lost, not drained
        got = [f.result(timeout=300) for f in futures]
        assert got == want
        assert admin_stats(base)["orchestrator"]["num_migrations"] >= 1
