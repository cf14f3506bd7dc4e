"""helm/mtpserve: lint, render, and validate what Kubernetes and Ray would receive.

Offline: `helm-python-sdk` runs Helm's own engine (lint, values.schema.json, templates). The
rendered RayService is checked against KubeRay's CRD schema in strict mode (unknown keys are
errors, as kubeconform --strict does; the API server would silently prune them), and its
`serveConfigV2` against Ray's ServeDeploySchema and our ClusterConfig.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml
from ray.serve.schema import DeploymentSchema
from serve_config_checks import check_serve_config

from cluster.config import ClusterConfig

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "mtpserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CASES = [None, *CI_VALUES]
CASE_IDS = ["default", *(p.stem for p in CI_VALUES)]
RELEASE, NAMESPACE = "demo", "llm"
# The CRD is shared data, not part of the project (1 MB); see notes/ray-platform.md section 6.
CRD_PATH = Path(
    os.environ.get(
        "MTPSERVE_KUBERAY_CRD",
        Path(__file__).resolve().parents[2] / "shared/kuberay/ray.io_rayservices.yaml",
    )
)
SEVERITY_WARNING = 2
K8S_VALUES = {"resources"}  # values passed through as Kubernetes objects


def load_values(path: Path | None) -> dict[str, Any] | None:
    return yaml.safe_load(path.read_text()) if path else None


def render(values: dict[str, Any] | None = None) -> dict[str, list[dict[str, Any]]]:
    """Template file name -> its rendered YAML documents (empty when gated off)."""
    chart = helm.Chart.load(CHART)
    try:
        out = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    finally:
        chart.close()
    docs = {}
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs[Path(path).name] = [d for d in yaml.safe_load_all(text) if d]
    return docs


@functools.cache
def render_case(path: Path | None) -> dict[str, list[dict[str, Any]]]:
    return render(load_values(path))


def rayservice(docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (rs,) = docs["rayservice.yaml"]
    return copy.deepcopy(rs)


def serve_config(rs: dict[str, Any]) -> dict[str, Any]:
    assert isinstance(rs["spec"]["serveConfigV2"], str)  # the CRD wants a YAML string
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def pod_templates(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rs["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]}
    pods.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return pods


# ---------------------------------------------------------------------------- CRD (strict)


def strict(schema: Any) -> Any:
    """additionalProperties: false on every object schema that lists properties, unless it
    preserves unknown fields. Recurses through schema positions only, so a field that happens
    to be named `properties` is not mistaken for a schema keyword."""
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, val in schema.items():
        if key in ("properties", "patternProperties"):
            out[key] = {name: strict(sub) for name, sub in val.items()}
        elif key in ("items", "additionalProperties", "not") and isinstance(val, dict):
            out[key] = strict(val)
        elif key in ("allOf", "anyOf", "oneOf"):
            out[key] = [strict(sub) for sub in val]
        else:
            out[key] = val
    if (
        "properties" in out
        and not out.get("x-kubernetes-preserve-unknown-fields")
        and "additionalProperties" not in out
    ):
        out["additionalProperties"] = False
    return out


@pytest.fixture(scope="module")
def crd_validator() -> jsonschema.Draft7Validator:
    if not CRD_PATH.is_file():
        pytest.skip(
            f"KubeRay RayService CRD not found at {CRD_PATH}; set MTPSERVE_KUBERAY_CRD to a copy "
            "of kuberay's ray-operator/config/crd/bases/ray.io_rayservices.yaml"
        )
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    with CRD_PATH.open() as f:
        crd = yaml.load(f, Loader=loader)
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = strict(v1["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": "RayService"}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return jsonschema.Draft7Validator(schema)


def crd_errors(validator: jsonschema.Draft7Validator, doc: dict[str, Any]) -> list[str]:
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_rayservice_matches_kuberay_crd(values_file: Path | None, crd_validator: Any) -> None:
    rs = rayservice(render_case(values_file))
    assert crd_errors(crd_validator, rs) == []


@pytest.mark.parametrize(
    "mutate, where",
    [
        (
            lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].update(minReplica=1),
            "workerGroupSpecs/0",
        ),
        (lambda rs: rs["spec"].update(serveConfigV2={"applications": []}), "serveConfigV2"),
        (
            lambda rs: pod_templates(rs)["decode"]["spec"]["containers"][0]["resources"][
                "limits"
            ].update({"nvidia.com/gpu": "eight"}),
            "limits",
        ),
        (
            lambda rs: rs["spec"]["rayClusterConfig"].update(authOptions={"mode": "on"}),
            "authOptions",
        ),
        (
            lambda rs: rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0].pop("groupName"),
            "workerGroupSpecs/0",
        ),
    ],
    ids=["unknown-key", "config-not-string", "bad-quantity", "bad-enum", "missing-required"],
)
def test_crd_check_catches_bad_manifests(mutate: Any, where: str, crd_validator: Any) -> None:
    rs = rayservice(render_case(None))
    mutate(rs)
    errors = crd_errors(crd_validator, rs)
    assert errors and any(where in e for e in errors), errors


# ---------------------------------------------------------------------------- lint + values


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_helm_lint_clean(values_file: Path | None) -> None:
    report = helm.lint(CHART, load_values(values_file), strict=True, kube_version="v1.30.0")
    problems = [m for m in report["messages"] if m["severity"] >= SEVERITY_WARNING]
    assert problems == [] and report["errors"] == []


@pytest.mark.parametrize(
    "values, where",
    [
        ({"workers": {"decode": {"gpusPerPod": "2"}}}, "/workers/decode/gpusPerPod"),
        ({"workers": {"decode": {"gpuPerPod": 2}}}, "gpuPerPod"),
        ({"serve": {"args": {"speculation": {"num_speculative_token": 3}}}}, "num_speculative"),
        ({"serve": {"args": {"decode": {"tp_size": "2"}}}}, "/serve/args/decode/tp_size"),
        ({"serve": {"args": {"device": "tpu"}}}, "/serve/args/device"),
        ({"serve": {"deployments": [{"name": "DecodeServer", "num_replica": 2}]}}, "num_replica"),
        ({"serve": {"deployments": [{"name": "Decoder"}]}}, "/serve/deployments/0/name"),
        ({"model": {"volume": {"type": "nfs"}}}, "/model/volume/type"),
        ({"monitoring": {"podMonitor": {"enabled": "yes"}}}, "/monitoring/podMonitor/enabled"),
        ({"replicaCount": 3}, "replicaCount"),
    ],
    ids=[
        "string-gpu-count",
        "typo-key",
        "typo-args-key",
        "string-tp",
        "bad-device",
        "typo-override",
        "unknown-deployment",
        "bad-volume-type",
        "string-bool",
        "unknown-top",
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    report = helm.lint(CHART, values, strict=True, kube_version="v1.30.0")
    assert any(where in e for e in report["errors"]), report["errors"]
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(values)


@pytest.mark.parametrize(
    "values, match",
    [
        ({"workers": {"decode": {"gpusPerPod": 1}}}, "workers.decode.gpusPerPod=1"),
        ({"workers": {"prefill": {"minReplicas": 5, "maxReplicas": 2}}}, "minReplicas"),
        ({"model": {"volume": {"type": "pvc"}}}, "claimName"),
        ({"model": {"volume": {"type": "hostPath"}}}, "hostPath"),
        ({"serve": {"args": {"auth": {"api_key": "plaintext"}}}}, "api_key"),
    ],
    ids=[
        "gpus-below-tp-group",
        "min-above-max",
        "pvc-no-claim",
        "hostpath-no-path",
        "plaintext-key",
    ],
)
def test_template_guards(values: dict[str, Any], match: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(match)):
        render(values)


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
    """serve.args mirrors ClusterConfig field for field; overrides allow DeploymentSchema only."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    serve = schema["properties"]["serve"]["properties"]
    _assert_mirrors(ClusterConfig, serve["args"], "serve.args")
    item = serve["deployments"]["items"]
    assert item["additionalProperties"] is False
    assert set(item["properties"]) == set(DeploymentSchema.model_fields)


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
            # Keys inside Kubernetes objects (resources, tolerations, ...) are examples of a
            # documented value, not chart API.
            passthrough = any(k in K8S_VALUES for _, k in stack)
            if key in _schema_fields(node) and not passthrough and not prev.startswith("#"):
                missing.append(".".join([k for _, k in stack] + [key]))
            stack.append((indent, key))
        if line.strip():
            prev = line.strip()
    assert missing == []


