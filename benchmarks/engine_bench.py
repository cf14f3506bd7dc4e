"""`mtpserve bench engine`: tokens/s of transformers.generate vs our engine at each k and
batch size, measured side by side in one run on the same prompts and weights (greedy)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch

from workers.engine import DTYPES, Engine, EngineConfig
from workers.sampling_params import SamplingParams
from workers.tokenizer import load_tokenizer
from workers.training.prompts import held_out_prompts


@dataclass
class BenchArgs:
    model: str
    prompts: list[str] | None = None
    max_tokens: int = 128
    ks: tuple[int, ...] = (0, 1, 2, 3)
    batch_sizes: tuple[int, ...] = (1, 8)
    dtype: str = "float32"
    num_prompts: int = 8
    prompt_tokens: int = 256
    device: str = "cpu"


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _hf_generate(model_path: str, prompts: list[list[int]], max_tokens: int, dtype,
                 device: str) -> dict:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    ref = ref.to(device).eval()
    ref.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=4,
                 do_sample=False)  # warm-up
    _sync(device)
    t0, n = time.perf_counter(), 0
    for p in prompts:
        out = ref.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                           do_sample=False, eos_token_id=None, pad_token_id=0)
        n += out.shape[1] - len(p)
    _sync(device)
    dt = time.perf_counter() - t0
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}


def _engine_run(eng: Engine, prompts: list[list[int]], batch: int, max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    t0, n = time.perf_counter(), 0
    reqs = []
    for i in range(0, len(prompts), batch):
        group = [eng.add_request(f"b{i}-{j}", p, params) for j, p in
                 enumerate(prompts[i : i + batch])]
        while eng.has_unfinished():
            eng.step()
        reqs += group
        n += sum(r.num_output_tokens for r in group)
    dt = time.perf_counter() - t0
    k = max((len(r.drafted_per_position) for r in reqs), default=0)
    drafted = [sum(r.drafted_per_position[i] for r in reqs) for i in range(k)]
    accepted = [sum(r.accepted_per_position[i] for r in reqs) for i in range(k)]
    rounds = sum(r.num_rounds for r in reqs)
    # Tokens emitted per decode round (the prefill's first token is not a round's).
    per_round = (sum(r.num_output_tokens - 1 for r in reqs) / rounds) if rounds else 1.0
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt,
            "acceptance_per_position": [a / d if d else None for a, d in
                                        zip(accepted, drafted, strict=True)],
            "mean_accepted_length": per_round}


def run_bench(args: BenchArgs) -> dict:
    tok = load_tokenizer(args.model)
    texts = args.prompts or held_out_prompts(args.num_prompts, num_chars=4 * args.prompt_tokens)
    prompts = [tok.encode(t)[: args.prompt_tokens] for t in texts]
    dtype = DTYPES[args.dtype]
    result: dict = {"model": args.model, "dtype": args.dtype, "num_prompts": len(prompts),
                    "prompt_tokens": [len(p) for p in prompts], "max_tokens": args.max_tokens,
                    "threads": torch.get_num_threads()}
    result["device"] = args.device
    result["transformers"] = _hf_generate(args.model, prompts, args.max_tokens, dtype,
                                          args.device)
    rows = []
    for k in args.ks:
        eng = Engine(EngineConfig(model=args.model, dtype=args.dtype, num_speculative_tokens=k,
                                  num_kv_blocks=4096, max_num_seqs=max(args.batch_sizes),
                                  device=args.device))
        _engine_run(eng, prompts[:1], 1, 8)  # warm-up
        for b in args.batch_sizes:
            r = _engine_run(eng, prompts, b, args.max_tokens)
            rows.append({"k": k, "batch_size": b, **r})
    hf = result["transformers"]["tokens_per_s"]
    for row in rows:
        base = next(x for x in rows if x["k"] == 0 and x["batch_size"] == row["batch_size"]) \
            if 0 in args.ks else None
        row["speedup_vs_k0"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        row["speedup_vs_transformers"] = row["tokens_per_s"] / hf
        row["spec_efficiency"] = (row["speedup_vs_k0"] / row["mean_accepted_length"]
                                  if row["speedup_vs_k0"] and row["k"] > 0 else None)
    result["engine"] = rows
    return result


def format_table(res: dict) -> str:
    lines = [f"model={res['model']} dtype={res['dtype']} prompts={res['num_prompts']} "
             f"max_tokens={res['max_tokens']} threads={res['threads']}",
             f"transformers.generate (batch 1): {res['transformers']['tokens_per_s']:.1f} tok/s",
             "| k | batch | tok/s | vs k=0 | vs HF | accepted/round | spec eff | acceptance "
             "per position |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["engine"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"] if a is not None)
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        lines.append(f"| {r['k']} | {r['batch_size']} | {r['tokens_per_s']:.1f} | "
                     f"{fmt(r['speedup_vs_k0'])} | {fmt(r['speedup_vs_transformers'])} | "
                     f"{r['mean_accepted_length']:.2f} | {fmt(r['spec_efficiency'])} | "
                     f"{acc or '-'} |")
    return "\n".join(lines)


def main(args: BenchArgs, json_out: str | None) -> dict:
    res = run_bench(args)
    print(format_table(res))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=2)
    return res
