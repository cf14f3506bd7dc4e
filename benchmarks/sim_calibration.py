"""Calibration of the cluster simulator (cluster/sim) against the live cluster on this machine
(issue 19, item 6): record a load through `mtpserve up`, replay it in the simulator with the
replicas' fitted models, and compare TTFT and TPOT p50/p99 per phase.

    python -m mtpserve.benchmarks.sim_calibration --json benchmarks/results/sim-calibration-cpu.json

1. Profile: `mtpserve sim profile` (cluster/sim/profile.py: decode round-time model and prefill
   step times of our engine, in thread CPU time) in a subprocess, eager (MTPSERVE_COMPILE=off).
2. Live: `mtpserve up` on configs/local-cpu.yaml with 1 prefill + 1 decode replica, fixed (no
   autoscaling), `engine.compile: off` (so decode runs eager, as the profile does; it also
   starts in seconds instead of compiling graphs), prefix caching off (the simulator does not
   model it), port 8767. Two warm-up requests, then idle probes, one at a time (prefill alone:
   max_tokens 1; then whole requests at batch 1; then the co-location probes: 4 streams at
   once, the prefill probes again under one decoding stream, and a stream decoding alone and
   again while prompts prefill, three times), then the phases: Poisson
   arrivals at a fixed rate with a fixed seed, prompts cut from the held-out files
   (`held_out_prompts`' text, in consecutive pieces) at lognormal lengths, `max_tokens` fixed
   with `ignore_eos`, greedy. Phases are drained one after another. Per request the client
   records its send time, prompt tokens (usage), output tokens, TTFT and TPOT (streaming,
   client side: TPOT = (last token - first token) / (tokens - 1), as the simulator defines
   it) and its `mtp_stats`; per phase the server's counters (/metrics, /v1/mtpserve/stats).
3. Replay: each phase's exact arrivals and lengths through `cluster.sim.Simulator` with one
   prefill and one decode replica, fixed; each request is its own acceptance class with
   per-position acceptance measured for it (its `mtp_stats`, shaped per position by the
   phase's per-position counters, see `request_alphas`).
4. Report: measured vs predicted TTFT and TPOT p50/p99 per phase and the p50 errors, for
   these replica models ("variants"), each adding measured terms (`measurements`: all of them
   from the idle probes, before the load, or from the replica's own reports):

   - `profile`: the offline profile as it is (thread CPU time; KV pulls at the datapath
     benchmark's 1.24 GiB/s + 2 ms; nothing outside the engines).
   - `profile+overhead`: + a fixed per-request time outside the engines (client TTFT - the
     prefill engine's own TTFT on the idle probes: HTTP, ingress, tokenization, Serve calls),
     added to TTFT (`SimConfig.ingress_overhead_s`), and the KV pulls' measured bytes per
     token and end-to-end rate (decode's puller: receive + scatter).
   - `calibrated`: + the engines' idle speed on this machine: prefill steps x (the prefill
     engine's TTFT / the profile's prefill time) and decode rounds x (the decode engine's
     round time at batch 1 / the profile's), both on the idle probes (wall clock vs the
     profile's thread CPU time).
   - `replica-start`: `calibrated` with the round-time model the live decode replica fitted
     at its start (its start profile, wall clock, before any request: what its autoscaling
     reports) instead of the scaled profile.
   - `shared-cpu`: `calibrated` + CPU sharing (cluster/sim/cpu.py): the replicas, ingress,
     proxy and client share this host's cores, so prefill steps, decode rounds, KV pulls and
     each request's work outside the engines run as jobs under processor sharing, each at
     min(1, cores / (busy jobs + other jobs' busy threads)) relative to its speed alone (as the
     idle probes measured it). Its parameters are machine facts known before the load: the
     cores and the cores other jobs kept busy, measured before `mtpserve up` (`machine` in
     the recording; `--cores` / `--other-busy-cores` for a recording without them).
   - `shared-cpu-pinned`: as `shared-cpu`, but the other jobs keep to their own cores and
     ours share the rest: min(1, free cores / busy jobs).
   - `shared-cpu+stream`: `shared-cpu` + the CPU cost of streaming each output chunk
     through ingress, proxy and client, a job on the shared cores (`stream_s_per_chunk`): the
     stream probe's /proc CPU seconds of those processes per chunk, with 4 streams at once on
     the idle cluster (`--stream-ms-per-chunk` overrides it).
   - `shared-cpu+contended`: `shared-cpu` + the slowdown of prefill steps and of the work
     outside the engines while decode runs (CpuSharing.contended), measured by the contended
     probes: the idle probes' prompts again, one at a time, while one stream decodes (engine
     TTFT / profile prefill vs the idle `prefill scale`; client - engine TTFT vs the idle
     overhead). `--contended-from OTHER.json` takes them from another run's measurements.
   - `co-located`: `shared-cpu+contended` + the decode replica's cost per extra request per
     round (the stream probe) + decode stretches slowed while a prefill step runs
     (CpuSharing.contended["decode"]), measured by the decode-contended probe: pairs of one
     192-token stream alone and again while the prefill probes' prompts (max_tokens 1) are
     sent one after another (`decode_contention`). `co-located-v1`: without the last term.
     The decode scale of every variant is the median of the batch-1 decode measurements (the
     decode probes' group and each lone stream of those pairs).
   - `online` (a diagnostic, not a prediction): `replica-start` with the round-time model
     the decode replica had fitted online by the end of each phase, i.e. from that phase's
     own rounds. What is left between it and the measurement is the simulator's structure
     (batching, joins, k choice, KV lane), not the round-time model.

   `diagnostics` splits each phase's TTFT and TPOT into what the server measured (engine TTFT
   vs the rest; decode-only TPOT; the decode replica's mean round time, batch and k against
   each round model at that batch and k; KV pulls; machine CPU use).

Nothing in the replay is fitted to the phases' TTFT / TPOT. `--recording OLD.json` replays a
previous run's recording (and profile) without starting the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from mtpserve.workers.paths import config_path

K_TOL = 1e-9


@dataclass(frozen=True)
class Phase:
    name: str
    rate: float  # Poisson arrivals per second
    duration_s: float


@dataclass
class CalibrationArgs:
    port: int = 8767
    seed: int = 0
    phases: tuple[Phase, ...] = (Phase("low", 1.0, 40.0), Phase("mid", 2.0, 40.0),
                                 Phase("high", 3.0, 30.0))
    max_tokens: int = 64
    # Prompt length in characters (~3.6 per token for this tokenizer on code): lognormal.
    prompt_chars_median: float = 540.0
    prompt_chars_sigma: float = 0.6
    prompt_chars_min: int = 120
    prompt_chars_max: int = 2400
    num_probes: int = 8
    num_decode_probes: int = 4
    num_warmup: int = 2
    start_timeout_s: float = 300.0
    config: str = field(default_factory=lambda: str(config_path("local-cpu.yaml")))


# Overrides of configs/local-cpu.yaml: fixed 1 + 1 replicas (it has no autoscaling), eager
# decode like the profile, no prefix caching and every prompt through the prefill replica
# (neither is modelled by the simulator).
LIVE_OVERRIDES = {
    "prefill": {"replicas": 1},
    "decode": {"replicas": 1, "max_local_prefill_length": 0},
    "engine": {"compile": "off"},
    "prefix_caching": {"enabled": False},
}


# Load plan -----------------------------------------------------------------------------------

class HeldOutText:
    """Consecutive pieces of the held-out files (the ones `held_out_prompts` draws from, that
    the default model never saw), each ending at a line end: distinct prompts of any length
    (the held-out set is ~340k characters in 31 files, too few files for one per request)."""

    def __init__(self) -> None:
        from mtpserve.workers.training.data import read_texts, split_files

        self.text = "".join(t if t.endswith("\n") else t + "\n"
                            for t in read_texts(split_files()[1]))
        self.pos = 0

    def take(self, chars: int) -> str:
        if self.pos + chars > len(self.text):
            self.pos = 0  # wrap around (only for loads larger than the held-out set)
        end = self.text.rfind("\n", self.pos, self.pos + chars) + 1
        if end <= self.pos:
            end = self.pos + chars
        out, self.pos = self.text[self.pos:end], end
        return out


def plan_load(args: CalibrationArgs) -> dict:
    """Probes and the phases' requests: Poisson send offsets (from each phase's start) and
    prompts cut from held-out text at lognormal lengths; fixed by `args.seed`."""
    rng = np.random.default_rng(args.seed)
    phases = []
    for ph in args.phases:
        offsets, t = [], 0.0
        while True:
            t += rng.exponential(1.0 / ph.rate)
            if t >= ph.duration_s:
                break
            offsets.append(t)
        phases.append(offsets)
    source = HeldOutText()

    def prompt() -> str:
        c = math.exp(math.log(args.prompt_chars_median)
                     + args.prompt_chars_sigma * rng.standard_normal())
        return source.take(int(np.clip(round(c), args.prompt_chars_min,
                                       args.prompt_chars_max)))

    return {"warmup": [prompt() for _ in range(args.num_warmup)],
            "probes": [prompt() for _ in range(args.num_probes)],
            "decode_probes": [prompt() for _ in range(args.num_decode_probes)],
            "phases": [{"name": ph.name, "rate": ph.rate, "duration_s": ph.duration_s,
                        "requests": [{"offset_s": o, "prompt": prompt()} for o in offs]}
                       for ph, offs in zip(args.phases, phases, strict=True)]}


# Client --------------------------------------------------------------------------------------

async def stream_request(client, prompt: str | list[int], max_tokens: int,
                         on_first=None) -> dict:
    """One streaming completion; times from `time.perf_counter()`. TTFT: send -> first chunk
    carrying tokens; TPOT: (last token chunk - first) / (tokens - 1). `on_first()` is called
    when the first token arrives."""
    from mtpserve.benchmarks.serve_bench import sse_events

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = chunks = 0
    usage: dict = {}
    mtp: dict = {}
    async for data in sse_events(client, body):
        now = time.perf_counter()
        for ch in data.get("choices") or []:
            n = len(ch.get("token_ids") or [])
            if n:
                tokens += n
                chunks += 1
                if first is None:
                    first = now
                    if on_first is not None:
                        on_first()
                last = now
        if data.get("usage"):
            usage = data["usage"]
            mtp = data.get("mtp_stats") or {}
    if first is None:
        raise RuntimeError("the stream carried no tokens")
    out_tokens = int(usage.get("completion_tokens", tokens))
    return {"sent": t0, "ttft_s": first - t0,
            "tpot_s": (last - first) / (out_tokens - 1) if out_tokens > 1 else None,
            "prompt_tokens": int(usage.get("prompt_tokens", 0)), "output_tokens": out_tokens,
            "streamed_tokens": tokens, "chunks": chunks, "last_s": last - t0,
            "num_drafted": int(mtp.get("num_drafted", 0)),
            "num_accepted": int(mtp.get("num_accepted", 0)),
            "num_rounds": int(mtp.get("num_rounds", 0))}


def parse_prometheus(text: str) -> dict[tuple[str, tuple], float]:
    """Prometheus text -> {(sample name, sorted label items): value}: the plain subset
    router/metrics_api.py renders (no escapes inside label values other than quotes)."""
    out: dict[tuple[str, tuple], float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        labels: tuple = ()
        if "{" in head:
            name, _, rest = head.partition("{")
            items = []
            for part in rest.rstrip("}").split(","):
                if "=" in part:
                    k, _, v = part.partition("=")
                    items.append((k.strip(), v.strip().strip('"')))
            labels = tuple(sorted(items))
        else:
            name = head
        out[(name, labels)] = float(value)
    return out


def counters_of(samples: dict[tuple[str, tuple], float], k_max: int) -> dict[str, float]:
    """The counters a phase is read by (sums over replicas and labels)."""
    def total(name: str, **labels: str) -> float:
        return sum(v for (n, lab), v in samples.items() if n == name
                   and all(dict(lab).get(k) == x for k, x in labels.items()))

    out = {
        "drafts": total("vllm:spec_decode_num_drafts_total"),
        "draft_tokens": total("vllm:spec_decode_num_draft_tokens_total"),
        "accepted_tokens": total("vllm:spec_decode_num_accepted_tokens_total"),
        "generation_tokens": total("vllm:generation_tokens_total"),
        "preemptions": total("vllm:num_preemptions_total"),
        "engine_ttft_sum": total("vllm:time_to_first_token_seconds_sum"),
        "engine_ttft_count": total("vllm:time_to_first_token_seconds_count"),
        "decode_tpot_sum": total("vllm:request_time_per_output_token_seconds_sum"),
        "decode_tpot_count": total("vllm:request_time_per_output_token_seconds_count"),
        "kv_bytes": total("mtpserve:kv_transfer_bytes_total"),
    }
    for i in range(k_max):
        out[f"accepted_pos_{i}"] = total("vllm:spec_decode_num_accepted_tokens_per_pos_total",
                                         position=str(i))
    return out


def _role_stats(stats: dict) -> dict:
    """The parts of /v1/mtpserve/stats a calibration reads (scalars, KV and autoscaling)."""
    out = {}
    for role in ("prefill", "decode"):
        s = stats.get(role) or {}
        keep = {k: v for k, v in s.items() if isinstance(v, (int, float, str)) or v is None}
        for key in ("kv_receiver", "kv_puller", "kv_sender", "autoscaling"):
            if isinstance(s.get(key), dict):
                keep[key] = {k: v for k, v in s[key].items() if isinstance(v, (int, float))}
        out[role] = keep
    return out


def _cpu_times() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine (/proc/stat), (0, 0) where absent."""
    try:
        vals = [float(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except OSError:
        return 0.0, 0.0
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0.0)
    return sum(vals) - idle, sum(vals)


async def _snapshot(client, k_max: int, timeout_s: float = 15.0) -> dict:
    """Counters and stats from replica snapshots pushed after now (replicas push them every
    second: wait for the next push instead of reading stale ones)."""
    since = time.time() + 0.2
    end = time.monotonic() + timeout_s
    fresh = True
    while True:
        stats = (await client.get("/v1/mtpserve/stats")).json()
        reps = stats.get("replicas", [])
        if reps and min(r["time"] for r in reps) >= since:
            break
        if time.monotonic() > end:  # recorded as stale rather than losing the run
            fresh = False
            break
        await asyncio.sleep(0.1)
    samples = parse_prometheus((await client.get("/metrics")).text)
    busy, total = _cpu_times()
    return {"counters": counters_of(samples, k_max), "stats": _role_stats(stats),
            "fresh": fresh, "cpu_busy": busy, "cpu_total": total,
            "loadavg": list(os.getloadavg())}


async def _guarded(coro) -> dict:
    try:
        return await coro
    except Exception as e:  # recorded, left out of the statistics and the replay
        return {"error": repr(e)[:300]}


def _delta(a: dict, b: dict) -> dict:
    return {k: b["counters"][k] - a["counters"].get(k, 0.0) for k in b["counters"]}


async def record_load(url: str, plan: dict, max_tokens: int) -> dict:
    """Run the plan against `url`: warm-up, idle probes, then each phase (drained before the
    next). Returns the recording (everything the replay needs, JSON-able)."""
    import httpx

    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = _role_stats((await client.get("/v1/mtpserve/stats")).json())
        k_max = int(start["decode"].get("num_speculative_tokens", 0) or 0)
        k_max = int(start["decode"].get("autoscaling", {}).get("k_max", k_max))
        for p in plan["warmup"]:
            await _guarded(stream_request(client, p, 8))
        rec = {"k_max": k_max, "start_stats": start, "phases": []}
        after = await _snapshot(client, k_max)
        # Idle probes, one at a time: prefill alone (max_tokens 1: no decode), then whole
        # requests (prefill, KV pull, decode at batch 1).
        for key, prompts, n in (("probes", plan["probes"], 1),
                                ("decode_probes", plan.get("decode_probes", []), max_tokens)):
            before = after
            reqs = [await _guarded(stream_request(client, p, n)) for p in prompts]
            after = await _snapshot(client, k_max)
            for r in reqs:
                r.pop("sent", None)
            rec[key] = {"requests": reqs, "counters": _delta(before, after),
                        "stats_start": before["stats"], "stats_end": after["stats"],
                        "fresh": before["fresh"] and after["fresh"]}
        # Co-location probes (still before the load): the CPU cost per streamed chunk outside
        # the engines, and what one running stream does to a prompt's TTFT.
        rec["stream_probe"] = await stream_probe(client, plan["probes"][:STREAM_PROBE_B],
                                                 STREAM_PROBE_TOKENS, k_max)
        rec["contended_probes"], after = await contended_probes(client, plan["probes"], k_max)
        # ... and what prompts prefilling do to a decoding stream (batch 1), paired with the
        # same stream alone (more batch-1 decode probes, too).
        stream_prompt = (plan.get("decode_probes") or plan["probes"])[0]
        rec["decode_contended_probe"], after = await decode_contended_probe(
            client, stream_prompt, plan["probes"], k_max)
        t_run = time.perf_counter()
        for ph in plan["phases"]:
            before = after
            t_phase = time.perf_counter()

            async def one(item: dict, t_phase: float = t_phase) -> dict:
                await asyncio.sleep(max(0.0, t_phase + item["offset_s"] - time.perf_counter()))
                r = await _guarded(stream_request(client, item["prompt"], max_tokens))
                r["offset_s"] = item["offset_s"]
                if "sent" in r:
                    r["arrival_s"] = r.pop("sent") - t_phase
                return r

            results = await asyncio.gather(*(one(it) for it in ph["requests"]))
            wall = time.perf_counter() - t_phase
            after = await _snapshot(client, k_max)
            rec["phases"].append({
                "name": ph["name"], "rate": ph["rate"], "duration_s": ph["duration_s"],
                "start_s": t_phase - t_run, "wall_s": wall, "requests": results,
                "counters": _delta(before, after), "stats_start": before["stats"],
                "stats_end": after["stats"], "fresh": before["fresh"] and after["fresh"],
                "machine_cpu_busy": (after["cpu_busy"] - before["cpu_busy"])
                / max(after["cpu_total"] - before["cpu_total"], 1.0),
                "loadavg_end": after["loadavg"]})
            print(f"phase {ph['name']}: {len(results)} requests in {wall:.1f}s", flush=True)
    return rec


# Co-location probes ---------------------------------------------------------------------------

STREAM_PROBE_B = 4  # concurrent streams
STREAM_PROBE_TOKENS = 256  # tokens each: ~350 chunks, so 10 ms clock ticks are < 5% of it
# Processes whose CPU a streamed chunk costs outside the engines (Ray's process titles).
OUTSIDE_PROCESSES = ("OpenAIIngress", "ProxyActor")


def process_cpu_s(names: tuple[str, ...]) -> dict[str, float]:
    """CPU seconds (user + system) so far of the processes whose command line contains one of
    `names` (summed per name), and of this process (`client`); from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = dict.fromkeys(names, 0.0) | {"client": 0.0}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (p / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        cpu = (int(fields[11]) + int(fields[12])) / tick
        if int(p.name) == os.getpid():
            out["client"] += cpu
        for n in names:
            if n in cmd:
                out[n] += cpu
    return out


async def stream_probe(client, prompts: list[str], max_tokens: int, k_max: int) -> dict:
    """Streams at once on the idle cluster: CPU seconds the ingress, proxy and client spent per
    streamed chunk (what `stream_s_per_chunk` of cluster/sim/cpu.py is), by /proc; and the
    decode engine's counters, for its round time at that batch (`measurements`)."""
    snap0 = await _snapshot(client, k_max)
    before = process_cpu_s(OUTSIDE_PROCESSES)
    t0 = time.perf_counter()
    reqs = await asyncio.gather(*(_guarded(stream_request(client, p, max_tokens))
                                  for p in prompts))
    wall = time.perf_counter() - t0
    after = process_cpu_s(OUTSIDE_PROCESSES)
    snap1 = await _snapshot(client, k_max)
    ok = [r for r in reqs if "error" not in r]
    chunks = sum(r["chunks"] for r in ok)
    cpu = {k: after[k] - before[k] for k in after}
    for r in reqs:
        r.pop("sent", None)
    out = {"streams": len(prompts), "ok": len(ok), "max_tokens": max_tokens, "chunks": chunks,
           "wall_s": wall, "cpu_s": cpu, "requests": reqs, "counters": _delta(snap0, snap1),
           "engine_rounds": snap1["stats"]["decode"].get("total_rounds", 0)
           - snap0["stats"]["decode"].get("total_rounds", 0)}
    if chunks and len(ok) == len(prompts):
        out["s_per_chunk"] = sum(cpu.values()) / chunks
    return out


async def contended_probes(client, prompts: list[str], k_max: int) -> tuple[dict, dict]:
    """The prefill probes again, one at a time, while one long stream decodes (started first,
    cancelled after): client and prefill-engine TTFT under one concurrent stream, to set
    against the idle probes. max_tokens 2 so the prefill engine times each request."""
    bg = asyncio.create_task(_guarded(stream_request(client, prompts[-1], 4096)))
    await asyncio.sleep(1.0)  # the stream is decoding
    before = await _snapshot(client, k_max)
    reqs = []
    for p in prompts:
        reqs.append(await _guarded(stream_request(client, p, 2)))
        await asyncio.sleep(0.2)
    after = await _snapshot(client, k_max)
    bg.cancel()
    await asyncio.gather(bg, return_exceptions=True)
    for r in reqs:
        r.pop("sent", None)
    out = {"requests": reqs, "counters": _delta(before, after),
           "fresh": before["fresh"] and after["fresh"]}
    await asyncio.sleep(2.0)  # the cancelled stream leaves decode
    return out, await _snapshot(client, k_max)


DECODE_PROBE_REPS = 3  # pairs (stream alone, stream with prompts prefilling)
DECODE_PROBE_TOKENS = 192  # each stream: ~75 rounds, ~1.3 s of decode at batch 1


async def decode_contended_probe(client, stream_prompt: str, prompts: list[str], k_max: int,
                                 reps: int = DECODE_PROBE_REPS,
                                 tokens: int = DECODE_PROBE_TOKENS) -> tuple[dict, dict]:
    """`reps` pairs: one stream alone (batch-1 decode), then the same stream again while the
    prefill probes' prompts (max_tokens 1: they never reach decode, so decode stays at batch
    1) are sent one after another, from its first token until it ends. The decode engine's
    counters around each stream give its round time (decode-only TPOT x tokens / its rounds);
    the prompts' client times give when the prefill engine was busy (`measurements`)."""
    after = await _snapshot(client, k_max)
    out: dict = {"reps": [], "tokens": tokens}
    for _ in range(reps):
        before = after
        alone = await _guarded(stream_request(client, stream_prompt, tokens))
        mid = await _snapshot(client, k_max)
        started = asyncio.Event()
        bg = asyncio.create_task(_guarded(stream_request(client, stream_prompt, tokens,
                                                         on_first=started.set)))
        waiter = asyncio.create_task(started.wait())
        await asyncio.wait({bg, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
        reqs, i = [], 0
        while not bg.done():
            r = await _guarded(stream_request(client, prompts[i % len(prompts)], 1))
            reqs.append(r)
            i += 1
        stream = await bg
        after = await _snapshot(client, k_max)
        t0 = stream.get("sent", 0.0)
        for r in reqs:  # send times relative to the stream's
            if "sent" in r:
                r["start_s"] = r.pop("sent") - t0
        for r in (alone, stream):
            r.pop("sent", None)
        out["reps"].append({"alone": alone, "contended": stream, "prompts": reqs,
                            "counters_alone": _delta(before, mid),
                            "counters_contended": _delta(mid, after),
                            "fresh": before["fresh"] and mid["fresh"] and after["fresh"]})
    return out, after


def machine_facts(window_s: float = 5.0) -> dict:
    """What the host gives the cluster, measured before it starts (issue 19 calibration, CPU
    sharing): its cores and how many of them other jobs keep busy (/proc/stat over
    `window_s`, nothing of ours running yet)."""
    b0, t0 = _cpu_times()
    time.sleep(window_s)
    b1, t1 = _cpu_times()
    cores = os.cpu_count() or 1
    busy = (b1 - b0) / (t1 - t0) if t1 > t0 else 0.0
    return {"cores": cores, "other_busy_cores": round(busy * cores, 3), "window_s": window_s,
            "loadavg": list(os.getloadavg()),
            "source": "measured before `mtpserve up` (/proc/stat, os.cpu_count)"}


def record_live(args: CalibrationArgs, plan: dict) -> dict:
    from mtpserve.benchmarks.local_server import running_server, variant_config

    machine = machine_facts()
    print(f"machine: {machine}", flush=True)
    cfg = variant_config(Path(args.config), LIVE_OVERRIDES, args.port)
    with running_server(cfg, args.start_timeout_s) as start_s:
        print(f"cluster up in {start_s:.1f}s", flush=True)
        rec = asyncio.run(record_load(f"http://127.0.0.1:{args.port}", plan, args.max_tokens))
    app_args = cfg["applications"][0]["args"]
    rec["server_start_s"] = start_s
    rec["machine"] = machine
    rec["cluster"] = {
        "block_size": app_args["block_size"],
        "prefill_max_num_batched_tokens": app_args["prefill"]["max_num_batched_tokens"],
        "prefill_num_kv_blocks": app_args["prefill"]["num_kv_blocks"],
        "decode_max_num_seqs": app_args["decode"]["max_num_seqs"],
        "decode_num_kv_blocks": app_args["decode"]["num_kv_blocks"],
        "overrides": LIVE_OVERRIDES,
    }
    return rec


# Measured acceptance -------------------------------------------------------------------------

def reach(kbar: float, k_max: int) -> list[float]:
    """P(k > i) for i < k_max when rounds draft the two integers around the mean k `kbar`."""
    m = int(math.floor(kbar + K_TOL))
    f = kbar - m
    return [1.0 if i < m else (f if i == m else 0.0) for i in range(k_max)]


def position_alphas(c: dict, k_max: int) -> list[float] | None:
    """Conditional acceptance per draft position from a phase's counters: rounds with drafts,
    draft tokens and accepted tokens per position (position i accepted = the round accepted
    more than i drafts). Position i is tested in rounds that drafted more than i and accepted
    the i before it; how many rounds drafted more than i is not counted, so their k is taken
    as the two integers around the mean and independent of acceptance (exact when every round
    drafts the same k). None without drafts."""
    drafts = c.get("drafts", 0.0)
    if k_max == 0 or drafts <= 0:
        return None
    w = reach(c["draft_tokens"] / drafts, k_max)
    out: list[float] = []
    for i in range(k_max):
        if i == 0:
            tested = drafts * w[0]
        else:
            tested = c[f"accepted_pos_{i - 1}"] * (w[i] / w[i - 1] if w[i - 1] > 0 else 0.0)
        if tested > 0:
            out.append(min(1.0, c[f"accepted_pos_{i}"] / tested))
        else:
            out.append(out[-1] if out else 0.0)
    return out


def accepted_per_round(alphas: list[float], w: list[float]) -> float:
    total, chain = 0.0, 1.0
    for a, p in zip(alphas, w, strict=False):
        chain *= a
        total += p * chain
    return total


def request_alphas(req: dict, shape: list[float] | None, k_max: int) -> tuple[float, ...]:
    """Per-position acceptance of one request: the phase's per-position shape scaled by one
    factor so that the request's own accepted drafts per round (its `mtp_stats`, at its own
    mean k) come out exactly. A request without decode rounds takes the phase's alphas."""
    if k_max == 0:
        return ()
    shape = shape or [1.0] * k_max
    rounds = req.get("num_rounds", 0)
    if rounds <= 0 or req.get("num_drafted", 0) <= 0:
        return tuple(shape)
    w = reach(req["num_drafted"] / rounds, k_max)
    target = req["num_accepted"] / rounds
    base = [max(a, 1e-6) for a in shape]

    def f(s: float) -> float:
        return accepted_per_round([min(1.0, s * a) for a in base], w)

    hi = 1.0 / min(base)
    if target >= f(hi):
        return tuple(min(1.0, hi * a) for a in base)
    lo = 0.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return tuple(min(1.0, (lo + hi) / 2 * a) for a in base)


# Replay --------------------------------------------------------------------------------------

@dataclass
class Variant:
    """What the simulator is given besides the recorded load."""

    name: str
    profile: dict  # a FittedReplicaModel profile (`mtpserve sim profile`)
    decode_coef: list[float] | None = None  # round-time model; None: the profile's
    prefill_scale: float = 1.0  # prefill step time multiplier
    decode_scale: float = 1.0  # round time multiplier
    kv_bytes_per_token: float | None = None
    kv_bytes_per_s: float | None = None
    kv_latency_s: float | None = None
    ingress_overhead_s: float = 0.0
    # Seconds per request per round beyond the first request (moved from T's intercept to its
    # batch slope, so T(1, k) is unchanged).
    decode_s_per_chunk: float = 0.0
    # CPU sharing between the co-located replicas (cluster/sim/cpu.py CpuSharing fields);
    # None: each replica its own machine.
    cpu: dict | None = None
    note: str = ""


def build_models(v: Variant, cluster: dict):
    """(prefill, decode) FittedReplicaModels for the live cluster's shape."""
    from mtpserve.cluster.sim.replica_models import FittedReplicaModel

    block = cluster["block_size"]
    p = FittedReplicaModel.from_profile(v.profile)
    d = FittedReplicaModel.from_profile(v.profile)
    for m in (p, d):
        m.max_num_batched_tokens = cluster["prefill_max_num_batched_tokens"]
        m.prefill_kv_tokens = cluster["prefill_num_kv_blocks"] * block
        m.decode_kv_tokens = cluster["decode_num_kv_blocks"] * block
        m.max_num_seqs = cluster["decode_max_num_seqs"]
        m.prefill = tuple(c * v.prefill_scale for c in m.prefill)
        if v.kv_bytes_per_token is not None:
            m.kv_bytes_per_token = v.kv_bytes_per_token
        if v.kv_bytes_per_s is not None:
            m.kv_bytes_per_s = v.kv_bytes_per_s
        if v.kv_latency_s is not None:
            m.kv_latency_s = v.kv_latency_s
    coef = v.decode_coef if v.decode_coef is not None else d.coef
    d.coef = tuple(float(c) * v.decode_scale for c in coef)
    if v.decode_s_per_chunk:
        d.coef = (d.coef[0] - v.decode_s_per_chunk, d.coef[1] + v.decode_s_per_chunk,
                  *d.coef[2:])
    d.__post_init__()
    return p, d


def replay(requests: list[dict], alphas: list[tuple[float, ...]], v: Variant, cluster: dict
           ) -> list[dict]:
    """Simulate `requests` (arrival_s, prompt_tokens, output_tokens) on 1 prefill + 1 decode
    replica, fixed; request i has acceptance `alphas[i]`. Returns TTFT / TPOT per request, in
    the order given."""
    from mtpserve.cluster.sim.cluster import Simulator
    from mtpserve.cluster.sim.config import SimConfig
    from mtpserve.cluster.sim.cpu import CpuSharing
    from mtpserve.cluster.sim.workloads import Workload

    n = len(requests)
    arrival = np.array([float(r["arrival_s"]) for r in requests])
    wl = Workload(arrival=arrival, cls=np.arange(n, dtype=np.int64),
                  prompt=np.array([int(r["prompt_tokens"]) for r in requests], dtype=np.int64),
                  output=np.array([int(r["output_tokens"]) for r in requests], dtype=np.int64),
                  duration_s=float(arrival.max()) + 1e-3 if n else 1e-3)
    models = build_models(v, cluster)
    sim_cfg = SimConfig(scenario="calibration-replay", policy="mtpserve",
                        prefill_replicas=(1, 1, 1), decode_replicas=(1, 1, 1),
                        max_num_seqs=cluster["decode_max_num_seqs"],
                        max_num_batched_tokens=cluster["prefill_max_num_batched_tokens"],
                        ingress_overhead_s=v.ingress_overhead_s,
                        cpu=CpuSharing(**v.cpu) if v.cpu else None)
    sim = Simulator(sim_cfg, workload=wl, models=models, class_alphas=alphas)
    sim.run()
    return [{"ttft_s": r.ttft, "tpot_s": r.tpot, "status": r.status} for r in sim.requests]


def pct_ms(values: list[float | None], q: float) -> float | None:
    xs = [v for v in values if v is not None]
    return float(np.percentile(xs, q)) * 1000.0 if xs else None


def err_pct(pred: float | None, meas: float | None) -> float | None:
    return None if pred is None or not meas else 100.0 * (pred - meas) / meas


def ok_requests(phase: dict) -> list[dict]:
    return [r for r in phase["requests"] if "error" not in r]


def phase_row(phase: dict, measured: list[dict], predicted: list[dict]) -> dict:
    row: dict = {"phase": phase["name"], "rate": phase["rate"], "requests": len(measured)}
    for key in ("ttft", "tpot"):
        for q in (50, 99):
            m = pct_ms([r[f"{key}_s"] for r in measured], q)
            p = pct_ms([r[f"{key}_s"] for r in predicted], q)
            row[f"{key}_ms_p{q}_measured"] = m
            row[f"{key}_ms_p{q}_predicted"] = p
        for name, rs in (("measured", measured), ("predicted", predicted)):
            xs = [r[f"{key}_s"] for r in rs if r[f"{key}_s"] is not None]
            row[f"{key}_ms_mean_{name}"] = 1000 * float(np.mean(xs)) if xs else None
        row[f"{key}_p50_error_pct"] = err_pct(row[f"{key}_ms_p50_predicted"],
                                               row[f"{key}_ms_p50_measured"])
        row[f"{key}_p99_error_pct"] = err_pct(row[f"{key}_ms_p99_predicted"],
                                               row[f"{key}_ms_p99_measured"])
    return row


def phase_alphas(rec: dict, phase: dict) -> list[tuple[float, ...]]:
    k = rec["k_max"]
    shape = position_alphas(phase["counters"], k)
    return [request_alphas(r, shape, k) for r in ok_requests(phase)]


def run_variant(rec: dict, v: Variant, per_phase_coef: list | None = None) -> dict:
    rows, per_request = [], []
    for i, phase in enumerate(rec["phases"]):
        reqs = ok_requests(phase)
        vv = replace(v, decode_coef=per_phase_coef[i]) if per_phase_coef else v
        pred = replay(reqs, phase_alphas(rec, phase), vv, rec["cluster"])
        rows.append(phase_row(phase, reqs, pred))
        per_request.append(pred)
    return {"rows": rows, "predicted": per_request}


# Measured corrections ------------------------------------------------------------------------

def coef_of(stats: dict) -> list[float] | None:
    a = (stats.get("decode") or {}).get("autoscaling") or {}
    if all(f"pm_{j}" in a for j in range(4)):
        return [float(a[f"pm_{j}"]) for j in range(4)]
    return None


def _kv(stats_start: dict, stats_end: dict) -> tuple[float, float, float]:
    """(pulls, seconds, bytes) of decode's KV pulls between two stats: the puller's seconds
    (receive + scatter into the cache: the time a pull holds its request, queueing excluded)
    and the receiver's bytes."""
    a, b = stats_start["decode"], stats_end["decode"]

    def d(part: str, key: str) -> float:
        return float(b.get(part, {}).get(key, 0) - a.get(part, {}).get(key, 0))

    return d("kv_puller", "pulls"), d("kv_puller", "seconds"), d("kv_receiver", "bytes_received")


def measurements(rec: dict, profile: dict) -> dict:
    """What the live run measured on its idle probes (one request at a time, before the load),
    and the decode replica's own round models; nothing here reads the phases.

    - ingress overhead = client TTFT - the prefill engine's TTFT (arrival in the engine to its
      first token), means over the probes the engine timed: HTTP, ingress, tokenization,
      Serve calls, streaming the token back;
    - prefill scale = the prefill engine's TTFT / the profile's prefill time of the same
      prompts (wall clock on this shared machine vs thread CPU time);
    - decode scale = the decode engine's round time on the decode probes (batch 1; its
      decode-only time per output token x tokens per round) / the profile's T(1, mean k);
    - KV pulls: bytes per pulled token and end-to-end bytes/s of the decode probes' pulls.

    The prefill engine does not time a request that ends at its first token (max_tokens 1:
    workers/replica/metrics.py no longer finds it when the output arrives), so only the decode
    probes
    give the engine's TTFT; the prefill-only probes give a cross-check, the least-squares line
    client TTFT = overhead + scale x profile prefill time over their prompt lengths.
    """
    from mtpserve.cluster.sim.replica_models import FittedReplicaModel, prefill_alone_s
    from mtpserve.workers.perf_model import PerfModel

    k = rec["k_max"]
    out: dict = {}
    m = FittedReplicaModel.from_profile(profile)
    m.max_num_batched_tokens = rec["cluster"]["prefill_max_num_batched_tokens"]
    timed = []  # (client TTFT, engine TTFT sum, engine TTFT count, profile prefill)
    for key in ("probes", "decode_probes"):
        group = rec.get(key) or {}
        reqs = [p for p in group.get("requests", []) if "error" not in p]
        if not reqs:
            continue
        c = group["counters"]
        client = [p["ttft_s"] for p in reqs]
        prof = [prefill_alone_s(m, p["prompt_tokens"]) for p in reqs]
        out[f"{key}_client_ttft_s"] = float(np.mean(client))
        out[f"{key}_profile_prefill_s"] = float(np.mean(prof))
        out[f"{key}_engine_ttft_count"] = c["engine_ttft_count"]
        if c["engine_ttft_count"] == len(reqs):
            timed.append((sum(client), c["engine_ttft_sum"], len(reqs), sum(prof)))
        if key == "probes" and len(reqs) >= 2 and np.ptp(prof) > 0:
            slope, icpt = np.polyfit(prof, client, 1)
            out["prefill_probe_fit"] = {"overhead_s": float(icpt), "scale": float(slope)}
    if timed:
        client, engine, n, prof = (sum(x) for x in zip(*timed, strict=True))
        out.update(engine_ttft_s=engine / n, client_ttft_s=client / n,
                   ingress_overhead_s=max((client - engine) / n, 0.0),
                   prefill_scale=engine / prof, ttft_probes=n)
    dp = rec.get("decode_probes")
    reqs = [r for r in (dp or {}).get("requests", []) if "error" not in r]
    if reqs:
        c = dp["counters"]
        rounds = sum(r["num_rounds"] for r in reqs)
        drafted = sum(r["num_drafted"] for r in reqs)
        out.update(decode_probes=len(reqs),
                   decode_probe_client_tpot_s=float(np.mean([r["tpot_s"] for r in reqs])),
                   decode_probe_client_ttft_s=float(np.mean([r["ttft_s"] for r in reqs])))
        if c["decode_tpot_count"] and rounds:
            # (decode-only TPOT x decode tokens) summed over the probes / their rounds; every
            # probe generated max_tokens tokens.
            tokens = float(np.mean([r["output_tokens"] - 1 for r in reqs]))
            round_s = (c["decode_tpot_sum"] / c["decode_tpot_count"] * tokens * len(reqs)
                       / rounds)
            kbar = drafted / rounds
            prof = PerfModel(profile["perf_model"]).round_s(1, kbar)
            out.update(decode_probe_round_s=round_s, decode_probe_k=kbar,
                       decode_probe_profile_round_s=prof, decode_scale=round_s / prof)
        pulls, secs, nbytes = _kv(dp["stats_start"], dp["stats_end"])
        pulled = sum(r["prompt_tokens"] + max(k - 1, 0) for r in reqs)
        out.update(kv_probe_pulls=pulls, kv_probe_seconds=secs, kv_probe_bytes=nbytes)
        if pulls == len(reqs) and secs > 0 and nbytes > 0:
            out.update(kv_bytes_per_token=nbytes / pulled, kv_bytes_per_s=nbytes / secs)
    cp = rec.get("contended_probes")
    creqs = [r for r in (cp or {}).get("requests", []) if "error" not in r]
    if creqs and cp["counters"]["engine_ttft_count"] == len(creqs):
        # The same prompts as the idle probes, under one concurrent stream.
        n = len(creqs)
        engine = cp["counters"]["engine_ttft_sum"] / n
        client = float(np.mean([r["ttft_s"] for r in creqs]))
        prof = float(np.mean([prefill_alone_s(m, r["prompt_tokens"]) for r in creqs]))
        out.update(contended_engine_ttft_s=engine, contended_client_ttft_s=client,
                   contended_overhead_s=client - engine, contended_prefill_scale=engine / prof)
        if out.get("prefill_scale") and out.get("ingress_overhead_s"):
            # Slowdown of prefill and of the work outside the engines while decode streams.
            out["contended_prefill_slowdown"] = engine / prof / out["prefill_scale"]
            out["contended_overhead_slowdown"] = (client - engine) / out["ingress_overhead_s"]
    dcp = rec.get("decode_contended_probe")
    if dcp:
        from mtpserve.cluster.sim.cpu import CpuSharing

        mach = rec.get("machine") or {}
        share = CpuSharing(cores=float(mach.get("cores", 1)),
                           other_threads=float(mach.get("other_busy_cores", 0.0)))
        dc = decode_contention(dcp, share.rate(2))
        out.update(dc)
        # More batch-1 decode probes: the decode scale is the median over the decode probes
        # (one value for their group) and each lone stream of the pairs.
        pm = PerfModel(profile["perf_model"])
        samples = ([out["decode_scale"]] if "decode_scale" in out else []) + [
            r / pm.round_s(1, k) for r, k in dc["decode_alone_rounds"]]
        if samples:
            out["decode_scale_samples"] = samples
            out["decode_scale"] = float(np.median(samples))
    sp = rec.get("stream_probe") or {}
    if sp.get("s_per_chunk") is not None:
        out["stream_s_per_chunk"] = sp["s_per_chunk"]
    out.update(decode_chunk_cost(sp, profile, out.get("decode_scale", 1.0)))
    out["machine"] = rec.get("machine")
    out["decode_coef_start"] = coef_of(rec["start_stats"])
    out["decode_coef_phase_end"] = [coef_of(ph["stats_end"]) for ph in rec["phases"]]
    return out


def _stream_round(r: dict, c: dict) -> tuple[float, float] | None:
    """(round seconds, mean k) of a lone stream from the decode engine's counters around it
    (decode-only TPOT x its decode tokens / its rounds); None when not measurable."""
    if "error" in r or c.get("decode_tpot_count") != 1 or not r.get("num_rounds"):
        return None
    return (c["decode_tpot_sum"] * (r["output_tokens"] - 1) / r["num_rounds"],
            r["num_drafted"] / r["num_rounds"])


def decode_contention(probe: dict, rate2: float) -> dict:
    """The slowdown of decode while the prefill engine runs, from the decode-contended probe
    (`decode_contended_probe`), per pair: rho = the stream's round time with prompts
    prefilling / alone; f = the fraction of its decode span (client: first to last token)
    during which the prefill engine was busy (each prompt's engine time, placed at the end
    of its client TTFT and clipped to the span; engine time = client TTFT x the window's
    prefill-engine TTFT sum / client TTFT sum, the stream's own prefill taken out). In the
    simulator a decode stretch runs at rate(2) / s while a prefill job runs and at full speed
    otherwise (cluster/sim/cpu.py), so rounds x alone round = span x ((1 - f) + f rate2 / s):
    s = f rate2 / (1 / rho - (1 - f)). The median over the pairs; {} without a usable pair.
    Ingress and streaming jobs during the span are not counted (they run between prompts)."""
    pairs, alone_rounds = [], []
    for rep in probe.get("reps", []):
        a = _stream_round(rep["alone"], rep["counters_alone"])
        if a is not None:
            alone_rounds.append(a)
        cc = rep["counters_contended"]
        ca, cs = rep["counters_alone"], rep["contended"]
        prompts = [r for r in rep["prompts"] if "error" not in r and "start_s" in r]
        if a is None or "error" in cs or not prompts or not cs.get("num_rounds"):
            continue
        # The contended window's decode counters hold the stream only (prompts end at prefill).
        b = _stream_round(cs, {"decode_tpot_sum": cc["decode_tpot_sum"],
                               "decode_tpot_count": cc["decode_tpot_count"]})
        engine = cc["engine_ttft_sum"] - ca["engine_ttft_sum"]  # less the stream's prefill
        if b is None or cc["engine_ttft_count"] - ca["engine_ttft_count"] != len(prompts):
            continue
        share = engine / sum(r["ttft_s"] for r in prompts)
        lo, hi = cs["ttft_s"], cs["last_s"]
        busy = 0.0
        for r in prompts:
            end = r["start_s"] + r["ttft_s"]
            busy += max(0.0, min(end, hi) - max(end - share * r["ttft_s"], lo))
        f = busy / (hi - lo) if hi > lo else 0.0
        rho = b[0] / a[0]
        den = 1.0 / rho - (1.0 - f)
        s = f * rate2 / den if f > 0 and den > 0 else None
        pairs.append({"alone_round_s": a[0], "contended_round_s": b[0], "alone_k": a[1],
                      "contended_k": b[1], "rho": rho, "prefill_busy_fraction": f,
                      "engine_share": share, "prompts": len(prompts), "slowdown": s})
    out: dict = {"decode_contended_pairs": pairs, "decode_alone_rounds": alone_rounds}
    ss = [p["slowdown"] for p in pairs if p["slowdown"] is not None]
    if ss:
        out["contended_decode_slowdown_raw"] = float(np.median(ss))
        # A slowdown under 1 (decode faster while prefill runs) is noise: none.
        out["contended_decode_slowdown"] = max(1.0, float(np.median(ss)))
    return out


def decode_chunk_cost(sp: dict, profile: dict, scale: float) -> dict:
    """The decode replica's cost per request per round that the profile's batch slope lacks
    (streaming each request's chunk out of the replica, in the engine's process), from the
    stream probe: its requests' round time (decode-only TPOT x tokens / own rounds) at the
    batch they decoded in (mean number of streams decoding over each one's decode span), less
    the calibrated model's T(batch, k), per extra request. {} without a usable probe."""
    from mtpserve.workers.perf_model import PerfModel

    reqs = [r for r in sp.get("requests", []) if "error" not in r]
    c = sp.get("counters") or {}
    if len(reqs) < 2 or len(reqs) != sp.get("streams") or not c.get("decode_tpot_count"):
        return {}
    spans = [(r["ttft_s"], r["last_s"]) for r in reqs]
    grid = np.linspace(min(a for a, _ in spans), max(b for _, b in spans), 2000)
    live = sum(((grid >= a) & (grid < b)).astype(float) for a, b in spans)
    batch = float(np.mean([live[(grid >= a) & (grid < b)].mean() for a, b in spans]))
    rounds = sum(r["num_rounds"] for r in reqs)
    tokens = sum(r["output_tokens"] - 1 for r in reqs)
    round_s = c["decode_tpot_sum"] / c["decode_tpot_count"] * tokens / rounds
    k = sum(r["num_drafted"] for r in reqs) / rounds
    model_s = scale * PerfModel(profile["perf_model"]).round_s(batch, k)
    out = {"stream_probe_batch": batch, "stream_probe_round_s": round_s,
           "stream_probe_model_round_s": model_s}
    if batch > 1.05:
        out["decode_s_per_chunk"] = max((round_s - model_s) / (batch - 1.0), 0.0)
    return out


def variants(profile: dict, meas: dict) -> dict[str, Variant]:
    """The replica models compared (module docstring), each adding one measured term."""
    base = Variant("profile", profile, note="offline profile as it is (thread CPU time; KV "
                   "pulls at the datapath benchmark's rate; nothing outside the engines)")
    kv = {"kv_bytes_per_token": meas.get("kv_bytes_per_token"),
          "kv_bytes_per_s": meas.get("kv_bytes_per_s"),
          "kv_latency_s": 0.0 if meas.get("kv_bytes_per_s") else None}
    over = replace(base, name="profile+overhead",
                   ingress_overhead_s=meas.get("ingress_overhead_s", 0.0), **kv,
                   note="+ the ingress overhead and KV pulls measured on the idle probes")
    cal = replace(over, name="calibrated", prefill_scale=meas.get("prefill_scale", 1.0),
                  decode_scale=meas.get("decode_scale", 1.0),
                  note="+ prefill and decode speed measured on the idle probes (live engines' "
                  "wall clock / profile)")
    out = {v.name: v for v in (base, over, cal)}
    machine = meas.get("machine") or {}
    if machine.get("cores"):
        share = {"cores": float(machine["cores"]),
                 "other_threads": float(machine.get("other_busy_cores", 0.0))}
        stream = float(machine.get("stream_s_per_chunk", 0.0))
        out["shared-cpu"] = replace(
            cal, name="shared-cpu", cpu=share | {"pinned": False},
            note=f"`calibrated` + CPU sharing (cluster/sim/cpu.py): prefill steps, decode "
            f"rounds, KV pulls and the work outside the engines share {share['cores']:g} cores "
            f"with {share['other_threads']:g} busy threads of other jobs, fairly per thread")
        out["shared-cpu-pinned"] = replace(
            cal, name="shared-cpu-pinned", cpu=share | {"pinned": True},
            note="as `shared-cpu`, but the other jobs keep to their own cores: ours share "
            f"the {share['cores'] - share['other_threads']:g} left")
        if stream > 0:
            out["shared-cpu+stream"] = replace(
                cal, name="shared-cpu+stream",
                cpu=share | {"pinned": False, "stream_s_per_chunk": stream},
                note=f"`shared-cpu` + {1000 * stream:.2f} ms of CPU per streamed chunk in "
                "ingress, proxy and client (the stream probe: /proc CPU time per chunk of "
                "concurrent streams on the idle cluster)")
        slow = {"prefill": meas.get("contended_prefill_slowdown"),
                "ingress": meas.get("contended_overhead_slowdown")}
        if all(slow.values()) and meas.get("decode_s_per_chunk") is not None:
            c = meas["decode_s_per_chunk"]
            v1 = replace(
                cal, name="co-located", decode_s_per_chunk=c,
                cpu=share | {"pinned": False, "contended": tuple(sorted(slow.items()))},
                note=f"`shared-cpu+contended` + {1000 * c:.2f} ms per extra request per decode "
                "round (the stream probe: decode round time at its batch vs `calibrated`)")
            d = meas.get("contended_decode_slowdown")
            if d:
                out["co-located-v1"] = replace(v1, name="co-located-v1", note=v1.note
                                               + "; no slowdown of decode by prefill")
                out["co-located"] = replace(
                    v1, cpu=share | {"pinned": False,
                                     "contended": tuple(sorted((slow | {"decode": d}).items()))},
                    note=v1.note + f"; decode stretches {d:.2f}x slower while a prefill step "
                    "runs (the decode-contended probe: a batch-1 stream's rounds while prompts "
                    "prefill vs alone)")
            else:
                out["co-located"] = v1
        if all(slow.values()):
            out["shared-cpu+contended"] = replace(
                cal, name="shared-cpu+contended",
                cpu=share | {"pinned": False, "contended": tuple(sorted(slow.items()))},
                note=f"`shared-cpu` + prefill steps {slow['prefill']:.2f}x and the work "
                f"outside the engines {slow['ingress']:.2f}x slower while decode runs (the "
                "contended probes: the idle probes' prompts under one decoding stream)")
    if meas.get("decode_coef_start"):
        out["replica-start"] = replace(
            over, name="replica-start", prefill_scale=meas.get("prefill_scale", 1.0),
            decode_coef=meas["decode_coef_start"],
            note="`calibrated` with the round model the decode replica fitted at its start "
            "(wall clock, as its autoscaling reports it) instead of the scaled profile")
    return out


def analyse(rec: dict, profile: dict, contended: dict | None = None) -> dict:
    """`contended`: the contended probes' slowdowns of another run, for a recording without
    its own."""
    meas = measurements(rec, profile) | (contended or {})
    out: dict = {"measurements": meas, "variants": {}}
    vs = variants(profile, meas)
    runs: list[tuple[Variant, list | None]] = [(v, None) for v in vs.values()]
    coefs = meas["decode_coef_phase_end"]
    if "replica-start" in vs and all(c is not None for c in coefs):
        runs.append((replace(vs["replica-start"], name="online", note="diagnostic, not a "
                             "prediction: the decode replica's online round model at each "
                             "phase's end (fitted on that phase's own rounds)"), coefs))
    for v, per_phase in runs:
        res = run_variant(rec, v, per_phase)
        cfg = _variant_json(v)
        if per_phase:
            cfg["decode_coef"] = per_phase
        out["variants"][v.name] = {"note": v.note, "config": cfg, **res}
    out["diagnostics"] = diagnostics(rec, profile, meas)
    primary = "co-located" if "co-located" in out["variants"] else "calibrated"
    out["ttft_by_arrival"] = {
        "variant": primary,
        "phases": [ttft_by_arrival(ok_requests(ph), pred) for ph, pred in
                   zip(rec["phases"], out["variants"][primary]["predicted"], strict=True)]}
    return out


ARRIVAL_STATES = ("alone", "behind-prefill", "during-decode")


def arrival_state(req: dict, others: list[dict]) -> str:
    """What the server was doing when `req` arrived, from the client's own times: another
    request still waiting for its first token (`behind-prefill`, whatever else streams), only
    other requests streaming their decode (`during-decode`), or nothing (`alone`)."""
    a = req["arrival_s"]
    if any(o["arrival_s"] <= a < o["arrival_s"] + o["ttft_s"] for o in others):
        return "behind-prefill"
    if any(o["arrival_s"] + o["ttft_s"] <= a < o["arrival_s"] + o["last_s"] for o in others):
        return "during-decode"
    return "alone"


def ttft_by_arrival(measured: list[dict], predicted: list[dict]) -> dict:
    """TTFT p50 measured vs predicted per arrival state (`arrival_state`): where in the load
    the prediction goes wrong. Diagnostic only: it reads the phase, never feeds a model."""
    groups: dict[str, list[tuple[float, float]]] = {s: [] for s in ARRIVAL_STATES}
    for i, r in enumerate(measured):
        others = measured[:i] + measured[i + 1:]
        if predicted[i]["ttft_s"] is not None:
            groups[arrival_state(r, others)].append((r["ttft_s"], predicted[i]["ttft_s"]))
    out = {}
    for state, pairs in groups.items():
        m = pct_ms([x for x, _ in pairs], 50)
        q = pct_ms([y for _, y in pairs], 50)
        out[state] = {"requests": len(pairs), "ttft_ms_p50_measured": m,
                      "ttft_ms_p50_predicted": q, "ttft_p50_error_pct": err_pct(q, m)}
    return out


def _variant_json(v: Variant) -> dict:
    d = asdict(v)
    d.pop("profile")
    return d


def _mean_ms(reqs: list[dict], key: str) -> float | None:
    xs = [r[key] for r in reqs if r[key] is not None]
    return 1000 * float(np.mean(xs)) if xs else None


def diagnostics(rec: dict, profile: dict, meas: dict) -> list[dict]:
    """Per phase, the terms behind TTFT and TPOT as the server measured them: client vs
    engine TTFT (the prefill engine's, queueing in the engine included) and client vs
    decode-only TPOT (the decode engine's, from KV arrival: no pull, no streaming); the decode
    replica's mean round time, batch and k (its 30 s window at the phase's end) against what
    the round models predict at that batch and k; KV pulls; acceptance; machine CPU use."""
    from mtpserve.workers.perf_model import PerfModel

    prof = PerfModel(profile["perf_model"])
    start = PerfModel(meas["decode_coef_start"]) if meas.get("decode_coef_start") else None
    scale = meas.get("decode_scale", 1.0)
    out = []
    for ph in rec["phases"]:
        a = ph["stats_end"]["decode"].get("autoscaling", {})
        c = ph["counters"]
        reqs = ok_requests(ph)
        row = {"phase": ph["name"], "errors": len(ph["requests"]) - len(reqs),
               "machine_cpu_busy": ph.get("machine_cpu_busy"),
               "loadavg_end": ph.get("loadavg_end"),
               "alphas": position_alphas(c, rec["k_max"]),
               "mean_k": c["draft_tokens"] / c["drafts"] if c["drafts"] else None,
               "client_ttft_mean_ms": _mean_ms(reqs, "ttft_s"),
               "engine_ttft_mean_ms": 1000 * c["engine_ttft_sum"] / c["engine_ttft_count"]
               if c["engine_ttft_count"] else None,
               "client_tpot_mean_ms": _mean_ms(reqs, "tpot_s"),
               "engine_decode_tpot_mean_ms": 1000 * c["decode_tpot_sum"]
               / c["decode_tpot_count"] if c["decode_tpot_count"] else None,
               "preemptions": c["preemptions"]}
        pulls, secs, nbytes = _kv(ph["stats_start"], ph["stats_end"])
        row.update(kv_pulls=pulls, kv_pull_ms_mean=1000 * secs / pulls if pulls else None,
                   kv_bytes_per_s=nbytes / secs if secs > 0 else None)
        if "round_s" in a and "batch" in a:
            b, k = a["batch"], a.get("k", 0.0)
            row.update(window_round_ms=1000 * a["round_s"], window_batch=b, window_k=k,
                       profile_round_ms=1000 * prof.round_s(b, k),
                       calibrated_round_ms=1000 * scale * prof.round_s(b, k))
            if start is not None:
                row["start_profile_round_ms"] = 1000 * start.round_s(b, k)
        out.append(row)
    return out


# Report --------------------------------------------------------------------------------------

def format_table(rows: list[dict], title: str) -> str:
    f = lambda x, p=1: "-" if x is None else f"{x:.{p}f}"  # noqa: E731
    e = lambda x: "-" if x is None else f"{x:+.0f}%"  # noqa: E731
    out = [title,
           "| phase | rate req/s | requests | TTFT p50 ms meas / pred | TTFT p99 ms meas / pred "
           "| TPOT p50 ms meas / pred | TPOT p99 ms meas / pred | TTFT p50 err | "
           "TPOT p50 err |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(
            f"| {r['phase']} | {r['rate']:g} | {r['requests']} | "
            f"{f(r['ttft_ms_p50_measured'])} / {f(r['ttft_ms_p50_predicted'])} | "
            f"{f(r['ttft_ms_p99_measured'])} / {f(r['ttft_ms_p99_predicted'])} | "
            f"{f(r['tpot_ms_p50_measured'], 2)} / {f(r['tpot_ms_p50_predicted'], 2)} | "
            f"{f(r['tpot_ms_p99_measured'], 2)} / {f(r['tpot_ms_p99_predicted'], 2)} | "
            f"{e(r['ttft_p50_error_pct'])} | {e(r['tpot_p50_error_pct'])} |")
    return "\n".join(out)


def fit_profile(path: Path, rounds_per_cell: int) -> dict:
    """`mtpserve sim profile` in a subprocess, eager (MTPSERVE_COMPILE=off), one torch
    thread (it sets that itself)."""
    env = dict(os.environ, MTPSERVE_COMPILE="off")
    subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "sim", "profile", "--json",
                    str(path), "--rounds-per-cell", str(rounds_per_cell)], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", dest="json_out", required=True)
    ap.add_argument("--recording", help="replay the recording in this earlier output JSON "
                    "instead of running the live cluster")
    ap.add_argument("--profile", help="a profile JSON (`mtpserve sim profile`); default: fit "
                    "one now (or, with --recording, the recording's)")
    ap.add_argument("--rounds-per-cell", type=int, default=12, help="profile: timed decode "
                    "rounds per (batch, k) cell")
    ap.add_argument("--port", type=int, default=8767)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--phases", help="name:rate:seconds,... (default low:1:40,mid:2:40,"
                    "high:3:30)")
    ap.add_argument("--cores", type=float, help="CPU sharing: the host's cores (default: "
                    "the recording's machine facts)")
    ap.add_argument("--other-busy-cores", type=float, help="CPU sharing: cores other jobs "
                    "kept busy (default: the recording's machine facts)")
    ap.add_argument("--contended-from", help="take the co-location probes' measurements "
                    "(contended slowdowns, decode cost per chunk) from this other output JSON "
                    "(for a recording without those probes)")
    ap.add_argument("--decode-contended-from", help="take only the decode-contended probe's "
                    "slowdown of decode by prefill from this other output JSON (applied after "
                    "--contended-from)")
    ap.add_argument("--stream-ms-per-chunk", type=float, help="CPU sharing: CPU time to "
                    "stream one output chunk through ingress, proxy and client (default: the "
                    "recording's stream probe; 0 without one)")
    a = ap.parse_args(argv)
    args = CalibrationArgs(port=a.port, seed=a.seed, max_tokens=a.max_tokens)
    if a.phases:
        args.phases = tuple(Phase(n, float(r), float(s)) for n, r, s in
                            (p.split(":") for p in a.phases.split(",")))
    old = json.loads(Path(a.recording).read_text()) if a.recording else None
    if a.profile:
        profile = json.loads(Path(a.profile).read_text())
    elif old is not None:
        profile = old["profile"]
    else:
        with tempfile.TemporaryDirectory() as tmp:
            t0 = time.perf_counter()
            profile = fit_profile(Path(tmp) / "profile.json", a.rounds_per_cell)
            print(f"profile fitted in {time.perf_counter() - t0:.1f}s: perf_model "
                  f"{profile['perf_model']}, prefill {profile['prefill']}", flush=True)
    if old is not None:
        rec, settings = old["recording"], old["settings"]
    else:
        plan = plan_load(args)
        t0 = time.perf_counter()
        rec = record_live(args, plan)
        print(f"live run: {time.perf_counter() - t0:.1f}s", flush=True)
        settings = asdict(args)
    machine = dict(rec.get("machine") or {})
    if a.cores is not None or a.other_busy_cores is not None:
        machine.update({k: v for k, v in (("cores", a.cores),
                                          ("other_busy_cores", a.other_busy_cores))
                        if v is not None}, source="command line")
    if machine:
        probe = (rec.get("stream_probe") or {}).get("s_per_chunk")
        machine["stream_s_per_chunk"] = (a.stream_ms_per_chunk / 1000
                                         if a.stream_ms_per_chunk is not None
                                         else float(probe or 0.0))
        rec = dict(rec, machine=machine)
    contended = None
    if a.contended_from:
        m = json.loads(Path(a.contended_from).read_text())["measurements"]
        contended = {k: m[k] for k in ("contended_prefill_slowdown",
                                        "contended_overhead_slowdown", "decode_s_per_chunk",
                                        "contended_decode_slowdown")
                     if k in m}
        contended["contended_source"] = a.contended_from
    if a.decode_contended_from:
        m = json.loads(Path(a.decode_contended_from).read_text())["measurements"]
        contended = (contended or {}) | {
            "contended_decode_slowdown": m["contended_decode_slowdown"],
            "decode_contended_source": a.decode_contended_from}
    res = analyse(rec, profile, contended)
    for name, v in res["variants"].items():
        print(format_table(v["rows"], f"\n{name}: {v['note']}"))
    print("\nmeasurements:", json.dumps({k: v for k, v in res["measurements"].items()},
                                        default=float))
    for d in res["diagnostics"]:
        print("diagnostics:", json.dumps(d))
    by = res["ttft_by_arrival"]
    print(f"\nTTFT p50 by what was in flight at arrival ({by['variant']}; measured / "
          "predicted ms, requests):")
    for ph, groups in zip(rec["phases"], by["phases"], strict=True):
        print(f"  {ph['name']:>6}: " + "; ".join(
            f"{s} {g['ttft_ms_p50_measured']:.1f} / {g['ttft_ms_p50_predicted']:.1f} "
            f"({g['requests']})" if g["requests"] else f"{s} - (0)"
            for s, g in groups.items()))
    out = {"settings": settings, "profile": profile, "recording": rec, **res}
    Path(a.json_out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
