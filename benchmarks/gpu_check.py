"""One prepared GPU check (for a session that is lent a GPU; untested without one).

    python -m benchmarks.gpu_check --out $OUT

1. `bench engine` in bf16 on CUDA (transformers.generate vs our engine at k = 0..3).
2. The disaggregated app with NCCL: prefill TP=1 -> decode TP=1 on one GPU (two processes
   sharing it), greedy outputs compared with the offline engine, and the KV pull bandwidth next
   to a raw NCCL send/recv of the same bytes on the same channel.
Writes JSON files and prints tables; each part runs even if the other fails.
"""

from __future__ import annotations

import argparse
import json
import socket
import traceback
from pathlib import Path


def engine_part(out: Path) -> None:
    from benchmarks.engine_bench import BenchArgs, main

    main(BenchArgs(model=_model(), dtype="bfloat16", device="cuda"),
         str(out / "engine-cuda-bfloat16.json"))


def _model() -> str:
    from workers.paths import default_model_path

    return str(default_model_path())


def cluster_part(out: Path) -> None:
    import httpx
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig
    from workers import LLM, SamplingParams
    from workers.training.prompts import held_out_prompts

    prompts = held_out_prompts(4, num_chars=300)
    offline = [r.text for r in LLM(_model(), num_speculative_tokens=2, device="cuda").generate(
        prompts, SamplingParams(max_tokens=32, temperature=0))]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ray.init(address="local", include_dashboard=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ClusterConfig(
            model=_model(), device="cuda",
            prefill={"tp_size": 1, "cpus_per_rank": 1, "gpus_per_rank": 0.5},
            decode={"tp_size": 1, "cpus_per_rank": 1, "gpus_per_rank": 0.5},
            speculation={"num_speculative_tokens": 2, "adaptive": False},
            kv_transfer={"backend": "nccl"},
        )
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        base = f"http://127.0.0.1:{port}"
        got = []
        for p in prompts:
            r = httpx.post(f"{base}/v1/completions", timeout=120,
                           json={"prompt": p, "max_tokens": 32, "temperature": 0})
            got.append(r.json()["choices"][0]["text"])
        stats = httpx.get(f"{base}/v1/mtpserve/stats", timeout=60).json()
        rx = stats["decode"]["kv_receiver"]
        mean_bytes = rx["bytes_received"] / max(rx["pulls"], 1)
        httpx.post(f"{base}/v1/mtpserve/kv_probe", json={"num_bytes": int(mean_bytes)},
                   timeout=60)  # warm-up: builds the NCCL communicator's buffers
        probe = httpx.post(f"{base}/v1/mtpserve/kv_probe", json={"num_bytes": int(mean_bytes)},
                           timeout=60).json()
        res = {"greedy_equal": got == offline, "http": got, "offline": offline,
               "kv_pull_gib_per_s": rx["bytes_received"] / rx["pull_seconds"] / 2**30
               if rx["pull_seconds"] else None,
               "kv_raw_gib_per_s": probe.get("gib_per_s"), "pull_bytes_mean": mean_bytes}
        print(json.dumps({k: v for k, v in res.items() if k not in ("http", "offline")}))
        (out / "cluster-nccl.json").write_text(json.dumps(res, indent=2))
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    out = Path(ap.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    for part in (engine_part, cluster_part):
        try:
            part(out)
        except Exception:
            traceback.print_exc()


if __name__ == "__main__":
    main()
