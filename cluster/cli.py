"""`mtpserve` command line: up | generate | check | bench {engine,serve} | train | eval-mtp."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields

from mtpserve.workers.paths import default_model_path


def _add_train(sub: argparse._SubParsersAction) -> None:
    from mtpserve.workers.training.trainer import TrainConfig

    p = sub.add_parser("train", help="train a model with an MTP module (or add one to a model)")
    for f in fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool",):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        elif f.name == "out":
            p.add_argument(flag, required=True, help="output folder (HF format + trainer state)")
        else:
            typ = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
            p.add_argument(flag, type=typ, default=f.default)


def _run_train(args: argparse.Namespace) -> int:
    from mtpserve.workers.training.trainer import TrainConfig, train

    kwargs = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    train(TrainConfig(**kwargs))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mtpserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    bench = sub.add_parser("bench", help="benchmarks that print tables and write JSON")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from mtpserve.cluster import cli_engine

    cli_engine.add_commands(sub, bench_sub, str(default_model_path()))
    try:
        from mtpserve.cluster import cli_serve
    except ImportError:  # serving extras missing: engine commands still work
        cli_serve = None
    if cli_serve is not None:
        cli_serve.add_commands(sub, bench_sub, str(default_model_path()))
    from mtpserve.cluster.sim import cli as cli_sim

    cli_sim.add_commands(sub)
    return parser


# Commands whose engines run in this process: they restart under tcmalloc when the machine
# has it (workers/allocator.py); `up` gives its replicas the library through their runtime_env.
IN_PROCESS_ENGINES = {("generate", None), ("bench", "engine"), ("eval-mtp", None)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if argv is None and (args.command, getattr(args, "bench_command", None)) in IN_PROCESS_ENGINES:
        from mtpserve.workers.allocator import reexec_with_preload

        try:
            reexec_with_preload()
        except ValueError as e:  # a bad MTPSERVE_MALLOC
            print(f"mtpserve: {e}", file=sys.stderr)
            return 2
    if args.command == "train":
        return _run_train(args)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
