"""Ray-free port of how Ray Serve 2.60 applies a deployment's autoscaling policy, and the
context object a policy receives.

Serve calls `_apply_autoscaling_config(policy)(ctx)` every control-loop tick
(ray/serve/_private/autoscaling_state.py): a cold-start fast path, the policy, upscaling /
downscaling factors, the upscale / downscale delays (measured in wall-clock time from the
first consecutive decision) and finally the min / max bounds. Ray's delay logic reads
`time.time()`, so a simulation cannot call it as is: this file ports it line for line onto
the simulated clock. tests/test_sim.py checks the port against Ray's own functions.

`SimAutoscalingContext` has exactly the attributes of `ray.serve.config.AutoscalingContext`
(same names, same meaning; values instead of lazy callables), and `TimeStampedValue` the two
fields of Serve's. Our policies (cluster/autoscaling_policy.py) read only these attributes, so
they receive a duck-typed context here and never import Ray.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

DECISION_COUNTERS_KEY = "__decision_counters"  # = SERVE_AUTOSCALING_DECISION_COUNTERS_KEY
DECISION_TIMESTAMP_KEY = "__decision_timestamp"  # = SERVE_AUTOSCALING_DECISION_TIMESTAMP_KEY
DELAY_EPS_S = 1e-6  # = _DELAY_ELAPSED_EPS_S
CONTROL_LOOP_INTERVAL_S = 0.1  # Serve's tick (the simulator ticks coarser, see SimConfig)


class TimeStampedValue(NamedTuple):
    timestamp: float
    value: float


@dataclass
class SimAutoscalingConfig:
    """The fields of `ray.serve.config.AutoscalingConfig` the autoscaler reads, with Serve's
    defaults."""

    min_replicas: int = 1
    max_replicas: int = 1
    initial_replicas: int | None = None
    target_ongoing_requests: float = 2.0
    metrics_interval_s: float = 10.0
    look_back_period_s: float = 30.0
    smoothing_factor: float = 1.0
    upscale_smoothing_factor: float | None = None
    downscale_smoothing_factor: float | None = None
    upscaling_factor: float | None = None
    downscaling_factor: float | None = None
    downscale_delay_s: float = 600.0
    downscale_to_zero_delay_s: float | None = None
    upscale_delay_s: float = 30.0
    policy: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> SimAutoscalingConfig:
        known = set(cls.__dataclass_fields__)
        bad = set(d) - known
        if bad:
            raise ValueError(f"autoscaling_config keys the simulator does not model: {bad}")
        return cls(**d)

    def get_upscaling_factor(self) -> float:
        if self.upscaling_factor:
            return self.upscaling_factor
        return self.upscale_smoothing_factor or self.smoothing_factor

    def get_downscaling_factor(self) -> float:
        if self.downscaling_factor:
            return self.downscaling_factor
        return self.downscale_smoothing_factor or self.smoothing_factor

    def get_target_ongoing_requests(self) -> float:
        return self.target_ongoing_requests


class SimAutoscalingContext:
    """`ray.serve.config.AutoscalingContext` without Ray: the same constructor arguments and
    attributes, and the same lazy metrics (a callable is evaluated on first access)."""

    def __init__(self, deployment_id: Any, deployment_name: str, app_name: str | None,
                 current_num_replicas: int, target_num_replicas: int, running_replicas: list,
                 total_num_requests: Any, total_queued_requests: Any,
                 aggregated_metrics: Any, raw_metrics: Any,
                 capacity_adjusted_min_replicas: int, capacity_adjusted_max_replicas: int,
                 policy_state: dict, last_scale_up_time: float | None,
                 last_scale_down_time: float | None, current_time: float | None,
                 config: Any) -> None:
        self.deployment_id = deployment_id
        self.deployment_name = deployment_name
        self.app_name = app_name
        self.current_num_replicas = current_num_replicas
        self.target_num_replicas = target_num_replicas
        self.running_replicas = running_replicas
        self._total_num_requests_value = total_num_requests
        self._total_queued_requests_value = total_queued_requests
        self._aggregated_metrics_value = aggregated_metrics
        self._raw_metrics_value = raw_metrics
        self.capacity_adjusted_min_replicas = capacity_adjusted_min_replicas
        self.capacity_adjusted_max_replicas = capacity_adjusted_max_replicas
        self.policy_state = policy_state
        self.last_scale_up_time = last_scale_up_time
        self.last_scale_down_time = last_scale_down_time
        self.current_time = current_time
        self.config = config

    @staticmethod
    def _value(v: Any) -> Any:
        return v() if callable(v) else v

    @cached_property
    def aggregated_metrics(self) -> dict | None:
        return self._value(self._aggregated_metrics_value)

    @cached_property
    def raw_metrics(self) -> dict | None:
        return self._value(self._raw_metrics_value)

    @cached_property
    def total_num_requests(self) -> float:
        return self._value(self._total_num_requests_value)

    @cached_property
    def total_queued_requests(self) -> float:
        return self._value(self._total_queued_requests_value)

    @property
    def total_running_requests(self) -> float:
        return max(0.0, self.total_num_requests - self.total_queued_requests)


def apply_scaling_factors(desired: float, current: int, config: SimAutoscalingConfig) -> int:
    """= ray.serve.autoscaling_policy._apply_scaling_factors."""
    if current == 0:
        return math.ceil(desired)
    delta = desired - current
    factor = config.get_upscaling_factor() if delta > 0 else config.get_downscaling_factor()
    scaled = math.ceil(current + factor * delta)
    if math.ceil(float(desired)) < current and scaled == current:
        scaled -= 1
    return scaled


def apply_delay_logic(desired: int, curr_target: int, config: SimAutoscalingConfig,
                      policy_state: dict, now: float) -> tuple[int, dict]:
    """= ray.serve.autoscaling_policy._apply_delay_logic with `_now` = the simulated clock."""
    decision = curr_target
    counter = policy_state.get(DECISION_COUNTERS_KEY, 0)
    stamp = policy_state.get(DECISION_TIMESTAMP_KEY, None)
    if desired > curr_target:
        if counter < 0:
            counter, stamp = 0, None
        counter += 1
        if stamp is None:
            stamp = now
        if now - stamp + DELAY_EPS_S >= config.upscale_delay_s:
            counter, stamp, decision = 0, None, desired
    elif desired < curr_target:
        if counter > 0:
            counter, stamp = 0, None
        counter -= 1
        if curr_target == 1:
            delay = (config.downscale_to_zero_delay_s
                     if config.downscale_to_zero_delay_s is not None
                     else config.downscale_delay_s)
        else:
            delay = config.downscale_delay_s
            desired = max(1, desired)
        if stamp is None:
            stamp = now
        if now - stamp + DELAY_EPS_S >= delay:
            counter, stamp, decision = 0, None, desired
    else:
        counter, stamp = 0, None
    policy_state[DECISION_COUNTERS_KEY] = counter
    policy_state[DECISION_TIMESTAMP_KEY] = stamp
    return decision, policy_state


def cold_start_replicas(ctx) -> int | None:
    """= ray.serve.autoscaling_policy._get_cold_start_scale_up_replicas."""
    if ctx.current_num_replicas == 0 and ctx.total_num_requests > 0:
        return max(math.ceil(1 * ctx.config.get_upscaling_factor()), ctx.target_num_replicas)
    return None


def apply_autoscaling_config(policy: Callable[[Any], tuple[float, dict]],
                             clock: Callable[[], float]) -> Callable[[Any], tuple[int, dict]]:
    """= ray.serve.autoscaling_policy._apply_autoscaling_config on the simulated clock: Serve's
    wrapper around every deployment-level policy (custom or default)."""

    def wrapped(ctx) -> tuple[int, dict]:
        cold = cold_start_replicas(ctx)
        if cold is not None:
            return cold, ctx.policy_state
        policy_state = ctx.policy_state.copy()
        desired, user_state = policy(ctx)
        desired = apply_scaling_factors(desired, ctx.current_num_replicas, ctx.config)
        internal = {DECISION_COUNTERS_KEY: policy_state.get(DECISION_COUNTERS_KEY, 0),
                    DECISION_TIMESTAMP_KEY: policy_state.get(DECISION_TIMESTAMP_KEY, None)}
        if ctx.current_num_replicas == 0 and desired > 0:
            final, updated = desired, internal
        else:
            final, updated = apply_delay_logic(max(0, desired), ctx.target_num_replicas,
                                               ctx.config, internal, clock())
        if updated:
            user_state.update(updated)
        return final, user_state

    return wrapped


def apply_bounds(n: int, config: SimAutoscalingConfig) -> int:
    """= DeploymentAutoscalingState.apply_bounds without target_capacity."""
    return max(config.min_replicas, min(config.max_replicas, n))
