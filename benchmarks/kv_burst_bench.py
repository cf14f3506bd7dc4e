"""Time to second token when a burst of KV transfers lands in one decode replica, next to a
single arrival (issue 18 target: burst p99 <= 3x single), for each given
`kv_transfer.max_concurrent_pulls` (default: 1, the old serial puller, then 4, the default).

Each variant is `mtpserve up` on configs/local-cpu.yaml (1 prefill, 1 decode replica) with:
the pull lanes; a prefill token budget that holds the whole burst, so its prefills finish in
the same step or two and the 16 transfers reach the decode replica together (with the default
512 the prefill spreads them out and no queue of pulls forms); prompts made unique by a leading
nonce, so no prefix cache on either side skips a block.

Per request, from the client's stream: TTFT (prefill: the first token comes from the prefill
replica), time to second token (TTST, from sending: the first decode-side token, after the KV
pull, admission and the first decode round) and the decode-side wait TTST - TTFT, which leaves
out the prefill queueing that a burst into one prefill replica adds. Then `--running` streams
(default 4) decode while more bursts arrive: each stream's TPOT (time per token, from the
tokens it received in a window) in the second before a burst and during the burst's
decode-side arrivals (from its first token at the client to its last second token: the
pulls, scatters and joins; the prefill's own seconds before it share the cores with decode on
this one machine and are left out). The servers run with
MTPSERVE_TRACE_HOPS=1, so that wait is also split at the decode replica's hops (LEGS).
`--gil released held` adds variants whose compiled graphs hold the GIL (the stock loader).

    python -m mtpserve.benchmarks.kv_burst_bench --json benchmarks/results/kv-burst-cpu.json

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from pathlib import Path

import httpx

from mtpserve.benchmarks.local_server import running_server, variant_config
from mtpserve.benchmarks.serve_bench import _pct, sse_events
from mtpserve.workers import hop_trace
from mtpserve.workers.model import aoti_runner
from mtpserve.workers.paths import config_path
from mtpserve.workers.training.prompts import held_out_prompts

METRICS = ("ttft_ms", "ttst_ms", "decode_wait_ms")
# The decode-side wait split at the hops of the second token's chunk (workers/hop_trace.py):
# first token at the client -> the decode replica got the request -> rank 0's lane took its
# pull -> scatter done -> joined the decode rounds -> its first round's chunk -> client.
LEGS = (("first_token", "decode_in"), ("decode_in", "pull_start"), ("pull_start", "pull_end"),
        ("pull_end", "activated"), ("activated", "engine"), ("engine", "client"))


async def timed_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    """One greedy stream: TTFT, TTST (from sending) and the prompt's length in tokens."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    t0 = time.time()
    stamps: list[float] = []  # arrival time of each output token (a chunk may carry several)
    hops: dict[str, float] = {}  # the second token's chunk's hop stamps (wall clock)
    prompt_tokens = None
    async for data in sse_events(client, body):
        now = time.time()
        if data.get("usage"):
            prompt_tokens = data["usage"]["prompt_tokens"]
        choices = data.get("choices") or [{}]
        new = len(choices[0].get("token_ids") or [])
        if len(stamps) < 2 <= len(stamps) + new:
            hops = {**(choices[0].get("mtpserve_trace") or {}), "client": now}
        stamps += [now] * new
    assert len(stamps) >= 2, f"{len(stamps)} tokens: no decode-side token to time"
    hops["first_token"] = stamps[0]
    legs = {f"{a}->{b}_ms": (hops[b] - hops[a]) * 1e3 for a, b in LEGS
            if a in hops and b in hops}
    return {"ttft_ms": (stamps[0] - t0) * 1e3, "ttst_ms": (stamps[1] - t0) * 1e3,
            "decode_wait_ms": (stamps[1] - stamps[0]) * 1e3, "prompt_tokens": prompt_tokens,
            **legs}


