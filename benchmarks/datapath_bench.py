"""The prefill -> decode data path under load, on a local Ray cluster (CPU by default):

1. KV pull throughput vs a raw send/recv of the same bytes on the same channel, one request at
   a time (c=1) with ~1k-token prompts (`serve_bench.run`).
2. TPOT p50/p99 of running streams without and with ~1.5k-token arrivals whose KV is pulled
   into the decode replica that runs them (`serve_bench.run_interference`).

    python -m mtpserve.benchmarks.datapath_bench --out benchmarks/results/datapath-cpu.json

Prints both tables and writes one JSON file.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket

ADMIN_KEY = "datapath-bench"


def admin_options(config_cls) -> dict:
    """Enable the admin-only bandwidth probe where such a switch exists (older configs have
    none and serve the probe to anyone)."""
    if "admin" not in config_cls.model_fields:
        return {}
    return {"admin": {"enable_kv_probe": True}, "auth": {"admin_api_key": ADMIN_KEY}}


def deploy(model: str, device: str, port: int, prefill_tp: int = 1, decode_tp: int = 1) -> str:
    from ray import serve

    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig

    gpu = 0.5 if device == "cuda" else 0.0  # both sides share one GPU on a one-GPU machine
    cfg = ClusterConfig(
        model=model, device=device,
        prefill={"tp_size": prefill_tp, "cpus_per_rank": 1, "gpus_per_rank": gpu},
        decode={"tp_size": decode_tp, "cpus_per_rank": 1, "gpus_per_rank": gpu},
        speculation={"num_speculative_tokens": 2, "adaptive": False},
        # The bandwidth probe is an admin endpoint (off by default where that switch exists).
        **admin_options(ClusterConfig),
    )
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
    return f"http://127.0.0.1:{port}"


def main() -> None:
    import ray

    from mtpserve.benchmarks.serve_bench import (
        ServeBenchArgs,
        format_interference,
        format_table,
        run,
        run_interference,
    )
    from mtpserve.workers.paths import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--num-cpus", type=int, default=4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", num_cpus=a.num_cpus, include_dashboard=False, log_to_driver=False)
    try:
        url = deploy(a.model, a.device, port)
        # Warm-up: builds the KV channel and the first buffers.
        asyncio.run(run(ServeBenchArgs(url=url, api_key=ADMIN_KEY, concurrency=1,
                                       num_requests=2, max_tokens=4, prompt_tokens=1000)))
        pull = asyncio.run(run(ServeBenchArgs(url=url, api_key=ADMIN_KEY, concurrency=1,
                                              num_requests=8, max_tokens=8,
                                              prompt_tokens=1000)))
        raw, got = pull.get("kv_raw_gib_per_s"), pull.get("kv_achieved_gib_per_s")
        pull["kv_pull_over_raw"] = got / raw if got and raw else None
        print(format_table(pull))
        print(f"KV pull / raw send-recv: {pull['kv_pull_over_raw']}")
        tpot = asyncio.run(run_interference(url, api_key=ADMIN_KEY))
        print(format_interference(tpot))
        res = {"kv_pull_c1_1k": pull, "tpot_with_arrivals": tpot}
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=2)
    finally:
        from ray import serve

        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
