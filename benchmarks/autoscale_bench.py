"""`mtpserve bench autoscale`: a load profile against a server, recording an autoscaling timeline.

Profile (closed-loop streaming clients; phase lengths scale with `--time-scale`):
ramp up 1 -> C clients, hold C with greedy code prompts, the same C with random-text prompts
sampled at temperature 1 (the step change in acceptance: with the embedded tiny model, greedy
continuations of random text degenerate into repetition the MTP module predicts well, so the
step needs sampling too), ramp down C -> 0, then idle. Every second the
timeline records replicas per deployment, the decode policy's desired replicas, client TPOT
p50/p99 of the requests that finished, acceptance (from /metrics counters), k, and the queue.

`--deploy model|default` starts a local Ray cluster and deploys the app itself: `model` with
the model-based policies (mtpserve.cluster.autoscaling_policy), `default` with Serve's request-based
default policy (`target_ongoing_requests`), so both run the same profile. Without it, the
server at `--url` is used (replica counts then come from /metrics, or from Ray with
`--ray-address`). Writes the timeline + summary to JSON and a PNG plot (matplotlib).
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import string
import time
from dataclasses import asdict, dataclass, field

import httpx

from mtpserve.benchmarks.serve_bench import _pct, stream_completion
from mtpserve.router.metrics_api import parse_samples
from mtpserve.workers.training.prompts import held_out_prompts


@dataclass
class AutoscaleBenchArgs:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    concurrency: int = 8
    max_tokens: int = 48
    time_scale: float = 1.0  # 1.0: 30 s ramp up, 60 s hold, 60 s random text, 30 s down
    idle_s: float = 45.0
    target_tpot_ms: float = 50.0
    deploy: str | None = None  # "model" | "default"
    ray_address: str | None = None
    baseline_target_ongoing: float = 2.0  # Serve default policy: requests per replica
    max_decode_replicas: int = 3  # --deploy: decode autoscaling 1..N
    config: dict = field(default_factory=dict)  # ClusterConfig args for --deploy


def phases(a: AutoscaleBenchArgs) -> list[tuple[str, float]]:
    s = a.time_scale
    return [("ramp_up", 30 * s), ("hold_code", 60 * s), ("random_text", 60 * s),
            ("ramp_down", 30 * s), ("idle", a.idle_s)]


def target_clients(a: AutoscaleBenchArgs, t: float) -> tuple[str, int, bool]:
    """(phase, clients, random_text) at `t` seconds into the profile."""
    start = 0.0
    for name, dur in phases(a):
        if t < start + dur:
            x = (t - start) / dur
            c = a.concurrency
            n = {"ramp_up": max(1, round(c * x)), "ramp_down": round(c * (1 - x)),
                 "idle": 0}.get(name, c)
            return name, n, name in ("random_text", "ramp_down")
        start += dur
    return "done", 0, False


def random_text_prompts(n: int, num_chars: int, seed: int = 0) -> list[str]:
    """Random printable characters (off the training distribution of the drafts)."""
    rng = random.Random(seed)
    return ["".join(rng.choice(string.printable) for _ in range(num_chars)) for _ in range(n)]


def _sum(m: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in m.items()
               if n == name and all(dict(lab).get(k) == x for k, x in labels.items()))


def _replicas_from_ray() -> dict[str, int]:
    from ray import serve

    out = {}
    for app in serve.status().applications.values():
        for name, dep in app.deployments.items():
            out[name] = int(dep.replica_states.get("RUNNING", 0))
    return out


async def run_profile(a: AutoscaleBenchArgs, use_ray: bool) -> dict:
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    code = held_out_prompts(16, num_chars=300)
    noise = random_text_prompts(16, 300)
    done: list[dict] = []
    timeline: list[dict] = []
    t0 = time.monotonic()

    async with httpx.AsyncClient(base_url=a.url, headers=headers, timeout=600) as client:
        async def worker(i: int) -> None:
            n = 0
            while True:
                phase, clients, rand = target_clients(a, time.monotonic() - t0)
                if phase == "done":
                    return
                if i >= clients:
                    await asyncio.sleep(0.2)
                    continue
                prompt = (noise if rand else code)[(i + n) % 16]
                n += 1
                try:
                    r = await stream_completion(client, prompt, a.max_tokens,
                                                1.0 if rand else 0.0)
                    done.append(r | {"t": time.monotonic() - t0, "phase": phase})
                except Exception as e:  # counted, the profile goes on
                    done.append({"t": time.monotonic() - t0, "phase": phase, "error": str(e)})

        async def sampler() -> None:
            prev, seen = None, 0
            while True:
                t = time.monotonic() - t0
                phase, clients, _ = target_clients(a, t)
                m = parse_samples((await client.get("/metrics")).text)
                new, seen = done[seen:], len(done)
                tpot = [r["tpot"] * 1000 for r in new if r.get("tpot") is not None]
                row = {"t": round(t, 2), "phase": phase, "clients": clients,
                       "tpot_ms_p50": _pct(tpot, 50), "tpot_ms_p99": _pct(tpot, 99),
                       "finished": len(new), "errors": sum("error" in r for r in new),
                       "waiting": _sum(m, "vllm:num_requests_waiting"),
                       "running": _sum(m, "vllm:num_requests_running")}
                ks = [v for (n, _), v in m.items() if n == "mtpserve:num_speculative_tokens"]
                row["k"] = statistics.mean(ks) if ks else None
                # What the policy sees: decode-only TPOT inside the replicas (window mean)
                # and the model's prediction, next to the client-side TPOT above.
                for key, name in (("tpot_replica_ms", "mtpserve:measured_tpot_seconds"),
                                  ("tpot_predicted_ms", "mtpserve:predicted_tpot_seconds")):
                    vals = [v for (n, _), v in m.items() if n == name]
                    row[key] = 1000 * statistics.mean(vals) if vals else None
                drafted = _sum(m, "vllm:spec_decode_num_draft_tokens_total")
                accepted = _sum(m, "vllm:spec_decode_num_accepted_tokens_total")
                if prev is not None and drafted > prev[0]:
                    row["acceptance"] = (accepted - prev[1]) / (drafted - prev[0])
                prev = (drafted, accepted)
                row["desired_decode"] = _sum(m, "mtpserve:autoscaling_desired_replicas",
                                             deployment="DecodeServer") or None
                if use_ray:
                    reps = await asyncio.to_thread(_replicas_from_ray)
                    row["decode_replicas"] = reps.get("DecodeServer")
                    row["prefill_replicas"] = reps.get("PrefillServer")
                else:
                    row["decode_replicas"] = _sum(m, "mtpserve:replicas", role="decode")
                    row["prefill_replicas"] = _sum(m, "mtpserve:replicas", role="prefill")
                timeline.append(row)
                if phase == "done":
                    return
                await asyncio.sleep(max(0.0, 1.0 - (time.monotonic() - t0 - t)))

        await asyncio.gather(sampler(), *(worker(i) for i in range(a.concurrency)))
    return {"timeline": timeline, "requests": done}


def summarise(res: dict, a: AutoscaleBenchArgs) -> dict:
    tl = res["timeline"]
    dts = [b["t"] - x["t"] for x, b in zip(tl, tl[1:], strict=False)]
    violation_s = sum(dt for row, dt in zip(tl[1:], dts, strict=True)
                      if row["tpot_ms_p50"] is not None and row["tpot_ms_p50"] > a.target_tpot_ms)
    replica_s = sum(dt * ((row.get("decode_replicas") or 0) + (row.get("prefill_replicas") or 0))
                    for row, dt in zip(tl[1:], dts, strict=True))
    decode_replica_s = sum(dt * (row.get("decode_replicas") or 0)
                           for row, dt in zip(tl[1:], dts, strict=True))
    # Decisions after the step change: distinct desired counts the policy went through.
    step = [r for r in tl if r["phase"] == "random_text"]
    desired = [r["desired_decode"] for r in step if r.get("desired_decode")]
    changes = sum(1 for x, y in zip(desired, desired[1:], strict=False) if x != y)
    reqs = res["requests"]
    return {"tpot_slo_ms": a.target_tpot_ms, "tpot_violation_seconds": round(violation_s, 1),
            "replica_seconds": round(replica_s, 1),
            "decode_replica_seconds": round(decode_replica_s, 1),
            "desired_changes_after_step": changes if desired else None,
            "requests": len(reqs), "errors": sum("error" in r for r in reqs),
            "max_decode_replicas": max((r.get("decode_replicas") or 0) for r in tl)}


def plot(res: dict, title: str, path: str, target_tpot_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = res["timeline"]
    t = [r["t"] for r in tl]
    fig, axes = plt.subplots(4, 1, figsize=(10, 10), sharex=True)
    ax = axes[0]
    ax.step(t, [r["decode_replicas"] for r in tl], where="post", label="decode replicas")
    ax.step(t, [r["prefill_replicas"] for r in tl], where="post", label="prefill replicas")
    if any(r.get("desired_decode") for r in tl):
        ax.step(t, [r.get("desired_decode") for r in tl], where="post", linestyle="--",
                label="decode desired (policy)")
    ax.plot(t, [r["clients"] for r in tl], color="grey", alpha=0.5, label="clients")
    ax.set_ylabel("count")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[1]
    ax.plot(t, [r["tpot_ms_p50"] for r in tl], label="TPOT p50")
    ax.plot(t, [r["tpot_ms_p99"] for r in tl], label="TPOT p99", alpha=0.6)
    if any(r.get("tpot_replica_ms") for r in tl):
        ax.plot(t, [r.get("tpot_replica_ms") for r in tl], label="decode TPOT in replicas",
                linestyle="--")
        ax.plot(t, [r.get("tpot_predicted_ms") for r in tl], label="predicted (model)",
                linestyle=":")
    ax.axhline(target_tpot_ms, color="red", linestyle=":", label="SLO")
    ax.set_ylabel("ms")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    ax.plot(t, [r.get("acceptance") for r in tl], label="acceptance")
    ax.plot(t, [r.get("k") for r in tl], label="k (mean over replicas)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[3]
    ax.plot(t, [r["waiting"] for r in tl], label="waiting")
    ax.plot(t, [r["running"] for r in tl], label="running")
    ax.set_xlabel("seconds")
    ax.legend(loc="upper right", fontsize=8)
    start = 0.0
    for name, dur in phases_from(tl):
        for a in axes:
            a.axvline(start, color="black", alpha=0.15)
        axes[0].text(start + 1, axes[0].get_ylim()[1] * 0.9, name, fontsize=7)
        start += dur
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def phases_from(tl: list[dict]) -> list[tuple[str, float]]:
    out: list[tuple[str, float]] = []
    for r in tl:
        if not out or out[-1][0] != r["phase"]:
            out.append((r["phase"], r["t"]))
    return [(n, (out[i + 1][1] if i + 1 < len(out) else tl[-1]["t"]) - s)
            for i, (n, s) in enumerate(out)]


def local_config(a: AutoscaleBenchArgs) -> dict:
    """ClusterConfig args for --deploy on a CPU machine: one prefill replica, decode
    autoscaling 1..max_decode_replicas at the TPOT target (the embedded tiny model). Every
    rank runs one torch thread, so on a 2-core machine a second decode replica can add
    compute and a third cannot."""
    return {
        "prefill": {"cpus_per_rank": 0.5, "num_kv_blocks": 512},
        "decode": {"cpus_per_rank": 0.5, "num_kv_blocks": 512, "max_num_seqs": 16,
                   "autoscaling": {"min_replicas": 1, "max_replicas": a.max_decode_replicas,
                                   "target_tpot_ms": a.target_tpot_ms, "upscale_delay_s": 1.0,
                                   "downscale_delay_s": 15.0, "window_s": 10.0,
                                   "metrics_interval_s": 0.5}},
        "speculation": {"num_speculative_tokens": 2, "adaptive": True},
    }


def deploy(a: AutoscaleBenchArgs) -> None:
    """Local Ray cluster + the app, with the model-based or Serve's default policy."""
    import ray
    from ray import serve

    from mtpserve.cluster.app import build_app, deployment_options, resolve
    from mtpserve.cluster.config import ClusterConfig

    port = int(a.url.rsplit(":", 1)[1])
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    cfg = resolve(ClusterConfig(**a.config))
    if a.deploy == "model":
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        return
    from mtpserve.router.ingress import OpenAIIngress
    from mtpserve.workers.replica.decode_server import DecodeServer
    from mtpserve.workers.replica.prefill_server import PrefillServer

    handles = []
    for role, cls in (("prefill", PrefillServer), ("decode", DecodeServer)):
        opts = deployment_options(cfg, role)
        side = cfg.decode if role == "decode" else cfg.prefill
        if side.autoscaling is not None:  # Serve's default: ongoing requests per replica
            ac = dict(opts["autoscaling_config"])
            ac.pop("policy")
            # The same scale-down patience our policy gets (it holds in the policy itself).
            ac["downscale_delay_s"] = side.autoscaling.downscale_delay_s
            ac["target_ongoing_requests"] = a.baseline_target_ongoing
            opts["autoscaling_config"] = ac
        handles.append(cls.options(**opts).bind(cfg))
    serve.run(OpenAIIngress.options(ray_actor_options={"num_cpus": 0})
              .bind(handles[0], handles[1], cfg), name="mtpserve", route_prefix="/")


def main(a: AutoscaleBenchArgs, json_out: str | None, png_out: str | None) -> dict:
    use_ray = a.deploy is not None or a.ray_address is not None
    if a.ray_address and not a.deploy:
        import ray

        ray.init(address=a.ray_address)
    if a.deploy:
        deploy(a)
    try:
        res = asyncio.run(run_profile(a, use_ray))
    finally:
        if a.deploy:
            from ray import serve

            serve.shutdown()
    summary = summarise(res, a)
    out = {"args": asdict(a), "summary": summary, **res}
    print(json.dumps(summary, indent=2))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(out, f, indent=1)
    if png_out:
        plot(res, f"autoscale profile, policy: {a.deploy or 'server'}", png_out,
             a.target_tpot_ms)
    return out
