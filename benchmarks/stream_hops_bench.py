"""Where a served token's time goes between the decode engine and the client's SSE event.

Starts `mtpserve up` (configs/local-cpu.yaml unless `--config`; k fixed) with
`MTPSERVE_TRACE_HOPS=1`, so every streamed chunk carries wall-clock stamps of the hops it
passed (workers/hop_trace.py): engine (the engine thread made the chunk) -> decode_out (the
decode replica's streaming generator yields it) -> ingress_in (the ingress received it over
the Serve handle) -> sse_out (the ingress wrote the SSE event) -> client (this process read
it, through Serve's HTTP proxy). Streams 1 and then 4 clients at a time; prints, per hop, the
p50 / p90 milliseconds over every decode-side chunk, and tokens per chunk (a chunk carries a
whole round; more when the consumer fell behind and chunks were merged), and the decode-side
tokens per second of each load.

`--engine-core thread process process-socket` starts one server per value of
`decode.engine_core` and `prefill.engine_core` (the engine core on a thread of the Serve
replica, or in its own process over shared memory or the socket pair), one after another in
one run, and writes them under `variants`; a value given again runs again, kept as
`process (run 2)` and so on (repeats show the host's drift).

    python -m mtpserve.benchmarks.stream_hops_bench --json benchmarks/results/stream-hops-cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

import httpx

from mtpserve.benchmarks.local_server import running_server, variant_config
from mtpserve.benchmarks.serve_bench import _pct, sse_events
from mtpserve.workers.hop_trace import ENV, HOPS
from mtpserve.workers.paths import config_path
from mtpserve.workers.training.prompts import held_out_prompts

_CHAIN = (*HOPS, "client")
LEGS = list(zip(_CHAIN, _CHAIN[1:], strict=False))  # consecutive hops


async def _stream(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> list[dict]:
    """Each traced chunk's stamps plus its client arrival and token count."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    out = []
    async for data in sse_events(client, body):
        now = time.time()
        for c in data.get("choices") or []:
            trace = c.get("mtpserve_trace")
            if trace and "engine" in trace:  # decode-side chunks (the first comes from prefill)
                out.append(trace | {"client": now, "tokens": len(c.get("token_ids") or [])})
    return out


async def _load(url: str, prompts: list[str], streams: int, max_tokens: int) -> list[dict]:
    chunks: list[dict] = []
    queue = list(prompts)
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        async def worker() -> None:
            while queue:
                chunks.extend(await _stream(client, queue.pop(), max_tokens))
        await asyncio.gather(*(worker() for _ in range(streams)))
    return chunks


def summarize(chunks: list[dict]) -> dict:
    out: dict = {"chunks": len(chunks),
                 "tokens_per_chunk": sum(c["tokens"] for c in chunks) / max(len(chunks), 1)}
    for a, b in LEGS + [("engine", "client")]:
        ms = [(c[b] - c[a]) * 1e3 for c in chunks if a in c and b in c]
        out[f"{a}->{b}"] = {"p50_ms": _pct(ms, 50), "p90_ms": _pct(ms, 90)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(config_path("local-cpu.yaml")))
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--port", type=int, default=8766)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--engine-core", nargs="+", choices=("thread", "process", "process-socket"),
                    help="one server per value of prefill/decode.engine_core (default: the "
                         "config's); process-socket: a process core over the socket pair "
                         "(engine_core_channel: socket) instead of shared memory")
    ap.add_argument("--stream-interval-ms", type=float,
                    help="decode.stream_interval_ms (default: the config's); 0 sends one "
                         "chunk per round, so the engine -> decode_out hop is the boundary "
                         "alone, not time a paced chunk was held")
    ap.add_argument("--json")
    a = ap.parse_args()
    os.environ[ENV] = "1"  # `mtpserve up` passes it on to every replica
    prompts = held_out_prompts(a.requests, num_chars=512)
    head: dict = {"config": a.config, "k": a.k, "max_tokens": a.max_tokens,
                  "requests": a.requests, "stream_interval_ms": a.stream_interval_ms}
    variants: dict[str, dict] = {}
    cores = a.engine_core or [None]
    for i, core in enumerate(cores):
        # Every stream goes prefill -> KV transfer -> decode (its arrival hops are traced).
        over: dict = {"speculation": {"num_speculative_tokens": a.k, "adaptive": False},
                      "decode": {"max_local_prefill_length": 0}}
        if core is not None:
            mode, _, channel = core.partition("-")
            side = {"engine_core": mode} | ({"engine_core_channel": channel} if channel else {})
            over |= {"prefill": dict(side), "decode": over["decode"] | side}
        if a.stream_interval_ms is not None:
            over.setdefault("decode", {})["stream_interval_ms"] = a.stream_interval_ms
        res: dict = {}
        with running_server(variant_config(Path(a.config), over, a.port), 900) as start_s:
            res["start_seconds"] = start_s
            url = f"http://127.0.0.1:{a.port}"
            asyncio.run(_load(url, prompts[:2], 1, 8))  # untimed: first requests warm paths
            for n in a.streams:
                t0 = time.perf_counter()
                chunks = asyncio.run(_load(url, prompts, n, a.max_tokens))
                res[f"streams_{n}"] = summarize(chunks) | {
                    "decode_tokens_per_s": sum(c["tokens"] for c in chunks)
                    / (time.perf_counter() - t0)}
        earlier = cores[:i].count(core)
        variants[(core or "config") + (f" (run {earlier + 1})" if earlier else "")] = res
        _print(a, core, res)
    if a.json:
        out = head | ({"variants": variants} if a.engine_core else variants["config"])
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


def _print(a, core: str | None, res: dict) -> None:
    print(f"k={a.k}, {a.requests} requests x {a.max_tokens} tokens per load; ms per hop"
          + (f"; engine_core: {core}" if core else ""))
    print("| hop | " + " | ".join(f"{n} stream(s) p50 / p90" for n in a.streams) + " |")
    print("|---|" + "---|" * len(a.streams))
    for a_, b_ in LEGS + [("engine", "client")]:
        cells = [res[f"streams_{n}"][f"{a_}->{b_}"] for n in a.streams]
        print(f"| {a_} -> {b_} | " + " | ".join(
            f"{c['p50_ms']:.2f} / {c['p90_ms']:.2f}" for c in cells) + " |")
    for key, label in (("tokens_per_chunk", "tokens per chunk"),
                       ("decode_tokens_per_s", "decode tokens/s")):
        print(f"| {label} | " + " | ".join(
            f"{res[f'streams_{n}'][key]:.2f}" for n in a.streams) + " |", flush=True)


if __name__ == "__main__":
    main()
