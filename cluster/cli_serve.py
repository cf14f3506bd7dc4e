"""Serving commands of the CLI: `up` (local Ray cluster + the app) and `bench serve`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mtpserve.workers.paths import config_path

DEFAULT_CONFIG = config_path("local-cpu.yaml")
# While the decode replicas compile their graphs in the background, `up` prints a progress
# line this often (the shapes not compiled yet run eagerly, several times slower).
COMPILE_REPORT_EVERY_S = 15.0


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

    p = sub.add_parser("warm", help="stream warm-up requests through a running server's "
                       "prefill -> KV transfer -> decode path (`up` does it itself; use this "
                       "after `serve deploy` or a rollout)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", help="default: $MTPSERVE_API_KEY")
    p.add_argument("--model", help="default: the first model the server lists")
    p.add_argument("--wait", type=float, default=0.0, help="seconds to wait for /health first "
                   "(a deploy that is still starting)")
    p.set_defaults(func=_warm)

    p = bench.add_parser("serve", help="concurrent streaming clients against a running server")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--shared-prefix-tokens", type=int, help="shared-prefix workload: groups "
                   "of requests sharing a prefix of this many tokens (benchmarks/prefix_bench.py)")
    p.add_argument("--num-prefixes", type=int, default=2, help="groups (shared prefixes)")
    p.add_argument("--suffix-tokens", type=int, default=32, help="distinct tokens per request")
    p.add_argument("--tokenizer", help="model folder whose tokenizer makes the prompts' token "
                   "ids (default: the embedded model)")
    p.add_argument("--json", dest="json_out")
    p.set_defaults(func=_bench_serve)

    p = bench.add_parser("autoscale", help="load profile (ramp, acceptance step, ramp down) "
                         "recording an autoscaling timeline (JSON + PNG)")
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--time-scale", type=float, default=1.0, help="1.0: 3 min of load")
    p.add_argument("--idle-s", type=float, default=45.0)
    p.add_argument("--target-tpot-ms", type=float, default=50.0)
    p.add_argument("--deploy", choices=["model", "default"], help="start a local Ray cluster "
                   "and deploy with our model-based policy or Serve's default policy")
    p.add_argument("--max-decode-replicas", type=int, default=3,
                   help="--deploy without --config: decode autoscaling 1..N")
    p.add_argument("--config", help="Serve config (YAML) whose args --deploy uses")
    p.add_argument("--ray-address", help="read replica counts from this Ray cluster")
    p.add_argument("--json", dest="json_out")
    p.add_argument("--png", dest="png_out")
    p.set_defaults(func=_bench_autoscale)


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
    """Poll `url` until it answers 200 (True), or `timeout` passed or `stop` was set (False).
    Asks at least once, so a zero timeout checks a server that is already up."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() >= deadline or stop.is_set():
            return False
        stop.wait(0.5)


# Ray settings `mtpserve up` starts its cluster with (a user's own environment wins):
# - RAY_worker_niceness: Ray starts its workers (every replica and their engine processes)
#   at nice 15 below its own daemons, the proxy's host and the client, which then take the
#   engine's core whenever they run. guidellm on the 2-core box, 48 requests, two runs per
#   value alternated, output tok/s at nice 15 / 0: c1 60.3 / 66.0 and 77.0 / 83.0, c4 109.5 /
#   117.0 and 139.2 / 164.8.
# - The Serve controller's loop at 0.5 s, not 0.1 s (autoscaling decides over seconds), and
#   replicas' cached metrics exported each 1 s, not 0.1 s: an idle server's controller fell
#   from 15.7% to 9.1% of a core and each engine replica from 9.2% to 7.4%; guidellm, two
#   alternated pairs: c1 80.9 / 82.8 and 79.0 / 91.6, c4 143.7 / 148.5 and 157.1 / 193.3.
# - Serve's gRPC transport, not Ray actor tasks, from the proxy to the ingress and between
#   deployments (the ingress also asks for it on its handles, router/ingress.py): guidellm
#   c1 on a warm cache, seven runs each taking turns, output tok/s mean 242 -> 272.
# - Replicas run our code and Serve's router on their main event loop, not on a thread and a
#   loop of their own (two of Ray Serve's throughput-optimized settings): each request and
#   each streamed message saves a cross-thread hand-off in the proxy, the ingress and the
#   decode replica. One sampled stream, 16 requests of 64 tokens, two starts of each taking
#   turns, medians: first token 78.0 / 71.4 -> 67.7 / 67.1 ms, request 198.6 / 185.0 ->
#   167.9 / 180.4 ms. Our replicas never block their loop (engines run in their own
#   threads or processes).
RAY_ENV = {"RAY_worker_niceness": "0",
           "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",
           "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "1000",
           "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
           "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
           "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": "0"}


