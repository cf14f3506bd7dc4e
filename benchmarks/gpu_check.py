"""The prepared GPU check, sized for one lent machine with a single H200 (< 8 minutes).

    python -m mtpserve.benchmarks.gpu_check --out DIR            # on the GPU machine
    python -m mtpserve.benchmarks.gpu_check --out DIR --device cpu   # dry run of the same script

1. engine: `bench engine` on CUDA in float32 and bfloat16, k = 0..3, batch 1 and 32.
2. disagg-gloo: the disaggregated app with prefill and decode on the *same* GPU (0.5 GPU
   each), KV over the gloo path (host staging: NCCL cannot put two ranks of one communicator
   on one GPU); greedy HTTP output == the offline engine on the same device; KV pull vs raw
   send/recv and TPOT of running streams while long prompts are pulled
   (mtpserve.benchmarks.serve_bench).
3. nccl-kv / nccl-tp: only with >= 2 (>= 4 for TP 2 -> 2) visible GPUs: the same app with
   KV over NCCL, one GPU per rank; printed as skipped otherwise.

Each part runs even if another fails. Writes DIR/gpu_check.json (status, seconds and results
of every part), one JSON per part, and DIR/gpu_check.log (everything printed).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import httpx


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> None:
        for st in self.streams:
            st.write(s)
            st.flush()

    def flush(self) -> None:
        for st in self.streams:
            st.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # faulthandler and subprocesses write to the real stream
        return self.streams[0].fileno()


def _model() -> str:
    from mtpserve.workers.paths import default_model_path

    return str(default_model_path())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# 1. Engine bench ------------------------------------------------------------------------------

def engine_part(out: Path, device: str, dry: bool) -> dict:
    from mtpserve.benchmarks.engine_bench import BenchArgs, main

    names = {f.name for f in dataclasses.fields(BenchArgs)}
    res = {}
    for dtype in ("float32", "bfloat16"):
        kw = dict(model=_model(), dtype=dtype, device=device, ks=(0, 1, 2, 3),
                  batch_sizes=(1, 32), num_prompts=32, max_tokens=64, prompt_tokens=256)
        if dry:
            kw.update(ks=(0, 2), batch_sizes=(1, 2), num_prompts=2, max_tokens=8,
                      prompt_tokens=32)
        # Eager: compiling every (batch, k) bucket for two dtypes could not fit the 8-minute
        # budget of a lent GPU; the compiled variant is measured by `mtpserve bench engine`.
        kw["variants"] = ("eager",)
        if "repeats" in names:
            kw["repeats"] = 1
        path = out / f"engine-{device}-{dtype}.json"
        r = main(BenchArgs(**{k: v for k, v in kw.items() if k in names}), str(path))
        res[dtype] = {"json": path.name, "rows": len(r.get("engine", []))}
    return res


# 2./3. The disaggregated app --------------------------------------------------------------------

def _offline(prompts: list[str], device: str, max_tokens: int) -> list[str]:
    from mtpserve.workers import LLM, SamplingParams

    llm = LLM(_model(), num_speculative_tokens=2, device=device)
    # One prompt at a time, as the HTTP requests below run (same batch shapes on the GPU).
    return [llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text
            for p in prompts]


def app_part(out: Path, device: str, dry: bool, backend: str, tp: int, name: str) -> dict:
    import ray
    from ray import serve

    from mtpserve.benchmarks.datapath_bench import ADMIN_KEY, admin_options
    from mtpserve.benchmarks.serve_bench import (
        ServeBenchArgs,
        format_interference,
        format_table,
        run,
        run_interference,
    )
    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.workers.training.prompts import held_out_prompts

    max_tokens = 8 if dry else 32
    prompts = held_out_prompts(2 if dry else 4, num_chars=300)
    offline = _offline(prompts, device, max_tokens)
    # Same GPU for both sides over gloo; one GPU per rank over NCCL.
    gpus = 0.0 if device == "cpu" else (0.5 if backend == "gloo" else 1.0)
    port = _port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             **({"num_cpus": 4} if device == "cpu" else {}))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ClusterConfig(
            model=_model(), device=device,
            prefill={"tp_size": tp, "cpus_per_rank": 1, "gpus_per_rank": gpus},
            decode={"tp_size": tp, "cpus_per_rank": 1, "gpus_per_rank": gpus},
            speculation={"num_speculative_tokens": 2, "adaptive": False},
            kv_transfer={"backend": backend}, **admin_options(ClusterConfig),
        )
        t0 = time.perf_counter()
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        deploy_s = time.perf_counter() - t0
        base = f"http://127.0.0.1:{port}"
        got = []
        for p in prompts:
            r = httpx.post(f"{base}/v1/completions", timeout=300,
                           json={"prompt": p, "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            got.append(r.json()["choices"][0]["text"])
        stats = httpx.get(f"{base}/v1/mtpserve/stats", timeout=60,
                          headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
        res = {"greedy_equal": got == offline, "deploy_s": deploy_s,
               "mismatches": [{"http": g, "offline": o} for g, o in zip(got, offline,
                                                                         strict=True)
                              if g != o],
               "kv_pulls": stats["decode"]["kv_receiver"]["pulls"],
               "migrations": stats.get("orchestrator", {}).get("num_migrations")}
        print(f"[{name}] greedy == offline: {res['greedy_equal']}  "
              f"(pulls {res['kv_pulls']}, migrations {res['migrations']})")
        n = 2 if dry else 8
        pull = asyncio_run(run(ServeBenchArgs(url=base, api_key=ADMIN_KEY, concurrency=1,
                                              num_requests=n, max_tokens=8,
                                              prompt_tokens=1000)))
        raw, ach = pull.get("kv_raw_gib_per_s"), pull.get("kv_achieved_gib_per_s")
        pull["kv_pull_over_raw"] = ach / raw if ach and raw else None
        print(format_table(pull))
        res["kv_pull_c1_1k"] = pull
        tpot = asyncio_run(run_interference(
            base, api_key=ADMIN_KEY, num_streams=4, stream_tokens=64 if dry else 400,
            num_arrivals=1 if dry else 3, settle_s=0.5 if dry else 1.0))
        print(format_interference(tpot))
        res["tpot_with_arrivals"] = tpot
        (out / f"{name}.json").write_text(json.dumps(res, indent=2))
        return res
    finally:
        serve.shutdown()
        ray.shutdown()


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a small dry run of the same steps (no GPU needed)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "gpu_check.log", "a")  # noqa: SIM115 (open for the whole run)
    sys.stdout = _Tee(sys.__stdout__, log)
    sys.stderr = _Tee(sys.__stderr__, log)
    import torch

    dry = a.device == "cpu"
    n_gpus = torch.cuda.device_count() if not dry else 0
    print(f"gpu_check: device={a.device} visible GPUs={n_gpus} torch={torch.__version__}")
    parts: list[tuple[str, Callable[[], dict] | None, str]] = [
        ("engine", lambda: engine_part(out, a.device, dry), ""),
        ("disagg-gloo", lambda: app_part(out, a.device, dry, "gloo", 1, "disagg-gloo"), ""),
        ("nccl-kv", (lambda: app_part(out, a.device, dry, "nccl", 1, "nccl-kv"))
         if n_gpus >= 2 else None, "needs >= 2 GPUs (one NCCL rank per GPU)"),
        ("nccl-tp", (lambda: app_part(out, a.device, dry, "nccl", 2, "nccl-tp"))
         if n_gpus >= 4 else None, "needs >= 4 GPUs (prefill TP 2 + decode TP 2)"),
    ]
    summary: dict = {"device": a.device, "gpus": n_gpus, "parts": {}}
    for name, fn, why in parts:
        if fn is None:
            print(f"[{name}] skipped: {why}")
            summary["parts"][name] = {"status": "skipped", "reason": why}
            continue
        t0 = time.perf_counter()
        try:
            result = fn()
            summary["parts"][name] = {"status": "ok", "result": result}
        except Exception as e:
            traceback.print_exc()
            summary["parts"][name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        summary["parts"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] {summary['parts'][name]['status']} in "
              f"{summary['parts'][name]['seconds']}s")
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    ok = all(p["status"] != "failed" for p in summary["parts"].values())
    print(f"gpu_check: {'all parts ok' if ok else 'some parts FAILED'}")


if __name__ == "__main__":
    main()
