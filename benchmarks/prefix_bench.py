"""Shared-prefix serving: groups of requests that share a long prefix (a system prompt, a file
under edit) with distinct short suffixes.

`mtpserve bench serve --shared-prefix-tokens N --num-prefixes G` runs the workload against a
running server (`run_shared_prefix`); `python -m mtpserve.benchmarks.prefix_bench` starts the
server once per configuration (prefix caching off; on with least-loaded routing; on with
cache-aware routing), runs the same workload on each and prints one table:

    python -m mtpserve.benchmarks.prefix_bench --json benchmarks/results/prefix-cpu.json

Requests go out interleaved across groups (g0, g1, g0, g1, ...), `concurrency` at a time; the
first request of each group is cold, the others warm. Prompts are token ids (from held-out
text, through the model's tokenizer), so the shared prefix is exactly N tokens. Counters come
from the server's /metrics (vLLM's names): prefill tokens computed = prefix-cache queries -
hits of the prefill role; KV bytes pulled by the decode replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from mtpserve.benchmarks.local_server import running_server, variant_config
from mtpserve.benchmarks.serve_bench import sse_events
from mtpserve.router.metrics_api import parse_samples
from mtpserve.workers.paths import config_path, default_model_path


@dataclass
class SharedPrefixArgs:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    num_requests: int = 16
    num_prefixes: int = 2
    shared_prefix_tokens: int = 1024
    suffix_tokens: int = 32
    max_tokens: int = 16
    concurrency: int = 1
    tokenizer: str | None = None  # a model folder; default: the embedded model


def shared_prefix_prompts(args: SharedPrefixArgs) -> list[tuple[int, list[int]]]:
    """(group, token ids) per request, interleaved across groups."""
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.prompts import held_out_prompts

    tok = load_tokenizer(args.tokenizer or str(default_model_path()))
    g, n = args.num_prefixes, args.num_requests
    texts = held_out_prompts(g + n, num_chars=6 * max(args.shared_prefix_tokens,
                                                      args.suffix_tokens))

    def ids(text: str, length: int) -> list[int]:
        out = tok.encode(text)
        while len(out) < length:  # a short file: repeat it
            out += out
        return out[:length]

    prefixes = [ids(texts[i], args.shared_prefix_tokens) for i in range(g)]
    return [(i % g, prefixes[i % g] + ids(texts[g + i], args.suffix_tokens)) for i in range(n)]


async def _counters(client: httpx.AsyncClient, since: float | None = None,
                    timeout_s: float = 15.0) -> dict[str, float]:
    """The cluster's counters, from replica snapshots taken after wall time `since` (replicas
    push them every second: waits for the next push instead of reading stale ones)."""
    if since is not None:
        end = time.monotonic() + timeout_s
        while True:
            reps = (await client.get("/v1/mtpserve/stats")).json().get("replicas", [])
            if reps and min(r["time"] for r in reps) >= since:
                break
            if time.monotonic() > end:
                raise TimeoutError("replicas did not push fresh metrics")
            await asyncio.sleep(0.1)
    samples = parse_samples((await client.get("/metrics")).text)

    def total(name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in samples.items() if n == name
                   and all(dict(lab).get(k) == x for k, x in labels.items()))

    return {"prefill_queries": total("vllm:prefix_cache_queries_total", role="prefill"),
            "prefill_hits": total("vllm:prefix_cache_hits_total", role="prefill"),
            "kv_bytes": total("mtpserve:kv_transfer_bytes_total"),
            "kv_bytes_saved": total("mtpserve:kv_transfer_bytes_saved_total")}


async def _stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft = None
    cached = 0
    async for data in sse_events(client, body):
        if ttft is None and data.get("choices"):
            ttft = time.perf_counter() - t0
        usage = data.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", cached)
    return {"ttft_ms": (ttft or time.perf_counter() - t0) * 1000, "cached_tokens": cached}


async def run_shared_prefix(args: SharedPrefixArgs) -> dict:
    """Run the workload against `args.url`; TTFT of cold and warm requests, prefill tokens
    computed, prefix-cache hits against the ideal, KV bytes pulled."""
    reqs = shared_prefix_prompts(args)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        block = int((await client.get("/v1/mtpserve/stats")).json()["prefill"]["block_size"])
        # A snapshot's stamp comes a moment after its counters were read: keep a margin.
        settled = lambda: time.time() + 0.2  # noqa: E731
        before = await _counters(client, settled())
        sem = asyncio.Semaphore(args.concurrency)
        seen: set[int] = set()
        per_kv: list[float | None] = [None] * len(reqs)

        async def one(i: int, group: int, ids: list[int]) -> dict:
            async with sem:
                cold = group not in seen
                seen.add(group)
                one_at_a_time = args.concurrency == 1
                k0 = (await _counters(client, settled()))["kv_bytes"] if one_at_a_time else 0
                r = await _stream(client, ids, args.max_tokens)
                if one_at_a_time:
                    per_kv[i] = (await _counters(client, settled()))["kv_bytes"] - k0
                return r | {"cold": cold}

        t0 = time.perf_counter()
        results = await asyncio.gather(*(one(i, g, ids) for i, (g, ids) in enumerate(reqs)))
        wall = time.perf_counter() - t0
        after = await _counters(client, settled())
    d = {k: after[k] - before[k] for k in after}
    cold = [r for r in results if r["cold"]]
    warm = [r for r in results if not r["cold"]]
    # A warm request can reuse every full block of the shared prefix whose lookahead token
    # (the next one) is shared too.
    ideal = len(warm) * ((args.shared_prefix_tokens - 1) // block * block)
    kv_cold = [per_kv[i] for i, r in enumerate(results) if r["cold"] and per_kv[i] is not None]
    kv_warm = [per_kv[i] for i, r in enumerate(results)
               if not r["cold"] and per_kv[i] is not None]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    return {
        "num_requests": len(reqs), "num_prefixes": args.num_prefixes,
        "shared_prefix_tokens": args.shared_prefix_tokens, "suffix_tokens": args.suffix_tokens,
        "concurrency": args.concurrency, "wall_seconds": wall,
        "ttft_ms_p50_cold": med([r["ttft_ms"] for r in cold]),
        "ttft_ms_p50_warm": med([r["ttft_ms"] for r in warm]),
        "ttft_ms_p50": med([r["ttft_ms"] for r in results]),
        "ttft_ms_p99": max(r["ttft_ms"] for r in results),  # 16 samples: p99 = max
        "prefill_tokens_computed": d["prefill_queries"] - d["prefill_hits"],
        "prefill_hit_tokens": d["prefill_hits"], "ideal_hit_tokens": ideal,
        "hit_fraction_of_ideal": d["prefill_hits"] / ideal if ideal else None,
        "cached_tokens_reported": sum(r["cached_tokens"] for r in results),
        "kv_bytes_pulled": d["kv_bytes"], "kv_bytes_saved": d["kv_bytes_saved"],
        "kv_bytes_per_cold": med(kv_cold), "kv_bytes_per_warm": med(kv_warm),
    }


def format_table(rows: dict[str, dict]) -> str:
    f = lambda x, p=0: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    any_row = next(iter(rows.values()))
    out = [f"{any_row['num_requests']} requests in {any_row['num_prefixes']} groups sharing "
           f"{any_row['shared_prefix_tokens']}-token prefixes (+{any_row['suffix_tokens']} "
           f"distinct tokens), {any_row['concurrency']} at a time",
           "| configuration | TTFT p50 cold ms | TTFT p50 warm ms | TTFT p50 / p99 ms | "
           "prefill tokens computed | hits / ideal | KV MiB pulled | KV KiB per cold / "
           "warm request |", "|---|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        kv = lambda x: None if x is None else x / 1024  # noqa: E731
        out.append(
            f"| {name} | {f(r['ttft_ms_p50_cold'])} | {f(r['ttft_ms_p50_warm'])} | "
            f"{f(r['ttft_ms_p50'])} / {f(r['ttft_ms_p99'])} | "
            f"{f(r['prefill_tokens_computed'])} | {f(r['hit_fraction_of_ideal'], 2)} | "
            f"{f(r['kv_bytes_pulled'] / 2**20, 1)} | {f(kv(r['kv_bytes_per_cold']))} / "
            f"{f(kv(r['kv_bytes_per_warm']))} |")
    return "\n".join(out)


# Configurations: the cluster the issue's targets name (2 prefill replicas whose caches hold
# about one prefix each, one decode replica).
VARIANTS = {
    "caching off": {"prefix_caching": {"enabled": False}},
    "caching on, least-loaded routing": {"prefix_caching": {"routing": "least_loaded"}},
    "caching on, cache-aware routing": {"prefix_caching": {"routing": "cache_aware"}},
}


def cluster_overrides(args: SharedPrefixArgs, block_size: int = 16, spare_blocks: int = 8
                      ) -> dict:
    """2 prefill replicas, each with KV blocks for one prompt (+ a round) and `spare_blocks`
    more: a replica's cache holds about one shared prefix. One decode replica with room for
    all."""
    prompt_blocks = -(-(args.shared_prefix_tokens + args.suffix_tokens + 8) // block_size)
    return {"block_size": block_size,
            "prefill": {"replicas": 2, "num_kv_blocks": prompt_blocks + spare_blocks,
                        "cpus_per_rank": 0.5},
            # Every prompt is prefilled on a prefill replica: their caches are what is routed.
            "decode": {"replicas": 1, "num_kv_blocks": 8 * prompt_blocks,
                       "cpus_per_rank": 0.5,  # 3 x 0.5 + the ingress fit `up`'s 2 CPUs
                       "max_local_prefill_length": 0},
            "speculation": {"adaptive": False}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(config_path("local-cpu.yaml")))
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--num-requests", type=int, default=16)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--shared-prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    args = SharedPrefixArgs(url=f"http://127.0.0.1:{a.port}", num_requests=a.num_requests,
                            num_prefixes=a.num_prefixes,
                            shared_prefix_tokens=a.shared_prefix_tokens,
                            suffix_tokens=a.suffix_tokens, max_tokens=a.max_tokens,
                            concurrency=a.concurrency)
    rows: dict[str, dict] = {}
    for name in a.variants:
        cfg = variant_config(Path(a.config), {**cluster_overrides(args), **VARIANTS[name]},
                             a.port)
        with running_server(cfg, a.timeout) as start_s:
            rows[name] = asyncio.run(run_shared_prefix(args)) | {"start_seconds": start_s}
        print(name, json.dumps({k: rows[name][k] for k in
                                ("ttft_ms_p50_cold", "ttft_ms_p50_warm", "prefill_hit_tokens")}),
              flush=True)
    if a.json_out:
        Path(a.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    print(format_table(rows))


if __name__ == "__main__":
    main()
