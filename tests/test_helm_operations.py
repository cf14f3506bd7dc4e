"""helm/mtpserve under real operations, rendered offline: incremental upgrades through KubeRay's
Gateway, node drains that hand replicas over (the worker preStop hook, run here against a fake
GCS), object store and /dev/shm sizing, the ingress deployment's size, per-cluster disruption
budgets, RayService annotations and the `helm test` pod (run here against a fake API).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from helm_render import (
    CASE_IDS,
    CASES,
    CHART,
    MULTI,
    NAMESPACE,
    RELEASE,
    load_values,
    pod_templates,
    rayservice,
    render,
    render_case,
    render_notes,
    serve_config,
)
from serve_config_checks import check_serve_config
from test_helm_production import _restricted_violations

from mtpserve.cluster.app import ingress_options

MI = 1 << 20
FULL = f"{RELEASE}-mtpserve"


def _groups(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rs["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"],
            **{g["groupName"]: g for g in cluster["workerGroupSpecs"]}}


def _bytes(q: str) -> int:
    num, unit = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", q).groups()
    return int(float(num) * {"": 1, "Mi": MI, "Gi": 1 << 30, "M": 10**6, "G": 10**9}[unit])


# ---------------------------------------------------------------------------- incremental upgrades


def test_incremental_upgrade_routes_through_kuberay_gateway() -> None:
    """KubeRay creates <fullname>-gateway in the release namespace and no serve Service in this
    mode: the NetworkPolicy admits that Gateway's pods (and not any source), no Ingress or
    HTTPRoute of the chart points anywhere, and `helm test` goes through the Gateway."""
    docs = render_case(MULTI)
    assert docs["ingress.yaml"] == [] and docs["httproute.yaml"] == []
    (np,) = docs["networkpolicy.yaml"]
    api = [r for r in np["spec"]["ingress"] if any(p["port"] == 8000 for p in r.get("ports", []))
           and r.get("from") and "podSelector" in r["from"][0]
           and "gateway.networking.k8s.io/gateway-name" in r["from"][0]["podSelector"].get(
               "matchLabels", {})]
    (rule,) = api
    # No namespaceSelector: the Gateway's pods run in the release namespace (GEP-1762).
    assert rule["from"] == [{"podSelector": {"matchLabels": {
        "gateway.networking.k8s.io/gateway-name": f"{FULL}-gateway"}}}]
    for r in np["spec"]["ingress"]:
        if any(p["port"] == 8000 for p in r.get("ports", [])):
            assert r.get("from"), "the API port must not be open to any source"
            assert "gateways" not in json.dumps(r)
    (test_pod,) = docs["test-api.yaml"]
    env = {e["name"]: e.get("value") for e in test_pod["spec"]["containers"][0]["env"]}
    assert env["MTPSERVE_URL"] == f"http://{FULL}-gateway-istio.{NAMESPACE}.svc:80"


def test_incremental_upgrade_clients_are_added_to_the_gateway() -> None:
    lb = [{"ipBlock": {"cidr": "35.191.0.0/16"}}]  # e.g. a cloud Gateway's proxies
    values = {**load_values(MULTI), "networkPolicy": {"clients": lb}}
    (np,) = render(values)["networkpolicy.yaml"]
    (rule,) = [r for r in np["spec"]["ingress"]
               if any("ipBlock" in f for f in r.get("from", []))]
    assert rule["from"][1:] == lb and "gateway-name" in json.dumps(rule["from"][0])


def test_notes_and_readme_say_no_gate_means_no_upgrades() -> None:
    notes = render_notes(load_values(MULTI))
    assert "WITHOUT THE OPERATOR'S RayServiceIncrementalUpgrade FEATURE GATE THIS STRATEGY " \
           "MEANS NO UPGRADES" in notes
    assert f"{FULL}-gateway" in notes
    assert "Reach the OpenAI-compatible API through the KubeRay-managed Service" not in notes
    default = render_notes()
    assert f"{FULL}-serve-svc" in default and "FEATURE GATE" not in default
    readme = " ".join((CHART / "README.md").read_text().split())
    assert "without the gate the strategy means no upgrades at all" in readme


# ---------------------------------------------------------------------------- drains


def _prestop(pod: dict[str, Any]) -> str:
    command = pod["spec"]["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert command[:2] == ["/bin/sh", "-c"]
    return command[2]


def _drain_python(script: str) -> tuple[str, int]:
    """The Python here-document of the preStop hook and the deadline it is given."""
    m = re.search(r"python - (\d+) <<'PY' \|\| true\n(.*)\nPY\n", script, re.S)
    assert m, script
    return m.group(2), int(m.group(1))


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_workers_drain_before_ray_stops(values_file: Path | None) -> None:
    """The worker preStop drains the node with a deadline, then stops Ray; the grace period
    covers the hook (deadline, `ray stop`, slack) and the deadline covers
    Serve's graceful shutdown of the replicas. The head (no replicas) has no hook."""
    rs = rayservice(render_case(values_file))
    cc = check_serve_config(serve_config(rs))
    pods = pod_templates(rs)
    assert "lifecycle" not in pods["head"]["spec"]["containers"][0]
    for role in ("prefill", "decode"):
        script = _prestop(pods[role])
        body, deadline = _drain_python(script)
        assert "DRAIN_NODE_REASON_PREEMPTION" in body and "drain_node(" in body
        # The drain part is killed 5 s after its deadline at the latest.
        assert script.startswith(f"timeout -k 2 {deadline + 3} python - {deadline} ")
        assert script.rstrip().endswith("ray stop -g 15")
        assert script.index("drain_node(") < script.index("ray stop")
        assert deadline >= cc.graceful_shutdown_timeout_s
        grace = pods[role]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= (deadline + 5) + 15 + 5, role  # killed drain, ray stop -g 15, slack
        compile(body, f"{role}-preStop", "exec")
        env = {e["name"] for e in pods[role]["spec"]["containers"][0]["env"]}
        assert "MTPSERVE_POD_IP" in env


