"""Prefill-burst benchmark (lever 5): TPOT of N running decode requests while long prompts
arrive, with and without mixed batches, side by side in one run (configurations interleaved,
best of `repeats`: on a shared machine other load only ever slows a run down).

Per configuration: N requests with short prompts decode (greedy); "steady" is their time per
output token over `steady_steps` steps with nothing else pending; then `burst` long prompts
arrive at once and "burst" is the running requests' time per output token from their arrival
until every long prompt has its first token and every running request has emitted again
("burst window", about the burst's TTFT; "max ITL": the longest a running request waited for
a token in it). Mixing must lower burst TPOT without raising steady TPOT.

Run: python -m mtpserve.benchmarks.prefill_burst [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch

from mtpserve.workers.engine import DTYPES, Engine, EngineConfig
from mtpserve.workers.model_runner import ModelRunner
from mtpserve.workers.paths import default_model_path
from mtpserve.workers.sampling_params import SamplingParams


@dataclass
class BurstArgs:
    model: str
    k: int = 2
    num_running: int = 4
    running_prompt_tokens: int = 64
    burst: int = 2
    burst_prompt_tokens: int = 1024
    steady_steps: int = 24
    max_num_batched_tokens: int = 512
    mixed_prefill_tokens: tuple[int, ...] = (64, 128, 256)  # one mixed config each
    repeats: int = 2
    dtype: str = "float32"
    device: str = "cpu"


def _measure(eng: Engine, args: BurstArgs, vocab: int, tag: str) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(3, vocab, (n,), generator=g).tolist()  # noqa: E731
    # Long enough that the running requests outlive the steady window and the burst.
    params = SamplingParams(max_tokens=1500, temperature=0, ignore_eos=True)
    running = [eng.add_request(f"{tag}-run{i}", ids(args.running_prompt_tokens), params)
               for i in range(args.num_running)]
    while not all(r.output_token_ids for r in running):
        eng.step()
    for _ in range(4):  # settle into pure decode rounds
        eng.step()

    def emitted() -> int:
        return sum(r.num_output_tokens for r in running)

    n0, t0 = emitted(), time.perf_counter()
    for _ in range(args.steady_steps):
        eng.step()
    steady = (time.perf_counter() - t0) / ((emitted() - n0) / args.num_running)

    first = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    longs = [eng.add_request(f"{tag}-long{i}", ids(args.burst_prompt_tokens), first)
             for i in range(args.burst)]
    n0, t0, steps = emitted(), time.perf_counter(), 0
    stalled = 0  # steps in which some running request emitted nothing
    last_emit = [t0] * len(running)
    max_gap = 0.0  # longest wait of a running request for its next token
    # Until every long prompt has its first token and every running request has emitted
    # after the burst arrived (without mixing, a burst step emits nothing for them).
    while not all(r.output_token_ids for r in longs) or steps == 0 or stalled == steps:
        before = [r.num_output_tokens for r in running]
        eng.step()
        steps += 1
        now = time.perf_counter()
        stalled += any(r.num_output_tokens == b for r, b in zip(running, before, strict=True))
        for i, (r, b) in enumerate(zip(running, before, strict=True)):
            if r.num_output_tokens > b:
                max_gap = max(max_gap, now - last_emit[i])
                last_emit[i] = now
    dt = time.perf_counter() - t0
    per_req = (emitted() - n0) / args.num_running
    for r in running:
        eng.abort(r.request_id)
    while eng.has_unfinished():
        eng.step()
    return {"steady_tpot_ms": steady * 1e3, "burst_tpot_ms": dt / per_req * 1e3,
            "burst_window_ms": dt * 1e3, "max_itl_ms": max_gap * 1e3, "burst_steps": steps,
            "stalled_steps": stalled}


def run_burst(args: BurstArgs) -> dict:
    configs: dict[str, int] = {"alternate": 0}
    configs |= {f"mixed-{m}": m for m in args.mixed_prefill_tokens}
    engines = {}
    for name, m in configs.items():
        runner = ModelRunner(args.model, 1024, 16, DTYPES[args.dtype], args.device,
                             decode_graphs=False)
        engines[name] = Engine(EngineConfig(
            model=args.model, dtype=args.dtype, device=args.device,
            num_speculative_tokens=args.k, num_kv_blocks=1024,
            max_num_batched_tokens=args.max_num_batched_tokens,
            mixed_batches=m > 0, mixed_prefill_tokens=max(m, 1)), runner=runner)
    vocab = next(iter(engines.values())).model_config.vocab_size
    best: dict[str, dict] = {}
    for rep in range(-1, args.repeats):  # -1: untimed warm-up
        for name, eng in engines.items():
            r = _measure(eng, args, vocab, f"{name}-{rep}")
            if rep < 0:
                continue
            old = best.get(name)
            best[name] = r if old is None else {
                key: min(r[key], old[key]) if key.endswith("_ms") else r[key] for key in r}
    return {"args": {k: v for k, v in vars(args).items()}, "threads": torch.get_num_threads(),
            "configs": [{"config": n, **best[n]} for n in configs]}


def format_table(res: dict) -> str:
    a = res["args"]
    lines = [f"k={a['k']} running={a['num_running']}x{a['running_prompt_tokens']} tokens, "
             f"burst={a['burst']}x{a['burst_prompt_tokens']} tokens, "
             f"threads={res['threads']}, best of {a['repeats']}",
             "| config | steady TPOT ms | burst TPOT ms | max ITL ms | burst window ms | "
             "burst steps | steps with a stalled decode |", "|---|---|---|---|---|---|---|"]
    for r in res["configs"]:
        lines.append(f"| {r['config']} | {r['steady_tpot_ms']:.2f} | {r['burst_tpot_ms']:.2f} "
                     f"| {r['max_itl_ms']:.1f} | {r['burst_window_ms']:.0f} "
                     f"| {r['burst_steps']} | {r['stalled_steps']} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--num-running", type=int, default=4)
    ap.add_argument("--burst", type=int, default=2)
    ap.add_argument("--burst-prompt-tokens", type=int, default=1024)
    ap.add_argument("--mixed-prefill-tokens", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json")
    ns = ap.parse_args()
    res = run_burst(BurstArgs(ns.model, k=ns.k, num_running=ns.num_running, burst=ns.burst,
                              burst_prompt_tokens=ns.burst_prompt_tokens,
                              mixed_prefill_tokens=tuple(ns.mixed_prefill_tokens),
                              repeats=ns.repeats))
    print(format_table(res))
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
