"""guidellm against `mtpserve up` (the default config unless told otherwise): the command the
serving issue measures with, run next to a server this script starts and stops.

    pip install guidellm   # not a dependency of mtpserve; any environment with it on PATH
    python -m mtpserve.benchmarks.guidellm_run --streams 4 1 --out benchmarks/results/guidellm

For each stream count: `guidellm run --backend kind=openai_http,... --profile
kind=concurrent,streams=N --data kind=synthetic_text,prompt_tokens=128,output_tokens=64
--constraint kind=max_requests,count=24`, with the model's own tokenizer as guidellm's
tokenizer (no hub access). Prints output tok/s, ITL p50 and TTFT p50 per run and writes
guidellm's JSON report per run under --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
from pathlib import Path

from mtpserve.benchmarks.local_server import running_server, variant_config
from mtpserve.workers.paths import config_path, default_model_path


def _find(d: object, *path: str) -> object:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def summarize(report: dict) -> dict:
    """Output tok/s, ITL and TTFT p50 (ms) of the one benchmark in a guidellm report."""
    b = report["benchmarks"][0]
    m = b["metrics"]
    out = {}
    for name, key in (("output_tok_s", "output_tokens_per_second"),
                      ("itl_ms", "inter_token_latency_ms"),
                      ("ttft_ms", "time_to_first_token_ms"),
                      ("requests_s", "requests_per_second")):
        stats = _find(m, key, "successful") or _find(m, key, "total") or {}
        out[name] = {"mean": stats.get("mean"), "p50": stats.get("median")}
    out["requests"] = _find(m, "request_totals")  # successful / errored / incomplete
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(config_path("local-cpu.yaml")))
    ap.add_argument("--streams", type=int, nargs="+", default=[4, 1])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--port", type=int, default=8771)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/guidellm"))
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm")
    ap.add_argument("--engine-core", nargs="+", choices=("thread", "process"),
                    help="one server per value of prefill/decode.engine_core, one after the "
                         "other (default: the config's); reports go under --out/<value>/")
    ap.add_argument("--stream-interval-ms", type=float, nargs="+",
                    help="one server per value of decode.stream_interval_ms (default: the "
                         "config's), for each engine core")
    args = ap.parse_args()
    rows = []
    for core, pace in ((c, i) for c in args.engine_core or [None]
                       for i in args.stream_interval_ms or [None]):
        over: dict = {"prefill": {}, "decode": {}}
        if core is not None:
            over["prefill"]["engine_core"] = over["decode"]["engine_core"] = core
        if pace is not None:
            over["decode"]["stream_interval_ms"] = pace
        name = " ".join(x for x in (core, None if pace is None else f"paced-{pace:g}ms") if x)
        out = args.out / name if name else args.out
        rows += [{"engine_core": core, "stream_interval_ms": pace} | r
                 for r in _run(args, over, out)]
    print("| engine core | stream interval ms | streams | output tok/s | ITL p50 ms | "
          "TTFT p50 ms | requests ok / errored |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        n = r["requests"] or {}
        pace = r["stream_interval_ms"]
        print(f"| {r['engine_core'] or 'config'} | {'config' if pace is None else f'{pace:g}'} "
              f"| {r['streams']} | "
              f"{r['output_tok_s']['mean']:.1f} | {r['itl_ms']['p50']:.1f} | "
              f"{r['ttft_ms']['p50']:.1f} | {n.get('successful')} / {n.get('errored')} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.json").write_text(json.dumps(rows, indent=2) + "\n")


def _run(args, over: dict, out: Path) -> list[dict]:
    """One server with the config's args overridden by `over`; guidellm per stream count."""
    out.mkdir(parents=True, exist_ok=True)
    cfg = variant_config(Path(args.config), over, args.port)
    model = cfg["applications"][0]["args"].get("served_model_name", "tiny-code-mtp")
    rows = []
    with running_server(cfg, 900) as start_s:
        print(f"server up in {start_s:.1f} s")
        for n in args.streams:
            report = out / f"guidellm-c{n}.json"
            cmd = [args.guidellm, "run",
                   "--backend", f"kind=openai_http,target=http://127.0.0.1:{args.port},"
                   f"model={model}",
                   "--profile", f"kind=concurrent,streams={n}",
                   "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=64",
                   "--constraint", f"kind=max_requests,count={args.requests}",
                   "--tokenizer", f"kind=huggingface_auto,model={default_model_path()}",
                   "--output", f"kind=json,path={report}"]
            print("$", " ".join(cmd))
            subprocess.run(cmd, check=True)
            rows.append({"streams": n, **summarize(json.loads(report.read_text()))})
    return rows


if __name__ == "__main__":
    main()
