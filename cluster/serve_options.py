"""Serve options the app builder derives from a `ClusterConfig` that need no Ray: autoscaling
configs (our policies, by import path) and admission caps. Shared by `cluster/app.py` and the
Ray-free simulator (`cluster/sim/`), so both configure exactly the same deployments."""

from __future__ import annotations

from mtpserve.cluster.config import AutoscalingSettings, ClusterConfig

POLICY_MODULE = "mtpserve.cluster.autoscaling_policy"


def autoscaling_options(a: AutoscalingSettings, initial: int, policy: str, kwargs: dict) -> dict:
    # The policy holds scale-downs itself (`downscale_hold_s`, with the model's prediction);
    # Serve's own delay on top only has to absorb one tick. Reports older than a few
    # intervals are stale: the policy then holds.
    kwargs = kwargs | {"downscale_hold_s": a.downscale_delay_s,
                       "max_age_s": max(5.0, 4 * a.metrics_interval_s)}
    return {
        "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
        "initial_replicas": min(max(initial, a.min_replicas), a.max_replicas),
        "metrics_interval_s": a.metrics_interval_s,
        "look_back_period_s": 5 * a.metrics_interval_s,
        "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": 1.0,
        "policy": {"policy_function": f"{POLICY_MODULE}:{policy}",
                   "policy_kwargs": kwargs},
    }


def max_ongoing(cfg: ClusterConfig, role: str) -> int:
    if role == "decode":
        n = cfg.decode.max_num_seqs
        return n + max(2, n // 4)
    # Prefill requests are short (one chunked prefill each); the engine batches up to its token
    # budget, so a few prompts' worth of budget keeps it busy without a long local queue.
    return max(16, 4 * cfg.prefill.max_num_batched_tokens // 256)


def autoscaling_config(cfg: ClusterConfig, role: str) -> dict:
    """The `autoscaling_config` of the prefill or decode deployment (with autoscaling)."""
    if role == "decode":
        a = cfg.decode.autoscaling
        return autoscaling_options(a, cfg.decode.replicas, "DecodePolicy",
                                   {"target_tpot_ms": a.target_tpot_ms})
    a = cfg.prefill.autoscaling
    return autoscaling_options(a, cfg.prefill.replicas, "PrefillPolicy",
                               {"target_ttft_ms": a.target_ttft_ms, "window_s": a.window_s})


def initial_replicas(replicas: int, autoscaling) -> int:
    """The replica count a deployment starts with (Serve's initial_replicas with autoscaling)."""
    if autoscaling is None:
        return replicas
    return min(max(replicas, autoscaling.min_replicas), autoscaling.max_replicas)


def resource_demand(cfg: ClusterConfig) -> dict[str, float]:
    """Logical CPUs and GPUs the application reserves at its initial replica counts: what a
    Ray cluster needs before the app can be ready (`mtpserve up` checks it up front)."""
    cpus = initial_replicas(cfg.ingress.replicas, cfg.ingress.autoscaling) * cfg.ingress.cpus
    gpus = 0.0
    for side in (cfg.prefill, cfg.decode):
        n = initial_replicas(side.replicas, side.autoscaling) * side.tp_size
        cpus += n * side.cpus_per_rank
        gpus += n * side.gpus_per_rank
    return {"CPU": cpus, "GPU": gpus}
