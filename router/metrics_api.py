"""`GET /metrics`: Prometheus text exposition aggregated over every replica.

vLLM's names where vLLM has the metric (`vllm:time_to_first_token_seconds`,
`vllm:inter_token_latency_seconds`, `vllm:request_time_per_output_token_seconds`,
`vllm:spec_decode_num_*`, `vllm:spec_decode_num_accepted_tokens_per_pos{position}`,
`vllm:kv_cache_usage_perc`, `vllm:num_requests_running|waiting`, `vllm:num_preemptions`,
`vllm:generation_tokens`), so vLLM dashboards work unchanged; ours under `mtpserve:` (k, measured
vs predicted TPOT and decode-graph compile progress per replica, KV transfer bytes and seconds,
the policies' desired replicas).
Units are seconds. Counters and histograms are sums over replicas, including replicas that went
away (their last snapshot), so they never go backwards; gauges come from fresh snapshots only.

The data comes from `app.state.metrics_source`, an async callable returning
`{"snapshots": [EngineRecorder.snapshot(...)], "policy": {deployment: decision}}`: the local
orchestrator reads its recorder in-process, the Serve ingress reads the `MetricsHub` actor.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

MetricsSource = Callable[[], Awaitable[dict]]
FRESH_S = 15.0  # a snapshot older than this no longer counts for gauges

COUNTERS = {
    "spec_decode_num_drafts": "Speculative rounds with drafts (one per request per round).",
    "spec_decode_num_draft_tokens": "Draft tokens proposed.",
    "spec_decode_num_accepted_tokens": "Draft tokens accepted.",
    "generation_tokens": "Output tokens generated.",
    "num_preemptions": "Requests preempted (KV evicted, recomputed later).",
}
HISTOGRAMS = {
    "time_to_first_token_seconds": "Time to first token inside the prefill engine.",
    "inter_token_latency_seconds": "Time between output tokens (per token) while decoding.",
    "request_time_per_output_token_seconds": "Decode-only time per output token of a finished "
    "request (from the first decode round; KV transfer excluded).",
}


def _labels(**kw: object) -> str:
    parts = []
    for k, v in kw.items():
        text = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
        parts.append(f'{k}="{text}"')
    return "{" + ",".join(parts) + "}"


def _num(x: float) -> str:
    return repr(float(x)) if x == x else "NaN"


def render(data: dict, model_name: str, now: float | None = None) -> str:
    """Prometheus text format (version 0.0.4) of the aggregated snapshots."""
    now = time.time() if now is None else now
    snaps = data.get("snapshots", [])
    fresh = [s for s in snaps if now - s.get("time", 0.0) <= FRESH_S]
    m = _labels(model_name=model_name)
    lines: list[str] = []

    def family(name: str, kind: str, doc: str) -> None:
        lines.append(f"# HELP {name} {doc}")
        lines.append(f"# TYPE {name} {kind}")

    for key, doc in COUNTERS.items():
        family(f"vllm:{key}", "counter", doc)
        total = sum(s["counters"].get(key, 0) for s in snaps)
        lines.append(f"vllm:{key}_total{m} {_num(total)}")
    family("vllm:spec_decode_num_accepted_tokens_per_pos", "counter",
           "Accepted draft tokens per draft position (0-based).")
    width = max((len(s.get("per_pos", [])) for s in snaps), default=0)
    for i in range(width):
        total = sum(s["per_pos"][i] for s in snaps if i < len(s.get("per_pos", [])))
        lines.append(f"vllm:spec_decode_num_accepted_tokens_per_pos_total"
                     f"{_labels(model_name=model_name, position=i)} {_num(total)}")

    for key, doc in HISTOGRAMS.items():
        hs = [s["hists"][key] for s in snaps if key in s.get("hists", {})]
        if not hs:
            continue
        family(f"vllm:{key}", "histogram", doc)
        bounds = hs[0]["bounds"]
        counts = [sum(h["counts"][j] for h in hs if h["bounds"] == bounds)
                  for j in range(len(bounds) + 1)]
        cum = 0
        for b, c in zip(bounds + [float("inf")], counts, strict=True):
            cum += c
            le = "+Inf" if b == float("inf") else repr(float(b))
            lines.append(f"vllm:{key}_bucket{_labels(model_name=model_name, le=le)} {cum}")
        lines.append(f"vllm:{key}_sum{m} {_num(sum(h['sum'] for h in hs))}")
        lines.append(f"vllm:{key}_count{m} {sum(h['count'] for h in hs)}")

    def gauge_sum(key: str, roles: tuple[str, ...]) -> float:
        return sum(s["gauges"].get(key, 0) for s in fresh if s["role"] in roles)

    family("vllm:num_requests_running", "gauge", "Requests in decode rounds.")
    running = gauge_sum("num_requests_running", ("decode", "both"))
    lines.append(f"vllm:num_requests_running{m} {_num(running)}")
    family("vllm:num_requests_waiting", "gauge", "Requests queued (prefill and decode).")
    lines.append(f"vllm:num_requests_waiting{m} "
                 f"{_num(gauge_sum('num_requests_waiting', ('prefill', 'decode', 'both')))}")
    kv = [s["gauges"]["kv_cache_usage_perc"] for s in fresh
          if s["role"] in ("decode", "both") and "kv_cache_usage_perc" in s["gauges"]]
    family("vllm:kv_cache_usage_perc", "gauge", "KV cache usage of the decode replicas "
           "(mean; 1 = full).")
    lines.append(f"vllm:kv_cache_usage_perc{m} {_num(sum(kv) / len(kv) if kv else 0.0)}")

    family("mtpserve:kv_transfer_bytes", "counter", "KV bytes received by decode rank 0s.")
    lines.append(f"mtpserve:kv_transfer_bytes_total{m} "
                 f"{_num(sum(s['counters'].get('kv_transfer_bytes', 0) for s in snaps))}")
    family("mtpserve:kv_transfer_bytes_saved", "counter",
           "KV bytes decode rank 0s did not pull: their prefix cache held those blocks.")
    lines.append(f"mtpserve:kv_transfer_bytes_saved_total{m} "
                 f"{_num(sum(s['counters'].get('kv_transfer_bytes_saved', 0) for s in snaps))}")
    for key, doc in (("prefix_cache_queries", "Prompt tokens looked up in the prefix cache."),
                     ("prefix_cache_hits", "Prompt tokens found in the prefix cache.")):
        family(f"vllm:{key}", "counter", doc + " Per role.")
        for role in sorted({s["role"] for s in snaps}):
            total = sum(s["counters"].get(key, 0) for s in snaps if s["role"] == role)
            lines.append(f"vllm:{key}_total{_labels(model_name=model_name, role=role)} "
                         f"{_num(total)}")
    for key, doc in (("num_migrations", "Streams resumed on another decode replica."),
                     ("num_prefill_retries", "Prefills retried after a failure."),
                     ("num_kv_recomputes", "Requests recomputed on decode after a failed KV "
                      "pull."),
                     ("num_busy_retries", "KV transfers offered again after every decode "
                      "replica was busy."),
                     ("num_local_prefills", "Prompts prefilled on a decode replica "
                      "(conditional disaggregation).")):
        name = "mtpserve:" + key.removeprefix("num_")
        family(name, "counter", doc + " Summed over ingress replicas.")
        total = sum(s["counters"].get(key, 0) for s in snaps if s.get("role") == "ingress")
        lines.append(f"{name}_total{m} {_num(total)}")
    family("mtpserve:kv_transfer_seconds", "counter", "Seconds decode rank 0s spent pulling KV.")
    lines.append(f"mtpserve:kv_transfer_seconds_total{m} "
                 f"{_num(sum(s['counters'].get('kv_transfer_seconds', 0) for s in snaps))}")

    per_replica = {
        "num_speculative_tokens": ("gauge", "Speculation depth k of the replica at its batch."),
        "kv_cache_usage_perc": ("gauge", "KV cache usage of one replica (1 = full)."),
        "prefix_cache_blocks": ("gauge", "KV blocks named in one replica's prefix cache "
                                "(in use or evictable)."),
        "measured_tpot_seconds": ("gauge", "Mean decode-only TPOT over the signal window."),
        "predicted_tpot_seconds": ("gauge", "TPOT the performance model predicts at the "
                                   "window's batch and k."),
        "compile_buckets_total": ("gauge", "Decode-graph buckets the replica's configuration "
                                  "covers."),
        "compile_buckets_done": ("gauge", "Decode-graph buckets compiled or loaded (the rest "
                                 "run eagerly, slower, until they are)."),
        "compile_eta_seconds": ("gauge", "Seconds until every decode-graph bucket is compiled, "
                                "from the measured seconds per bucket (0: done; absent while "
                                "not measured or when compiling stopped)."),
    }
    for key, (kind, doc) in per_replica.items():
        rows = [s for s in fresh if key in s["gauges"]]
        if not rows:
            continue
        family(f"mtpserve:{key}", kind, doc)
        for s in rows:
            lab = _labels(model_name=model_name, replica=s["replica"], role=s["role"])
            lines.append(f"mtpserve:{key}{lab} {_num(s['gauges'][key])}")
    family("mtpserve:replicas", "gauge", "Replicas reporting, per role.")
    for role in sorted({s["role"] for s in fresh}):
        n = sum(s["role"] == role for s in fresh)
        lines.append(f"mtpserve:replicas{_labels(model_name=model_name, role=role)} {n}")

    policy = data.get("policy", {})
    if policy:
        family("mtpserve:autoscaling_desired_replicas", "gauge",
               "Replicas the autoscaling policy asks for, per deployment.")
        for dep, d in sorted(policy.items()):
            lines.append(f"mtpserve:autoscaling_desired_replicas"
                         f"{_labels(model_name=model_name, deployment=dep)} "
                         f"{_num(d['desired_replicas'])}")
        for name, key, help_text in (
            ("predicted_tpot_seconds", "predicted_tpot_s",
             "TPOT the decode policy predicts at the current replica count."),
            ("target_tpot_seconds", "target_tpot_s", "The decode TPOT SLO the policy sizes for."),
        ):
            have = {dep: d for dep, d in policy.items() if d.get(key)}
            if not have:
                continue
            family(f"mtpserve:autoscaling_{name}", "gauge", help_text)
            for dep, d in sorted(have.items()):
                lines.append(f"mtpserve:autoscaling_{name}"
                             f"{_labels(model_name=model_name, deployment=dep)} {_num(d[key])}")
    return "\n".join(lines) + "\n"


def parse_samples(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted label items): value}, for clients of /metrics
    (benchmarks, tests); needs `prometheus_client` (the `bench` / `test` extras)."""
    from prometheus_client.parser import text_string_to_metric_families

    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def replica_caches(data: dict, now: float | None = None) -> list[dict]:
    """Per live replica: its role, cached blocks, prefix-cache counters and decode-graph
    compile progress (for the stats endpoint; the same snapshots /metrics renders)."""
    now = time.time() if now is None else now
    return [{"replica": s["replica"], "role": s["role"], "time": s.get("time", 0.0),
             "cached_blocks": s["gauges"].get("prefix_cache_blocks", 0),
             "prefix_cache_queries": s["counters"].get("prefix_cache_queries", 0),
             "prefix_cache_hits": s["counters"].get("prefix_cache_hits", 0),
             "kv_transfer_bytes_saved": s["counters"].get("kv_transfer_bytes_saved", 0),
             "compile": s.get("compile")}
            for s in data.get("snapshots", []) if now - s.get("time", 0.0) <= FRESH_S
            and s["role"] != "ingress"]


