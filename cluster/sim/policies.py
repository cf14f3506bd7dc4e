"""The autoscaling policies the simulator runs, called the way their runtimes call them.

- `mtpserve`: our `DecodePolicy` / `PrefillPolicy`. The simulator resolves the
  `policy_function` import path and `policy_kwargs` that cluster/app.py puts into the
  deployments' `autoscaling_config` (mirrored Ray-free in sim/config.py and checked equal by
  tests/test_sim.py), instantiating the class once as Serve's `_resolve_policy_callable`
  does, so it calls the very class the deployments use. The only added kwargs are
  `publish=False` (publishing a decision goes to a Ray actor: metrics only, no effect on the
  decision) and `board`: a `DemandBoard` of this run, where the prefill policy posts arrival
  growth for the decode policy (in Serve both run in the controller and share the module's
  board; a run of its own keeps simulations independent and deterministic). Each tick builds
  a duck-typed context, `serve_port.SimAutoscalingContext`, with exactly the attributes of
  Serve's `AutoscalingContext`, and Serve's wrapper (delays, factors, bounds; ported in
  serve_port.py) applies the result.
- `serve-default`: Ray Serve's own `default_autoscaling_policy` (request-based,
  `target_ongoing_requests`), imported from Ray inside `_ray_default_policy` only, and given a
  real `ray.serve.config.AutoscalingContext` (built in `_ray_context`); the same wrapper port
  applies its result. These two functions are the simulator's only Ray imports.
- `slo-planner`: a Dynamo-style SLA planner (sim/slo_planner.py), which sets replica counts
  itself, outside Serve's autoscaler.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mtpserve.cluster.demand_board import DemandBoard
from mtpserve.cluster.sim.replica_models import ReplicaModel
from mtpserve.cluster.sim.serve_port import (
    SimAutoscalingConfig,
    SimAutoscalingContext,
    apply_autoscaling_config,
    apply_bounds,
)

POLICIES = ("mtpserve", "serve-default", "slo-planner")
APP_NAME = "mtpserve"
DEPLOYMENT_NAMES = {"prefill": "PrefillServer", "decode": "DecodeServer"}


@dataclass
class DeploymentView:
    """What Serve's controller knows about one deployment at a tick."""

    role: str
    target: int
    running_ids: list[str]
    raw_metrics: Callable[[], dict]
    aggregated_metrics: Callable[[], dict]
    total_num_requests: Callable[[], float]
    total_queued_requests: Callable[[], float]
    last_scale_up_time: float | None
    last_scale_down_time: float | None


def resolve_policy_callable(spec: dict, extra_kwargs: dict | None = None) -> Callable:
    """= ray.serve._private.autoscaling_state._resolve_policy_callable for a policy given by
    import path: a class is instantiated once with its `policy_kwargs`, a function is used
    as is."""
    module, _, attr = spec["policy_function"].partition(":")
    obj = getattr(importlib.import_module(module), attr)
    if inspect.isclass(obj):
        return obj(**(dict(spec.get("policy_kwargs") or {}) | (extra_kwargs or {})))
    return obj


def _sim_context(owner: ServeDeploymentAutoscaler, now: float, view: DeploymentView
                 ) -> SimAutoscalingContext:
    return SimAutoscalingContext(
        deployment_id=(APP_NAME, owner.name), deployment_name=owner.name, app_name=APP_NAME,
        current_num_replicas=len(view.running_ids), target_num_replicas=view.target,
        running_replicas=list(view.running_ids), total_num_requests=view.total_num_requests,
        total_queued_requests=view.total_queued_requests,
        aggregated_metrics=view.aggregated_metrics, raw_metrics=view.raw_metrics,
        capacity_adjusted_min_replicas=owner.config.min_replicas,
        capacity_adjusted_max_replicas=owner.config.max_replicas,
        policy_state=dict(owner.policy_state), last_scale_up_time=view.last_scale_up_time,
        last_scale_down_time=view.last_scale_down_time, current_time=now,
        config=owner.config)


