"""Engine commands of the CLI: generate, check, bench engine, eval-mtp."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction, default_model: str) -> None:
    p = sub.add_parser("check", help="print a checkpoint's tensor inventory; non-zero on problems")
    p.add_argument("path", nargs="?", default=default_model)
    p.set_defaults(func=_check)


def _check(args: argparse.Namespace) -> int:
    from workers.model.checkpoint import inventory

    entries = inventory(args.path)
    width = max(len(e.tensor) for e in entries)
    print(f"{'tensor':<{width}}  {'shape':<16} {'dtype':<6} status")
    for e in entries:
        shape = "x".join(map(str, e.shape)) if e.shape is not None else "-"
        print(f"{e.tensor:<{width}}  {shape:<16} {e.dtype or '-':<6} {e.status}")
    bad = [e for e in entries if e.is_problem]
    print(f"{len(entries)} tensors, {len(bad)} problem(s)")
    return 1 if bad else 0