def test_drain_deadline_values() -> None:
    pods = pod_templates(rayservice(render({"drain": {"deadlineSeconds": 300}})))
    assert _drain_python(_prestop(pods["decode"]))[1] == 300
    assert pods["decode"]["spec"]["terminationGracePeriodSeconds"] == 300 + 15 + 10
    # A fixed grace period: the drain gets what it leaves after `ray stop`.
    pods = pod_templates(rayservice(render({"terminationGracePeriodSeconds": 400})))
    assert _drain_python(_prestop(pods["prefill"]))[1] == 400 - 15 - 10
    assert pods["prefill"]["spec"]["terminationGracePeriodSeconds"] == 400


def test_drain_script_uses_ray_apis_that_exist() -> None:
    """The hook calls what `ray drain-node` calls (Ray 2.60): fail here if Ray renames it."""
    import ray  # noqa: F401  (loads _raylet)
    from ray._raylet import InnerGcsClient
    from ray.core.generated import autoscaler_pb2, gcs_pb2

    assert callable(InnerGcsClient.get_all_node_info) and callable(InnerGcsClient.drain_node)
    assert autoscaler_pb2.DrainNodeReason.DRAIN_NODE_REASON_PREEMPTION == 2
    assert gcs_pb2.GcsNodeInfo.ALIVE == 0
    fields = {f.name for f in gcs_pb2.GcsNodeInfo.DESCRIPTOR.fields}
    assert {"node_id", "state", "instance_id", "node_manager_address"} <= fields
    scripts = Path(ray.__file__).parent / "scripts" / "scripts.py"
    assert "gcs_client.drain_node(" in scripts.read_text()