async def running_stream(client: httpx.AsyncClient, prompt: str, max_tokens: int,
                         stamps: list[float]) -> None:
    """A greedy stream that appends each output token's arrival time to `stamps`."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    async for data in sse_events(client, body):
        now = time.time()
        stamps += [now] * len((data.get("choices") or [{}])[0].get("token_ids") or [])


def tpot_ms(stamps: list[float], t0: float, t1: float) -> float | None:
    """Time per token over [t0, t1] from the tokens that arrived in it (a paced stream's
    chunk counts whole where it lands: with 20 ms pacing, +-one chunk per window)."""
    n = sum(t0 <= t < t1 for t in stamps)
    return (t1 - t0) * 1e3 / n if n else None


def summary(samples: list[dict]) -> dict:
    out: dict = {"n": len(samples)}
    for m in METRICS + tuple(f"{a}->{b}_ms" for a, b in LEGS):
        values = [s[m] for s in samples if m in s]
        if values:
            out[f"{m}_p50"], out[f"{m}_p99"] = _pct(values, 50), _pct(values, 99)
    return out


async def measure(url: str, burst: int, singles: int, bursts: int, prompt_tokens: int,
                  max_tokens: int, running: int = 0, running_bursts: int = 0) -> dict:
    texts = held_out_prompts(burst, num_chars=4 * prompt_tokens)
    n = 0

    def fresh() -> str:  # a unique first block: no prefix cache hit on either side
        nonlocal n
        n += 1
        return f"# {uuid.uuid4().hex}\n" + texts[n % len(texts)]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one_burst() -> list[dict]:
            return await asyncio.gather(*(timed_stream(client, fresh(), max_tokens)
                                          for _ in range(burst)))

        # Warm-up: the KV pair, grow-only pull and pack buffers, decode batch shapes.
        await timed_stream(client, fresh(), max_tokens)
        await one_burst()
        before = (await client.get("/v1/mtpserve/stats")).json()["decode"]
        single = [await timed_stream(client, fresh(), max_tokens) for _ in range(singles)]
        burst_samples: list[dict] = []
        for _ in range(bursts):
            burst_samples += await one_burst()
        after = (await client.get("/v1/mtpserve/stats")).json()["decode"]
        tpot: dict[str, list[float]] = {"before": [], "during": []}
        ended_early = 0  # running streams that finished before the window's end
        for _ in range(running_bursts if running else 0):
            # Short prompts and enough tokens to outlast the burst's prefill and arrivals
            # within 1024 tokens (two compiled context buckets; the benchmark compiles none).
            streams: list[list[float]] = [[] for _ in range(running)]
            tasks = [asyncio.create_task(running_stream(client, fresh()[:120], 900, s))
                     for s in streams]
            while not all(len(s) >= 2 for s in streams):
                await asyncio.sleep(0.02)
            t_before = time.time()
            await asyncio.sleep(1.0)
            t_burst = time.time()
            got = await one_burst()
            w0 = t_burst + min(g["ttft_ms"] for g in got) / 1e3
            w1 = t_burst + max(g["ttst_ms"] for g in got) / 1e3
            for s in streams:
                if s[-1] >= w1:  # still running at the window's end
                    tpot["before"].append(tpot_ms(s, t_before, t_burst))
                    tpot["during"].append(tpot_ms(s, w0, w1))
                else:
                    ended_early += 1
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
    k0, k1 = before.get("kv_puller", {}), after.get("kv_puller", {})
    r0, r1 = before.get("kv_receiver", {}), after.get("kv_receiver", {})
    pulls = k1.get("pulls", 0) - k0.get("pulls", 0)
    res = {"single": summary(single), "burst": summary(burst_samples),
           "prompt_tokens": burst_samples[0]["prompt_tokens"],
           "pulls": pulls, "pull_failures": k1.get("failures", 0) - k0.get("failures", 0),
           # Per pull, singles and bursts together: on the wire (request -> last byte, under
           # the pair's lock) and end to end on the lane (+ waiting for the pair, scatter).
           "pull_wire_ms_mean": 1e3 * (r1.get("pull_seconds", 0) - r0.get("pull_seconds", 0))
           / max(pulls, 1),
           "pull_lane_ms_mean": 1e3 * (k1.get("seconds", 0) - k0.get("seconds", 0))
           / max(pulls, 1),
           "pull_mib_mean": (r1.get("bytes_received", 0) - r0.get("bytes_received", 0))
           / max(pulls, 1) / 2**20,
           # Since the replica started (warm-up burst included); absent on older trees.
           "peak_pulls_in_flight": k1.get("peak_in_flight")}
    for m in METRICS:
        b, s = res["burst"][f"{m}_p99"], res["single"][f"{m}_p99"]
        res[f"{m}_p99_ratio"] = b / s if b and s else None
    if tpot["during"] and all(tpot["before"] + tpot["during"]):
        res["running"] = {"streams": running, "n": len(tpot["during"]),
                          "ended_early": ended_early} | {
            f"tpot_{w}_ms_p{q}": _pct(v, q) for w, v in tpot.items() for q in (50, 99)}
        res["running"]["tpot_p99_ratio"] = (res["running"]["tpot_during_ms_p99"]
                                            / res["running"]["tpot_before_ms_p99"])
    return res


def format_table(results: dict[str, dict], burst: int) -> str:
    f = lambda x, p=0: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    rows = [f"{burst} simultaneous arrivals vs one alone, into one decode replica "
            "(ms; ratio = burst p99 / single p99)",
            "| pull lanes | arrivals | TTFT p50 / p99 | TTST p50 / p99 | TTST - TTFT p50 / p99 |"
            " peak pulls in flight |", "|---|---|---|---|---|---|"]
    for lanes, r in results.items():
        for kind in ("single", "burst"):
            x = r[kind]
            cells = " | ".join(f"{f(x[f'{m}_p50'])} / {f(x[f'{m}_p99'])}" for m in METRICS)
            peak = f(r["peak_pulls_in_flight"]) if kind == "burst" else ""
            rows.append(f"| {lanes} | {kind} ({x['n']}) | {cells} | {peak} |")
        rows.append(f"| {lanes} | p99 ratio | "
                    + " | ".join(f(r[f"{m}_p99_ratio"], 2) for m in METRICS) + " | |")
    rows += ["", "The decode-side wait by hop (ms, p50 / p99; MTPSERVE_TRACE_HOPS=1)",
             "| pull lanes | arrivals | " + " | ".join(f"{a} -> {b}" for a, b in LEGS) + " |",
             "|---|---|" + "---|" * len(LEGS)]
    for lanes, r in results.items():
        for kind in ("single", "burst"):
            x = r[kind]
            rows.append(f"| {lanes} | {kind} | " + " | ".join(
                f"{f(x.get(f'{a}->{b}_ms_p50'), 1)} / {f(x.get(f'{a}->{b}_ms_p99'), 1)}"
                for a, b in LEGS) + " |")
    run = {n: r["running"] for n, r in results.items() if r.get("running")}
    if run:
        rows += ["", "Running streams: TPOT (ms) the second before a burst and during its "
                 "decode-side arrivals", "| variant | streams x bursts | before p50 / p99 | "
                 "during p50 / p99 | p99 ratio |", "|---|---|---|---|---|"]
        rows += [f"| {n} | {x['n']} | {f(x['tpot_before_ms_p50'], 1)} / "
                 f"{f(x['tpot_before_ms_p99'], 1)} | {f(x['tpot_during_ms_p50'], 1)} / "
                 f"{f(x['tpot_during_ms_p99'], 1)} | {f(x['tpot_p99_ratio'], 2)} |"
                 for n, x in run.items()]
    rows += [f"lanes {lanes}: {r['pulls']} pulls of {f(r['pull_mib_mean'], 2)} MiB, "
             f"{f(r['pull_wire_ms_mean'], 1)} ms on the wire, {f(r['pull_lane_ms_mean'], 1)} ms "
             f"on the lane (mean)" for lanes, r in results.items()]
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(config_path("local-cpu.yaml")))
    ap.add_argument("--lanes", type=int, nargs="+", default=[1, 4],
                    help="kv_transfer.max_concurrent_pulls values, one server each")
    ap.add_argument("--gil", nargs="+", choices=("released", "held"), default=["released"],
                    help="compiled decode graphs run with the GIL released (default) or held "
                         "(MTPSERVE_AOTI_RELEASE_GIL=0, the stock AOTInductor loader)")
    ap.add_argument("--engine-core", nargs="+", choices=("thread", "process"),
                    help="one server per value of prefill/decode.engine_core (the engine core "
                         "on a thread of the Serve replica or in its own process; default: "
                         "the config's)")
    ap.add_argument("--stream-interval-ms", type=float, nargs="+",
                    help="one server per value of decode.stream_interval_ms (default: the "
                         "config's)")
    ap.add_argument("--running", type=int, default=4,
                    help="streams decoding while --running-bursts more bursts arrive")
    ap.add_argument("--running-bursts", type=int, default=3)
    ap.add_argument("--burst", type=int, default=16)
    ap.add_argument("--singles", type=int, default=8, help="single arrivals, one at a time")
    ap.add_argument("--bursts", type=int, default=3, help="bursts measured (after a warm-up)")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--timeout", type=float, default=900, help="server start limit (s)")
    ap.add_argument("--json", dest="json_out")
    a = ap.parse_args()
    os.environ[hop_trace.ENV] = "1"  # `mtpserve up` passes it on to every replica
    results: dict[str, dict] = {}
    for lanes, gil, core, pace in ((n, g, c, i) for c in a.engine_core or [None]
                                   for i in a.stream_interval_ms or [None] for g in a.gil
                                   for n in a.lanes):
        name = str(lanes) if gil == "released" else f"{lanes}, GIL held"
        name += f", core {core}" if core else ""
        name += f", paced {pace:g} ms" if pace is not None else ""
        os.environ[aoti_runner.ENV] = "1" if gil == "released" else "0"
        over = {"kv_transfer": {"max_concurrent_pulls": lanes},
                # The whole burst's prompts fit one prefill step (see the module docstring).
                "prefill": {"max_num_batched_tokens": a.burst * (a.prompt_tokens + 64)},
                # Every request's KV is transferred (no prefill on an idle decode replica).
                "decode": {"max_num_seqs": max(32, a.burst), "max_local_prefill_length": 0},
                "limits": {"max_queued_requests": max(64, 4 * a.burst)}}
        if core:
            over["prefill"]["engine_core"] = over["decode"]["engine_core"] = core
        if pace is not None:
            over["decode"]["stream_interval_ms"] = pace
        cfg = variant_config(Path(a.config), over, a.port)
        with running_server(cfg, a.timeout) as start_s:
            results[name] = asyncio.run(measure(f"http://127.0.0.1:{a.port}", a.burst,
                                                a.singles, a.bursts, a.prompt_tokens,
                                                a.max_tokens, a.running, a.running_bursts))
            results[name]["start_seconds"] = start_s
        print(format_table({name: results[name]}, a.burst), flush=True)
    print(format_table(results, a.burst))
    if a.json_out:
        out = {"config": a.config, "burst": a.burst, "singles": a.singles, "bursts": a.bursts,
               "max_tokens": a.max_tokens, "variants": results}
        Path(a.json_out).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
