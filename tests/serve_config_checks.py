"""Checks shared by the config-file and Helm-chart tests: a Serve deploy config is one we run.

Ray's `DeploymentSchema` accepts unknown keys silently (`num_replica` validates), so override
keys are compared with its fields here; `args` must be a valid `ClusterConfig`.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingConfig
from ray.serve.schema import DeploymentSchema, ServeDeploySchema

from mtpserve.cluster.config import ClusterConfig

APP_NAME = "mtpserve"
IMPORT_PATH = "mtpserve.cluster.app:build_app"
DEPLOYMENT_NAMES = {"OpenAIIngress", "PrefillServer", "DecodeServer"}


def unknown_override_keys(app: dict[str, Any]) -> list[str]:
    """Deployment-override keys (and autoscaling_config keys) that Ray would silently ignore."""
    bad = []
    for dep in app.get("deployments") or []:
        name = dep.get("name", "?")
        bad += [f"{name}.{k}" for k in dep if k not in DeploymentSchema.model_fields]
        auto = dep.get("autoscaling_config") or {}
        bad += [
            f"{name}.autoscaling_config.{k}"
            for k in auto
            if k not in AutoscalingConfig.model_fields
        ]
    return bad


def check_serve_config(cfg: dict[str, Any]) -> ClusterConfig:
    """Assert `cfg` is our single-application Serve config; return its validated args."""
    schema = ServeDeploySchema.model_validate(cfg)
    assert [a.name for a in schema.applications] == [APP_NAME]
    app_schema = schema.applications[0]
    assert app_schema.import_path == IMPORT_PATH
    assert app_schema.route_prefix == "/"

    app = cfg["applications"][0]
    assert unknown_override_keys(app) == []
    names = {d["name"] for d in app.get("deployments") or []}
    assert names <= DEPLOYMENT_NAMES, f"overrides for unknown deployments: {names}"
    return ClusterConfig.model_validate(app.get("args") or {})
