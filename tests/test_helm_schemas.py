"""Every object helm/mtpserve renders validates against its kind's schema, strictly.

The RayService against KubeRay v1.7.0's CRD, the `helm test` Pod against the PodTemplateSpec
that CRD embeds, built-in kinds against Kubernetes v1.30's OpenAPI, PodMonitor/HTTPRoute/
PrometheusRule against hand-written subsets; unknown keys are errors everywhere (the API server
would silently prune them). All schemas are vendored (tests/data/, tests/helm_render.py), so
nothing skips.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helm_render import (
    CASE_IDS,
    CASES,
    MULTI,
    crd_validator,
    objects,
    pod_templates,
    rayservice,
    render,
    render_case,
    schema_errors,
)

# Every optional object on at once, so each template is validated at least once (the
# incremental upgrade, which excludes an HTTPRoute, is in ci/multi-gpu-values.yaml).
EVERYTHING: dict[str, Any] = {
    "model": {"source": "hf", "hf": {"repo": "org/model", "cache": "pvc",
                                     "tokenSecret": {"name": "hf"}},
              "pvc": {"create": True, "storageClassName": "fast"}},
    "httpRoute": {"enabled": True, "parentRefs": [{"name": "gw", "namespace": "gateways"}],
                  "hostnames": ["llm.example.com"], "annotations": {"a": "b"}},
    "monitoring": {"podMonitor": {"enabled": True}, "grafanaDashboard": {"enabled": True},
                   "prometheusRule": {"enabled": True, "labels": {"release": "prom"}}},
    "networkPolicy": {"egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}],
                      "extraIngress": [{"from": [{"ipBlock": {"cidr": "10.1.0.0/16"}}]}],
                      "apiServer": {"peers": [{"ipBlock": {"cidr": "172.20.0.1/32"}}]}},
    "serviceAccount": {"annotations": {"iam.gke.io/gcp-service-account": "x@y.iam"}},
    "gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379"},
    "rayService": {"annotations": {"ray.io/initializing-timeout": "30m"},
                   "labels": {"team": "llm"}},
    "rayAuth": {"secretName": "ray-token"},
    "autoscaler": {"version": "v2"},
    "rdma": {"resourceName": "rdma/hca"},
    "priorityClassName": "high",
    "runtimeClassName": "nvidia",
    "extraVolumes": [{"name": "x", "emptyDir": {}}],
    "extraVolumeMounts": [{"name": "x", "mountPath": "/x"}],
    "extraInitContainers": [{"name": "w", "image": "busybox", "command": ["true"]}],
    "serveService": {"type": "LoadBalancer", "annotations": {"lb": "internal"}},
    "upgrade": {"rayClusterDeletionDelaySeconds": 1200},
}
INGRESS = {"ingress": {"enabled": True, "className": "nginx", "host": "llm.example.com",
                       "tls": [{"hosts": ["llm.example.com"], "secretName": "tls"}]}}


@pytest.mark.parametrize("values_file", CASES, ids=CASE_IDS)
def test_rendered_objects_match_their_schemas(values_file: Path | None) -> None:
    docs = objects(render_case(values_file))
    assert docs
    assert [e for d in docs for e in schema_errors(d)] == []


@pytest.mark.parametrize("values", [EVERYTHING, INGRESS], ids=["everything", "ingress"])
def test_every_template_matches_its_schema(values: dict[str, Any]) -> None:
    docs = objects(render(values))
    assert [e for d in docs for e in schema_errors(d)] == []


def test_everything_renders_every_kind() -> None:
    kinds = {d["kind"] for d in objects(render(EVERYTHING))}
    kinds |= {d["kind"] for d in objects(render(INGRESS))}
    assert kinds == {"RayService", "Secret", "ServiceAccount", "NetworkPolicy",
                     "PodDisruptionBudget", "PersistentVolumeClaim", "HTTPRoute", "Ingress",
                     "PodMonitor", "ConfigMap", "PrometheusRule", "Pod"}


def _crd_errors(doc: dict[str, Any]) -> list[str]:
    return ["/".join(map(str, e.absolute_path)) + ": " + e.message
            for e in crd_validator().iter_errors(doc)]


def _group(rs: dict[str, Any], i: int = 0) -> dict[str, Any]:
    return rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][i]


@pytest.mark.parametrize(
    "mutate, where",
    [
        (lambda rs: _group(rs).update(minReplica=1), "workerGroupSpecs/0"),
        (lambda rs: rs["spec"].update(serveConfigV2={"applications": []}), "serveConfigV2"),
        (lambda rs: pod_templates(rs)["decode"]["spec"]["containers"][0]["resources"][
            "limits"].update({"nvidia.com/gpu": "eight"}), "limits"),
        (lambda rs: rs["spec"]["rayClusterConfig"].update(authOptions={"mode": "on"}),
         "authOptions"),
        (lambda rs: _group(rs).pop("groupName"), "workerGroupSpecs/0"),
        (lambda rs: rs["spec"].update(rayClusterDeletionDelaySeconds=-1),
         "rayClusterDeletionDelaySeconds"),
        (lambda rs: rs["spec"]["serveService"]["spec"].update(tpye="ClusterIP"), "serveService"),
        (lambda rs: pod_templates(rs)["head"]["spec"]["securityContext"].update(
            runAsNonRoot="yes"), "securityContext"),
    ],
    ids=["unknown-key", "config-not-string", "bad-quantity", "bad-enum", "missing-required",
         "negative-delay", "typo-in-serve-service", "string-bool-in-pod"],
)
def test_crd_check_catches_bad_manifests(mutate: Any, where: str) -> None:
    rs = rayservice(render_case(None))
    mutate(rs)
    errors = _crd_errors(rs)
    assert errors and any(where in e for e in errors), errors


@pytest.mark.parametrize(
    "template, mutate, where",
    [
        ("networkpolicy.yaml", lambda d: d["spec"].update(podSelectr={}), "podSelectr"),
        ("poddisruptionbudget.yaml", lambda d: d["spec"].update(maxUnavailable=[1]),
         "maxUnavailable"),
        ("secret.yaml", lambda d: d.update(typ="Opaque"), "typ"),
        ("serviceaccount.yaml", lambda d: d.update(automountServiceAccountToken="no"),
         "automountServiceAccountToken"),
        ("test-api.yaml", lambda d: d["spec"]["containers"][0]["securityContext"].update(
            runAsNonRoot="yes"), "securityContext"),
        ("test-api.yaml", lambda d: d["spec"].update(restartPolicyy="Never"), "restartPolicyy"),
        ("prometheusrule.yaml", lambda d: d["spec"]["groups"][0]["rules"][0].update(
            **{"for": "ten minutes"}), "rules/0/for"),
        ("prometheusrule.yaml", lambda d: d["spec"]["groups"][1]["rules"][0].update(
            severity="page"), "severity"),
    ],
    ids=["networkpolicy", "pdb", "secret", "serviceaccount", "test-pod-bool", "test-pod-typo",
         "rule-duration", "rule-unknown-key"],
)
def test_k8s_schemas_catch_bad_manifests(template: str, mutate: Any, where: str) -> None:
    # The multi-GPU set renders the PrometheusRule; the defaults the API key Secret.
    doc = render_case(MULTI if template == "prometheusrule.yaml" else None)[template][0]
    mutate(doc)
    errors = schema_errors(doc)
    assert errors and any(where in e for e in errors), errors


def test_unknown_kinds_are_errors() -> None:
    assert schema_errors({"apiVersion": "v1", "kind": "ReplicationController"}) == [
        "v1/ReplicationController: no schema vendored for this kind"
    ]
    route = render({"httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]}})
    (doc,) = route["httproute.yaml"]
    doc["spec"]["rules"][0]["backendRefs"][0]["prot"] = 8000
    assert any("prot" in e for e in schema_errors(doc))
