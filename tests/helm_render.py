"""Render helm/mtpserve offline and validate what Kubernetes would receive (shared by the
tests/test_helm_*.py files).

`helm-python-sdk` runs Helm's own engine (values.schema.json, templates, `fail`); `lookup`
returns nothing offline. Schemas are vendored under tests/data/ (see its README), plus two built
here (a bare Pod from the CRD's embedded PodTemplateSpec, a PrometheusRule subset), so nothing
here depends on files outside the repository.
"""

from __future__ import annotations

import copy
import functools
import gzip
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import yaml

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "helm" / "mtpserve"
MULTI = CHART / "ci" / "multi-gpu-values.yaml"
CPU = CHART / "ci" / "cpu-values.yaml"
GPU_NODE = CHART / "ci" / "gpu-node-values.yaml"
DATA = Path(__file__).resolve().parent / "data"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
CASES: list[Path | None] = [None, *CI_VALUES]
CASE_IDS = ["default", *(p.stem for p in CI_VALUES)]
RELEASE, NAMESPACE = "demo", "llm"
KUBE_VERSION = "v1.30.0"


def load_values(path: Path | None) -> dict[str, Any] | None:
    return yaml.safe_load(path.read_text()) if path else None


def _render_raw(values: dict[str, Any] | None, is_upgrade: bool) -> dict[str, str]:
    chart = helm.Chart.load(CHART)
    try:
        return chart.render(
            values=values,
            name=RELEASE,
            namespace=NAMESPACE,
            is_install=not is_upgrade,
            is_upgrade=is_upgrade,
        )
    finally:
        chart.close()


def render_notes(values: dict[str, Any] | None = None) -> str:
    """The install notes (templates/NOTES.txt) as Helm prints them."""
    (text,) = [t for p, t in _render_raw(values, False).items() if p.endswith("NOTES.txt")]
    return text


def render(
    values: dict[str, Any] | None = None, *, is_upgrade: bool = False
) -> dict[str, list[dict[str, Any]]]:
    """Template file name -> its rendered YAML documents (empty when gated off)."""
    out = _render_raw(values, is_upgrade)
    docs = {}
    for path, text in out.items():
        if path.endswith(".yaml"):
            docs[Path(path).name] = [d for d in yaml.safe_load_all(text) if d]
    return docs


@functools.cache
def _render_cached(path: Path | None) -> dict[str, list[dict[str, Any]]]:
    return render(load_values(path))


def render_case(path: Path | None) -> dict[str, list[dict[str, Any]]]:
    return copy.deepcopy(_render_cached(path))


def objects(docs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [d for ds in docs.values() for d in ds]


def rayservice(docs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    (rs,) = docs["rayservice.yaml"]
    return rs


def serve_config(rs: dict[str, Any]) -> dict[str, Any]:
    assert isinstance(rs["spec"]["serveConfigV2"], str)  # the CRD wants a YAML string
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def pod_templates(rs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rs["spec"]["rayClusterConfig"]
    pods = {"head": cluster["headGroupSpec"]["template"]}
    pods.update({g["groupName"]: g["template"] for g in cluster["workerGroupSpecs"]})
    return pods


# ---------------------------------------------------------------------------- schemas


def strict(schema: Any) -> Any:
    """additionalProperties: false on every object schema that lists properties, unless it
    preserves unknown fields (kubeconform --strict; the API server would silently prune them).
    Recurses through schema positions only, so a field named `properties` is not mistaken for
    the keyword."""
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


@functools.cache
def crd_validator() -> jsonschema.Draft7Validator:
    with gzip.open(DATA / "kuberay-rayservice-v1.7.0.schema.json.gz", "rt") as f:
        schema = strict(json.load(f)["openAPIV3Schema"])
    schema["properties"]["apiVersion"] = {"const": "ray.io/v1"}
    schema["properties"]["kind"] = {"const": "RayService"}
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    return jsonschema.Draft7Validator(schema)


@functools.cache
def pod_validator() -> jsonschema.Draft7Validator:
    """A bare v1 Pod (the `helm test` hook), strictly: its metadata and spec schemas are the
    PodTemplateSpec that the KubeRay CRD embeds (Kubernetes' own PodSpec, vendored with it)."""
    with gzip.open(DATA / "kuberay-rayservice-v1.7.0.schema.json.gz", "rt") as f:
        crd = json.load(f)["openAPIV3Schema"]
    template = crd["properties"]["spec"]["properties"]["rayClusterConfig"]["properties"][
        "headGroupSpec"]["properties"]["template"]["properties"]
    schema = strict({
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": "v1"}, "kind": {"const": "Pod"},
                       "metadata": template["metadata"], "spec": template["spec"]},
    })
    return jsonschema.Draft7Validator(schema)


_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": "^([0-9]+(ms|s|m|h|d|w|y))+$"}
# Hand-written strict subset of the Prometheus Operator's PrometheusRule (monitoring.coreos.com/v1),
# from its CRD's field names, like tests/data/minimal-crd-schemas.json.
PROMETHEUS_RULE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "PrometheusRule"},
        "metadata": {"type": "object", "additionalProperties": False, "required": ["name"],
                     "properties": {"name": {"type": "string"}, "namespace": {"type": "string"},
                                    "labels": _STR_MAP, "annotations": _STR_MAP}},
        "spec": {"type": "object", "additionalProperties": False, "required": ["groups"],
                 "properties": {"groups": {"type": "array", "items": {
                     "type": "object", "additionalProperties": False,
                     "required": ["name", "rules"],
                     "properties": {
                         "name": {"type": "string", "minLength": 1},
                         "interval": _DURATION,
                         "rules": {"type": "array", "minItems": 1, "items": {
                             "type": "object", "additionalProperties": False,
                             "required": ["expr"],
                             "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                             "properties": {
                                 "alert": {"type": "string", "pattern": "^[A-Za-z][A-Za-z0-9_]*$"},
                                 "record": {"type": "string"},
                                 "expr": {"type": "string", "minLength": 1},
                                 "for": _DURATION,
                                 "keep_firing_for": _DURATION,
                                 "labels": _STR_MAP,
                                 "annotations": _STR_MAP}}}}}}}},
    },
}


@functools.cache
def kind_validators() -> dict[str, jsonschema.protocols.Validator]:
    """`apiVersion/kind` -> validator, for every kind the chart may render."""
    out: dict[str, jsonschema.protocols.Validator] = {
        "ray.io/v1/RayService": crd_validator(),
        "v1/Pod": pod_validator(),
        "monitoring.coreos.com/v1/PrometheusRule":
            jsonschema.Draft202012Validator(PROMETHEUS_RULE_SCHEMA),
    }
    for name in ("k8s-schemas-v1.30.json", "minimal-crd-schemas.json"):
        bundle = json.loads((DATA / name).read_text())
        for kind, schema in bundle["kinds"].items():
            full = {k: v for k, v in schema.items() if k not in ("$id", "$schema")}
            full["$defs"] = bundle["$defs"]
            out[kind] = jsonschema.Draft202012Validator(full)
    return out


def schema_errors(doc: dict[str, Any]) -> list[str]:
    """Errors of one rendered object against its kind's schema (unknown kinds are errors)."""
    kind = f"{doc.get('apiVersion')}/{doc.get('kind')}"
    validator = kind_validators().get(kind)
    if validator is None:
        return [f"{kind}: no schema vendored for this kind"]
    return [
        f"{kind} {'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(doc)
    ]
