"""Engine commands of the CLI: generate, check, bench engine, eval-mtp."""

from __future__ import annotations

import argparse
import json
import sys


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def add_commands(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction,
                 default_model: str) -> None:
    p = sub.add_parser("check", help="print a checkpoint's tensor inventory and, with --tp-size "
                       "/ --gpu-memory-gib (or with config.json only), its memory plan per TP "
                       "rank; non-zero on problems or when it does not fit")
    p.add_argument("path", nargs="?", default=default_model)
    p.add_argument("--tp-size", type=int, help="plan for this many TP ranks (default 1)")
    p.add_argument("--gpu-memory-gib", type=float,
                   help="device memory of one rank's GPU, GiB (the plan's verdict needs it)")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="serving dtype of the plan (the engine's default on CUDA)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests per decode round (default: the engine's, 32)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="drafts per round, k (default: the engine's, 2)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="largest prefill chunk (default: the engine's, 512)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context the KV must hold for one request (default: the model's)")
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="share of the GPU a rank may use (default: the engine's, 0.9)")
    p.add_argument("--json", action="store_true", help="print the memory plan as JSON")
    p.set_defaults(func=_check)

    p = sub.add_parser("generate", help="generate offline with MTP speculative decoding")
    p.add_argument("--model", default=default_model)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompts-file", help="one JSON string per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--num-speculative-tokens", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="same seed + k: same tokens (default: random)")
    p.add_argument("--min-tokens", type=int, default=0, help="no EOS/stop token before this")
    p.add_argument("--stop-token-ids", type=_ints, default=(), help="comma-separated ids")
    p.add_argument("--logprobs", type=int, help="with --json: log probs + N alternatives")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="compiled decode graphs (auto: where measured faster; "
                   "MTPSERVE_COMPILE overrides)")
    p.add_argument("--json", action="store_true", help="one JSON object per prompt")
    p.add_argument("--keep-special-tokens", action="store_true",
                   help="keep special tokens (EOS) in the text; the server drops them")
    p.add_argument("--token-healing", action=argparse.BooleanOptionalAction, default=None,
                   help="heal the prompt's trailing token(s) as the server does; default: the "
                   "model's (on for the embedded model: a line-break tail only)")
    p.set_defaults(func=_generate)

    p = bench.add_parser("engine", help="engine tokens/s vs transformers.generate, per k")
    p.add_argument("--model", default=default_model)
    p.add_argument("--prompts-file")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ks", type=_ints, default=(0, 1, 2, 3))
    p.add_argument("--batch-sizes", type=_ints, default=(1, 8))
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--variants", type=lambda s: tuple(s.split(",")), default=("graphs",),
                   help="runner variants measured side by side: eager, graphs, "
                        "graphs-mtp-bf16, graphs-dv1024 (draft vocabulary of 1024), "
                        "... (comma-separated)")
    p.add_argument("--repeats", type=int, default=1,
                   help="repeat each measurement (interleaved) and keep the fastest")
    p.add_argument("--context-sweep", type=_ints, default=(),
                   help="also measure k=0 batch-1 TPOT at these context lengths")
    p.add_argument("--json", dest="json_out", help="write results here")
    p.set_defaults(func=_bench_engine)

    p = sub.add_parser("draft-vocab", help="rank a checkpoint's tokens by corpus frequency "
                       "(draft_vocab.json, for speculation.draft_vocab_size)")
    p.add_argument("--model", default=default_model)
    p.add_argument("--corpus", help="folder of text files (default: the training split of "
                   "this interpreter's standard library, the default model's data)")
    p.add_argument("--glob", default="**/*.py", help="files of --corpus to read")
    p.set_defaults(func=_draft_vocab)

    p = sub.add_parser("eval-mtp", help="held-out MTP acceptance and losses")
    p.add_argument("--model", default=default_model)
    p.add_argument("--data", help="folder of .py files (default: the held-out stdlib split)")
    p.add_argument("--max-positions", type=int, default=4000)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--repetition-files", type=int, default=0, help="also continue the first "
                   "12 lines of this many --data files greedily for 96 tokens and report the "
                   "share of repeated lines (the model card's demo check)")
    p.add_argument("--json", dest="json_out")
    p.set_defaults(func=_eval_mtp)


def _read_prompts(path: str) -> list[str]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _has_weights(path: str) -> bool:
    from pathlib import Path

    p = Path(path)
    return (p / "model.safetensors.index.json").is_file() or any(p.glob("*.safetensors"))


