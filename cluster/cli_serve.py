"""Serving commands of the CLI: `up` (local Ray cluster + the app) and `bench serve`."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

from workers.paths import REPO_ROOT

DEFAULT_CONFIG = REPO_ROOT / "configs" / "local-cpu.yaml"


def add_commands(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction,
                 default_model: str) -> None:
    p = sub.add_parser("up", help="start a local Ray cluster and serve the OpenAI API")
    p.add_argument("--config", default=str(DEFAULT_CONFIG), help="Serve deploy config (YAML)")
    p.add_argument("--model", help="override the config's model folder")
    p.add_argument("--host", help="override the HTTP host (default from the config)")
    p.add_argument("--port", type=int, help="override the HTTP port (default from the config)")
    p.add_argument("--num-cpus", type=float, help="CPUs of the local Ray cluster")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.set_defaults(func=_up)

    p = bench.add_parser("serve", help="concurrent streaming clients against a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--json", dest="json_out")
    p.set_defaults(func=_bench_serve)


def load_app_config(path: str | Path, model: str | None = None, host: str | None = None,
                    port: int | None = None) -> tuple[dict, dict]:
    """(http_options, ClusterConfig args) of the config's single application, with the
    command-line overrides applied in both places that name the address."""
    import yaml

    doc = yaml.safe_load(Path(path).read_text())
    apps = doc.get("applications") or []
    if len(apps) != 1:
        raise SystemExit(f"{path}: expected exactly one application, found {len(apps)}")
    args = dict(apps[0].get("args") or {})
    http = dict(doc.get("http_options") or {})
    if model:
        args["model"] = model
    http_args = dict(args.get("http") or {})
    for key, val in (("host", host), ("port", port)):
        if val is not None:
            http[key] = val
            http_args[key] = val
        elif key in http_args:
            http.setdefault(key, http_args[key])
    args["http"] = http_args | {k: http[k] for k in ("host", "port") if k in http}
    return http, args


def _wait_healthy(url: str, timeout: float, stop: threading.Event) -> bool:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not stop.is_set():
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        stop.wait(0.5)
    return False


def _up(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from cluster.app import build_app
    from cluster.config import ClusterConfig

    http, app_args = load_app_config(args.config, args.model, args.host, args.port)
    cfg = ClusterConfig(**app_args)  # fail fast, before starting anything
    stop = threading.Event()
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False)
    # After ray.init: Ray's core worker installs its own SIGTERM handler, which aborts.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/", blocking=False)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        if not _wait_healthy(url + "/health", args.startup_timeout, stop):
            if stop.is_set():
                return 0
            print(f"mtpserve did not become healthy within {args.startup_timeout:.0f}s",
                  file=sys.stderr)
            return 1
        print(f"mtpserve is serving {Path(cfg.model).name} at {url}/v1 (Ctrl-C to stop)",
              flush=True)
        stop.wait()
        return 0
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _bench_serve(args: argparse.Namespace) -> int:
    from benchmarks.serve_bench import ServeBenchArgs, main

    main(ServeBenchArgs(url=args.url, api_key=args.api_key, concurrency=args.concurrency,
                        num_requests=args.num_requests, max_tokens=args.max_tokens,
                        prompt_tokens=args.prompt_tokens), args.json_out)
    return 0
