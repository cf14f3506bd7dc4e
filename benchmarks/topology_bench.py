"""Which local topology serves fastest: `mtpserve up` with variants of a Serve config, one after
another in one run, each measured by streaming clients (1 and 4 at a time) next to the offline
engine at the same k. Prints a table and writes JSON.

    python -m mtpserve.benchmarks.topology_bench --json benchmarks/results/topology-cpu.json

Replica start time is the time from `mtpserve up` to a healthy server (Ray start, model load,
graph warm-up); a second start of a compiled variant shows the on-disk compile cache
(`--fresh-compile-cache` makes the first one cold).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from mtpserve.benchmarks.local_server import running_server, variant_config
from mtpserve.benchmarks.serve_bench import ServeBenchArgs, run
from mtpserve.workers.paths import config_path

_TP2 = {"tp_size": 2, "cpus_per_rank": 0.5}  # configs/local-cpu-tp2.yaml
VARIANTS = {
    # name: overrides of the config's args ("_env": environment of that server)
    "decode-tp2-gloo-eager": {"decode": _TP2, "engine": {"compile": "off"},
                              "_env": {"MTPSERVE_SHM_COLLECTIVES": "0"}},  # before shm
    "decode-tp2-eager": {"decode": _TP2, "engine": {"compile": "off"}},
    "decode-tp2-compiled": {"decode": _TP2, "engine": {"compile": "auto"}},
    "decode-tp2-compiled-again": {"decode": _TP2, "engine": {"compile": "auto"}},
    "decode-tp1-eager": {"decode": {"tp_size": 1}, "engine": {"compile": "off"}},
    "decode-tp1-compiled": {"decode": {"tp_size": 1}, "engine": {"compile": "auto"}},
    "decode-tp1-compiled-again": {"decode": {"tp_size": 1}, "engine": {"compile": "auto"}},
    # The engine core on a thread of each Serve replica, or in a child process of it.
    "core-thread": {"prefill": {"engine_core": "thread"}, "decode": {"engine_core": "thread"}},
    "core-process": {"prefill": {"engine_core": "process"},
                     "decode": {"engine_core": "process"}},
    # Stream pacing (decode.stream_interval_ms; the variants above take the default).
    "core-thread-unpaced": {"prefill": {"engine_core": "thread"},
                            "decode": {"engine_core": "thread", "stream_interval_ms": 0}},
    "core-process-unpaced": {"prefill": {"engine_core": "process"},
                             "decode": {"engine_core": "process", "stream_interval_ms": 0}},
    "core-thread-paced-50": {"prefill": {"engine_core": "thread"},
                             "decode": {"engine_core": "thread", "stream_interval_ms": 50}},
    "core-process-paced-50": {"prefill": {"engine_core": "process"},
                              "decode": {"engine_core": "process", "stream_interval_ms": 50}},
    # The process core's channel (engine_core_channel; the variants above take shm, the
    # default since the socket pair was measured against it).
    "core-process-socket": {"prefill": {"engine_core_channel": "socket"},
                            "decode": {"engine_core_channel": "socket"}},
    "core-process-socket-unpaced": {"prefill": {"engine_core_channel": "socket"},
                                    "decode": {"engine_core_channel": "socket",
                                               "stream_interval_ms": 0}},
}


def _config(base: Path, over: dict, k: int, port: int) -> dict:
    return variant_config(base, over | {"speculation": {"num_speculative_tokens": k,
                                                        "adaptive": False}}, port)


def _offline(k: int, prompts: int, max_tokens: int, prompt_tokens: int, compile: str) -> float:
    """Decode tokens/s of the offline engine, batch 1, on one thread like the decode replica
    (cpus_per_rank 1): the reference the served stream is compared with."""
    import torch

    from mtpserve.workers.llm import LLM
    from mtpserve.workers.sampling_params import SamplingParams
    from mtpserve.workers.training.prompts import held_out_prompts

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(num_speculative_tokens=k, compile=compile)
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        tokens = seconds = 0.0
        for p in held_out_prompts(prompts, num_chars=4 * prompt_tokens):
            r = llm.generate([p], params)[0]
            tokens += len(r.output_token_ids) - 1
            seconds += r.decode_seconds
        return tokens / seconds
    finally:
        torch.set_num_threads(threads)


def _busy_seconds() -> float:
    """CPU seconds every core of this machine spent busy so far (/proc/stat; Linux)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def idle_cpu_percent(seconds: float = 10.0) -> float | None:
    """The machine's CPU use (% of one core) while the server idles: its replicas' idle
    loops, heartbeats and Ray's own background work (nothing else should run)."""
    try:
        a = _busy_seconds()
        time.sleep(seconds)
        return 100 * (_busy_seconds() - a) / seconds
    except (OSError, ValueError):
        return None