def _check(args: argparse.Namespace) -> int:
    from mtpserve.workers.model.checkpoint import inventory
    from mtpserve.workers.model.config import ModelConfig

    # The family inventory first: an unsupported piece (rope type, quantization, MLA, ...)
    # is refused here by name, before any tensor is read or any replica starts.
    try:
        cfg = ModelConfig.from_pretrained(args.path)
    except (ValueError, FileNotFoundError) as e:
        print(f"mtpserve check: {e}", file=sys.stderr)
        return 1
    weights = _has_weights(args.path)
    want_plan = (args.tp_size is not None or args.gpu_memory_gib is not None or args.json
                 or not weights)
    bad = []
    if not args.json:
        for line in cfg.describe():
            print(line)
    if weights:
        entries = inventory(args.path, cfg)
        bad = [e for e in entries if e.is_problem]
        if not args.json:
            width = max(len(e.tensor) for e in entries)
            print(f"{'tensor':<{width}}  {'shape':<16} {'dtype':<6} status")
            for e in entries:
                shape = "x".join(map(str, e.shape)) if e.shape is not None else "-"
                print(f"{e.tensor:<{width}}  {shape:<16} {e.dtype or '-':<6} {e.status}")
            print(f"{len(entries)} tensors, {len(bad)} problem(s)")
    elif not args.json:
        print("weights: none here (config.json only); the memory plan needs none")
    if not want_plan:
        return 1 if bad else 0
    plan = _plan(args, cfg)
    if args.json:
        out = plan.to_json()
        if weights:
            out["inventory_problems"] = len(bad)
        print(json.dumps(out, indent=2))
    else:
        for line in plan.lines():
            print(line)
    return 1 if bad or plan.fits is False else 0


def _plan(args: argparse.Namespace, cfg):  # noqa: ANN001, ANN202 - lazy import of the types
    from mtpserve.workers.memory_plan import PlanSettings, plan_memory, plan_settings_from_gib

    given = {"tp_size": args.tp_size, "max_num_seqs": args.max_num_seqs,
             "num_speculative_tokens": args.num_speculative_tokens,
             "max_num_batched_tokens": args.max_num_batched_tokens,
             "max_model_len": args.max_model_len,
             "kv_cache_memory_fraction": args.kv_cache_memory_fraction}
    kw = {k: v for k, v in given.items() if v is not None}
    settings: PlanSettings = plan_settings_from_gib(args.gpu_memory_gib, dtype=args.dtype, **kw)
    return plan_memory(args.path, settings, cfg)


def _generate(args: argparse.Namespace) -> int:
    from mtpserve.workers import LLM, SamplingParams

    prompts = [args.prompt] if args.prompt is not None else _read_prompts(args.prompts_file)
    llm = LLM(args.model, dtype=args.dtype, num_speculative_tokens=args.num_speculative_tokens,
              compile=args.compile)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            min_tokens=args.min_tokens, stop_token_ids=args.stop_token_ids,
                            logprobs=args.logprobs)
    for res in llm.generate(prompts, params, skip_special_tokens=not args.keep_special_tokens,
                            token_healing=args.token_healing):
        if args.json:
            print(json.dumps(res.to_json()))
        else:
            print(res.prompt + res.text)
            acc = sum(res.accepted_per_position)
            print(f"\n[{len(res.output_token_ids)} tokens, {res.num_rounds} rounds, "
                  f"{acc}/{sum(res.drafted_per_position)} drafts accepted, "
                  f"{res.decode_seconds:.2f}s decode]", file=sys.stderr)
    return 0


def _bench_engine(args: argparse.Namespace) -> int:
    from mtpserve.benchmarks.engine_bench import BenchArgs, main

    prompts = _read_prompts(args.prompts_file) if args.prompts_file else None
    main(BenchArgs(model=args.model, prompts=prompts, max_tokens=args.max_tokens, ks=args.ks,
                   batch_sizes=args.batch_sizes, dtype=args.dtype,
                   num_prompts=args.num_prompts, device=args.device, variants=args.variants,
                   context_sweep=args.context_sweep, repeats=args.repeats), args.json_out)
    return 0


def _draft_vocab(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mtpserve.workers.model.config import ModelConfig
    from mtpserve.workers.spec_decode.draft_vocab import (
        corpus_token_streams,
        rank_tokens,
        write_ranking,
    )
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.data import split_files

    if args.corpus:
        files = sorted(p for p in Path(args.corpus).glob(args.glob) if p.is_file())
        source = f"{args.corpus}/{args.glob}"
    else:
        files, source = split_files()[0], "training split of the standard library"
    if not files:
        print(f"no files match {args.glob} under {args.corpus}", file=sys.stderr)
        return 2
    vocab = ModelConfig.from_pretrained(args.model).vocab_size
    ranking = rank_tokens(corpus_token_streams(load_tokenizer(args.model), files), vocab)
    path = write_ranking(args.model, ranking, f"{source} ({len(files)} files)")
    print(f"wrote {path}: {vocab} tokens ranked over {len(files)} files")
    return 0


def _eval_mtp(args: argparse.Namespace) -> int:
    from mtpserve.workers.training.evaluate import evaluate, format_report

    res = evaluate(args.model, args.data, args.max_positions, args.seq_len, args.dtype)
    print(format_report(res))
    if args.repetition_files:
        from pathlib import Path

        from mtpserve.workers.training.data import split_files
        from mtpserve.workers.training.evaluate import repetition_check

        files = (sorted(Path(args.data).rglob("*.py")) if args.data else split_files()[1])
        files = [f for f in files if f.stat().st_size > 2000][: args.repetition_files]
        res["repetition"] = repetition_check(args.model, files, dtype=args.dtype)
        print(f"greedy continuations: {res['repetition']['repeated_line_share']:.1%} of "
              f"non-empty lines repeated ({len(files)} files)")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(res, f, indent=2)
    return 0