FAKE_RAY = {
    "ray/__init__.py": "",
    "ray/core/__init__.py": "",
    "ray/core/generated/__init__.py": "",
    "ray/core/generated/autoscaler_pb2.py": """
        class DrainNodeReason:
            DRAIN_NODE_REASON_PREEMPTION = 2
    """,
    "ray/core/generated/gcs_pb2.py": """
        class GcsNodeInfo:
            ALIVE, DEAD = 0, 1
    """,
    "ray/_raylet.py": """
        import json, os, time

        LOG = os.environ["FAKE_GCS_LOG"]
        MODE = os.environ["FAKE_GCS_MODE"]

        def log(**kw):
            with open(LOG, "a") as f:
                f.write(json.dumps(kw) + "\\n")

        class _Node:
            def __init__(self, hex_id, instance, ip, state=0):
                self.node_id = bytes.fromhex(hex_id)
                self.instance_id, self.node_manager_address, self.state = instance, ip, state

        class GcsClient:
            drained = False

            def __init__(self, address):
                log(call="connect", address=address)
                if MODE == "unreachable":
                    raise ConnectionError("GCS unreachable")

            def get_all_node_info(self, timeout=None):
                nodes = [_Node("aa" * 28, "other-pod", "10.0.0.9")]
                if MODE != "gone" and not GcsClient.drained:
                    nodes.append(_Node("bb" * 28, "demo-decode-x1", "10.0.0.5"))
                return {i: n for i, n in enumerate(nodes)}

            def drain_node(self, node_id, reason, message, deadline_ms, timeout=None):
                log(call="drain", node_id=node_id, reason=reason, message=message,
                    deadline_in_s=round(deadline_ms / 1000 - time.time()))
                GcsClient.drained = True  # the raylet exits once idle
                return True, ""
    """,
}


def _run_drain(tmp_path: Path, mode: str) -> tuple[list[dict[str, Any]], str]:
    for name, text in FAKE_RAY.items():
        path = tmp_path / "fake" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    body, _ = _drain_python(_prestop(pod_templates(rayservice(render_case(None)))["decode"]))
    log = tmp_path / "gcs.log"
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "FAKE_GCS_LOG": str(log),
           "FAKE_GCS_MODE": mode, "RAY_ADDRESS": "head-svc:6379",
           "RAY_CLOUD_INSTANCE_ID": "demo-decode-x1", "MTPSERVE_POD_IP": "10.0.0.5"}
    out = subprocess.run([sys.executable, "-", "30"], input=body, env=env, text=True,
                         capture_output=True, timeout=60, check=True)
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return calls, out.stdout + out.stderr


def test_drain_script_drains_its_own_node_then_returns(tmp_path: Path) -> None:
    """Against a fake GCS: the hook finds its node by the pod name (RAY_CLOUD_INSTANCE_ID),
    drains it (PREEMPTION, the deadline it was given) and returns once the node is gone."""
    calls, out = _run_drain(tmp_path, "drains")
    assert calls[0] == {"call": "connect", "address": "head-svc:6379"}
    (drain,) = [c for c in calls if c["call"] == "drain"]
    assert drain["node_id"] == "bb" * 28 and drain["reason"] == 2
    assert drain["deadline_in_s"] == 30 and "demo-decode-x1" in drain["message"]


@pytest.mark.parametrize("mode", ["gone", "unreachable"])
def test_drain_script_never_blocks_shutdown(tmp_path: Path, mode: str) -> None:
    """No live node on this pod (the autoscaler drained it already) or no GCS (the cluster is
    being deleted): the hook drains nothing and returns at once, so `ray stop` runs."""
    calls, _ = _run_drain(tmp_path, mode)
    assert not [c for c in calls if c["call"] == "drain"]


def test_readme_describes_a_stream_during_kubectl_drain() -> None:
    readme = " ".join((CHART / "README.md").read_text().split())
    section = readme[readme.index("What `kubectl drain` does to a running stream"):]
    for fact in ("ray stop", "PENDING_MIGRATION", "graceful_shutdown_timeout_s",
                 "resumes on another decode replica", "max_migrations", "[DONE]"):
        assert fact in section, fact


# ---------------------------------------------------------------------------- sizing


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_object_store_fits_dev_shm(values_file: Path | None) -> None:
    """Every group sets object-store-memory, and /dev/shm holds it plus the headroom, so Ray
    never finds /dev/shm smaller than its store (it would refuse to start or use the disk)."""
    values = load_values(values_file) or {}
    headroom = _bytes(values.get("sharedMemory", {}).get("headroom", "2Gi"))
    rs = rayservice(render_case(values_file))
    for role, group in _groups(rs).items():
        store = int(group["rayStartParams"]["object-store-memory"])
        pod = group["template"]["spec"]
        (shm,) = [v for v in pod["volumes"] if v["name"] == "dshm"]
        size = _bytes(shm["emptyDir"]["sizeLimit"])
        assert store % MI == 0 and store >= 100 * MI, role
        assert store + headroom <= size < store + headroom + MI, role
        limit = _bytes(pod["containers"][0]["resources"]["limits"]["memory"])
        assert store <= 0.2 * limit, role


