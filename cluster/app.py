"""`cluster.app:build_app`: the Serve application from a validated `ClusterConfig`.

Usable as `import_path` in `serve run` / `serve deploy` configs (`args:` is the config) and by
`mtpserve up`. The builder only wires: placement, replica counts or autoscaling, routing.
"""

from __future__ import annotations

from pathlib import Path

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import AutoscalingSettings, ClusterConfig

ROUTER = "router.routing:LeastLoadedRouter"


def _bundles(tp: int, cpus: float, gpus: float) -> list[dict]:
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {})
    return [dict(bundle) for _ in range(tp)]


def _autoscaling(a: AutoscalingSettings, initial: int, policy: str, kwargs: dict) -> dict:
    return {
        "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
        "initial_replicas": min(max(initial, a.min_replicas), a.max_replicas),
        "metrics_interval_s": 2.0, "look_back_period_s": 10.0,
        "upscale_delay_s": a.upscale_delay_s, "downscale_delay_s": a.downscale_delay_s,
        "policy": {"policy_function": f"cluster.autoscaling_policy:{policy}",
                   "policy_kwargs": kwargs},
    }


def deployment_options(cfg: ClusterConfig, role: str) -> dict:
    """Serve options of the prefill or decode deployment (one placement group per replica,
    one bundle per TP rank; the replica itself is rank 0 in bundle 0)."""
    side = cfg.prefill if role == "prefill" else cfg.decode
    opts: dict = {
        "placement_group_bundles": _bundles(side.tp_size, side.cpus_per_rank,
                                            side.gpus_per_rank),
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {
            "num_cpus": side.cpus_per_rank, "num_gpus": side.gpus_per_rank,
            # TP worker actors inherit this. Quiet c10d's idle-wait warnings of the KV store.
            "runtime_env": {"env_vars": {
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "OMP_NUM_THREADS": str(max(1, int(side.cpus_per_rank)))}},
        },
        "max_ongoing_requests": 256,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER),
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 60.0,
    }
    if side.autoscaling is None:
        opts["num_replicas"] = side.replicas
    elif role == "decode":
        a = side.autoscaling
        opts["autoscaling_config"] = _autoscaling(
            a, side.replicas, "DecodePolicy",
            {"target_tpot_ms": a.target_tpot_ms, "min_acceptance_rate": a.min_acceptance_rate})
    else:
        a = side.autoscaling
        opts["autoscaling_config"] = _autoscaling(
            a, side.replicas, "PrefillPolicy", {"target_ttft_ms": a.target_ttft_ms})
    return opts


def resolve(cfg: ClusterConfig) -> ClusterConfig:
    """Absolute model path: replicas do not share the caller's working directory."""
    path = Path(cfg.model).expanduser()
    return cfg.model_copy(update={"model": str(path.resolve())}) if path.exists() else cfg


def build_app(args: ClusterConfig) -> Application:
    from router.ingress import OpenAIIngress
    from workers.decode_server import DecodeServer
    from workers.prefill_server import PrefillServer

    cfg = resolve(args if isinstance(args, ClusterConfig) else ClusterConfig(**args))
    prefill = PrefillServer.options(**deployment_options(cfg, "prefill")).bind(cfg)
    decode = DecodeServer.options(**deployment_options(cfg, "decode")).bind(cfg)
    return OpenAIIngress.options(
        ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024,
    ).bind(prefill, decode, cfg)
