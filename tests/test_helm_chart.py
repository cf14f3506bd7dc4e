"""helm/mtpserve: what the chart renders for the default values and the ci/ value sets.

The Serve config must be one we run (Ray's ServeDeploySchema, our ClusterConfig); the pods must
be able to hold it; traffic, model delivery and monitoring must be wired as values.yaml
documents. Security, upgrades and production knobs are in test_helm_production.py, bad values in
test_helm_validation.py, schemas in test_helm_schemas.py.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml
from helm_render import (
    CASE_IDS,
    CASES,
    CHART,
    CPU,
    GPU_NODE,
    KUBE_VERSION,
    MULTI,
    RELEASE,
    REPO,
    load_values,
    objects,
    pod_templates,
    rayservice,
    render,
    render_case,
    serve_config,
)
from ray.serve.schema import DeploymentSchema
from serve_config_checks import check_serve_config

from mtpserve.cluster.config import ClusterConfig

SEVERITY_WARNING = 2
K8S_VALUES = {"resources", "podSecurityContext", "containerSecurityContext", "prometheus",
              "operator"}  # values passed through as Kubernetes objects


def _args(rs: dict[str, Any]) -> dict[str, Any]:
    return serve_config(rs)["applications"][0]["args"]


# ---------------------------------------------------------------------------- lint, values


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_helm_lint_clean(values_file: Path | None) -> None:
    report = helm.lint(CHART, load_values(values_file), strict=True, kube_version=KUBE_VERSION)
    problems = [m for m in report["messages"] if m["severity"] >= SEVERITY_WARNING]
    assert problems == [] and report["errors"] == []


def _schema_fields(node: dict[str, Any]) -> dict[str, Any]:
    return node.get("properties", {})


def _assert_mirrors(model: type, node: dict[str, Any], path: str) -> None:
    assert node.get("additionalProperties") is False, path
    assert set(_schema_fields(node)) == set(model.model_fields), path
    for name, field in model.model_fields.items():
        sub = getattr(field.annotation, "__args__", (field.annotation,))
        nested = [t for t in sub if isinstance(t, type) and hasattr(t, "model_fields")]
        if nested:
            _assert_mirrors(nested[0], _schema_fields(node)[name], f"{path}.{name}")


def test_values_schema_in_step_with_code() -> None:
    """serve.args mirrors ClusterConfig field for field (helm/mtpserve/tools/
    sync_args_schema.py brings it in step); overrides allow DeploymentSchema fields only."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    serve = schema["properties"]["serve"]["properties"]
    _assert_mirrors(ClusterConfig, serve["args"], "serve.args")
    item = serve["deployments"]["items"]
    assert item["additionalProperties"] is False
    assert set(item["properties"]) == set(DeploymentSchema.model_fields)