def orchestrator_totals(data: dict, local: dict[str, int], own_key: str | None
                        ) -> dict[str, int]:
    """The orchestrator counters over every ingress replica: this one's live `local` ones plus
    the last push of every other one (`own_key`: this replica's snapshot, left out)."""
    snaps = [s for s in data.get("snapshots", [])
             if s.get("role") == "ingress" and s.get("replica") != own_key]
    return {k: v + sum(s["counters"].get(k, 0) for s in snaps) for k, v in local.items()}


async def metrics_data(request: Request) -> dict:
    """The snapshots behind /metrics ({} where there is no source)."""
    source: MetricsSource | None = getattr(request.app.state, "metrics_source", None)
    if source is None and _in_ray():
        source = request.app.state.metrics_source = hub_source()  # the Serve ingress
    return await source() if source is not None else {}


def metrics_router() -> APIRouter:
    """`GET /metrics` over `app.state.metrics_source` (empty families when unset)."""
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    async def metrics(request: Request) -> PlainTextResponse:
        data = await metrics_data(request)
        ingress = getattr(request.app.state, "ingress", None)
        name = getattr(ingress, "model_name", "") if ingress is not None else ""
        return PlainTextResponse(render(data, name),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    return router


def _in_ray() -> bool:
    try:
        import ray

        return ray.is_initialized()
    except ImportError:
        return False


def local_source(recorder, key: str = "local") -> MetricsSource:
    """In-process source over one `EngineRecorder` (the local orchestrator)."""

    async def source() -> dict:
        stats = await recorder.async_engine.acall(lambda e: e.stats())
        return {"snapshots": [recorder.snapshot(key, stats)], "policy": {}}

    return source


def hub_source() -> MetricsSource:
    """Source over the cluster's `MetricsHub` actor (Serve ingress)."""

    async def source() -> dict:
        from mtpserve.workers.replica.metrics import hub

        return await hub().collect.remote()

    return source