def test_object_store_follows_memory_and_explicit_sizes() -> None:
    rs = rayservice(render())
    groups = _groups(rs)
    assert int(groups["decode"]["rayStartParams"]["object-store-memory"]) == (
        int(64 * 1024 * 0.2)) * MI
    # A fixed /dev/shm caps the store at it minus the headroom.
    capped = _groups(rayservice(render({"sharedMemory": {"sizeLimit": "8Gi"}})))
    assert int(capped["decode"]["rayStartParams"]["object-store-memory"]) == 6 * 1024 * MI
    assert [v for v in capped["decode"]["template"]["spec"]["volumes"]
            if v["name"] == "dshm"][0]["emptyDir"]["sizeLimit"] == "8192Mi"
    # The group's own object-store-memory wins; /dev/shm follows it.
    own = _groups(rayservice(render({"workers": {"prefill": {"rayStartParams": {
        "object-store-memory": str(3 << 30)}}}})))
    assert own["prefill"]["rayStartParams"]["object-store-memory"] == str(3 << 30)
    assert [v for v in own["prefill"]["template"]["spec"]["volumes"]
            if v["name"] == "dshm"][0]["emptyDir"]["sizeLimit"] == "5120Mi"


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_ingress_is_sized_from_args(values_file: Path | None) -> None:
    """serve.args.ingress reaches the builder, which sizes OpenAIIngress (fixed replicas or
    autoscaling); the chart adds no ingress override of its own."""
    values = load_values(values_file) or {}
    rs = rayservice(render_case(values_file))
    cfg = serve_config(rs)
    cc = check_serve_config(cfg)
    want = {**{"replicas": 2, "cpus": 1}, **values.get("serve", {}).get("args", {}).get(
        "ingress", {})}
    assert cc.ingress.replicas == want["replicas"] and cc.ingress.cpus == want["cpus"]
    opts = ingress_options(cc)
    if cc.ingress.autoscaling is None:
        assert opts["num_replicas"] == cc.ingress.replicas
    else:
        assert opts["autoscaling_config"]["min_replicas"] >= 2
    assert opts["ray_actor_options"] == {"num_cpus": cc.ingress.cpus}
    assert not [d for d in cfg["applications"][0].get("deployments", [])
                if d["name"] == "OpenAIIngress" and ("num_replicas" in d
                                                     or "autoscaling_config" in d)]


# ---------------------------------------------------------------------------- knobs


def _spec_label(values: dict[str, Any] | None) -> str:
    rs = rayservice(render(values))
    labels = {p["metadata"]["labels"]["mtpserve.io/cluster-spec"]
              for p in pod_templates(rs).values()}
    (label,) = labels
    return label


def test_cluster_spec_label_follows_kuberays_new_cluster_decision() -> None:
    """The label (and so the PDBs) changes exactly when KubeRay builds a new RayCluster: not
    for replica counts, bounds or tolerations (muted in KubeRay's hash), nor for Serve-only
    changes; yes for the image or anything else in the pods."""
    base = _spec_label(None)
    same = [{"workers": {"decode": {"replicas": 3, "maxReplicas": 5},
                         "prefill": {"minReplicas": 2}}},
            {"workers": {"prefill": {"tolerations": []}}},
            {"serve": {"args": {"speculation": {"num_speculative_tokens": 3}}}}]
    for values in same:
        assert _spec_label(values) == base, values
    for values in ({"image": {"tag": "0.1.1"}}, {"workers": {"decode": {"env": [
            {"name": "X", "value": "1"}]}}}, {"network": {"ncclDebug": "INFO"}}):
        assert _spec_label(values) != base, values
    docs = render()
    for pdb in docs["poddisruptionbudget.yaml"]:
        assert pdb["spec"]["selector"]["matchLabels"]["mtpserve.io/cluster-spec"] == base