def _up(args: argparse.Namespace) -> int:
    import ray
    from ray import serve

    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig

    http, app_args = load_app_config(args.config, args.model, args.host, args.port)
    cfg = ClusterConfig(**app_args)  # fail fast, before starting anything
    try:  # fail closed: a configured key variable that is missing never means "no auth"
        cfg.auth.resolve(os.environ)
    except RuntimeError as e:
        print(f"mtpserve: {e}", file=sys.stderr)
        return 2
    from mtpserve.workers.allocator import malloc_library

    try:  # a bad MTPSERVE_MALLOC, before any replica is built with it
        malloc_library()
    except ValueError as e:
        print(f"mtpserve: {e}", file=sys.stderr)
        return 2
    from mtpserve.cluster.app import memory_refusal

    refusal = memory_refusal(cfg)  # CUDA: the layout's memory plan, before Ray starts
    if refusal:
        print(f"mtpserve: {refusal}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for name, value in RAY_ENV.items():  # the cluster's processes inherit them
        os.environ.setdefault(name, value)
    ray.init(address="local", num_cpus=args.num_cpus, include_dashboard=False,
             log_to_driver=False)
    # After ray.init: Ray's core worker installs its own SIGTERM handler, which aborts.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        short = _unplaceable(cfg, ray.cluster_resources())
        if short:
            # Serve would wait for resources that never come (the replicas stay pending).
            print(f"mtpserve: {short}", file=sys.stderr)
            return 2
        serve.start(http_options={"host": cfg.http.host, "port": cfg.http.port})
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/", blocking=False)
        url = f"http://{cfg.http.host}:{cfg.http.port}"
        if not _wait_healthy(url + "/health", args.startup_timeout, stop):
            if stop.is_set():
                return 0
            print(f"mtpserve did not become healthy within {args.startup_timeout:.0f}s",
                  file=sys.stderr)
            return 1
        api_key, admin_key = cfg.auth.resolve(os.environ)
        error = warm_request_path(url, cfg.served_model_name or Path(cfg.model).name,
                                  api_key or admin_key)
        if error:
            print(f"mtpserve: warming the request path failed ({error}); serving anyway",
                  flush=True)
        print(f"mtpserve is serving {Path(cfg.model).name} at {url}/v1 (Ctrl-C to stop)",
              flush=True)
        # A daemon thread: the main thread only waits for the signal, so Ctrl-C is never
        # held up by a stats request.
        threading.Thread(target=watch_compile, name="compile-progress", daemon=True,
                         args=(_stats_fetcher(url, api_key or admin_key), stop,
                               COMPILE_REPORT_EVERY_S)).start()
        stop.wait()
        grace = cfg.graceful_shutdown_timeout_s
        _bounded(lambda: _drain(grace), grace + 15, "drain")
        return 0
    finally:
        if not _bounded(_shutdown_ray, 60, "shutdown"):
            os._exit(1)


def bearer_headers(api_key: str | None) -> dict[str, str]:
    """The Authorization header `up`'s own requests carry (none on an open API)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# Streams `up` sends through prefill -> KV transfer -> decode before it reports serving; one
# more goes where the server itself sends a lone short prompt (decode.max_local_prefill_length:
# prefilled on the decode replica; else the same path again).
WARM_REQUESTS = 2


def warm_request_path(url: str, model: str, api_key: str | None,
                      timeout_s: float = 60.0) -> str | None:
    """Send `WARM_REQUESTS` short streams through proxy -> ingress -> prefill -> KV transfer
    -> decode, then one the server routes itself, before `up` reports serving: each hop's
    first use is slow (Serve's routes and channels, the KV pair's gloo communicator,
    first-call paths), and the first client request would pay it: guidellm c1 measured the
    first one or two of 24 requests 100-170 ms slower than the rest. Returns None, or what
    failed (`up` reports it and serves anyway; `mtpserve warm` exits 1)."""
    import httpx

    headers = bearer_headers(api_key)
    # ~150 tokens, a typical prompt: a multi-block prefill and KV transfer, not a one-block
    # one; ignore_eos: the stream must reach decode even if the first token is EOS.
    prompt = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(12))
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "stream": True}
    bodies = [body | {"disaggregate": True}] * WARM_REQUESTS + [body]
    t0 = time.perf_counter()
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=timeout_s) as client:
            for b in bodies:
                with client.stream("POST", "/v1/completions", json=b) as r:
                    r.raise_for_status()
                    for line in r.iter_lines():
                        # A stream that fails after its 200 says so in an `error` event.
                        if line.startswith("data: {"):
                            error = json.loads(line[len("data: "):]).get("error")
                            if error:
                                return f"the stream ended with an error: {error}"
    except (httpx.HTTPError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    print(f"warmed the request path (prefill -> KV transfer -> decode) in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    return None


def _warm(args: argparse.Namespace) -> None:
    """`mtpserve warm`: exit 0 once the warm-up streams went through, 1 with the reason."""
    import httpx

    api_key = args.api_key or os.environ.get("MTPSERVE_API_KEY") or None
    url = args.url.rstrip("/")
    if not _wait_healthy(url + "/health", args.wait, threading.Event()):
        sys.exit(f"mtpserve warm: {url}/health did not answer 200"
                 + (f" within {args.wait:.0f}s" if args.wait else " (--wait to wait for it)"))
    model = args.model
    if model is None:
        try:
            r = httpx.get(url + "/v1/models", headers=bearer_headers(api_key), timeout=30)
            r.raise_for_status()
            model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            sys.exit(f"mtpserve warm: could not list the server's models ({e})")
    error = warm_request_path(url, model, api_key)
    if error:
        sys.exit(f"mtpserve warm: warming the request path failed ({error})")


def format_duration(seconds: float) -> str:
    """`45s`, `6m10s`, `1h02m`: a progress line's durations."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def compile_progress_of(stats: dict) -> list[dict]:
    """The decode replicas' compile progress in a `/v1/mtpserve/stats` answer: each live
    replica's (the metrics hub's snapshots), else the one decode replica that answered."""
    rows = [r["compile"] for r in stats.get("replicas") or []
            if r.get("role") == "decode" and r.get("compile")]
    if rows:
        return rows
    one = (stats.get("decode") or {}).get("compile")
    return [one] if one else []


def compile_progress_line(progress: list[dict]) -> str | None:
    """The line `up` prints for the decode replicas' compile progress (`compile_progress_of`),
    or None when there is nothing to report (eager decode, or not known yet)."""
    if not progress:
        return None
    total = sum(p["total"] for p in progress)
    done = sum(p["done"] for p in progress)
    where = f" ({len(progress)} decode replicas)" if len(progress) > 1 else ""
    if any(p["state"] == "compiling" for p in progress):
        etas = [p.get("eta_s") for p in progress if p["state"] == "compiling"]
        eta = ("ETA after the first bucket" if any(e is None for e in etas)
               else f"ETA {format_duration(max(etas))}")
        return f"compiling decode graphs: {done}/{total} buckets, {eta}{where}"
    took = format_duration(max(p.get("elapsed_s") or 0.0 for p in progress))
    if done == total:
        if not any(p.get("compiled") for p in progress):
            return f"decode graphs: all {total} loaded from the compile cache ({took}){where}"
        return f"decode graphs: all {total} compiled ({took}){where}"
    return (f"decode graphs: {done}/{total} compiled; the other {total - done} run eagerly "
            f"(warm-up budget spent, background compile off or stopped){where}")


def watch_compile(fetch: Callable[[], dict | None], stop: threading.Event,
                  every_s: float, emit: Callable[[str], None] | None = None) -> None:
    """Print the compile progress line now and every `every_s` while the decode replicas
    compile, then the final line once, and return; also returns at once when decode is
    eager. `fetch`: the stats endpoint's answer, None when it did not answer (tried again)."""
    emit = emit or (lambda line: print(line, flush=True))
    while not stop.is_set():
        stats = fetch()
        if stats is not None:
            progress = compile_progress_of(stats)
            line = compile_progress_line(progress)
            if line is None:
                return
            emit(line)
            if not any(p["state"] == "compiling" for p in progress):
                return
        stop.wait(every_s)


def _stats_fetcher(url: str, api_key: str | None) -> Callable[[], dict | None]:
    import httpx

    headers = bearer_headers(api_key)

    def fetch() -> dict | None:
        try:
            r = httpx.get(url + "/v1/mtpserve/stats", headers=headers, timeout=10.0)
            return r.json() if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    return fetch


def _unplaceable(cfg, have: dict) -> str | None:
    """Why the app's initial replicas cannot all be placed on this Ray cluster, or None."""
    from mtpserve.cluster.serve_options import resource_demand

    for res, need in resource_demand(cfg).items():
        if need > have.get(res, 0.0) + 1e-9:
            return (f"the config reserves {need:g} {res} (ingress, prefill and decode replicas "
                    f"x TP ranks x {res.lower()}s per rank) but this Ray cluster has "
                    f"{have.get(res, 0.0):g}; lower `cpus_per_rank` / replicas or pass "
                    "--num-cpus")
    return None


def _shutdown_ray() -> None:
    import ray
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()


def _bounded(fn: Callable[[], None], timeout_s: float, what: str) -> bool:
    """Run `fn` on a daemon thread for at most `timeout_s`. A signal sent to the whole process
    group (a terminal's Ctrl-C, `timeout`, some supervisors) also stops Ray's GCS and raylet, and
    Ray's client calls then block without a deadline: stopping must never hang on them."""
    t = threading.Thread(target=fn, name=what, daemon=True)
    t.start()
    t.join(timeout_s)
    if t.is_alive():
        print(f"mtpserve: {what} did not finish within {timeout_s:g}s (is the Ray cluster "
              "gone?); exiting", file=sys.stderr, flush=True)
    return not t.is_alive()


def _drain(timeout_s: float) -> None:
    """SIGTERM: the ingress stops taking requests (503; /health 503) and the running ones get
    up to `timeout_s` to finish. Then Serve's own shutdown drains the replicas."""
    from ray import serve

    try:
        ingress = serve.get_deployment_handle("OpenAIIngress", app_name="mtpserve")
        deadline = time.monotonic() + timeout_s
        left = ingress.drain.remote().result(timeout_s=10)
        if left:
            print(f"mtpserve: draining {left} request(s) (at most {timeout_s:g}s)", flush=True)
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = ingress.num_inflight.remote().result(timeout_s=10)
        if left:
            print(f"mtpserve: {left} request(s) still running after {timeout_s:g}s; stopping",
                  file=sys.stderr)
    except Exception as e:  # the app may have failed already: shut down regardless
        print(f"mtpserve: drain failed ({type(e).__name__}: {e})", file=sys.stderr)


def _bench_serve(args: argparse.Namespace) -> int:
    from mtpserve.benchmarks.serve_bench import ServeBenchArgs, main

    if args.shared_prefix_tokens:
        import asyncio
        import json

        from mtpserve.benchmarks.prefix_bench import (
            SharedPrefixArgs,
            format_table,
            run_shared_prefix,
        )

        res = asyncio.run(run_shared_prefix(SharedPrefixArgs(
            url=args.url, api_key=args.api_key, num_requests=args.num_requests,
            num_prefixes=args.num_prefixes, shared_prefix_tokens=args.shared_prefix_tokens,
            suffix_tokens=args.suffix_tokens, max_tokens=args.max_tokens,
            concurrency=args.concurrency, tokenizer=args.tokenizer)))
        print(format_table({args.url: res}))
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(res, indent=2) + "\n")
        return 0

    main(ServeBenchArgs(url=args.url, api_key=args.api_key, concurrency=args.concurrency,
                        num_requests=args.num_requests, max_tokens=args.max_tokens,
                        prompt_tokens=args.prompt_tokens), args.json_out)
    return 0


def _bench_autoscale(args: argparse.Namespace) -> int:
    from mtpserve.benchmarks.autoscale_bench import AutoscaleBenchArgs, local_config, main

    a = AutoscaleBenchArgs(
        url=args.url, api_key=args.api_key, concurrency=args.concurrency,
        max_tokens=args.max_tokens, time_scale=args.time_scale, idle_s=args.idle_s,
        target_tpot_ms=args.target_tpot_ms, deploy=args.deploy, ray_address=args.ray_address,
        max_decode_replicas=args.max_decode_replicas)
    if args.deploy:
        a.config = load_app_config(args.config)[1] if args.config else local_config(a)
    main(a, args.json_out, args.png_out)
    return 0
