"""`mtpserve bench serve`: N concurrent streaming clients against a running server.

Prints TTFT and TPOT percentiles, output tokens/s, the acceptance rate over the run (from the
server's stats), and the KV transfer bandwidth achieved by real pulls next to a raw send/recv
of the same number of bytes on the same channel, measured in the same run.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx

from mtpserve.workers.training.prompts import held_out_prompts


async def sse_events(client: httpx.AsyncClient, body: dict,
                     path: str = "/v1/completions") -> AsyncIterator[dict]:
    """POST a streaming request and yield each SSE `data:` event as a dict (not `[DONE]`);
    an error event raises."""
    async with client.stream("POST", path, json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            data = json.loads(line[6:])
            if "error" in data:
                raise RuntimeError(data["error"])
            yield data


@dataclass
class ServeBenchArgs:
    url: str = "http://127.0.0.1:8000"
    api_key: str | None = None
    concurrency: int = 4
    num_requests: int = 16
    max_tokens: int = 64
    prompt_tokens: int = 200


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def stream_completion(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                            temperature: float = 0.0) -> dict:
    """One streaming completion: TTFT, client-side TPOT after the first token, tokens, and
    the decode-side TPOT: from the first chunk the decode replica sent (the second event;
    the first carries the prefill's token) to the last, per token after it. That one
    leaves out the KV handoff, so it reads as the offline engine's decode rate does."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "stream": True, "stream_options": {"include_usage": True},
            "return_token_ids": True}
    t0 = time.perf_counter()
    stamps: list[tuple[float, int]] = []  # (arrival, tokens in the event)
    tokens = 0
    async for data in sse_events(client, body):
        choice = (data.get("choices") or [{}])[0]
        if choice.get("text") or choice.get("token_ids"):
            stamps.append((time.perf_counter(), len(choice.get("token_ids") or [1])))
        if data.get("usage"):
            tokens = data["usage"]["completion_tokens"]
    end = time.perf_counter()
    ttft = (stamps[0][0] - t0) if stamps else end - t0
    tpot = (end - stamps[0][0]) / max(tokens - 1, 1) if stamps and tokens > 1 else None
    after = tokens - sum(n for _, n in stamps[:2])
    tpot_decode = (stamps[-1][0] - stamps[1][0]) / after if len(stamps) > 2 and after > 0 \
        else None
    return {"ttft": ttft, "tpot": tpot, "tpot_decode": tpot_decode, "tokens": tokens,
            "seconds": end - t0}


async def run(args: ServeBenchArgs) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    prompts = held_out_prompts(args.num_requests, num_chars=4 * args.prompt_tokens)
    async with httpx.AsyncClient(base_url=args.url, headers=headers, timeout=600) as client:
        before = (await client.get("/v1/mtpserve/stats")).json()
        sem = asyncio.Semaphore(args.concurrency)

        async def guarded(p: str) -> dict:
            async with sem:
                return await stream_completion(client, p, args.max_tokens)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(guarded(p) for p in prompts))
        wall = time.perf_counter() - t0
        after = (await client.get("/v1/mtpserve/stats")).json()
        res = _summarise(results, wall, before, after)
        pull_bytes = res["kv_pull_bytes_mean"]
        if pull_bytes:
            await client.post("/v1/mtpserve/kv_probe", json={"num_bytes": int(pull_bytes)})
            probe = (await client.post("/v1/mtpserve/kv_probe",
                                       json={"num_bytes": int(pull_bytes)})).json()
            res["kv_raw_gib_per_s"] = probe.get("gib_per_s")
    res.update(concurrency=args.concurrency, num_requests=args.num_requests,
               max_tokens=args.max_tokens)
    return res


def _summarise(results: list[dict], wall: float, before: dict, after: dict) -> dict:
    ttft = [r["ttft"] * 1000 for r in results]
    tpot = [r["tpot"] * 1000 for r in results if r["tpot"] is not None]
    tpot_decode = [r["tpot_decode"] * 1000 for r in results if r.get("tpot_decode")]
    d0, d1 = before.get("decode", {}), after.get("decode", {})
    drafted = d1.get("total_drafted", 0) - d0.get("total_drafted", 0)
    accepted = d1.get("total_accepted", 0) - d0.get("total_accepted", 0)
    k0, k1 = d0.get("kv_receiver", {}), d1.get("kv_receiver", {})
    pulled = k1.get("bytes_received", 0) - k0.get("bytes_received", 0)
    pull_s = k1.get("pull_seconds", 0.0) - k0.get("pull_seconds", 0.0)
    pulls = k1.get("pulls", 0) - k0.get("pulls", 0)
    # Receive + scatter into the cache on the transfer thread (absent before that thread).
    e2e_s = d1.get("kv_puller", {}).get("seconds", 0.0) - d0.get("kv_puller", {}).get(
        "seconds", 0.0)
    return {
        "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p99": _pct(ttft, 99),
        "tpot_ms_p50": _pct(tpot, 50), "tpot_ms_p99": _pct(tpot, 99),
        "decode_tpot_ms_p50": _pct(tpot_decode, 50),
        "output_tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "acceptance_rate": accepted / drafted if drafted else None,
        "kv_pulls": pulls, "kv_pull_bytes_mean": pulled / pulls if pulls else None,
        "kv_achieved_gib_per_s": pulled / pull_s / 2**30 if pull_s else None,
        "kv_e2e_gib_per_s": pulled / e2e_s / 2**30 if e2e_s > 0 else None,
        "wall_seconds": wall,
        "mean_tokens": statistics.mean(r["tokens"] for r in results),
    }


