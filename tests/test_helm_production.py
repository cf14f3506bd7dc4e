"""helm/mtpserve in production: secure defaults, API key handling, upgrades that cut no
request, and the knobs of multi-node GPU clusters (role pinning, GCS fault tolerance, NCCL and
RDMA settings, disruption budgets), as rendered for the default values and the ci/ value sets.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helm_render import (
    CASE_IDS,
    CASES,
    CPU,
    GPU_NODE,
    MULTI,
    RELEASE,
    load_values,
    pod_templates,
    rayservice,
    render,
    render_case,
    serve_config,
)
from serve_config_checks import check_serve_config

from mtpserve.cluster.app import deployment_options
from mtpserve.cluster.config import ClusterConfig


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return pod["spec"]["containers"] + pod["spec"].get("initContainers", [])


def _args(rs: dict[str, Any]) -> dict[str, Any]:
    return serve_config(rs)["applications"][0]["args"]


# ---------------------------------------------------------------------------- security


def _restricted_violations(pod: dict[str, Any]) -> list[str]:
    """The Pod Security "restricted" profile's rules that a pod template can break."""
    spec, bad = pod["spec"], []
    psc = spec.get("securityContext", {})
    if any("hostPath" in v for v in spec.get("volumes", [])):
        bad.append("hostPath")
    if psc.get("seccompProfile", {}).get("type") not in ("RuntimeDefault", "Localhost"):
        bad.append("seccomp")
    for c in _containers(pod):
        sc = c.get("securityContext", {})
        if sc.get("allowPrivilegeEscalation") is not False:
            bad.append(f"{c['name']}: allowPrivilegeEscalation")
        if "ALL" not in sc.get("capabilities", {}).get("drop", []):
            bad.append(f"{c['name']}: drop ALL")
        if set(sc.get("capabilities", {}).get("add", [])) - {"NET_BIND_SERVICE"}:
            bad.append(f"{c['name']}: capabilities.add")
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            bad.append(f"{c['name']}: runAsNonRoot")
        if sc.get("privileged"):
            bad.append(f"{c['name']}: privileged")
    return bad


@pytest.mark.parametrize("values_file", [None, CPU, GPU_NODE], ids=["default", "cpu", "gpu-node"])
def test_pods_meet_restricted_pod_security(values_file: Path | None) -> None:
    rs = rayservice(render_case(values_file))
    for role, pod in pod_templates(rs).items():
        assert _restricted_violations(pod) == [], role
    # KubeRay injects the autoscaler sidecar into the head; it gets the same context.
    options = rs["spec"]["rayClusterConfig"].get("autoscalerOptions")
    if options:
        assert options["securityContext"]["capabilities"]["drop"] == ["ALL"]