def _serve(cfg: dict, bench: list[ServeBenchArgs], timeout_s: float) -> dict:
    with running_server(cfg, timeout_s) as start_s:
        out = {"start_seconds": start_s}
        time.sleep(5.0)  # past the start's own settling (controller, health checks)
        out["idle_cpu_percent"] = idle_cpu_percent()
        for b in bench:
            out[f"c{b.concurrency}"] = asyncio.run(run(b))
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", default=str(config_path("local-cpu.yaml")))
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--port", type=int, default=8765)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--json", dest="json_out")
    ap.add_argument("--fresh-compile-cache", action="store_true",
                    help="the servers use a new, empty compile cache (the offline reference "
                    "fills the default one): the first compiled variant starts cold")
    args = ap.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    bench = [ServeBenchArgs(url=url, concurrency=1, num_requests=8, max_tokens=args.max_tokens,
                            prompt_tokens=args.prompt_tokens),
             ServeBenchArgs(url=url, concurrency=4, num_requests=12,
                            max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens)]
    offline = {mode: _offline(args.k, 8, args.max_tokens, args.prompt_tokens, mode)
               for mode in ("off", "on")}
    rows = {"k": args.k, "offline_decode_tokens_per_s": offline, "variants": {}}
    if args.fresh_compile_cache:  # `mtpserve up` passes the environment on to the replicas
        os.environ["MTPSERVE_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="mtpserve-compile-")
    for name in args.variants:
        over = dict(VARIANTS[name])
        env = over.pop("_env", {})
        cfg = _config(Path(args.config), over, args.k, args.port)
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # `mtpserve up` passes it on to the replicas
        try:
            rows["variants"][name] = _serve(cfg, bench, args.timeout)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        print(name, json.dumps({k: v for k, v in rows["variants"][name].items()
                                if k == "start_seconds"}), flush=True)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=2) + "\n")
    print(f"k={args.k}; offline engine, batch 1, one thread: eager {offline['off']:.1f}, "
          f"compiled {offline['on']:.1f} decode tok/s")
    # 1/TPOT counts the KV handoff to the decode replica in its first gap; "decode" tok/s
    # starts at the decode replica's first chunk, as the offline engine's decode time does.
    print("| variant | start s | 1 stream: tok/s (1/TPOT p50) | vs offline (same mode) | "
          "1 stream: decode tok/s | vs offline | "
          "TTFT p50 ms | 4 streams: output tok/s | TPOT p50 ms | TTFT p50 ms | idle CPU % |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows["variants"].items():
        one, four = r["c1"], r["c4"]
        tps = 1000 / one["tpot_ms_p50"]
        ref = offline["off" if "eager" in name else "on"]
        dec = 1000 / one["decode_tpot_ms_p50"] if one.get("decode_tpot_ms_p50") else float("nan")
        print(f"| {name} | {r['start_seconds']:.0f} | {tps:.1f} | {tps / ref:.2f}x | "
              f"{dec:.1f} | {dec / ref:.2f}x | {one['ttft_ms_p50']:.0f} | "
              f"{four['output_tokens_per_s']:.1f} | "
              f"{four['tpot_ms_p50']:.1f} | {four['ttft_ms_p50']:.0f} | "
              f"{r.get('idle_cpu_percent') or float('nan'):.1f} |")


if __name__ == "__main__":
    main()