def test_rayservice_annotations_and_labels() -> None:
    rs = rayservice(render({"rayService": {
        "annotations": {"ray.io/initializing-timeout": "30m"}, "labels": {"team": "llm"}}}))
    assert rs["metadata"]["annotations"] == {"ray.io/initializing-timeout": "30m"}
    assert rs["metadata"]["labels"]["team"] == "llm"
    assert "annotations" not in rayservice(render_case(None))["metadata"]
    rayservice(render({"rayService": {"annotations": {"ray.io/initializing-timeout": "900"}}}))


def test_gcs_fault_tolerance_keys_each_cluster_by_its_uid() -> None:
    rs = rayservice(render({"gcsFaultTolerance": {"enabled": True, "redisAddress": "r:6379"}}))
    assert "externalStorageNamespace" not in rs["spec"]["rayClusterConfig"][
        "gcsFaultToleranceOptions"]


# ---------------------------------------------------------------------------- helm test


def test_helm_test_pod() -> None:
    docs = render_case(None)
    (pod,) = docs["test-api.yaml"]
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert pod["spec"]["automountServiceAccountToken"] is False
    assert _restricted_violations(pod) == []
    (c,) = pod["spec"]["containers"]
    env = {e["name"]: e for e in c["env"]}
    assert env["MTPSERVE_URL"]["value"] == f"http://{FULL}-serve-svc.{NAMESPACE}.svc:8000"
    # The key from the very Secret the app reads.
    app_env = {e["name"]: e for e in pod_templates(rayservice(docs))["decode"]["spec"][
        "containers"][0]["env"]}
    assert env["MTPSERVE_API_KEY"]["valueFrom"] == app_env["MTPSERVE_API_KEY"]["valueFrom"]
    # Admitted by the NetworkPolicy, but not one of the Ray pods it fences (no chart name).
    (np,) = docs["networkpolicy.yaml"]
    release = np["spec"]["podSelector"]["matchLabels"]
    assert not release.items() <= pod["metadata"]["labels"].items()
    peers = [f for r in np["spec"]["ingress"] for f in r.get("from", [])
             if any(p["port"] == 8000 for p in r.get("ports", []))]
    assert {"podSelector": {"matchLabels": {
        k: pod["metadata"]["labels"][k] for k in ("app.kubernetes.io/instance",
                                                  "app.kubernetes.io/component")}}} in peers
    assert render({"helmTest": {"enabled": False}})["test-api.yaml"] == []
    no_key = render({"auth": {"enabled": False}})["test-api.yaml"][0]
    assert "MTPSERVE_API_KEY" not in {e["name"] for e in no_key["spec"]["containers"][0]["env"]}


class _FakeAPI(BaseHTTPRequestHandler):
    seen: list[tuple[str, str, Any]] = []

    def _reply(self, body: dict[str, Any], code: int = 200) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802
        self.seen.append(("GET", self.path, self.headers.get("Authorization")))
        if self.headers.get("Authorization") != "Bearer sk-test":
            return self._reply({"error": "unauthorized"}, 401)
        self._reply({"data": [{"id": "code-mtp"}]})

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append(("POST", self.path, body))
        self._reply({"choices": [{"text": "\n    return a + b"}]})

    def log_message(self, *args: Any) -> None:
        pass


def test_helm_test_script_calls_models_then_a_completion() -> None:
    (pod,) = render({"auth": {"apiKey": "sk-test"}})["test-api.yaml"]
    (c,) = pod["spec"]["containers"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeAPI)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {**os.environ, "MTPSERVE_URL": f"http://127.0.0.1:{server.server_port}",
               "MTPSERVE_API_KEY": "sk-test", "MTPSERVE_TEST_TIMEOUT_S": "5",
               "MTPSERVE_TEST_PROMPT": next(e["value"] for e in c["env"]
                                            if e["name"] == "MTPSERVE_TEST_PROMPT")}
        out = subprocess.run(c["command"], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok: model code-mtp" in out.stdout
    get, post = _FakeAPI.seen[-2:]
    assert get == ("GET", "/v1/models", "Bearer sk-test")
    assert post[:2] == ("POST", "/v1/completions")
    assert post[2]["model"] == "code-mtp" and post[2]["max_tokens"] == 8
