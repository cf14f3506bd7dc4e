"""`mtpserve.cluster.app:build_app`: the Serve application from a validated `ClusterConfig`.

Usable as `import_path` in `serve run` / `serve deploy` configs (`args:` is the config) and by
`mtpserve up`. The builder only wires: placement, replica counts or autoscaling, routing.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from mtpserve.cluster.config import ClusterConfig
from mtpserve.cluster.serve_options import autoscaling_config, max_ongoing
from mtpserve.workers.allocator import runtime_env_vars

log = logging.getLogger(__name__)

ROUTER = "mtpserve.router.routing:CacheAwareRouter"
ROUTING_STATS_PERIOD_S = 1.0  # = router.routing.ROUTING_STATS_PERIOD_S (no Serve import here)


def _bundles(tp: int, cpus: float, gpus: float, resources: dict[str, float]) -> list[dict]:
    bundle = {"CPU": cpus} | ({"GPU": gpus} if gpus else {}) | resources
    return [dict(bundle) for _ in range(tp)]


def deployment_options(cfg: ClusterConfig, role: str) -> dict:
    """Serve options of the prefill or decode deployment (one placement group per replica,
    one bundle per TP rank; the replica itself is rank 0 in bundle 0)."""
    side = cfg.prefill if role == "prefill" else cfg.decode
    opts: dict = {
        "placement_group_bundles": _bundles(side.tp_size, side.cpus_per_rank,
                                            side.gpus_per_rank, side.resources),
        "placement_group_strategy": "STRICT_PACK",
        "ray_actor_options": {
            "num_cpus": side.cpus_per_rank, "num_gpus": side.gpus_per_rank,
            # TP worker actors inherit this. Quiet c10d's idle-wait warnings of the KV store.
            "runtime_env": {"env_vars": {
                "TORCH_CPP_LOG_LEVEL": "ERROR",
                "OMP_NUM_THREADS": str(max(1, int(side.cpus_per_rank))),
                # CPU engines on tcmalloc when the machine has it (workers/allocator.py);
                # their engine-core and compile children inherit it.
                **(runtime_env_vars() if cfg.device == "cpu" else {})}},
        },
        # Serve's admission matches the engine's: decode runs max_num_seqs at once plus a small
        # queue in the engine; beyond that requests wait in the caller's router, at most
        # limits.max_queued_requests of them, then BackPressureError (answered 429).
        "max_ongoing_requests": max_ongoing(cfg, role),
        "max_queued_requests": cfg.limits.max_queued_requests,
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
        # Routing stats at <= 1 s, combined with Serve's live queue lengths (router/routing.py).
        "request_router_config": RequestRouterConfig(
            request_router_class=ROUTER, request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
            request_router_kwargs={"routing": cfg.prefix_caching.routing,
                                   "max_load_gap": cfg.prefix_caching.max_load_gap,
                                   "min_hit_fraction": cfg.prefix_caching.min_hit_fraction}),
        "health_check_period_s": 10.0,
        "health_check_timeout_s": 60.0,
    }
    if side.autoscaling is None:
        opts["num_replicas"] = side.replicas
    else:
        opts["autoscaling_config"] = autoscaling_config(cfg, role)
    return opts


def resolve(cfg: ClusterConfig) -> ClusterConfig:
    """Absolute model path: replicas do not share the caller's working directory."""
    path = Path(cfg.model).expanduser()
    return cfg.model_copy(update={"model": str(path.resolve())}) if path.exists() else cfg


def with_kv_secret(cfg: ClusterConfig) -> ClusterConfig:
    """`cfg` carrying a fresh per-deployment KV secret (kept if it has one): KV sender stores
    and pairs then accept only the replicas and ingresses of this application."""
    from mtpserve.workers.kv_transfer.auth import Secret

    if cfg.kv_transfer.secret is not None:
        return cfg
    kv = cfg.kv_transfer.model_copy()
    kv._secret = Secret.generate()
    return cfg.model_copy(update={"kv_transfer": kv})


