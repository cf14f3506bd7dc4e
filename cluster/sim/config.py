"""What one simulation runs: `SimConfig` (scenario, policy, hardware, SLOs) and the cluster's
`ClusterConfig` (cluster/config.py, Ray-free), from which the Serve options of the two
deployments are derived exactly as cluster/app.py derives them.

Both take the autoscaling options and admission caps from `cluster/serve_options.py` (Ray-free),
so the simulated deployments are configured by the same code as the real ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from mtpserve.cluster.config import ClusterConfig
from mtpserve.cluster.serve_options import autoscaling_config
from mtpserve.cluster.sim.cpu import CpuSharing


@dataclass
class SimConfig:
    scenario: str = "burst"
    policy: str = "mtpserve"  # mtpserve | serve-default | slo-planner
    hardware: str = "h200"
    model_config: str = "mimo-7b-like"  # shipped name or a config.json path
    profile: str | None = None  # a fitted profile JSON instead of the roofline
    tp: int | None = None  # default: the model config's mtpserve_sim.tp
    mtp_depth: int | None = None  # k_max; default: mtpserve_sim.mtp_depth
    max_num_seqs: int | None = None
    seed: int = 0
    rate_scale: float = 1.0
    duration_s: float | None = None  # default: the scenario's
    ttft_slo_ms: float = 500.0  # configs/production.yaml's prefill target
    tpot_slo_ms: float = 8.0
    prefill_replicas: tuple[int, int, int] = (1, 1, 8)  # initial, min, max
    decode_replicas: tuple[int, int, int] = (2, 1, 16)
    upscale_delay_s: float = 10.0  # configs/production.yaml
    downscale_delay_s: float = 120.0
    metrics_interval_s: float = 1.0
    window_s: float = 30.0
    graceful_shutdown_timeout_s: float = 30.0
    max_num_batched_tokens: int = 8192
    # Replica start delay (roofline models; parts and sources in sim_data/hardware.json
    # `start`): decode graphs load warm from the on-disk compile cache unless `cold_start`;
    # `load_gbs` overrides the weight-loading bandwidth per GPU (GB/s).
    cold_start: bool = False
    load_gbs: float | None = None
    # Serve's controller ticks every 0.1 s; replicas report every metrics_interval_s, so a
    # coarser tick only delays a decision by < control_interval_s (delays are timed).
    control_interval_s: float = 1.0
    timeline_interval_s: float = 10.0
    # serve-default: target_ongoing_requests of (decode, prefill) replicas; None: profiled
    # (policies.profiled_serve_targets).
    serve_target_ongoing: tuple[float, float] | None = None
    # slo-planner: Dynamo's defaults (throughput-based every 180 s; load-based 10 s).
    planner_interval_s: float = 180.0
    planner_reactive_s: float = 10.0
    max_drain_s: float = 1800.0  # after the last arrival; then unfinished requests count
    # Fixed time of every request outside the engines (HTTP, ingress, tokenization, the Serve
    # calls, streaming the first token back): it reaches prefill this long after it arrives,
    # so it adds to TTFT and not to TPOT. 0: not modelled (benchmarks/sim_calibration.py
    # measures it on the live cluster).
    ingress_overhead_s: float = 0.0
    # Replicas co-located on one CPU host (sim/cpu.py): their work (prefill steps, decode
    # rounds, KV pulls, the ingress overhead above) shares the host's cores. None (default,
    # every GPU-scale run): each replica is its own machine and runs at its model's speed.
    cpu: CpuSharing | None = None


def cluster_config(sim: SimConfig, tp: int, k_max: int, max_num_seqs: int,
                   prefill_kv_tokens: int, decode_kv_tokens: int) -> ClusterConfig:
    """The ClusterConfig a GPU deployment of the simulated cluster would use (the shape of
    configs/production.yaml, sized for the model)."""
    block = 16

    def scaling(bounds: tuple[int, int, int], **slo: float) -> dict:
        return {"min_replicas": bounds[1], "max_replicas": bounds[2],
                "upscale_delay_s": sim.upscale_delay_s,
                "downscale_delay_s": sim.downscale_delay_s, "window_s": sim.window_s,
                "metrics_interval_s": sim.metrics_interval_s, **slo}

    return ClusterConfig(
        # Not a folder: the config's checks of the checkpoint's head counts do not apply.
        model=f"sim:{sim.model_config}", dtype="bfloat16", device="cuda", block_size=block,
        graceful_shutdown_timeout_s=sim.graceful_shutdown_timeout_s,
        prefill={"replicas": sim.prefill_replicas[0], "tp_size": tp,
                 "max_num_batched_tokens": sim.max_num_batched_tokens,
                 "num_kv_blocks": max(8, prefill_kv_tokens // block), "gpus_per_rank": 1,
                 "autoscaling": scaling(sim.prefill_replicas, target_ttft_ms=sim.ttft_slo_ms)},
        decode={"replicas": sim.decode_replicas[0], "tp_size": tp,
                "max_num_seqs": max_num_seqs,
                "num_kv_blocks": max(8, decode_kv_tokens // block), "gpus_per_rank": 1,
                "autoscaling": scaling(sim.decode_replicas, target_tpot_ms=sim.tpot_slo_ms)},
        ingress={"replicas": 2},
        speculation={"num_speculative_tokens": k_max, "adaptive": True},
        kv_transfer={"backend": "nccl"},
    )


def serve_default_config(cfg: ClusterConfig, role: str, target_ongoing: float) -> dict:
    """Serve's default request-based policy on the same deployment, as `mtpserve bench
    autoscale --deploy default` configures it: our options without `policy`, the scale-down
    patience our policy holds itself, and a target of ongoing requests per replica."""
    side = cfg.decode if role == "decode" else cfg.prefill
    ac = dict(autoscaling_config(cfg, role))
    ac.pop("policy")
    ac["downscale_delay_s"] = side.autoscaling.downscale_delay_s
    ac["target_ongoing_requests"] = target_ongoing
    return ac
