"""`mtpserve bench engine`: tokens/s of transformers.generate vs our engine at each k and
batch size, measured side by side in one run on the same prompts and weights (greedy).

`variants` picks the runner configurations, each measured on every row with the variants
interleaved (so a lever's effect is measured side by side): "eager", "graphs" (fixed-shape
compiled decode graphs, compiled before timing), "graphs-mtp-bf16" (graphs, and the MTP
module and its head in bfloat16), "graphs-dv1024" (graphs, drafting over the 1024 most
frequent tokens; see `parse_variant`). `context_sweep` adds k=0 batch-1 TPOT at each
context length (time per decode token after the first)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass

import torch

from mtpserve.workers.engine import DTYPES, Engine, EngineConfig
from mtpserve.workers.engine_config import resolve_dtype
from mtpserve.workers.model_runner import ModelRunner
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.tokenizer import load_tokenizer
from mtpserve.workers.training.prompts import held_out_prompts


@dataclass(frozen=True)
class Variant:
    graphs: bool
    mtp_dtype: str | None = None  # None: the model's dtype
    draft_vocab_size: int | None = None  # None: the full vocabulary
    cpp_wrapper: bool = True  # graphs' kernel-calling code in C++ (False: Python)
    # A whole greedy k = 1 round as one graph; None: as the engine does by default (on for
    # CPU graphs, engine_config.fused_greedy_rounds), so "graphs" measures the default engine.
    greedy_rounds: bool | None = None
    cuda_graphs: bool = True  # CUDA: replay the compiled buckets as CUDA graphs
    attention_backend: str = "gather"  # "flex": FlexAttention over the block table
    ahead_of_time: bool = True  # CPU: AOTInductor packages (disk-cached); False: torch.compile
    dynamic_graphs: bool = True  # CPU: one dynamic-shape package per kind; False: buckets


def parse_variant(name: str) -> Variant:
    """"eager" | "graphs" | "graphs-pywrap" (graphs called through inductor's Python
    wrapper), then optional "-mtp-bf16", "-dv<N>" (a draft vocabulary of the N most
    frequent tokens) and "-rounds" (a whole greedy round as one graph), in that order, e.g.
    "graphs-dv1024-rounds", or "-steps" (k = 1 rounds step by step, as graphs did before fused
    rounds became the CPU default); then optionally "-nocg" (CUDA: compiled graphs called, not
    replayed as CUDA graphs), "-flex" (the flex attention backend), e.g. "eager-flex", and
    "-jit" (CPU: torch.compile in the process instead of ahead-of-time packages), then
    "-static" (CPU: static-shape bucket packages instead of one dynamic package per kind)."""
    extra: dict = {}
    for suffix, field_value in (("-static", ("dynamic_graphs", False)),
                                ("-jit", ("ahead_of_time", False)),
                                ("-flex", ("attention_backend", "flex")),
                                ("-nocg", ("cuda_graphs", False))):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            extra[field_value[0]] = field_value[1]
    return dataclasses.replace(_parse_base(name), **extra)


def _parse_base(name: str) -> Variant:
    base, *rest = name.split("-", 1)
    if base not in ("eager", "graphs"):
        raise ValueError(f"variant {name!r}: starts with eager or graphs")
    tail = rest[0] if rest else ""
    pywrap = tail.startswith("pywrap")
    if pywrap:
        tail = tail[len("pywrap"):].lstrip("-")
    v = Variant(graphs=base == "graphs", cpp_wrapper=not pywrap)
    if tail.startswith("mtp-bf16"):
        v = dataclasses.replace(v, mtp_dtype="bfloat16")
        tail = tail[len("mtp-bf16"):].lstrip("-")
    if tail.startswith("dv"):
        num, _, tail = tail[2:].partition("-")
        if not num.isdigit():
            raise ValueError(f"variant {name!r}: dv needs a size")
        v = dataclasses.replace(v, draft_vocab_size=int(num))
    if tail in ("rounds", "steps"):
        v = dataclasses.replace(v, greedy_rounds=tail == "rounds")
        tail = ""
    if tail:
        raise ValueError(f"variant {name!r}: unknown suffix {tail!r}")
    return v


@dataclass
class BenchArgs:
    model: str
    prompts: list[str] | None = None
    max_tokens: int = 128
    ks: tuple[int, ...] = (0, 1, 2, 3)
    batch_sizes: tuple[int, ...] = (1, 8)
    dtype: str = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    num_prompts: int = 8
    prompt_tokens: int = 256
    device: str = "cpu"
    variants: tuple[str, ...] = ("graphs",)  # see parse_variant
    context_sweep: tuple[int, ...] = ()
    sweep_tokens: int = 32
    num_kv_blocks: int = 4096
    block_size: int = 16
    # Each measurement is repeated (variants interleaved) and the fastest kept: on a shared
    # machine other load only ever slows a run down.
    repeats: int = 1


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _hf_generate(model_path: str, prompts: list[list[int]], max_tokens: int, dtype,
                 device: str, repeats: int = 1) -> dict:
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
    ref = ref.to(device).eval()
    ref.generate(torch.tensor([prompts[0]], device=device), max_new_tokens=4,
                 do_sample=False)  # warm-up
    _sync(device)
    best: dict | None = None
    for _ in range(repeats):
        t0, n = time.perf_counter(), 0
        for p in prompts:
            out = ref.generate(torch.tensor([p], device=device), max_new_tokens=max_tokens,
                               do_sample=False, eos_token_id=None, pad_token_id=0)
            n += out.shape[1] - len(p)
        _sync(device)
        dt = time.perf_counter() - t0
        if best is None or n / dt > best["tokens_per_s"]:
            best = {"tokens": n, "seconds": dt, "tokens_per_s": n / dt}
    return best


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


def _greedy_rounds(v: Variant, device: str) -> bool:
    """The variant's choice, else the engine's default at a fixed k: fused k = 1 rounds on CPU
    (DecodeGraphs.round_key fuses only k = 1, so every other k runs as the engine runs it)."""
    if v.greedy_rounds is not None:
        return v.greedy_rounds
    return v.graphs and torch.device(device).type == "cpu"


def _runner(args: BenchArgs, variant: str, max_context: int) -> tuple[ModelRunner, dict]:
    """One runner per variant, shared by every k (compiled graphs are per runner); graphs are
    compiled here, before anything is timed."""
    v = parse_variant(variant)
    runner = ModelRunner(args.model, args.num_kv_blocks, args.block_size,
                         DTYPES[resolve_dtype(args.dtype, args.device)], args.device,
                         decode_graphs=v.graphs, cuda_graphs=v.cuda_graphs,
                         attention_backend=v.attention_backend,
                         mtp_dtype=DTYPES[v.mtp_dtype] if v.mtp_dtype else None,
                         draft_vocab_size=v.draft_vocab_size, cpp_wrapper=v.cpp_wrapper,
                         greedy_rounds=_greedy_rounds(v, args.device),
                         compile_ahead_of_time=v.ahead_of_time, dynamic_graphs=v.dynamic_graphs)
    t0 = time.perf_counter()
    batches = [1 << i for i in range(max(args.batch_sizes).bit_length())]
    queries = list(range(1, max(args.ks) + 2))
    n = runner.warmup_graphs(batches, queries, max_context)
    if args.context_sweep:  # k=0 batch-1 main graphs for the longer contexts
        n += runner.warmup_graphs([1], [1], max(args.context_sweep) + args.sweep_tokens + 1, 0)
    return runner, {"variant": variant, "graphs_compiled": n,
                    "compile_seconds": time.perf_counter() - t0}


def _engine(args: BenchArgs, runner: ModelRunner, k: int) -> Engine:
    return Engine(EngineConfig(model=args.model, dtype=args.dtype, num_speculative_tokens=k,
                               num_kv_blocks=args.num_kv_blocks, block_size=args.block_size,
                               max_num_seqs=max(args.batch_sizes), device=args.device),
                  runner=runner)


def _tpot_sweep(args: BenchArgs, runner: ModelRunner, vocab: int) -> list[dict]:
    """k=0 batch-1 time per output token after the first, at each context length."""
    eng = _engine(args, runner, 0)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.sweep_tokens, temperature=0, ignore_eos=True)
    rows = []
    for ctx in args.context_sweep:
        ids = torch.randint(1, vocab, (ctx,), generator=g).tolist()
        tpots = []
        for i in range(-1, args.repeats):  # -1: untimed warm-up
            req = eng.add_request(f"sweep-{ctx}-{i}", ids, params)
            while eng.has_unfinished():
                eng.step()
            if i >= 0:
                tpots.append((req.finish_time - req.first_token_time)
                             / (req.num_output_tokens - 1))
        rows.append({"context": ctx, "tpot_ms": min(tpots) * 1e3})
    return rows


def run_bench(args: BenchArgs) -> dict:
    tok = load_tokenizer(args.model)
    texts = args.prompts or held_out_prompts(args.num_prompts, num_chars=4 * args.prompt_tokens)
    prompts = [tok.encode(t)[: args.prompt_tokens] for t in texts]
    dtype = DTYPES[resolve_dtype(args.dtype, args.device)]
    result: dict = {"model": args.model, "dtype": resolve_dtype(args.dtype, args.device),
                    "num_prompts": len(prompts),
                    "prompt_tokens": [len(p) for p in prompts], "max_tokens": args.max_tokens,
                    "threads": torch.get_num_threads()}
    result["device"] = args.device
    result["transformers"] = _hf_generate(args.model, prompts, args.max_tokens, dtype,
                                          args.device, args.repeats)
    result["repeats"] = args.repeats
    modes = list(args.variants)
    max_context = max(len(p) for p in prompts) + args.max_tokens + 2 * max(args.ks) + 1
    runners = {g: _runner(args, g, max_context) for g in modes}
    result["runners"] = [info for _, info in runners.values()]
    best: dict[tuple, dict] = {}
    for k in args.ks:
        engines = {g: _engine(args, runners[g][0], k) for g in modes}
        for eng in engines.values():
            _engine_run(eng, prompts[:1], 1, 8)  # warm-up
        for _ in range(args.repeats):
            for b in args.batch_sizes:
                for g in modes:
                    r = _engine_run(engines[g], prompts, b, args.max_tokens)
                    key = (k, b, g)
                    if key not in best or r["tokens_per_s"] > best[key]["tokens_per_s"]:
                        best[key] = {"k": k, "batch_size": b, "variant": g, **r}
    rows = list(best.values())
    hf = result["transformers"]["tokens_per_s"]
    for row in rows:
        base = next((x for x in rows if x["k"] == 0 and x["batch_size"] == row["batch_size"]
                     and x["variant"] == row["variant"]), None)
        row["speedup_vs_k0"] = row["tokens_per_s"] / base["tokens_per_s"] if base else None
        row["speedup_vs_transformers"] = row["tokens_per_s"] / hf
        row["spec_efficiency"] = (row["speedup_vs_k0"] / row["mean_accepted_length"]
                                  if row["speedup_vs_k0"] and row["k"] > 0 else None)
        b1 = next((x for x in rows if x["k"] == row["k"] and x["batch_size"] == 1
                   and x["variant"] == row["variant"]), None)
        row["speedup_vs_batch1"] = row["tokens_per_s"] / b1["tokens_per_s"] if b1 else None
    result["engine"] = rows
    if args.context_sweep:
        vocab = next(iter(runners.values()))[0].config.vocab_size
        result["context_sweep"] = [{"variant": g, "rows": _tpot_sweep(args, runners[g][0],
                                                                      vocab)}
                                   for g in modes]
    return result


def format_table(res: dict) -> str:
    lines = [f"model={res['model']} dtype={res['dtype']} prompts={res['num_prompts']} "
             f"max_tokens={res['max_tokens']} threads={res['threads']} "
             f"best of {res.get('repeats', 1)}",
             f"transformers.generate (batch 1): {res['transformers']['tokens_per_s']:.1f} tok/s"]
    for info in res.get("runners", []):
        lines.append(f"{info['variant']}: {info['graphs_compiled']} graphs compiled in "
                     f"{info['compile_seconds']:.0f}s")
    lines += ["| variant | k | batch | tok/s | vs k=0 | vs HF | vs batch 1 | accepted/round | "
              "spec eff | acceptance per position |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    for r in res["engine"]:
        acc = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"] if a is not None)
        lines.append(f"| {r.get('variant', '-')} | {r['k']} | {r['batch_size']} | "
                     f"{r['tokens_per_s']:.1f} | {fmt(r['speedup_vs_k0'])} | "
                     f"{fmt(r['speedup_vs_transformers'])} | {fmt(r.get('speedup_vs_batch1'))} | "
                     f"{r['mean_accepted_length']:.2f} | {fmt(r['spec_efficiency'])} | "
                     f"{acc or '-'} |")
    for sweep in res.get("context_sweep", []):
        cells = ", ".join(f"{x['context']}: {x['tpot_ms']:.2f} ms" for x in sweep["rows"])
        lines.append(f"k=0 batch 1 TPOT by context ({sweep['variant']}): {cells}")
    return "\n".join(lines)


def main(args: BenchArgs, json_out: str | None) -> dict:
    res = run_bench(args)
    print(format_table(res))
    if json_out:
        with open(json_out, "w") as f:
            json.dump(res, f, indent=2)
    return res