def test_rdma_leaves_restricted_only_by_ipc_lock() -> None:
    pods = pod_templates(rayservice(render_case(MULTI)))
    for role in ("prefill", "decode"):
        assert _restricted_violations(pods[role]) == ["ray-worker: capabilities.add"], role
        (c,) = pods[role]["spec"]["containers"]
        assert c["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "1"
    assert _restricted_violations(pods["head"]) == []


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_only_the_head_gets_api_credentials(values_file: Path | None) -> None:
    docs = render_case(values_file)
    rs = rayservice(docs)
    pods = pod_templates(rs)
    (sa,) = docs["serviceaccount.yaml"]
    assert sa["automountServiceAccountToken"] is False
    head = pods["head"]["spec"]
    assert head["serviceAccountName"] == sa["metadata"]["name"] == f"{RELEASE}-mtpserve-head"
    # The autoscaler sidecar patches pods with the head's token; without it no token at all.
    assert head["automountServiceAccountToken"] is rs["spec"]["rayClusterConfig"][
        "enableInTreeAutoscaling"]
    for role in ("prefill", "decode"):
        assert "serviceAccountName" not in pods[role]["spec"], role
        assert pods[role]["spec"]["automountServiceAccountToken"] is False, role


def test_ray_token_auth_is_on_by_default() -> None:
    cluster = rayservice(render_case(None))["spec"]["rayClusterConfig"]
    assert cluster["authOptions"] == {"mode": "token"}
    off = rayservice(render({"rayAuth": {"enabled": False}}))["spec"]["rayClusterConfig"]
    assert off["authOptions"] == {"mode": "disabled"}


def test_network_policy_denies_by_default() -> None:
    (np,) = render_case(None)["networkpolicy.yaml"]
    release = {"app.kubernetes.io/name": "mtpserve", "app.kubernetes.io/instance": RELEASE}
    assert np["spec"]["podSelector"] == {"matchLabels": release}
    assert np["spec"]["policyTypes"] == ["Ingress"]
    by_port = _peers_by_port(np)
    # The API from anywhere (key-protected), metrics from the monitoring namespace, the
    # dashboard from the operator only; GCS (6379) and Ray client (10001) from no one else.
    monitoring = [{"namespaceSelector": {"matchLabels": {
        "kubernetes.io/metadata.name": "monitoring"}}}]
    # The serve port: clients (None: any source), the `helm test` pod, and Prometheus (GET
    # /metrics, no key).
    helm_test = [{"podSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE,
                                                  "app.kubernetes.io/component": "helm-test"}}}]
    assert by_port[8000] == [None, helm_test, monitoring]
    assert by_port[8080] == by_port[44217] == by_port[44227] == [monitoring]
    assert by_port[8265] == [[{"namespaceSelector": {}, "podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "kuberay-operator"}}}]]
    assert set(by_port) == {8000, 8080, 44217, 44227, 8265}
    for pod in pod_templates(rayservice(render_case(None))).values():
        assert release.items() <= pod["metadata"]["labels"].items()


def test_prometheus_reaches_metrics_on_the_serve_port_when_clients_are_limited() -> None:
    """With `clients` set, the API port is closed to everyone else, but the PodMonitor's
    /metrics endpoint on it must still be reachable from Prometheus."""
    clients = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "web"}}}]
    prometheus = [{"podSelector": {"matchLabels": {"app": "prometheus"}}}]
    docs = render({"networkPolicy": {"clients": clients, "prometheus": prometheus},
                   "serve": {"args": {"http": {"port": 9000}}},
                   "monitoring": {"podMonitor": {"enabled": True}},
                   "helmTest": {"enabled": False}})
    (np,) = docs["networkpolicy.yaml"]
    assert _peers_by_port(np)[9000] == [clients, prometheus]
    (pm,) = docs["podmonitor.yaml"]
    (serve,) = [e for e in pm["spec"]["podMetricsEndpoints"] if e["port"] == "serve"]
    assert serve["path"] == "/metrics"


def _peers_by_port(np: dict[str, Any]) -> dict[int, list[Any]]:
    """Port -> the `from` of every ingress rule naming it (None: any source)."""
    release = np["spec"]["podSelector"]["matchLabels"]
    by_port: dict[int, list[Any]] = {}
    for rule in np["spec"]["ingress"]:
        if "ports" not in rule:  # the only all-ports rule: this release's own pods
            assert rule["from"] == [{"podSelector": {"matchLabels": release}}]
            continue
        for p in rule["ports"]:
            by_port.setdefault(p["port"], []).append(rule.get("from"))
    return by_port