def format_table(r: dict) -> str:
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    return "\n".join([
        f"{r['num_requests']} requests, concurrency {r['concurrency']}, "
        f"max_tokens {r['max_tokens']} (decode stats from rank 0 of one decode replica)",
        "| TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | output tok/s | acceptance |"
        " KV pull GiB/s | raw send/recv GiB/s |",
        "|---|---|---|---|---|---|---|---|",
        f"| {f(r['ttft_ms_p50'])} | {f(r['ttft_ms_p99'])} | {f(r['tpot_ms_p50'])} | "
        f"{f(r['tpot_ms_p99'])} | {f(r['output_tokens_per_s'])} | "
        f"{f(r['acceptance_rate'], 3)} | {f(r['kv_achieved_gib_per_s'], 3)} | "
        f"{f(r.get('kv_raw_gib_per_s'), 3)} |",
    ])


# TPOT of running streams while long prompts arrive -------------------------------------------

async def _gaps(client: httpx.AsyncClient, prompt: str, max_tokens: int, out: list[float],
                window: list[float]) -> None:
    """Stream one request; append to `out` the per-token time of every chunk that arrived
    inside `window` = [start, end] (perf_counter; end may be set later)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    last = None
    async for data in sse_events(client, body):
        now = time.perf_counter()
        n = len(data.get("choices", [{}])[0].get("token_ids") or []) or 1
        if last is not None and window[0] <= now <= window[1]:
            out.append((now - last) / n)
        last = now


async def run_interference(url: str, api_key: str | None = None, num_streams: int = 4,
                           stream_tokens: int = 400, arrival_tokens: int = 1500,
                           num_arrivals: int = 3, settle_s: float = 1.0) -> dict:
    """TPOT p50/p99 of `num_streams` running streams in two phases of equal length: without
    arrivals, then while `num_arrivals` prompts of ~`arrival_tokens` tokens arrive one after
    another (each prefilled elsewhere and pulled into the decode replica that runs the
    streams). Per-token time = gap between chunks / tokens in the chunk."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    prompts = held_out_prompts(num_streams + num_arrivals, num_chars=4 * 64)
    longs = held_out_prompts(num_arrivals, num_chars=4 * arrival_tokens)
    res: dict = {}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        for phase, arrivals in (("without", 0), ("with", num_arrivals)):
            before = (await client.get("/v1/mtpserve/stats")).json()
            gaps: list[float] = []
            window = [float("inf"), float("inf")]
            tasks = [asyncio.create_task(_gaps(client, p, stream_tokens, gaps, window))
                     for p in prompts[:num_streams]]
            await asyncio.sleep(settle_s)  # every stream is decoding
            window[0] = time.perf_counter()
            if arrivals:
                for p in longs[:arrivals]:
                    await stream_completion(client, p, 8)  # prefill + one pull + a few rounds
            else:
                await asyncio.sleep(settle_s * num_arrivals)
            window[1] = time.perf_counter()
            await asyncio.gather(*tasks)
            after = (await client.get("/v1/mtpserve/stats")).json()
            k0 = before["decode"].get("kv_puller", {})
            k1 = after["decode"].get("kv_puller", {})
            ms = [g * 1000 for g in gaps]
            res[phase] = {"tpot_ms_p50": _pct(ms, 50), "tpot_ms_p99": _pct(ms, 99),
                          "samples": len(ms), "window_s": window[1] - window[0],
                          "pulls": k1.get("pulls", 0) - k0.get("pulls", 0)}
    w, wo = res["with"]["tpot_ms_p99"], res["without"]["tpot_ms_p99"]
    res["p99_ratio"] = w / wo if w and wo else None
    res.update(num_streams=num_streams, arrival_tokens=arrival_tokens,
               num_arrivals=num_arrivals)
    return res


def format_interference(r: dict) -> str:
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    rows = [f"{r['num_streams']} running streams; {r['num_arrivals']} arrivals of "
            f"~{r['arrival_tokens']}-token prompts (KV pulled into the same decode replica)",
            "| phase | TPOT p50 ms | TPOT p99 ms | samples | pulls |", "|---|---|---|---|---|"]
    for phase in ("without", "with"):
        x = r[phase]
        rows.append(f"| {phase} arrivals | {f(x['tpot_ms_p50'])} | {f(x['tpot_ms_p99'])} | "
                    f"{x['samples']} | {x['pulls']} |")
    rows.append(f"p99 ratio (with / without): {f(r['p99_ratio'], 2)}")
    return "\n".join(rows)


def main(args: ServeBenchArgs, json_out: str | None) -> dict:
    res = asyncio.run(run(args))
    print(format_table(res))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=2)
    return res