def _sync_tool():
    path = CHART / "tools" / "sync_args_schema.py"
    spec = importlib.util.spec_from_file_location("sync_args_schema", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sync_tool_is_a_no_op_and_rebuilds_optional_models() -> None:
    """Running sync_args_schema.py changes nothing (the schema is in step), and it rebuilds a
    nullable nested model (`autoscaling`: pydantic's anyOf [{$ref}, {type: null}]) from
    scratch or from a shape it cannot merge into, instead of failing."""
    tool = _sync_tool()
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert tool.synced(schema) == schema
    broken = copy.deepcopy(schema)
    args = broken["properties"]["serve"]["properties"]["args"]["properties"]
    del args["decode"]["properties"]["autoscaling"]
    args["prefill"]["properties"]["autoscaling"] = {"anyOf": [{"type": "object"},
                                                              {"type": "null"}]}
    del args["limits"]
    fixed = tool.synced(broken)
    _assert_mirrors(ClusterConfig, fixed["properties"]["serve"]["properties"]["args"],
                    "serve.args")
    for role in ("prefill", "decode"):
        node = fixed["properties"]["serve"]["properties"]["args"]["properties"][role][
            "properties"]["autoscaling"]
        assert node["type"] == ["object", "null"] and node["additionalProperties"] is False
        assert node["properties"]["max_replicas"] == {"type": "integer", "minimum": 1}


def test_every_value_is_commented() -> None:
    """Each key the schema defines has a comment on the line above it in values.yaml."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    stack: list[tuple[int, str]] = []
    missing, prev = [], ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        m = re.match(r"^(\s*)([A-Za-z_][\w.-]*):", line)
        if m:
            indent, key = len(m.group(1)), m.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            node = schema
            for _, k in stack:
                node = _schema_fields(node).get(k, {})
            # Keys inside Kubernetes objects (resources, securityContext, ...) are examples of
            # a documented value, not chart API.
            passthrough = any(k in K8S_VALUES for _, k in stack)
            if key in _schema_fields(node) and not passthrough and not prev.startswith("#"):
                missing.append(".".join([k for _, k in stack] + [key]))
            stack.append((indent, key))
        if line.strip():
            prev = line.strip()
    assert missing == []


# ---------------------------------------------------------------------------- Serve config


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_serve_config_is_valid_and_ports_agree(values_file: Path | None) -> None:
    docs = render_case(values_file)
    rs = rayservice(docs)
    cfg = serve_config(rs)
    cc = check_serve_config(cfg)
    port = cc.http.port
    assert cfg["http_options"] == {"host": "0.0.0.0", "port": port}
    # Every Ray pod runs a proxy (proxy_location EveryNode) behind the serve Service, so every
    # Ray container exposes the Serve port, and the Service targets it.
    for role, pod in pod_templates(rs).items():
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["serve"] == port, role
    # KubeRay takes the head's `serve` container port for the Service; the chart renders the same.
    (svc_port,) = rs["spec"]["serveService"]["spec"]["ports"]
    assert svc_port["port"] == port
    (np,) = docs["networkpolicy.yaml"]
    assert any(p["port"] == port for r in np["spec"]["ingress"] for p in r.get("ports", []))


def test_non_default_http_port_flows_everywhere() -> None:
    rs = rayservice(render({"serve": {"args": {"http": {"port": 9000}}}}))
    assert serve_config(rs)["http_options"]["port"] == 9000
    for pod in pod_templates(rs).values():
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["serve"] == 9000
    assert rs["spec"]["serveService"]["spec"]["ports"][0]["port"] == 9000


# What the chart's defaults add to configs/production.yaml's args: role pinning (the worker
# groups advertise these custom resources; a bare Ray cluster's nodes do not).
CHART_ONLY_ARGS = {"prefill": {"resources": {"mtpserve-prefill": 1}},
                   "decode": {"resources": {"mtpserve-decode": 1}}}


def test_default_render_equals_production_config() -> None:
    """`helm install` with defaults runs `serve deploy configs/production.yaml`, plus exactly
    the Kubernetes-only args above."""
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
    cfg = serve_config(rayservice(render_case(None)))
    args = cfg["applications"][0]["args"]
    for key, extra in CHART_ONLY_ARGS.items():
        for sub, value in extra.items():
            assert args[key].pop(sub) == value, f"{key}.{sub}"
        if not args[key]:
            del args[key]
    assert cfg == production


def test_values_flow_into_args() -> None:
    values = load_values(MULTI)
    assert values is not None
    cc = check_serve_config(serve_config(rayservice(render_case(MULTI))))
    args = values["serve"]["args"]
    assert cc.model == args["model"]
    assert (cc.prefill.tp_size, cc.decode.tp_size) == (2, 4)
    assert cc.speculation.num_speculative_tokens == 3
    assert cc.decode.autoscaling is not None and cc.decode.autoscaling.max_replicas == 6
    assert cc.auth.api_key_env == "MTPSERVE_API_KEY"


# ---------------------------------------------------------------------------- pods


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_worker_pods_hold_whole_tp_groups(values_file: Path | None) -> None:
    rs = rayservice(render_case(values_file))
    cc = ClusterConfig.model_validate(_args(rs))
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, settings in (("prefill", cc.prefill), ("decode", cc.decode)):
        group = groups[role]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus = int(limits.get("nvidia.com/gpu", "0"))
        need = settings.tp_size * settings.gpus_per_rank
        assert gpus >= need, role
        assert float(limits["cpu"]) >= settings.tp_size * settings.cpus_per_rank, role
        if need:
            top = settings.autoscaling.max_replicas if settings.autoscaling else settings.replicas
            assert group["maxReplicas"] * (gpus // need) >= top, role
            assert group["template"]["spec"]["tolerations"], role
    head_params = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head_params["num-cpus"] == "0"  # replicas stay off the head
    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_every_pod_has_shm_and_the_model(values_file: Path | None) -> None:
    """Every pod that runs replicas mounts the model; the head, which advertises no CPUs and so
    runs none, does not (and downloads nothing)."""
    values = load_values(values_file) or {}
    model = values.get("model", {})
    source = model.get("source", "image")
    rs = rayservice(render_case(values_file))
    path = _args(rs).get("model")
    for role, pod in pod_templates(rs).items():
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory", role
        assert mounts["dshm"]["mountPath"] == "/dev/shm", role
        if source == "image" or role == "head":
            assert "model" not in vols and "model" not in mounts, role
            assert "model-download" not in {c["name"] for c in pod["spec"].get(
                "initContainers", [])}, role
            continue
        assert path.startswith(mounts["model"]["mountPath"] + "/"), role
        assert mounts["model"]["readOnly"] is True, role
        if source == "pvc":
            assert vols["model"]["persistentVolumeClaim"]["claimName"] == model["pvc"]["claimName"]


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_every_pod_runs_ray_as_mtpserve_up_does(values_file: Path | None) -> None:
    """The Ray and Serve settings `mtpserve up` gives its cluster (RAY_ENV: worker niceness,
    Serve's control loop, gRPC transport, replicas' main-loop mode) reach every pod with the
    same values, so the chart and the CLI cannot drift apart."""
    from mtpserve.cluster.cli_serve import RAY_ENV

    rs = rayservice(render_case(values_file))
    for role, pod in pod_templates(rs).items():
        env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
        assert {k: env.get(k) for k in RAY_ENV} == RAY_ENV, role


def _workers(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {r: p for r, p in pod_templates(rs).items() if r != "head"}


def test_model_from_host_path() -> None:
    values = {"model": {"source": "hostPath", "hostPath": "/mnt/models"}}
    for pod in _workers(rayservice(render(values))).values():
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["model"]["hostPath"]["path"] == "/mnt/models"


def test_head_gets_the_model_only_when_it_runs_replicas() -> None:
    hf = {"model": {"source": "hf", "hf": {"repo": "org/m"}}}
    head = pod_templates(rayservice(render(hf)))["head"]
    assert "initContainers" not in head["spec"]
    assert "ephemeral-storage" not in head["spec"]["containers"][0]["resources"]["requests"]
    # A head that advertises CPUs may get (ingress) replicas: it downloads like a worker.
    busy = {**hf, "head": {"noReplicas": False}}
    head = pod_templates(rayservice(render(busy)))["head"]
    assert _download(head)["name"] == "model-download"
    assert {v["name"] for v in head["spec"]["volumes"]} >= {"model", "dshm"}


def _download(pod: dict[str, Any]) -> dict[str, Any]:
    (init,) = [c for c in pod["spec"]["initContainers"] if c["name"] == "model-download"]
    return init


def test_hf_download_into_a_created_pvc() -> None:
    docs = render_case(GPU_NODE)
    rs = rayservice(docs)
    model_dir = _args(rs)["model"]
    assert model_dir == "/models/my-org--code-mtp-1b"
    (pvc,) = docs["persistentvolumeclaim.yaml"]
    assert pvc["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "50Gi"
    assert pvc["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    for role, pod in _workers(rs).items():
        init = _download(pod)
        env = {e["name"]: e for e in init["env"]}
        assert env["MTPSERVE_HF_REPO"]["value"] == "my-org/code-mtp-1b"
        # Only what the server reads: weights, configs, tokenizer files.
        patterns = json.loads(env["MTPSERVE_HF_ALLOW_PATTERNS"]["value"])
        assert {"*.safetensors", "*.json", "*.model", "*.txt"} <= set(patterns)
        assert not {"*.bin", "*.pth", "*.gguf", "*"} & set(patterns)
        assert "allow_patterns=json.loads(" in init["command"][-1]
        assert env["MTPSERVE_HF_REVISION"]["value"] == "2f0c4b1"
        assert env["MTPSERVE_MODEL_DIR"]["value"] == model_dir
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token",
                                                                "key": "HF_TOKEN"}
        assert "snapshot_download" in init["command"][-1]
        # The download writes; the Ray containers only read.
        (w,) = init["volumeMounts"]
        assert (w["name"], w["mountPath"], w.get("readOnly", False)) == ("model", "/models", False)
        claim = {v["name"]: v for v in pod["spec"]["volumes"]}["model"]["persistentVolumeClaim"]
        assert claim["claimName"] == pvc["metadata"]["name"], role


def test_hf_download_into_empty_dir_of_a_public_repo() -> None:
    docs = render({"model": {"source": "hf", "hf": {"repo": "org/m", "cache": "emptyDir"}}})
    assert docs["persistentvolumeclaim.yaml"] == []
    for pod in _workers(rayservice(docs)).values():
        assert "HF_TOKEN" not in {e["name"] for e in _download(pod)["env"]}
        vol = {v["name"]: v for v in pod["spec"]["volumes"]}["model"]
        assert vol["emptyDir"]["sizeLimit"] == "100Gi"
        # The download lands on the node's disk: the scheduler must see it.
        requests = pod["spec"]["containers"][0]["resources"]["requests"]
        assert requests["ephemeral-storage"] == "100Gi"
    given = render({"model": {"source": "hf", "hf": {"repo": "org/m",
                                                     "ephemeralStorageRequest": "120Gi"}}})
    for pod in _workers(rayservice(given)).values():
        assert pod["spec"]["containers"][0]["resources"]["requests"][
            "ephemeral-storage"] == "120Gi"
    # A shared PVC cache takes nothing from the node's disk.
    pvc = render_case(GPU_NODE)
    for pod in pod_templates(rayservice(pvc)).values():
        assert "ephemeral-storage" not in pod["spec"]["containers"][0]["resources"].get(
            "requests", {})


def test_pvc_source_can_create_its_claim() -> None:
    values = {"model": {"source": "pvc", "pvc": {"create": True, "size": "10Gi",
                                                 "accessModes": ["ReadOnlyMany"]}},
              "serve": {"args": {"model": "/models/m"}}}
    docs = render(values)
    (pvc,) = docs["persistentvolumeclaim.yaml"]
    assert pvc["metadata"]["name"] == f"{RELEASE}-mtpserve-model"
    for pod in pod_templates(rayservice(docs)).values():
        assert "initContainers" not in pod["spec"]


# ---------------------------------------------------------------------------- traffic


def test_serve_service_is_kuberay_managed() -> None:
    docs = render_case(None)
    rs = rayservice(docs)
    # No chart Service selecting head pods by release labels: KubeRay's serveService selects
    # the serve-ready pods of the active cluster and swaps clusters on upgrade.
    assert not [o for o in objects(docs) if o["kind"] == "Service"]
    svc = rs["spec"]["serveService"]
    assert svc["metadata"]["name"] == f"{RELEASE}-mtpserve-serve-svc"
    assert "selector" not in svc["spec"]  # KubeRay sets it
    assert rs["spec"]["excludeHeadPodFromServeSvc"] is True
    lb = render({"serveService": {"type": "LoadBalancer", "annotations": {"x": "y"}}})
    svc = rayservice(lb)["spec"]["serveService"]
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"] == {"x": "y"}


def test_ingress_and_http_route_point_at_the_serve_service() -> None:
    (ing,) = render_case(GPU_NODE)["ingress.yaml"]
    backend = ing["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {"name": f"{RELEASE}-mtpserve-serve-svc", "port": {"number": 8000}}
    assert ing["spec"]["tls"][0]["secretName"] == "llm-tls"
    docs = render({"httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}],
                                 "hostnames": ["llm.example.com"]},
                   "serve": {"args": {"http": {"port": 9000}}}})
    (route,) = docs["httproute.yaml"]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"name": f"{RELEASE}-mtpserve-serve-svc", "port": 9000}
    ]
    assert docs["ingress.yaml"] == []


# ---------------------------------------------------------------------------- monitoring


def test_monitoring_is_gated() -> None:
    default = render_case(None)
    assert default["podmonitor.yaml"] == [] and default["grafana-dashboard.yaml"] == []
    multi = render_case(MULTI)
    (pm,) = multi["podmonitor.yaml"]
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    endpoints = {e["port"]: e for e in pm["spec"]["podMetricsEndpoints"]}
    assert list(endpoints) == ["metrics", "as-metrics", "dash-metrics", "serve"]
    # GET /metrics (router/metrics_api.py: vllm:*, mtpserve:*) on the HTTP port. Each response
    # is aggregated over the whole cluster, so only the head (always running a proxy) is kept.
    serve = endpoints["serve"]
    assert serve["path"] == "/metrics"
    assert {"sourceLabels": ["__meta_kubernetes_pod_label_ray_io_node_type"], "regex": "head",
            "action": "keep"} in serve["relabelings"]
    assert all("path" not in e for p, e in endpoints.items() if p != "serve")  # Ray's own
    pods = pod_templates(rayservice(multi))
    for role, pod in pods.items():
        ports = {p["name"]: p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]}
        assert ports["metrics"] == 8080, role
        assert pm["spec"]["selector"]["matchLabels"].items() - {
            ("ray.io/is-ray-node", "yes")} <= pod["metadata"]["labels"].items()
    head_ports = {p["name"]: p["containerPort"] for p in pods["head"]["spec"]["containers"][0][
        "ports"]}
    # Ray's autoscaler and dashboard metrics ports (AUTOSCALER_METRIC_PORT, DASHBOARD_METRIC_PORT).
    assert (head_ports["as-metrics"], head_ports["dash-metrics"]) == (44217, 44227)
    http_port = serve_config(rayservice(multi))["http_options"]["port"]
    assert head_ports["serve"] == http_port


def test_dashboard_panels() -> None:
    (cm,) = render_case(MULTI)["grafana-dashboard.yaml"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["mtpserve.json"])
    exprs = {p["title"]: " ".join(t["expr"] for t in p.get("targets", []))
             for p in dash["panels"]}
    wanted = {  # /metrics (router/metrics_api.py): vLLM's names + mtpserve:*
        "TTFT": "vllm:time_to_first_token_seconds_bucket",
        "TPOT": "vllm:request_time_per_output_token_seconds_bucket",
        "acceptance per position": "vllm:spec_decode_num_accepted_tokens_per_pos_total",
        "k per replica": "mtpserve:num_speculative_tokens",
        "tokens/s": "vllm:generation_tokens_total",
        "KV": "vllm:kv_cache_usage_perc",
        "Replicas": "ray_serve_deployment_replica_healthy",
        "desired": "mtpserve:autoscaling_desired_replicas",
    }
    for word, metric in wanted.items():
        assert any(word in title and metric in e for title, e in exprs.items()), word
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])


# ---------------------------------------------------------------------------- image


def test_dockerfile_pins_torch_and_checks_cuda() -> None:
    text = (REPO / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert re.fullmatch(r"cu\d{3}", args["TORCH_CUDA"])
    # The base's CUDA build is torch's.
    assert args["RAY_IMAGE_GPU"].endswith("-" + args["TORCH_CUDA"])
    assert "torch.version.cuda" in text and "download.pytorch.org/whl/" in text
    cpu = yaml.safe_load(CPU.read_text())
    assert cpu["image"]["tag"].endswith("-cpu")