# ---------------------------------------------------------------------------- Serve config


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_serve_config_is_valid(values_file: Path | None) -> None:
    rs = rayservice(render_case(values_file))
    cfg = serve_config(rs)
    cc = check_serve_config(cfg)
    # The Serve HTTP port is the one the pods expose and the Service targets.
    head = pod_templates(rs)["head"]["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in head["ports"]}
    assert cfg["http_options"] == {"host": "0.0.0.0", "port": ports["serve"]}
    assert cc.http.port == ports["serve"]


def test_default_render_equals_production_config() -> None:
    """`helm install` with defaults runs exactly `serve deploy configs/production.yaml`."""
    production = yaml.safe_load((REPO / "configs" / "production.yaml").read_text())
    assert serve_config(rayservice(render_case(None))) == production


def test_values_flow_into_args() -> None:
    path = CHART / "ci" / "multi-gpu-values.yaml"
    values = load_values(path)
    cc = check_serve_config(serve_config(rayservice(render_case(path))))
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
    cc = ClusterConfig.model_validate(serve_config(rs)["applications"][0]["args"])
    groups = {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, settings in (("prefill", cc.prefill), ("decode", cc.decode)):
        group = groups[role]
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus = int(limits.get("nvidia.com/gpu", "0"))
        need = settings.tp_size * settings.gpus_per_rank
        assert gpus >= need, role
        if need:
            # Enough pods for the autoscaling ceiling, one or more replicas per pod.
            top = settings.autoscaling.max_replicas if settings.autoscaling else settings.replicas
            assert group["maxReplicas"] * (gpus // need) >= top, role
            assert group["template"]["spec"]["tolerations"], role
    head_params = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]
    assert head_params["num-cpus"] == "0"  # replicas stay off the head
    assert rs["spec"]["rayClusterConfig"]["rayVersion"] == "2.60.0"


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_every_pod_has_shm_and_model_volume(values_file: Path | None) -> None:
    values = load_values(values_file) or {}
    volume = values.get("model", {}).get("volume", {})
    for role, pod in pod_templates(rayservice(render_case(values_file))).items():
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
        assert vols["dshm"]["emptyDir"]["medium"] == "Memory", role
        assert mounts["dshm"]["mountPath"] == "/dev/shm", role
        if volume.get("type") == "pvc":
            assert vols["model"]["persistentVolumeClaim"]["claimName"] == volume["claimName"]
            assert mounts["model"]["mountPath"] == volume["mountPath"]
            assert values["serve"]["args"]["model"].startswith(volume["mountPath"] + "/")
        else:
            assert "model" not in vols, role


def test_model_from_host_path() -> None:
    values = {"model": {"volume": {"type": "hostPath", "hostPath": "/mnt/models"}}}
    for pod in pod_templates(rayservice(render(values))).values():
        vols = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert vols["model"]["hostPath"]["path"] == "/mnt/models"


# ---------------------------------------------------------------------------- auth


def _key_refs(rs: dict[str, Any]) -> dict[str, tuple[str, str, str]]:
    refs = {}
    for role, pod in pod_templates(rs).items():
        for env in pod["spec"]["containers"][0].get("env", []):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                refs[role] = (env["name"], ref["name"], ref["key"])
    return refs


def test_default_auth_creates_secret_and_wires_env() -> None:
    docs = render_case(None)
    (secret,) = docs["secret.yaml"]
    key_name = f"{RELEASE}-mtpserve-api-key"
    assert secret["metadata"]["name"] == key_name and len(secret["data"]["api-key"]) > 40
    rs = rayservice(docs)
    want = ("MTPSERVE_API_KEY", key_name, "api-key")
    assert _key_refs(rs) == {"head": want, "prefill": want, "decode": want}
    args = serve_config(rs)["applications"][0]["args"]
    assert args["auth"] == {"api_key_env": "MTPSERVE_API_KEY"}
    assert "api_key:" not in rs["spec"]["serveConfigV2"]  # only the variable's name travels


def test_existing_secret_and_no_auth() -> None:
    multi = render_case(CHART / "ci" / "multi-gpu-values.yaml")
    assert multi["secret.yaml"] == []
    assert set(_key_refs(rayservice(multi)).values()) == {
        ("MTPSERVE_API_KEY", "mtpserve-api-key", "token")
    }
    cpu = render_case(CHART / "ci" / "cpu-values.yaml")
    assert cpu["secret.yaml"] == [] and _key_refs(rayservice(cpu)) == {}
    assert "auth" not in serve_config(rayservice(cpu))["applications"][0]["args"]


def test_given_api_key_is_stored() -> None:
    (secret,) = render({"auth": {"apiKey": "sk-test"}})["secret.yaml"]
    assert secret["data"]["api-key"] == "c2stdGVzdA=="  # base64("sk-test")


# ---------------------------------------------------------------------------- service, monitoring


def test_service_targets_serve_port_on_head() -> None:
    (svc,) = render_case(None)["service.yaml"]
    (port,) = svc["spec"]["ports"]
    assert (port["port"], port["targetPort"]) == (8000, "serve")
    assert svc["spec"]["selector"] == {
        "app.kubernetes.io/name": "mtpserve",
        "app.kubernetes.io/instance": RELEASE,
        "ray.io/node-type": "head",
    }
    head = pod_templates(rayservice(render_case(None)))["head"]["metadata"]["labels"]
    selector = {k: v for k, v in svc["spec"]["selector"].items() if not k.startswith("ray.io")}
    assert selector.items() <= head.items()


def test_monitoring_is_gated() -> None:
    default = render_case(None)
    assert default["podmonitor.yaml"] == [] and default["grafana-dashboard.yaml"] == []
    multi = render_case(CHART / "ci" / "multi-gpu-values.yaml")
    (pm,) = multi["podmonitor.yaml"]
    assert pm["kind"] == "PodMonitor" and pm["apiVersion"] == "monitoring.coreos.com/v1"
    assert pm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert [e["port"] for e in pm["spec"]["podMetricsEndpoints"]] == ["metrics"]
    # Every Ray container exposes the port the PodMonitor scrapes.
    for role, pod in pod_templates(rayservice(multi)).items():
        names = {p["name"] for p in pod["spec"]["containers"][0]["ports"]}
        assert "metrics" in names, role
        assert (
            pm["spec"]["selector"]["matchLabels"].items() - {("ray.io/is-ray-node", "yes")}
            <= pod["metadata"]["labels"].items()
        )


def test_dashboard_panels() -> None:
    (cm,) = render_case(CHART / "ci" / "multi-gpu-values.yaml")["grafana-dashboard.yaml"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dash = json.loads(cm["data"]["mtpserve.json"])
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in dash["panels"]}
    wanted = {
        "TTFT": "ray_mtpserve_ttft_ms_bucket",
        "TPOT": "ray_mtpserve_tpot_ms_bucket",
        "acceptance": "ray_mtpserve_spec_acceptance_rate",
        "tokens/s": "ray_mtpserve_generated_tokens_total",
        "KV": "ray_mtpserve_kv_blocks_used",
        "Replicas": "ray_serve_deployment_replica_healthy",
    }
    for word, metric in wanted.items():
        assert any(word in title and metric in e for title, e in exprs.items()), word
    assert len({p["id"] for p in dash["panels"]}) == len(dash["panels"])