def _gpu_memory_bytes(cfg: ClusterConfig) -> int | None:
    if cfg.engine.gpu_memory_gib is not None:
        return int(cfg.engine.gpu_memory_gib * 2**30)
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def memory_refusal(cfg: ClusterConfig) -> str | None:
    """Why the cluster's layout cannot fit its GPUs (each role's memory plan,
    workers/memory_plan.py), or None: it fits, the check is off, the device is not CUDA (no
    device memory to check), there is no config.json, or no GPU size is known here."""
    if cfg.device != "cuda" or not cfg.engine.memory_check:
        return None
    if not (Path(cfg.model) / "config.json").is_file():
        return None
    total = _gpu_memory_bytes(cfg)
    if total is None:
        log.warning("memory check skipped: no CUDA device here and engine.gpu_memory_gib unset")
        return None
    from mtpserve.workers.memory_plan import PlanSettings, plan_memory

    for role in ("prefill", "decode"):
        side = getattr(cfg, role)
        share = min(1.0, side.gpus_per_rank or 1.0)  # ranks splitting one GPU
        settings = PlanSettings(
            tp_size=side.tp_size, gpu_memory_bytes=int(total * share),
            dtype="bfloat16" if cfg.dtype == "auto" else cfg.dtype,
            max_num_seqs=getattr(side, "max_num_seqs", 64),
            num_speculative_tokens=cfg.speculation.num_speculative_tokens,
            max_num_batched_tokens=getattr(side, "max_num_batched_tokens", 512),
            block_size=cfg.block_size,
            kv_cache_memory_fraction=cfg.engine.kv_cache_memory_fraction,
            max_model_len=cfg.max_model_len)
        plan = plan_memory(cfg.model, settings)
        if plan.fits is False:
            fit = "; ".join(plan.suggestions)
            return (f"{role} replicas (TP {side.tp_size}) do not fit the GPU: {plan.message}"
                    + (f". Would fit: {fit}" if fit else "")
                    + " (`mtpserve check` prints the plan; engine.memory_check: false skips "
                    "this check)")
    return None


def build_app(args: ClusterConfig) -> Application:
    from mtpserve.router.ingress import OpenAIIngress
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer

    cfg = with_kv_secret(resolve(args if isinstance(args, ClusterConfig)
                                 else ClusterConfig(**args)))
    refusal = memory_refusal(cfg)
    if refusal:
        raise ValueError(refusal)
    prefill = PrefillServer.options(**deployment_options(cfg, "prefill")).bind(cfg)
    decode = DecodeServer.options(**deployment_options(cfg, "decode")).bind(cfg)
    return OpenAIIngress.options(**ingress_options(cfg)).bind(prefill, decode, cfg)


def ingress_options(cfg: ClusterConfig) -> dict:
    """Serve options of the ingress: replicas (fixed or request-based autoscaling) with a CPU
    reserved each. It answers its own overload with 429 (limits.max_concurrent_requests, per
    replica) before Serve's proxy would, so Serve's cap sits above it."""
    ing = cfg.ingress
    opts: dict = {
        "ray_actor_options": {"num_cpus": ing.cpus,
                              **({"resources": dict(ing.resources)} if ing.resources else {})},
        "max_ongoing_requests": cfg.limits.max_concurrent_requests + 64,
        "graceful_shutdown_timeout_s": cfg.graceful_shutdown_timeout_s,
        "graceful_shutdown_wait_loop_s": 1.0,
    }
    if ing.autoscaling is None:
        opts["num_replicas"] = ing.replicas
    else:
        a = ing.autoscaling
        opts["autoscaling_config"] = {
            "min_replicas": a.min_replicas, "max_replicas": a.max_replicas,
            "initial_replicas": min(max(ing.replicas, a.min_replicas), a.max_replicas),
            "target_ongoing_requests": a.target_ongoing_requests}
    return opts
