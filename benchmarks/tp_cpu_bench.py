"""TP on CPU: decode speed of a TP=2 group next to TP=1, one stream, greedy, same run.

Variants (each in fresh processes, one thread per rank as a replica with cpus_per_rank 1 runs):
  tp1-eager, tp1-compiled            one process (the engine's ModelRunner)
  tp2-gloo-eager                     two ranks, activations all-reduced over gloo (loopback TCP)
  tp2-shm-eager, tp2-shm-compiled    two ranks, shared-memory collectives (the default), eager
                                     or compiled decode graphs with the collectives inside
The TP=2 ranks are built as a decode replica builds them (`RankCore`, rank 0 drives the
engine through `TPDriver`). Warm-up (compile, or load from the on-disk compile cache) runs
before the clock; every variant's greedy tokens are checked against tp1-eager's.

    python -m mtpserve.benchmarks.tp_cpu_bench --json benchmarks/results/tp-cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from mtpserve.workers.paths import default_model_path

VARIANTS = {
    "tp1-eager": (1, {"MTPSERVE_COMPILE": "off"}),
    "tp1-compiled": (1, {"MTPSERVE_COMPILE": "on"}),
    "tp2-gloo-eager": (2, {"MTPSERVE_COMPILE": "off", "MTPSERVE_SHM_COLLECTIVES": "0"}),
    "tp2-shm-eager": (2, {"MTPSERVE_COMPILE": "off"}),
    "tp2-shm-compiled": (2, {"MTPSERVE_COMPILE": "on"}),
}


def _prompts(model: str, n: int, tokens: int) -> list[list[int]]:
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.prompts import held_out_prompts

    tok = load_tokenizer(model)
    return [tok.encode(t)[:tokens] for t in held_out_prompts(n, num_chars=4 * tokens)]


def _decode(runner, model: str, prompts: list[list[int]], ks: list[int],
            max_tokens: int) -> dict:
    """Per k: tokens/s over the prompts one at a time (after an untimed first prompt) and the
    greedy tokens."""
    from mtpserve.workers.engine import Engine, EngineConfig
    from mtpserve.workers.sampling_params import SamplingParams

    out: dict = {}
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for k in ks:
        eng = Engine(EngineConfig(model=model, num_speculative_tokens=k, num_kv_blocks=512,
                                  max_num_seqs=4, warmup_budget_s=600), runner=runner)
        t_warm = time.perf_counter()
        graphs = eng.warmup(max_batch=1)
        t_warm = time.perf_counter() - t_warm
        tokens, n, dt = [], 0, 0.0
        for i, p in enumerate([prompts[0]] + prompts):
            req = eng.add_request(f"k{k}-{i}", p, params)
            t0 = time.perf_counter()
            while eng.has_unfinished():
                eng.step()
            if i:  # the first prompt is an untimed warm-up of the Python paths
                dt += time.perf_counter() - t0
                n += req.num_output_tokens
                tokens.append(list(req.output_token_ids))
        out[k] = {"tokens_per_s": n / dt, "tokens": tokens, "warmup_s": t_warm,
                  "graphs": graphs}
    return out


def _rank(rank: int, tp: int, port: int, env: dict, model: str, prompts, ks, max_tokens,
          queue) -> None:
    os.environ.update(env)
    torch.set_num_threads(1)
    from mtpserve.workers.replica.tp_group import RankCore, RankSpec, TPDriver, worker_loop

    if tp == 1:
        from mtpserve.workers.engine_config import compile_enabled
        from mtpserve.workers.model_runner import ModelRunner

        runner = ModelRunner(model, 512, decode_graphs=compile_enabled("auto", "cpu"))
        queue.put(_decode(runner, model, prompts, ks, max_tokens))
        return
    spec = RankSpec(model=model, role="decode", tp_size=tp, num_kv_blocks=512,
                    init_method=f"tcp://127.0.0.1:{port}", kv_interface="lo", num_threads=1)
    core = RankCore(spec, rank)
    if rank:
        worker_loop(core)
    else:
        driver = TPDriver(core)
        result = _decode(driver, model, prompts, ks, max_tokens)
        result["shm_collectives"] = _shm_calls()
        driver.shutdown()
        queue.put(result)
    torch.distributed.barrier()
    os._exit(0)  # skip gloo's teardown (see tests/test_tensor_parallel.py)


def _shm_calls() -> int:
    from mtpserve.workers.model.parallel import get_tp

    shm = get_tp().shm
    return shm.calls if shm is not None else 0


def run_variant(name: str, model: str, prompts, ks, max_tokens) -> dict:
    tp, env = VARIANTS[name]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, tp, port, env, model, prompts, ks,
                                              max_tokens, q)) for r in range(tp)]
    for p in procs:
        p.start()
    res = q.get(timeout=1800)
    for p in procs:
        p.join(timeout=60)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS))
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json")
    a = ap.parse_args()
    prompts = _prompts(a.model, a.num_prompts, a.prompt_tokens)
    results = {v: run_variant(v, a.model, prompts, a.ks, a.max_tokens) for v in a.variants}
    base = results.get("tp1-eager")
    print(f"{'variant':18} " + " ".join(f"{'k=' + str(k) + ' tok/s':>12} {'vs tp1-eager':>12}"
                                        for k in a.ks) + "  same tokens  warm-up s")
    for v, r in results.items():
        cells = []
        for k in a.ks:
            x = r[k]["tokens_per_s"]
            ratio = x / base[k]["tokens_per_s"] if base else float("nan")
            cells.append(f"{x:12.1f} {ratio:11.2f}x")
        same = all(r[k]["tokens"] == base[k]["tokens"] for k in a.ks) if base else None
        warm = sum(r[k]["warmup_s"] for k in a.ks)
        print(f"{v:18} " + " ".join(cells) + f"  {str(same):11}  {warm:9.1f}")
        r["same_tokens_as_tp1_eager"] = same
    if a.json:
        for r in results.values():
            for k in a.ks:
                r[k].pop("tokens")
        Path(a.json).write_text(json.dumps({"settings": vars(a), "variants": results},
                                           indent=1, default=str))


if __name__ == "__main__":
    main()
