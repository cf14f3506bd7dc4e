"""helm/mtpserve refuses bad values at install time, not once the cluster runs.

Two layers: values.schema.json (types, enums, unknown keys: `helm lint` and every render) and
templates/_validate.tpl (`fail` on combinations that render valid objects but break at runtime:
an unplaceable replica, a Serve app that fails to build, requests cut by an upgrade).
"""

from __future__ import annotations

import re
from typing import Any

import helm_python as helm
import pytest
from helm_render import KUBE_VERSION, render

CHART_VALUES_ERRORS = [
    ({"workers": {"decode": {"gpusPerPod": "2"}}}, "/workers/decode/gpusPerPod"),
    ({"workers": {"decode": {"gpuPerPod": 2}}}, "gpuPerPod"),
    ({"serve": {"args": {"speculation": {"num_speculative_token": 3}}}}, "num_speculative"),
    ({"serve": {"args": {"decode": {"tp_size": "2"}}}}, "/serve/args/decode/tp_size"),
    ({"serve": {"args": {"device": "tpu"}}}, "/serve/args/device"),
    ({"serve": {"deployments": [{"name": "DecodeServer", "num_replica": 2}]}}, "num_replica"),
    ({"serve": {"deployments": [{"name": "Decoder"}]}}, "/serve/deployments/0/name"),
    ({"model": {"source": "nfs"}}, "/model/source"),
    ({"model": {"volume": {"type": "pvc"}}}, "volume"),
    ({"monitoring": {"podMonitor": {"enabled": "yes"}}}, "/monitoring/podMonitor/enabled"),
    ({"upgrade": {"strategy": "Rolling"}}, "/upgrade/strategy"),
    ({"serveService": {"type": "External"}}, "/serveService/type"),
    ({"replicaCount": 3}, "replicaCount"),
    ({"service": {"enabled": True}}, "service"),
    ({"rolePinning": {"labelKey": "mtpserve.io/role"}}, "labelKey"),
    ({"upgrade": {"incremental": {"featureGateEnabled": "yes"}}},
     "/upgrade/incremental/featureGateEnabled"),
    ({"serve": {"args": {"decode": {"resources": {"mtpserve-decode": "one"}}}}},
     "/serve/args/decode/resources/mtpserve-decode"),
    ({"serve": {"args": {"ingress": {"replica": 2}}}}, "replica"),
    ({"model": {"hf": {"allowPatterns": []}}}, "/model/hf/allowPatterns"),
    ({"monitoring": {"prometheusRule": {"kvCacheFor": "10 minutes"}}},
     "/monitoring/prometheusRule/kvCacheFor"),
    ({"helmTest": {"url": "llm.example.com"}}, "/helmTest/url"),
]


@pytest.mark.parametrize(
    "values, where",
    CHART_VALUES_ERRORS,
    ids=[
        "string-gpu-count",
        "typo-key",
        "typo-args-key",
        "string-tp",
        "bad-device",
        "typo-override",
        "unknown-deployment",
        "bad-model-source",
        "old-model-volume-key",
        "string-bool",
        "bad-upgrade-strategy",
        "bad-service-type",
        "unknown-top",
        "removed-head-service",
        "removed-label-pinning",
        "string-feature-gate",
        "string-custom-resource",
        "typo-ingress-args",
        "no-download-patterns",
        "bad-alert-duration",
        "test-url-without-scheme",
    ],
)
def test_values_schema_rejects_bad_values(values: dict[str, Any], where: str) -> None:
    report = helm.lint("helm/mtpserve", values, strict=True, kube_version=KUBE_VERSION)
    assert any(where in e for e in report["errors"]), report["errors"]
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        render(values)


def _cpu(**args: Any) -> dict[str, Any]:
    """CPU args that pass the checks, with `args` merged over them."""
    base = {"device": "cpu", "dtype": "float32", "kv_transfer": {"backend": "gloo"},
            "prefill": {"gpus_per_rank": 0, "autoscaling": None},
            "decode": {"gpus_per_rank": 0, "autoscaling": None}}
    base.update(args)
    return {"serve": {"args": base},
            "workers": {"prefill": {"gpusPerPod": 0}, "decode": {"gpusPerPod": 0}}}