def test_network_policy_egress_when_asked() -> None:
    """Restricted egress keeps DNS and intra-release traffic, and opens the API server (what
    values.yaml promises) for the head's autoscaler only, in a second policy."""
    extra = [{"to": [{"ipBlock": {"cidr": "10.0.0.1/32"}}], "ports": [{"port": 443}]}]
    api = [{"ipBlock": {"cidr": "172.20.0.1/32"}}]
    np, apiserver = render({"networkPolicy": {"egress": extra, "apiServer": {"peers": api}}})[
        "networkpolicy.yaml"]
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    ports = [p["port"] for r in np["spec"]["egress"] for p in r.get("ports", [])]
    assert ports == [53, 53, 443]
    assert apiserver["metadata"]["name"] == f"{RELEASE}-mtpserve-apiserver"
    assert apiserver["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "head"
    assert apiserver["spec"]["policyTypes"] == ["Egress"]
    assert apiserver["spec"]["egress"] == [{"to": api, "ports": [
        {"port": 443, "protocol": "TCP"}, {"port": 6443, "protocol": "TCP"}]}]
    # Without the autoscaler the head calls no API: no second policy.
    fixed = render({"networkPolicy": {"egress": extra}, "autoscaler": {"enabled": False},
                    "serve": {"args": {"prefill": {"autoscaling": None},
                                       "decode": {"autoscaling": None},
                                       "ingress": {"autoscaling": None}}}})
    assert len(fixed["networkpolicy.yaml"]) == 1


# ---------------------------------------------------------------------------- auth


def _key_refs(rs: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    refs = {}
    for role, pod in pod_templates(rs).items():
        for env in pod["spec"]["containers"][0].get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs[role] = (env["name"], ref["name"], ref["key"])
    return refs


def test_default_auth_creates_kept_secret_and_wires_env() -> None:
    docs = render_case(None)
    (secret,) = docs["secret.yaml"]
    key_name = f"{RELEASE}-mtpserve-api-key"
    assert secret["metadata"]["name"] == key_name and len(secret["data"]["api-key"]) == 64
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    rs = rayservice(docs)
    want = ("MTPSERVE_API_KEY", key_name, "api-key")
    assert _key_refs(rs) == {"head": want, "prefill": want, "decode": want}
    assert _args(rs)["auth"] == {"api_key_env": "MTPSERVE_API_KEY"}
    assert "api_key:" not in rs["spec"]["serveConfigV2"]  # only the variable's name travels


def test_existing_secret_and_no_auth() -> None:
    multi = render_case(MULTI)
    assert multi["secret.yaml"] == []
    assert set(_key_refs(rayservice(multi)).values()) == {
        ("MTPSERVE_API_KEY", "mtpserve-api-key", "token")
    }
    cpu = render_case(CPU)
    assert cpu["secret.yaml"] == [] and _key_refs(rayservice(cpu)) == {}
    assert "auth" not in _args(rayservice(cpu))


def test_given_api_key_is_stable_across_renders() -> None:
    values = {"auth": {"apiKey": "sk-test"}}
    first, second = render(values), render(values, is_upgrade=True)
    assert first["secret.yaml"] == second["secret.yaml"]
    (secret,) = first["secret.yaml"]
    assert secret["data"]["api-key"] == "c2stdGVzdA=="  # base64("sk-test")
    assert "annotations" not in secret["metadata"]  # the value is the source of truth


# ---------------------------------------------------------------------------- upgrades


def test_upgrade_keeps_the_old_cluster_for_running_requests() -> None:
    spec = rayservice(render_case(None))["spec"]
    assert spec["upgradeStrategy"] == {"type": "NewCluster"}
    assert spec["rayClusterDeletionDelaySeconds"] == 600 + 30
    short = rayservice(render({"serve": {"args": {"request_timeout_s": 120}}}))["spec"]
    assert short["rayClusterDeletionDelaySeconds"] == 150
    given = render({"upgrade": {"rayClusterDeletionDelaySeconds": 900}})
    assert rayservice(given)["spec"]["rayClusterDeletionDelaySeconds"] == 900


def test_incremental_upgrade_options() -> None:
    spec = rayservice(render_case(MULTI))["spec"]
    assert spec["upgradeStrategy"] == {
        "type": "NewClusterWithIncrementalUpgrade",
        "clusterUpgradeOptions": {"gatewayClassName": "istio", "maxSurgePercent": 25,
                                  "stepSizePercent": 10, "intervalSeconds": 60},
    }


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_grace_period_covers_the_drain(values_file: Path | None) -> None:
    """Workers: the preStop drain (replacement start + Serve's graceful shutdown), `ray stop`
    and 10 s of slack (the hook's timeout, `ray stop` itself); the head: Serve's graceful
    shutdown + 30 s."""
    rs = rayservice(render_case(values_file))
    drain = ClusterConfig.model_validate(_args(rs)).graceful_shutdown_timeout_s
    pods = pod_templates(rs)
    assert pods["head"]["spec"]["terminationGracePeriodSeconds"] == drain + 30
    for role in ("prefill", "decode"):
        assert pods[role]["spec"]["terminationGracePeriodSeconds"] == 120 + drain + 15 + 10, role


# ---------------------------------------------------------------------------- production knobs


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_role_pinning_matches_the_builder(values_file: Path | None) -> None:
    """Each worker group advertises its role's custom resource, as many as the TP-rank bundles
    its pods hold, in the form both KubeRay and the Ray autoscaler parse; the builder puts the
    same resource in every bundle of that role, and the other group offers none of it."""
    rs = rayservice(render_case(values_file))
    cc = check_serve_config(serve_config(rs))
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    offered = {}
    for role in ("prefill", "decode"):
        raw = groups[role]["rayStartParams"]["resources"]
        assert raw.startswith("'") and raw.endswith("'")  # shell-quoted JSON for `ray start`
        assert _autoscaler_custom_resources(groups[role]) == json.loads(raw.strip("'"))
        offered[role] = json.loads(raw.strip("'"))
        assert "labels" not in groups[role]  # no label selectors (they need autoscaler v2)
    for role, other in (("prefill", "decode"), ("decode", "prefill")):
        side = getattr(cc, role)
        bundles = deployment_options(cc, role)["placement_group_bundles"]
        assert all(b.items() >= side.resources.items() for b in bundles)
        limits = groups[role]["template"]["spec"]["containers"][0]["resources"]["limits"]
        per_pod = side.tp_size * (int(limits.get("nvidia.com/gpu", "0")) // max(
            1, side.tp_size * int(side.gpus_per_rank)) if side.gpus_per_rank else
            int(float(limits["cpu"]) // (side.tp_size * side.cpus_per_rank)))
        assert offered[role] == {k: int(v * per_pod) for k, v in side.resources.items()}, role
        assert not set(side.resources) & set(offered[other]), role
    assert not any("placement_group_bundle_label_selector" in d for d in
                   serve_config(rs)["applications"][0].get("deployments", []))


def _autoscaler_custom_resources(group: dict[str, Any]) -> dict[str, int]:
    """What Ray's KubeRay autoscaler reads from a group spec (Ray 2.60's own parser)."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_custom_resources

    return _get_custom_resources({}, group["rayStartParams"], group["groupName"])


def test_role_pinning_can_be_turned_off() -> None:
    off = {"rolePinning": {"enabled": False},
           "serve": {"args": {"prefill": {"resources": {"mtpserve-prefill": None}},
                              "decode": {"resources": {"mtpserve-decode": None}}}}}
    rs = rayservice(render(off))
    for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]:
        assert "resources" not in g["rayStartParams"]
    cc = check_serve_config(serve_config(rs))
    assert cc.prefill.resources == cc.decode.resources == {}


def test_multi_node_knobs() -> None:
    docs = render_case(MULTI)
    rs = rayservice(docs)
    cluster = rs["spec"]["rayClusterConfig"]
    assert cluster["gcsFaultToleranceOptions"] == {
        "redisAddress": "redis.llm-infra.svc:6379",
        "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "mtpserve-redis",
                                                         "key": "password"}}},
    }
    for role, pod in pod_templates(rs).items():
        spec = pod["spec"]
        env = {e["name"]: e.get("value") for e in spec["containers"][0]["env"]}
        assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "eth0", role
        assert env["NCCL_IB_HCA"] == "mlx5" and env["NCCL_IB_GID_INDEX"] == "3", role
        assert spec["priorityClassName"] == "llm-serving", role
        assert pod["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
        # The GPU runtime class on GPU pods only.
        assert spec.get("runtimeClassName") == (None if role == "head" else "nvidia"), role


def test_cpu_values_set_no_nccl_env() -> None:
    for pod in pod_templates(rayservice(render_case(CPU))).values():
        names = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
        assert "NCCL_DEBUG" not in names and "GLOO_SOCKET_IFNAME" in names


def test_extra_volumes_and_init_containers() -> None:
    values = {
        "extraVolumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
        "extraVolumeMounts": [{"name": "certs", "mountPath": "/etc/ca", "readOnly": True}],
        "extraInitContainers": [{"name": "wait", "image": "busybox:1.36",
                                 "command": ["true"]}],
        "terminationGracePeriodSeconds": 200,
    }
    for pod in pod_templates(rayservice(render(values))).values():
        spec = pod["spec"]
        assert "certs" in {v["name"] for v in spec["volumes"]}
        assert "/etc/ca" in {m["mountPath"] for m in spec["containers"][0]["volumeMounts"]}
        assert [c["name"] for c in spec["initContainers"]] == ["wait"]
        assert spec["terminationGracePeriodSeconds"] == 200


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_disruption_budgets_select_the_pods(values_file: Path | None) -> None:
    docs = render_case(values_file)
    values = load_values(values_file) or {}
    gcs_ft = values.get("gcsFaultTolerance", {}).get("enabled", False)
    pdbs = {p["metadata"]["name"].rsplit("-", 1)[1]: p for p in docs["poddisruptionbudget.yaml"]}
    # The head may go only when a restarted head recovers the cluster (GCS state in Redis).
    assert pdbs["head"]["spec"]["maxUnavailable"] == (1 if gcs_ft else 0)
    for role, pod in pod_templates(rayservice(docs)).items():
        sel = pdbs[role]["spec"]["selector"]["matchLabels"]
        assert sel.items() <= pod["metadata"]["labels"].items(), role
        assert "mtpserve.io/cluster-spec" in sel, role  # one RayCluster's pods only
        if role != "head":
            assert pdbs[role]["spec"]["maxUnavailable"] == 1
    given = render({"podDisruptionBudget": {"headMaxUnavailable": 0},
                    "gcsFaultTolerance": {"enabled": True, "redisAddress": "r:6379"}})
    head = [p for p in given["poddisruptionbudget.yaml"] if p["metadata"]["name"].endswith(
        "-head")]
    assert head[0]["spec"]["maxUnavailable"] == 0


def test_compile_cache_volume_reaches_every_ray_container() -> None:
    """The compiled-graph cache (README "On-disk compile cache"): an emptyDir by default, a
    node folder or an existing claim when asked, named to the engines by
    MTPSERVE_COMPILE_CACHE; `none` adds nothing; a pvc without a claim name fails."""
    def cache(values: dict[str, Any]) -> list[tuple[dict | None, str | None, str | None]]:
        out = []
        for pod in pod_templates(rayservice(render(values))).values():
            spec, ctr = pod["spec"], pod["spec"]["containers"][0]
            vol = next((v for v in spec["volumes"] if v["name"] == "compile-cache"), None)
            mount = next((m["mountPath"] for m in ctr["volumeMounts"]
                          if m["name"] == "compile-cache"), None)
            env = next((e.get("value") for e in ctr["env"]
                        if e["name"] == "MTPSERVE_COMPILE_CACHE"), None)
            out.append((vol, mount, env))
        return out

    path = "/var/cache/mtpserve/compile"
    for vol, mount, env in cache({}):
        assert vol == {"name": "compile-cache", "emptyDir": {"sizeLimit": "10Gi"}}
        assert mount == env == path
    for vol, mount, env in cache({"compileCache": {"type": "pvc", "claimName": "graphs",
                                                   "mountPath": "/cache"}}):
        assert vol["persistentVolumeClaim"] == {"claimName": "graphs"}
        assert mount == env == "/cache"
    for vol, _, _ in cache({"compileCache": {"type": "hostPath"}}):
        assert vol["hostPath"] == {"path": path, "type": "DirectoryOrCreate"}
    assert all(x == (None, None, None) for x in cache({"compileCache": {"type": "none"}}))
    with pytest.raises(Exception, match="compileCache.claimName is required"):
        render({"compileCache": {"type": "pvc"}})