def _ray_context(owner: ServeDeploymentAutoscaler, now: float, view: DeploymentView) -> Any:
    """A real `ray.serve.config.AutoscalingContext` (Serve's default policy reads
    `ctx.config.get_target_ongoing_requests()` of a real AutoscalingConfig)."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    if owner.ray_config is None:
        owner.ray_config = AutoscalingConfig(**owner.config_dict)
        owner.ray_id = DeploymentID(name=owner.name, app_name=APP_NAME)
    return AutoscalingContext(
        deployment_id=owner.ray_id, deployment_name=owner.name, app_name=APP_NAME,
        current_num_replicas=len(view.running_ids), target_num_replicas=view.target,
        running_replicas=list(view.running_ids), total_num_requests=view.total_num_requests,
        total_queued_requests=view.total_queued_requests,
        aggregated_metrics=view.aggregated_metrics, raw_metrics=view.raw_metrics,
        capacity_adjusted_min_replicas=owner.config.min_replicas,
        capacity_adjusted_max_replicas=owner.config.max_replicas,
        policy_state=dict(owner.policy_state), last_scale_up_time=view.last_scale_up_time,
        last_scale_down_time=view.last_scale_down_time, current_time=now,
        config=owner.ray_config)


def _ray_default_policy() -> Callable:
    from ray.serve.autoscaling_policy import default_autoscaling_policy

    return default_autoscaling_policy


class ServeDeploymentAutoscaler:
    """Serve's per-deployment autoscaling state (DeploymentAutoscalingState) for one
    deployment: `policy` is the raw callable Serve resolved; every tick it is wrapped by
    Serve's config application and bounded."""

    def __init__(self, role: str, config_dict: dict, policy: Callable,
                 context: Callable[..., Any], clock: Callable[[], float]) -> None:
        self.role = role
        self.name = DEPLOYMENT_NAMES[role]
        self.config_dict = config_dict
        self.config = SimAutoscalingConfig.from_dict(config_dict)
        self.policy = policy
        self.wrapped = apply_autoscaling_config(policy, clock)
        self.context = context
        self.policy_state: dict = {}
        self.ray_config: Any = None
        self.ray_id: Any = None

    def decide(self, now: float, view: DeploymentView) -> int:
        n, self.policy_state = self.wrapped(self.context(self, now, view))
        if isinstance(n, float):
            n = math.ceil(n)
        return apply_bounds(n, self.config)


def mtpserve_autoscalers(configs: dict[str, dict], clock: Callable[[], float]
                         ) -> dict[str, ServeDeploymentAutoscaler]:
    """`configs`: role -> the deployment's autoscaling_config (sim/config.py)."""
    board = DemandBoard()
    out = {}
    for role, ac in configs.items():
        policy = resolve_policy_callable(ac["policy"], {"publish": False, "board": board})
        out[role] = ServeDeploymentAutoscaler(role, ac, policy, _sim_context, clock)
    return out


SERVE_DEFAULT_TARGET_ONGOING = 2.0  # = ray.serve's DEFAULT_TARGET_ONGOING_REQUESTS


def profiled_serve_targets(decode: ReplicaModel, alphas: list[float], tpot_slo_s: float,
                           context: float, headroom: float = 0.8) -> tuple[float, float]:
    """(decode, prefill) `target_ongoing_requests` for Serve's default policy. Decode: what an
    operator would set from an offline profile at a fixed acceptance (no live acceptance, like
    the slo-planner's): the largest batch whose round time / tokens per round (best k) meets
    `headroom` x the TPOT SLO at `context` tokens per request (`headroom` = our policy's
    UP_HEADROOM, for a like-for-like comparison). Prefill: Serve's default, 2 (ongoing prompts
    are mostly queue; a TTFT-derived target of ~9 made the queue-length policy swing between 1
    and 8 replicas)."""
    from mtpserve.workers.perf_model import expected_tokens

    best = 1
    for b in range(1, decode.max_num_seqs + 1):
        tpot = min(decode.round_s(b, k, b * context) / expected_tokens(alphas, k)
                   for k in range(decode.k_max + 1))
        if tpot > headroom * tpot_slo_s:
            break
        best = b
    return float(best), SERVE_DEFAULT_TARGET_ONGOING


def serve_default_autoscalers(configs: dict[str, dict], clock: Callable[[], float]
                              ) -> dict[str, ServeDeploymentAutoscaler]:
    """`configs`: role -> autoscaling_config without `policy` (Serve's default applies)."""
    policy = _ray_default_policy()
    return {role: ServeDeploymentAutoscaler(role, ac, policy, _ray_context, clock)
            for role, ac in configs.items()}