# Each case renders valid Kubernetes objects without the guard, and fails only at runtime.
RUNTIME_FAILURES = {
    # ClusterConfig rejects it when Serve builds the app.
    "nccl-on-cpu": (
        {**_cpu(), "serve": {"args": {**_cpu()["serve"]["args"],
                                      "kv_transfer": {"backend": "nccl"}}}},
        "kv_transfer.backend nccl needs serve.args.device cuda",
    ),
    "cuda-without-gpus": (
        {"workers": {"prefill": {"gpusPerPod": 0}},
         "serve": {"args": {"prefill": {"gpus_per_rank": 0}}}},
        "serve.args.device is cuda but workers.prefill.gpusPerPod is 0",
    ),
    # The autoscaler can never add the pods Serve asks for: replicas stay pending forever.
    "decode-autoscaling-beyond-group": (
        {"serve": {"args": {"decode": {"autoscaling": {"max_replicas": 8}}}}},
        "serve.args.decode.autoscaling.max_replicas=8 exceeds what workers.decode can hold",
    ),
    "prefill-replicas-beyond-fixed-group": (
        {"autoscaler": {"enabled": False},
         "serve": {"args": {"prefill": {"autoscaling": None, "replicas": 3}}}},
        "serve.args.prefill.replicas=3 exceeds what workers.prefill can hold: 2 pods",
    ),
    "pod-cpu-below-tp-group": (
        {"serve": {"args": {"decode": {"cpus_per_rank": 10}}}},
        "workers.decode pod CPU (16) is below one replica's CPUs (tp_size × cpus_per_rank = 20)",
    ),
    "milli-cpu-below-rank": (
        _cpu() | {"workers": {"prefill": {"gpusPerPod": 0, "resources": {
            "limits": {"cpu": "500m", "memory": "1Gi"}}}, "decode": {"gpusPerPod": 0}}},
        "workers.prefill pod CPU (0.5) is below one replica's CPUs",
    ),
    "gpus-below-tp-group": (
        {"workers": {"decode": {"gpusPerPod": 1}}},
        "workers.decode.gpusPerPod=1 is below one replica's GPUs",
    ),
    "fractional-gpu-with-tp": (
        {"serve": {"args": {"decode": {"gpus_per_rank": 0.5}}}},
        "serve.args.decode.gpus_per_rank=0.5 is fractional with tp_size=2",
    ),
    "model-outside-volume": (
        {"model": {"source": "pvc", "pvc": {"claimName": "ckpt"}},
         "serve": {"args": {"model": "/data/ckpt"}}},
        "serve.args.model=/data/ckpt is outside the model volume mounted at /models",
    ),
    "model-prefix-not-folder": (
        {"model": {"source": "pvc", "pvc": {"claimName": "ckpt"}},
         "serve": {"args": {"model": "/models-old/ckpt"}}},
        "is outside the model volume",
    ),
    "model-under-unmounted-path": (
        {"serve": {"args": {"model": "/models/ckpt"}}},
        "model.source is image (nothing is mounted there)",
    ),
    # Serve config overrides replace the builder's options instead of merging with them.
    "override-ray-actor-options": (
        {"serve": {"deployments": [{"name": "DecodeServer",
                                    "ray_actor_options": {"num_cpus": 4}}]}},
        "serve.deployments[DecodeServer].ray_actor_options would replace the builder's",
    ),
    "override-autoscaling-config": (
        {"serve": {"deployments": [{"name": "PrefillServer",
                                    "autoscaling_config": {"max_replicas": 9}}]}},
        "serve.deployments[PrefillServer].autoscaling_config would replace",
    ),
    "override-placement-group": (
        {"serve": {"deployments": [{"name": "DecodeServer",
                                    "placement_group_bundles": [{"CPU": 1}]}]}},
        "placement_group_bundles would replace",
    ),
    # The API unreachable behind its Service.
    "http-host-loopback": (
        {"serve": {"args": {"http": {"host": "127.0.0.1"}}}},
        "serve.args.http.host=127.0.0.1 binds the API to the pod itself",
    ),
    "http-port-taken-by-ray": (
        {"serve": {"args": {"http": {"port": 8080}}}},
        "serve.args.http.port=8080 collides with a Ray port",
    ),
    "metrics-port-moved": (
        {"workers": {"decode": {"rayStartParams": {"metrics-export-port": "9090"}}}},
        "workers.decode.rayStartParams.metrics-export-port: the chart's container ports",
    ),
    "dashboard-port-moved": (
        {"head": {"rayStartParams": {"dashboard-port": "9265"}}},
        "head.rayStartParams.dashboard-port",
    ),
    "no-proxies": ({"serve": {"proxyLocation": "Disabled"}}, "proxyLocation Disabled"),
    "head-only-proxy-excluded": (
        {"serve": {"proxyLocation": "HeadOnly"}},
        "serveService.excludeHeadPod with serve.proxyLocation HeadOnly",
    ),
    # Upgrades and shutdown cutting requests.
    "deletion-delay-below-timeout": (
        {"upgrade": {"rayClusterDeletionDelaySeconds": 60}},
        "upgrade.rayClusterDeletionDelaySeconds=60 is below serve.args.request_timeout_s=600",
    ),
    "grace-below-drain": (
        {"terminationGracePeriodSeconds": 20,
         "serve": {"args": {"graceful_shutdown_timeout_s": 45}}},
        "terminationGracePeriodSeconds=20 is below serve.args.graceful_shutdown_timeout_s=45",
    ),
    "override-graceful-shutdown": (
        {"serve": {"deployments": [{"name": "DecodeServer",
                                    "graceful_shutdown_timeout_s": 900}]}},
        "graceful_shutdown_timeout_s would replace",
    ),
    "incremental-without-feature-gate": (
        {"upgrade": {"strategy": "NewClusterWithIncrementalUpgrade",
                     "incremental": {"gatewayClassName": "istio"}}},
        'without it KubeRay treats this strategy as "no upgrades"',
    ),
    "incremental-without-gateway": (
        {"upgrade": {"strategy": "NewClusterWithIncrementalUpgrade",
                     "incremental": {"featureGateEnabled": True}}},
        "needs upgrade.incremental.gatewayClassName",
    ),
    "incremental-with-ingress": (
        {"ingress": {"enabled": True},
         "upgrade": {"strategy": "NewClusterWithIncrementalUpgrade",
                     "incremental": {"gatewayClassName": "istio", "featureGateEnabled": True}}},
        "the Ingress would point at demo-mtpserve-serve-svc, which KubeRay does not create",
    ),
    "incremental-step-above-surge": (
        {"upgrade": {"strategy": "NewClusterWithIncrementalUpgrade",
                     "incremental": {"gatewayClassName": "istio", "featureGateEnabled": True,
                                     "maxSurgePercent": 10, "stepSizePercent": 20}}},
        "stepSizePercent exceeds maxSurgePercent",
    ),
    # Drains: the preStop hook must have time to hand replicas over.
    "drain-deadline-below-shutdown": (
        {"drain": {"deadlineSeconds": 20}},
        "the worker drain deadline (20 s",
    ),
    "grace-shorter-than-prestop": (
        {"terminationGracePeriodSeconds": 100, "drain": {"deadlineSeconds": 80}},
        "terminationGracePeriodSeconds=100 does not cover the worker preStop",
    ),
    "grace-leaves-no-drain": (
        {"terminationGracePeriodSeconds": 45},
        "is below serve.args.graceful_shutdown_timeout_s=30",
    ),
    "incremental-without-autoscaler": (
        {"autoscaler": {"enabled": False},
         "serve": {"args": {"prefill": {"autoscaling": None}, "decode": {"autoscaling": None}}},
         "upgrade": {"strategy": "NewClusterWithIncrementalUpgrade",
                     "incremental": {"gatewayClassName": "istio", "featureGateEnabled": True}}},
        "NewClusterWithIncrementalUpgrade needs autoscaler.enabled",
    ),
    "incremental-with-load-balancer": (
        {"serveService": {"type": "LoadBalancer"},
         "upgrade": {"strategy": "NewClusterWithIncrementalUpgrade",
                     "incremental": {"gatewayClassName": "istio", "featureGateEnabled": True}}},
        "KubeRay then ignores spec.serveService",
    ),
    "incremental-with-own-route": (
        {"httpRoute": {"enabled": True, "parentRefs": [{"name": "gw"}]},
         "upgrade": {"strategy": "NewClusterWithIncrementalUpgrade",
                     "incremental": {"gatewayClassName": "istio", "featureGateEnabled": True}}},
        "a second route would bypass the traffic split",
    ),
    # Model delivery.
    "pvc-without-claim": ({"model": {"source": "pvc"}}, "model.pvc.claimName is empty"),
    "hostpath-without-path": ({"model": {"source": "hostPath"}}, "model.hostPath is empty"),
    "hf-without-repo": ({"model": {"source": "hf"}}, "model.hf.repo is empty"),
    "hf-cache-pvc-without-claim": (
        {"model": {"source": "hf", "hf": {"repo": "o/m", "cache": "pvc"}}},
        "model.hf.cache is pvc but model.pvc.claimName is empty",
    ),
    "hf-cache-read-only": (
        {"model": {"source": "hf", "hf": {"repo": "o/m", "cache": "pvc"},
                   "pvc": {"create": True, "accessModes": ["ReadOnlyMany"]}}},
        "the download cannot write",
    ),
    # Production knobs.
    "gcs-ft-without-redis": ({"gcsFaultTolerance": {"enabled": True}}, "needs gcsFaultTolerance"),
    "external-storage-namespace": (
        {"gcsFaultTolerance": {"enabled": True, "redisAddress": "redis:6379",
                               "externalStorageNamespace": "mtpserve"}},
        "a fixed Redis namespace makes the old and new RayCluster of an upgrade share",
    ),
    "external-storage-namespace-annotation": (
        {"rayService": {"annotations": {"ray.io/external-storage-namespace": "x"}}},
        "KubeRay copies it to every RayCluster",
    ),
    "bad-initializing-timeout": (
        {"rayService": {"annotations": {"ray.io/initializing-timeout": "soon"}}},
        'ray.io/initializing-timeout]="soon": KubeRay wants a Go duration',
    ),
    "egress-without-api-server": (
        {"networkPolicy": {"egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}]}},
        "the head's autoscaler sidecar could not reach the Kubernetes API server",
    ),
    "alerts-without-scrape": (
        {"monitoring": {"prometheusRule": {"enabled": True}}},
        "monitoring.prometheusRule needs monitoring.podMonitor",
    ),
    # Role pinning: bundles that no pod offers never get placed; shared ones pin nothing.
    "pinning-without-resources": (
        {"serve": {"args": {"decode": {"resources": {"mtpserve-decode": None}}}}},
        "rolePinning.enabled but serve.args.decode.resources is empty",
    ),
    "pinning-shared-resource": (
        {"serve": {"args": {"prefill": {"resources": {"mtpserve-decode": 1}}}}},
        'both ask for "mtpserve-decode"',
    ),
    "pinning-fractional-offer": (
        {"serve": {"args": {"prefill": {"resources": {"mtpserve-prefill": 0.5}}}}},
        "workers.prefill pods would advertise mtpserve-prefill=0.5",
    ),
    "pinning-and-own-resources-param": (
        {"workers": {"decode": {"rayStartParams": {"resources": "'{\"x\": 1}'"}}}},
        "workers.decode.rayStartParams.resources: with rolePinning the chart sets it",
    ),
    "resources-nobody-offers": (
        {"rolePinning": {"enabled": False}},
        'serve.args.prefill.resources asks for "mtpserve-prefill", which no worker group',
    ),
    # Sizing: the object store must fit /dev/shm, the ingress the pods' spare CPUs.
    "shm-below-headroom": (
        {"sharedMemory": {"sizeLimit": "1Gi"}},
        "Ray's object store would get 0 MiB",
    ),
    "object-store-above-shm": (
        {"sharedMemory": {"sizeLimit": "8Gi"},
         "workers": {"decode": {"rayStartParams": {"object-store-memory": "8000000000"}}}},
        "workers.decode.rayStartParams.object-store-memory=8000000000 does not fit",
    ),
    "no-memory-to-size-from": (
        {"workers": {"prefill": {"resources": {"limits": {"memory": None},
                                               "requests": {"memory": None}}}}},
        "workers.prefill has no memory limit or request",
    ),
    "unreadable-memory": (
        {"head": {"resources": {"limits": {"memory": "8GB"}}}},
        '"8GB" is not a memory quantity',
    ),
    "ingress-beyond-spare-cpus": (
        {"serve": {"args": {"ingress": {"cpus": 4, "autoscaling": {"max_replicas": 40}}}}},
        "serve.args.ingress: 40 replicas × 4 CPUs exceed",
    ),
    "ingress-and-route": (
        {"ingress": {"enabled": True}, "httpRoute": {"enabled": True, "parentRefs": []}},
        "pick one entry point",
    ),
    "min-above-max": (
        {"workers": {"prefill": {"minReplicas": 5, "maxReplicas": 2}}},
        "workers.prefill.minReplicas exceeds maxReplicas",
    ),
    "replicas-outside-bounds": (
        {"workers": {"prefill": {"replicas": 9}}},
        "workers.prefill.replicas=9 is outside minReplicas..maxReplicas",
    ),
    "plaintext-key": (
        {"serve": {"args": {"auth": {"api_key": "plaintext"}}}},
        "serve.args.auth.api_key would store the key in the RayService",
    ),
}


@pytest.mark.parametrize("values, match", RUNTIME_FAILURES.values(), ids=RUNTIME_FAILURES.keys())
def test_render_fails_for_runtime_only_failures(values: dict[str, Any], match: str) -> None:
    with pytest.raises(helm.HelmRenderError, match=re.escape(match)):
        render(values)


def test_the_cpu_base_of_the_cases_renders() -> None:
    """The guards fire on the change each case makes, not on its CPU base."""
    render(_cpu())


# Keys of the builder's options (cluster/app.py) a deployment override may still tune: they
# replace a fixed value, not something derived from serve.args.
TUNABLE = {"health_check_period_s", "health_check_timeout_s", "graceful_shutdown_wait_loop_s"}
SAMPLE = {"num_replicas": 2, "autoscaling_config": {"max_replicas": 2},
          "ray_actor_options": {"num_cpus": 1}, "placement_group_bundles": [{"CPU": 1}],
          "placement_group_strategy": "PACK", "max_ongoing_requests": 10,
          "max_queued_requests": 10, "graceful_shutdown_timeout_s": 5,
          "request_router_config": {"request_routing_stats_period_s": 5}}


def _builder_keys() -> dict[str, set[str]]:
    """Deployment name -> the option keys the builder sets, for the default values (with the
    ingress both fixed and autoscaled, so num_replicas and autoscaling_config both appear)."""
    from helm_render import rayservice, serve_config

    from mtpserve.cluster.app import deployment_options, ingress_options
    from mtpserve.cluster.config import ClusterConfig

    args = serve_config(rayservice(render()))["applications"][0]["args"]
    cc = ClusterConfig.model_validate(args)
    fixed = cc.model_copy(update={
        role: getattr(cc, role).model_copy(update={"autoscaling": None})
        for role in ("ingress", "prefill", "decode")})
    keys = {"OpenAIIngress": set(ingress_options(cc)) | set(ingress_options(fixed)),
            "PrefillServer": set(deployment_options(cc, "prefill"))
            | set(deployment_options(fixed, "prefill")),
            "DecodeServer": set(deployment_options(cc, "decode"))
            | set(deployment_options(fixed, "decode"))}
    return keys


@pytest.mark.parametrize("name", ["OpenAIIngress", "PrefillServer", "DecodeServer"])
def test_overrides_of_what_the_builder_derives_are_refused(name: str) -> None:
    """Every option the builder derives from serve.args is refused as an override (the guard
    follows cluster/app.py: a new derived option fails here until _validate.tpl knows it)."""
    derived = _builder_keys()[name] - TUNABLE
    assert {"num_replicas", "autoscaling_config", "ray_actor_options"} <= derived
    for key in sorted(derived):
        with pytest.raises(helm.HelmRenderError,
                           match=re.escape(f"serve.deployments[{name}].{key} would replace")):
            render({"serve": {"deployments": [{"name": name, key: SAMPLE[key]}]}})
    for key in sorted(TUNABLE & _builder_keys()[name]):
        render({"serve": {"deployments": [{"name": name, key: 7}]}})


def test_override_messages_name_the_args_knob() -> None:
    cases = {("OpenAIIngress", "num_replicas"): "set serve.args.ingress.replicas",
             ("OpenAIIngress", "max_ongoing_requests"): "serve.args.limits.max_concurrent_requests",
             ("DecodeServer", "max_ongoing_requests"): "set serve.args.decode.max_num_seqs",
             ("PrefillServer", "autoscaling_config"): "set serve.args.prefill.autoscaling",
             ("DecodeServer", "max_replicas_per_node"): "next to placement group bundles"}
    for (name, key), knob in cases.items():
        with pytest.raises(helm.HelmRenderError, match=re.escape(knob)):
            render({"serve": {"deployments": [{"name": name, key: SAMPLE.get(key, 1)}]}})


def test_overrides_the_builder_does_not_set_pass() -> None:
    """The guard refuses only what fights the builder: spreading the ingress over nodes, or a
    user_config, renders and reaches the Serve config."""
    from helm_render import rayservice, serve_config

    deps = [{"name": "OpenAIIngress", "max_replicas_per_node": 1},
            {"name": "DecodeServer", "health_check_timeout_s": 120}]
    rs = rayservice(render({"serve": {"deployments": deps}}))
    assert serve_config(rs)["applications"][0]["deployments"] == deps


def test_generated_key_is_never_rotated_on_upgrade() -> None:
    """Offline `lookup` finds nothing: on an install the chart generates a key, on an upgrade
    it refuses rather than render a new key that would lock every client out."""
    first, second = render(), render()
    assert first["secret.yaml"][0]["data"] != second["secret.yaml"][0]["data"]
    with pytest.raises(helm.HelmRenderError, match="was not found during this upgrade"):
        render(is_upgrade=True)
    # With a key given (or an existing Secret) upgrades render as usual.
    render({"auth": {"apiKey": "k"}}, is_upgrade=True)
    render({"auth": {"existingSecret": "mine"}}, is_upgrade=True)
