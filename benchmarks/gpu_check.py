"""The prepared GPU check, sized for one lent machine with a single H200 (< 8 minutes).

    python -m mtpserve.benchmarks.gpu_check --out DIR            # on the GPU machine
    python -m mtpserve.benchmarks.gpu_check --out DIR --device cpu   # dry run of the same script

1. engine: `bench engine` on CUDA in float32 and bfloat16, k = 0..3, batch 1 and 8, against
   transformers.generate (eager).
1a. hot-path: issue 33 item 7 measured: the KV pool sized from kv_cache_memory_fraction (its
   budget, and the graph memory captured against the reserve); float32 logits of every
   replayed bucket against the eager forward of the same batch (two batches per bucket, rows
   and query slots partly padding) within 1e-3 relative; host syncs per decode round, greedy
   and sampled: the engine's own (workers/host_sync.py, 1 per round promised) and any other
   sync CUDA sync debug mode sees (0 promised), with the code lines they come from.
1b. fast-path: the GPU fast path, bf16 (the CUDA default), within a time budget: device checks
   (keyed uniforms bit-equal on CUDA and CPU; rejection sampling on the device gives the host's
   tokens; flex == gather logits), then decode tok/s at k = 0..3, batch 1 / 8 / 32 for eager,
   compiled (inductor, no CUDA graphs), compiled + CUDA graphs, and the same with the flex
   attention backend (eager-flex and graphs-flex); greedy tokens compared across variants.
2. disagg-gloo: the disaggregated app with prefill and decode on the *same* GPU (0.5 GPU
   each), KV over the gloo path (host staging: NCCL cannot put two ranks of one communicator
   on one GPU); greedy HTTP output == the offline engine on the same device; KV pull vs raw
   send/recv, one-stream TPOT (the served single stream, default engine settings) and TPOT of
   running streams while long prompts are pulled (mtpserve.benchmarks.serve_bench).
2b. kv: issue 18's KV checks on the same gloo path: a burst of 64 pulls into one decode
   replica (time to second token and decode-side wait vs single arrivals, peak pulls in
   flight, pulls per decode step), TPOT of running streams while 8 long prompts are pulled,
   and the prefill's send-buffer memory after bursts into 1 and 2 decode replicas.
3. nccl-kv / nccl-tp: only with >= 2 (>= 4 for TP 2 -> 2) visible GPUs: the same app with
   KV over NCCL, one GPU per rank; printed as skipped otherwise.

Each part runs even if another fails. Writes DIR/gpu_check.json (status, seconds and results
of every part), one JSON per part, and DIR/gpu_check.log (everything printed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx


class _Tee:
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, s: str) -> None:
        for st in self.streams:
            st.write(s)
            st.flush()

    def flush(self) -> None:
        for st in self.streams:
            st.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:  # faulthandler and subprocesses write to the real stream
        return self.streams[0].fileno()


def _model() -> str:
    from mtpserve.workers.paths import default_model_path

    return str(default_model_path())


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# 1. Engine bench ------------------------------------------------------------------------------

def engine_part(out: Path, device: str, dry: bool) -> dict:
    from mtpserve.benchmarks.engine_bench import BenchArgs, main

    names = {f.name for f in dataclasses.fields(BenchArgs)}
    res = {}
    for dtype in ("float32", "bfloat16"):
        # Sized to leave the 8-minute budget to the fast-path part (which covers batch 32).
        kw = dict(model=_model(), dtype=dtype, device=device, ks=(0, 1, 2, 3),
                  batch_sizes=(1, 8), num_prompts=8, max_tokens=64, prompt_tokens=256)
        if dry:
            kw.update(ks=(0, 2), batch_sizes=(1, 2), num_prompts=2, max_tokens=8,
                      prompt_tokens=32)
        # Eager: compiling every (batch, k) bucket for two dtypes could not fit the 8-minute
        # budget of a lent GPU; the compiled variant is measured by `mtpserve bench engine`.
        kw["variants"] = ("eager",)
        if "repeats" in names:
            kw["repeats"] = 1
        path = out / f"engine-{device}-{dtype}.json"
        r = main(BenchArgs(**{k: v for k, v in kw.items() if k in names}), str(path))
        res[dtype] = {"json": path.name, "rows": len(r.get("engine", []))}
    return res


# 1b. The GPU fast path ---------------------------------------------------------------------------

def _device_checks(device: str, model: str) -> dict:
    """Sampling on the device draws what the host draws; flex == gather on this device."""
    import torch

    from mtpserve.workers.model_runner import ForwardBatch, ModelRunner
    from mtpserve.workers.sampling_params import SamplingParams
    from mtpserve.workers.spec_decode.keyed_random import SLOT_DRAFT, keyed_uniforms
    from mtpserve.workers.spec_decode.rejection_sampler import RejectionSampler

    g = torch.Generator().manual_seed(0)
    seeds = torch.randint(-(1 << 62), 1 << 62, (4096,), generator=g)
    pos = torch.randint(0, 1 << 20, (4096,), generator=g)
    u_host = keyed_uniforms(seeds, pos, SLOT_DRAFT + 1)
    u_dev = keyed_uniforms(seeds.to(device), pos.to(device), SLOT_DRAFT + 1).cpu()
    res: dict = {"uniforms_bit_equal": bool(torch.equal(u_host, u_dev))}
    # Rejection sampling of the same float32 logits on the host and on the device.
    R, K, V = 16, 3, 4096
    logits = torch.randn(R, K + 1, V, generator=g) * 3
    drafts = torch.randint(0, V, (R, K), generator=g).tolist()
    q = torch.softmax(torch.randn(R, K, V, generator=g), -1)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=i) for i in range(R)]
    args = (drafts, list(q), params, list(range(R)), [100] * R)
    host = RejectionSampler()(logits, *args)
    dev = RejectionSampler()(logits.to(device), drafts, [x.to(device) for x in q], *args[2:])
    res["rejection_sampler_same_tokens"] = host.output_token_ids == dev.output_token_ids
    # flex == gather: prefill, verify and MTP shapes through the eager runner.
    outs = []
    for backend in ("gather", "flex"):
        r = ModelRunner(model, 64, 16, torch.float32, device, decode_graphs=False,
                        attention_backend=backend)
        prompts = [list(range(3, 3 + n)) for n in (37, 21, 50)]
        tables = [[5, 9, 2, 7], [1, 3, 4, 6], [10, 11, 12, 13]]
        S = max(map(len, prompts))
        a = r.execute(ForwardBatch("main", prompts, [0, 0, 0], tables,
                                   [b * S + len(p) - 1 for b, p in enumerate(prompts)]))
        news, starts = [[7], [8, 9], [10, 11, 12]], [len(p) for p in prompts]
        b = r.execute(ForwardBatch("main", news, starts, tables, [0, 3, 4, 6, 7, 8]))
        c = r.execute(ForwardBatch("mtp", news, starts, tables, [0, 4, 8], hidden_from="main",
                                   hidden_rows=[[0], [3, 4], [6, 7, 8]]))
        outs.append([x.float().cpu() for x in (a, b, c)])
    res["flex_vs_gather_max_abs_diff"] = max((x - y).abs().max().item()
                                             for x, y in zip(*outs, strict=True))
    res["flex_vs_gather_argmax_equal"] = all(
        torch.equal(x.argmax(-1), y.argmax(-1)) for x, y in zip(*outs, strict=True))
    print(f"[fast-path] device checks: {res}")
    return res


def fast_path_part(out: Path, device: str, dry: bool, budget_s: float) -> dict:
    """Decode tok/s of each runner variant (see the module docstring), inside `budget_s`:
    each compiled runner gets what is left of the budget for its warm-up (buckets it does
    not reach run eagerly, and the row says how many graphs it had)."""
    from mtpserve.benchmarks.engine_bench import BenchArgs, _engine, _engine_run
    from mtpserve.workers.engine_config import DTYPES, resolve_dtype
    from mtpserve.workers.model_runner import ModelRunner
    from mtpserve.workers.sampling_params import SamplingParams
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.prompts import held_out_prompts

    t_end = time.perf_counter() + budget_s
    model = _model()
    res: dict = {"device_checks": _device_checks(device, model), "rows": [], "runners": []}
    ks, batches = ((0, 1), (1, 2)) if dry else ((0, 1, 2, 3), (1, 8, 32))
    n_prompts, max_tokens = (2, 6) if dry else (32, 48)
    tok = load_tokenizer(model)
    prompts = [tok.encode(t)[:128] for t in held_out_prompts(n_prompts, num_chars=600)]
    args = BenchArgs(model=model, dtype="auto", device=device, ks=ks, batch_sizes=batches,
                     num_kv_blocks=1024)
    dtype = resolve_dtype("auto", device)
    res["dtype"] = dtype
    max_context = max(map(len, prompts)) + max_tokens + 2 * max(ks) + 2
    # (name, attention backend, compiled?); "-nocg" rows reuse the compiled runner with its
    # CUDA graphs switched off, so the two differ only in replay vs call.
    plan = [("eager", "gather", False), ("eager-flex", "flex", False),
            ("graphs", "gather", True), ("graphs-flex", "flex", True)]
    tokens: dict[str, list] = {}
    for name, backend, compiled in plan:
        left = t_end - time.perf_counter()
        if left < 20:
            print(f"[fast-path] {name}: skipped, budget spent")
            res["runners"].append({"variant": name, "skipped": "budget"})
            continue
        t0 = time.perf_counter()
        runner = ModelRunner(model, args.num_kv_blocks, args.block_size, DTYPES[dtype], device,
                             decode_graphs=compiled, attention_backend=backend)
        n = 0
        if compiled:  # the buckets these rows hit, likeliest first; what does not fit: eager
            n = runner.warmup_graphs(list(batches), list(range(1, max(ks) + 2)), max_context,
                                     budget_s=0.0 if dry else max(0.0, left * 0.45 - 10))
        info = {"variant": name, "graphs_compiled": n,
                "cuda_graphs": len(runner.cuda_graphs.captured) if runner.cuda_graphs else 0,
                "setup_s": round(time.perf_counter() - t0, 1)}
        res["runners"].append(info)
        print(f"[fast-path] {info}")
        modes = [(name, True)] + ([(name.replace("graphs", "compiled-nocg"), False)]
                                  if compiled and runner.cuda_graphs is not None else [])
        for k in ks:
            eng = _engine(args, runner, k)
            _engine_run(eng, prompts[:1], 1, 4)  # warm-up (eager flex compiles its shapes)
            for b in batches:
                group = prompts[: max(4 if b == 1 else 2 * b, b)]
                for mode, replay in modes:
                    if time.perf_counter() > t_end:
                        break
                    saved = runner.cuda_graphs
                    if not replay:
                        runner.cuda_graphs = None
                    try:
                        r = _engine_run(eng, group, b, max_tokens)
                    finally:
                        runner.cuda_graphs = saved
                    row = {"variant": mode, "k": k, "batch_size": b, **r}
                    res["rows"].append(row)
                    print(f"[fast-path] {mode:<18} k={k} batch={b:<3} "
                          f"{r['tokens_per_s']:8.1f} tok/s  ({r['mean_accepted_length']:.2f} "
                          "tokens/round)")
        # Greedy tokens of the same prompts, to compare variants (bf16: near-ties may flip).
        eng = _engine(args, runner, max(ks))
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        reqs = [eng.add_request(f"eq-{i}", p, params) for i, p in enumerate(prompts[:4])]
        while eng.has_unfinished():
            eng.step()
        tokens[name] = [r.output_token_ids for r in reqs]
        del runner, eng
    ref = tokens.get("eager")
    res["greedy_equal_to_eager"] = {n: t == ref for n, t in tokens.items() if ref is not None}
    (out / f"fast-path-{device}.json").write_text(json.dumps(res, indent=2, default=str))
    return {k: v for k, v in res.items() if k != "rows"} | {"num_rows": len(res["rows"])}


# 1c. The hot path, measured: graphs == eager per bucket, host syncs per step, KV sizing --------

def graph_vs_eager(runner, keys=None, tolerance: float = 1e-3, seed: int = 0,
                   batches_per_key: int = 2) -> list[dict]:
    """Logits of every compiled bucket (`keys`; default: every bucket the runner replays, the
    captured CUDA graphs, or on CPU the compiled graphs) against the eager forward of the same
    batch: max |graph - eager| / max |eager| per bucket, `ok` when <= `tolerance`. Each bucket
    runs `batches_per_key` different batches through the same graph (a replay that ignored
    its new inputs would reproduce the first batch's logits), rows partly padding (batch and
    query below the bucket) so padding slots and rows are exercised. Context KV: random ids
    prefilled eagerly; each row owns its blocks (no two rows write one slot)."""
    import torch

    from mtpserve.workers.model.decode_graph import bucket, query_bucket
    from mtpserve.workers.model_runner import ForwardBatch

    g = runner.graphs
    if keys is None:
        keys = (runner.cuda_graphs.captured if runner.cuda_graphs is not None
                else set(g.compiled))
    gen = torch.Generator().manual_seed(seed)
    V, bs = runner.config.vocab_size, runner.block_size
    pool = runner.kv_cache.num_blocks
    rows_out = []
    for key in sorted(keys, key=lambda k: (k.kind, k.module, k.batch, k.query_len,
                                           k.num_blocks)):
        if key.kind not in ("main", "mtp"):
            rows_out.append({"key": str(key), "skipped": "fused round: compared by tokens"})
            continue
        worst = 0.0
        for t in range(batches_per_key):
            if key.dynamic:
                # A dynamic package runs every shape exactly: sample different batch, query
                # and table widths through the one package.
                B, S, nb = _dynamic_sample(t, g.max_query_len)
            else:
                # Real rows: the full bucket, then fewer (padding rows) with a shorter query.
                B = key.batch if t == 0 else max(1, key.batch // 2 + (key.batch > 1))
                S = key.query_len if t == 0 else max(1, key.query_len - 1)
                if bucket(B) != key.batch or query_bucket(S) != key.query_len:
                    B, S = key.batch, key.query_len
                nb = key.num_blocks if key.num_blocks > g.min_blocks else min(g.min_blocks, 8)
            if B * nb > pool:
                rows_out.append({"key": str(key), "skipped": f"needs {B * nb} KV blocks"})
                break
            tables = [list(range(b * nb, (b + 1) * nb)) for b in range(B)]
            lo = (nb // 2) * bs if key.dynamic or key.num_blocks > g.min_blocks else 1
            starts = torch.randint(lo, nb * bs - S + 1, (B,), generator=gen).tolist()
            ctx = [torch.randint(1, V, (n,), generator=gen).tolist() for n in starts]
            runner._execute_eager(ForwardBatch("main", ctx, [0] * B, tables, [0]))
            ids = torch.randint(1, V, (B, S), generator=gen).tolist()
            rows = [b * S + s for b in range(B) for s in range(S)]
            batch = ForwardBatch(key.kind, ids, starts, tables, rows, module=key.module,
                                 hidden_from="main" if key.kind == "mtp" else None,
                                 hidden_rows=[[b * S + s for s in range(S)] for b in range(B)])
            if key.kind == "mtp":  # the main hidden states both MTP forwards read
                runner._execute_eager(ForwardBatch("main", ids, starts, tables, [0]))
            got = runner.graphs.key_for(key.kind, key.module, [S] * B, tables)
            assert got is not None and got.package == key, f"batch meant for {key} maps to {got}"
            graph = runner.execute(batch).float().clone()
            eager = runner._execute_eager(batch).float()
            diff = ((graph - eager).abs().max() / eager.abs().max().clamp(min=1e-6)).item()
            worst = max(worst, diff)
        else:
            rows_out.append({"key": str(key), "max_rel_diff": worst,
                             "ok": worst <= tolerance})
    return rows_out


def _dynamic_sample(t: int, max_query_len: int) -> tuple[int, int, int]:
    """The t-th (batch, query length, table width) a dynamic package is checked at: shapes
    off its export example (4, 4, 8), a single row among them."""
    samples = [(3, 2, 5), (1, 1, 2), (2, 5, 11), (5, 3, 3)]
    B, S, nb = samples[t % len(samples)]
    return B, min(S, max_query_len), nb


@contextlib.contextmanager
def count_host_syncs(device: str) -> Iterator[dict]:
    """Counts the host's waits on the device inside the block, two ways: `syncs` and
    `sites`: synchronizing CUDA calls seen by CUDA sync debug mode ("warn": each one raises a
    Python warning), with the Python lines they came from, most frequent first (off CUDA: 0).
    The engine's own sync (workers/host_sync.py: a non-blocking copy into pinned memory, then
    one event wait) is not one of them, so on the hot path every one is a bypass;
    `host_sync`: the engine's counted syncs by reason (`HOST_SYNCS`, any device)."""
    import warnings

    import torch

    from mtpserve.workers.host_sync import HOST_SYNCS

    res: dict = {"syncs": 0, "sites": {}, "host_sync": {}}
    before = HOST_SYNCS.snapshot()
    if not device.startswith("cuda"):
        yield res
        res["host_sync"] = dict(HOST_SYNCS.snapshot() - before)
        return
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield res
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    res["host_sync"] = dict(HOST_SYNCS.snapshot() - before)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    res["syncs"] = len(syncs)
    sites: dict[str, int] = {}
    for w in syncs:
        site = f"{Path(w.filename).name}:{w.lineno}"
        sites[site] = sites.get(site, 0) + 1
    res["sites"] = dict(sorted(sites.items(), key=lambda kv: -kv[1]))


def hot_path_part(out: Path, device: str, dry: bool) -> dict:
    """What issue 33 item 7 promises, measured: (a) the KV pool sized from
    kv_cache_memory_fraction (budget, blocks, then the graph pool actually captured against
    its reserve); (b) eager vs compiled/replayed logits at every bucket, float32 so the
    tolerance can be tight (a wrong slot, stale static buffer or padding leak is >> 1e-3);
    (c) host syncs per engine step and per round, greedy and sampled, from CUDA sync debug
    mode, with the code lines they come from."""
    import torch

    from mtpserve.benchmarks.engine_bench import BenchArgs, _engine
    from mtpserve.workers.model_runner import ModelRunner
    from mtpserve.workers.sampling_params import SamplingParams

    model = _model()
    res: dict = {}
    cuda = device.startswith("cuda")
    # (a) sizing: a fraction well below 1 so the other parts' runners still fit afterwards.
    fraction = 0.35
    before = torch.cuda.memory_reserved() if cuda else 0
    runner = ModelRunner(model, None if cuda else 256, 16, torch.float32, device,
                         decode_graphs=True, kv_cache_memory_fraction=fraction,
                         attention_backend="auto")
    res["attention_backend"] = runner.attention_backend
    res["num_kv_blocks"] = runner.kv_cache.num_blocks
    res["kv_budget"] = dataclasses.asdict(runner.kv_budget) if runner.kv_budget else None
    ks, batches = ((1, 2), (1, 2)) if dry else ((1, 2, 3), (1, 4, 8))
    k = max(ks)
    pre_graphs = torch.cuda.memory_reserved() if cuda else 0
    t0 = time.perf_counter()
    n = runner.warmup_graphs(list(batches), list(range(1, k + 2)), 256,
                             budget_s=30.0 if dry else 150.0)
    res["graphs_compiled"] = n
    res["warmup_s"] = round(time.perf_counter() - t0, 1)
    if cuda:
        torch.cuda.synchronize()
        total = torch.cuda.mem_get_info()[1]
        res["graph_memory_bytes"] = torch.cuda.memory_reserved() - pre_graphs
        # What the capture itself measured (recorded for the next start's KV sizing) against
        # what this start reserved (the default on a first start, else the measured record).
        res["graph_memory_measured_bytes"] = runner.graph_memory_bytes
        res["graph_reserve_bytes"] = runner.graph_reserve_bytes
        res["process_reserved_over_total"] = torch.cuda.memory_reserved() / total
        res["process_reserved_before"] = before
        res["fraction"] = fraction
    print(f"[hot-path] KV sizing: backend={res['attention_backend']} "
          f"blocks={res['num_kv_blocks']} budget={res['kv_budget']} "
          f"graph memory={res.get('graph_memory_bytes')} (reserve "
          f"{res.get('graph_reserve_bytes')})")
    # (b) every replayed bucket against eager.
    rows = graph_vs_eager(runner, tolerance=1e-3)
    res["graph_vs_eager"] = rows
    checked = [r for r in rows if "ok" in r]
    res["graph_vs_eager_all_ok"] = bool(checked) and all(r["ok"] for r in checked)
    for r in rows:
        print(f"[hot-path] graph vs eager {r}")
    # (c) host syncs per step: an engine over the compiled runner, greedy then sampled.
    args = BenchArgs(model=model, dtype="float32", device=device, ks=ks, batch_sizes=batches,
                     num_kv_blocks=runner.kv_cache.num_blocks)
    prompts = [list(range(3 + i, 40 + i)) for i in range(max(batches))]
    res["syncs"] = []
    for temperature in (0.0, 0.8):
        eng = _engine(args, runner, k)
        params = SamplingParams(max_tokens=8 if dry else 32, temperature=temperature,
                                seed=1, ignore_eos=True)
        for i, p in enumerate(prompts):
            eng.add_request(f"sync-{temperature}-{i}", p, params)
        while eng.scheduler.waiting or eng.scheduler.prefilling:
            eng.step()  # prefill (and the first tokens) outside the count
        steps = 0
        with count_host_syncs(device) as c:
            while eng.has_unfinished():
                eng.step()
                steps += 1
        counted = sum(c["host_sync"].values())
        # The promise: one engine sync per round (its accepted ids) and no CUDA sync beside it.
        row = {"temperature": temperature, "k": k, "batch": len(prompts), "steps": steps,
               "cuda_syncs": c["syncs"],
               "cuda_syncs_per_step": c["syncs"] / steps if steps else None,
               "engine_syncs_per_step": counted / steps if steps else None,
               "engine_syncs": c["host_sync"],
               "top_sites": dict(list(c["sites"].items())[:12])}
        res["syncs"].append(row)
        print(f"[hot-path] host syncs: {row}")
        del eng
    del runner
    if cuda:
        torch.cuda.empty_cache()
    (out / f"hot-path-{device}.json").write_text(json.dumps(res, indent=2, default=str))
    return {k: v for k, v in res.items() if k != "graph_vs_eager"}


# 2./3. The disaggregated app --------------------------------------------------------------------

def _offline(prompts: list[str], device: str, max_tokens: int) -> list[str]:
    from mtpserve.workers import LLM, SamplingParams

    # A fixed pool: an offline engine sizes it from memory only once workers/engine.py
    # takes the runner's pool (num_kv_blocks None on CUDA).
    llm = LLM(_model(), num_speculative_tokens=2, device=device, num_kv_blocks=1024)
    # One prompt at a time, as the HTTP requests below run (same batch shapes on the GPU).
    return [llm.generate([p], SamplingParams(max_tokens=max_tokens, temperature=0))[0].text
            for p in prompts]


@contextlib.contextmanager
def _app(device: str, backend: str, tp: int, decode_replicas: int = 1, admin: bool = True
         ) -> Iterator[tuple[str, float]]:
    """The disaggregated app on a local Ray cluster: (base URL, deploy seconds). Over gloo
    every rank shares the one GPU (prefill 0.5, the decode replicas the other half); over
    NCCL one GPU per rank."""
    import ray
    from ray import serve

    from mtpserve.benchmarks.datapath_bench import admin_options
    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig

    gpus = 0.0 if device == "cpu" else (0.5 if backend == "gloo" else 1.0)
    port = _port()
    ray.init(address="local", include_dashboard=False, log_to_driver=False,
             **({"num_cpus": 4} if device == "cpu" else {}))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        cfg = ClusterConfig(
            model=_model(), device=device,
            prefill={"tp_size": tp, "cpus_per_rank": 1, "gpus_per_rank": gpus},
            decode={"tp_size": tp, "cpus_per_rank": 1 / decode_replicas,
                    "gpus_per_rank": gpus / decode_replicas, "replicas": decode_replicas},
            speculation={"num_speculative_tokens": 2, "adaptive": False},
            kv_transfer={"backend": backend},
            # Without an admin key the stats endpoint is open (kv_burst_bench reads it).
            **(admin_options(ClusterConfig) if admin else {}),
        )
        t0 = time.perf_counter()
        serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
        yield f"http://127.0.0.1:{port}", time.perf_counter() - t0
    finally:
        serve.shutdown()
        ray.shutdown()


def _stats(base: str) -> dict:
    from mtpserve.benchmarks.datapath_bench import ADMIN_KEY

    return httpx.get(f"{base}/v1/mtpserve/stats", timeout=60,
                     headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()  # ignored if open


def kv_part(out: Path, device: str, dry: bool) -> dict:
    """Issue 18's KV checks on one GPU (gloo path, host staging): a burst of 64 pulls into
    one decode replica (time to second token vs a single arrival, peak pulls in flight, pulls
    completed per decode step, TPOT of streams already running meanwhile), and the prefill's
    send-buffer memory after bursts into 1 and 2 decode replicas (with 2, the decode counters
    are one replica's: Serve answers the stats call from one of them)."""
    from mtpserve.benchmarks.kv_burst_bench import measure
    from mtpserve.benchmarks.serve_bench import format_interference, run_interference

    burst = 4 if dry else 64
    res: dict = {}
    for replicas in (1, 2):
        with _app(device, "gloo", 1, replicas, admin=False) as (base, deploy_s):
            before = _stats(base)
            got = asyncio_run(measure(base, burst, 2 if dry else 8, 1, 128 if dry else 512,
                                      4))
            after = _stats(base)
            d0, d1 = before["decode"], after["decode"]
            pulls = d1["kv_puller"]["pulls"] - d0["kv_puller"]["pulls"]
            steps = d1.get("num_steps", 0) - d0.get("num_steps", 0)
            row = {"deploy_s": deploy_s, "burst": got, "pulls": pulls, "decode_steps": steps,
                   "pulls_per_decode_step": pulls / steps if steps else None,
                   "peak_pulls_in_flight": d1["kv_puller"].get("peak_in_flight"),
                   "prefill_send_buffer_mib": after["prefill"]["kv_sender"].get(
                       "send_buffer_bytes", 0) / 2**20}
            if replicas == 1:  # decode TPOT of running streams while long prompts arrive
                row["tpot_with_arrivals"] = asyncio_run(run_interference(
                    base, api_key=None, num_streams=4, stream_tokens=64 if dry else 400,
                    num_arrivals=1 if dry else 8, settle_s=0.5 if dry else 1.0))
                print(format_interference(row["tpot_with_arrivals"]))
            brief = {k: v for k, v in row.items() if k not in ("burst", "tpot_with_arrivals")}
            print(f"[kv] decode replicas {replicas}: {json.dumps(brief)} "
                  f"burst: {json.dumps(got.get('burst', got))}")
            res[f"decode_replicas_{replicas}"] = row
    (out / "kv.json").write_text(json.dumps(res, indent=2, default=str))
    return res


def app_part(out: Path, device: str, dry: bool, backend: str, tp: int, name: str) -> dict:
    from mtpserve.benchmarks.datapath_bench import ADMIN_KEY
    from mtpserve.benchmarks.serve_bench import (
        ServeBenchArgs,
        format_interference,
        format_table,
        run,
        run_interference,
    )
    from mtpserve.workers.training.prompts import held_out_prompts

    max_tokens = 8 if dry else 32
    prompts = held_out_prompts(2 if dry else 4, num_chars=300)
    offline = _offline(prompts, device, max_tokens)
    with _app(device, backend, tp) as (base, deploy_s):
        got = []
        for p in prompts:
            r = httpx.post(f"{base}/v1/completions", timeout=300,
                           json={"prompt": p, "max_tokens": max_tokens, "temperature": 0})
            r.raise_for_status()
            got.append(r.json()["choices"][0]["text"])
        stats = _stats(base)
        res = {"greedy_equal": got == offline, "deploy_s": deploy_s,
               "mismatches": [{"http": g, "offline": o} for g, o in zip(got, offline,
                                                                         strict=True)
                              if g != o],
               "kv_pulls": stats["decode"]["kv_receiver"]["pulls"],
               "migrations": stats.get("orchestrator", {}).get("num_migrations")}
        print(f"[{name}] greedy == offline: {res['greedy_equal']}  "
              f"(pulls {res['kv_pulls']}, migrations {res['migrations']})")
        one = asyncio_run(run(ServeBenchArgs(url=base, api_key=ADMIN_KEY, concurrency=1,
                                             num_requests=2 if dry else 6,
                                             max_tokens=8 if dry else 64, prompt_tokens=128)))
        res["one_stream"] = one
        print(f"[{name}] one stream: TPOT p50 {one.get('tpot_ms_p50')} ms, "
              f"TTFT p50 {one.get('ttft_ms_p50')} ms")
        n = 2 if dry else 8
        pull = asyncio_run(run(ServeBenchArgs(url=base, api_key=ADMIN_KEY, concurrency=1,
                                              num_requests=n, max_tokens=8,
                                              prompt_tokens=1000)))
        raw, ach = pull.get("kv_raw_gib_per_s"), pull.get("kv_achieved_gib_per_s")
        pull["kv_pull_over_raw"] = ach / raw if ach and raw else None
        print(format_table(pull))
        res["kv_pull_c1_1k"] = pull
        tpot = asyncio_run(run_interference(
            base, api_key=ADMIN_KEY, num_streams=4, stream_tokens=64 if dry else 400,
            num_arrivals=1 if dry else 3, settle_s=0.5 if dry else 1.0))
        print(format_interference(tpot))
        res["tpot_with_arrivals"] = tpot
        (out / f"{name}.json").write_text(json.dumps(res, indent=2))
        return res


def _timed_peak(fn, device: str, reps: int) -> tuple[float, int]:
    """(median ms of `reps` calls after one warm-up, peak bytes allocated beyond the start)."""
    import statistics

    import torch

    cuda = device.startswith("cuda")
    fn()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return statistics.median(times), peak


def kernels_part(out: Path, device: str, dry: bool) -> dict:
    """Issue 41 items 4 and 5 against the paths they replaced, at a DeepSeek-V3 TP=8 rank's
    shapes (small ones in a dry run): (a) routed experts of one decode bucket, gathered
    weights per (token, slot) pair vs sorted pairs through grouped matmuls (`Experts`),
    bf16; (b) MLA absorbed decode, SDPA's GQA form (the latent repeated per local head) vs
    the heads folded into query rows. Median ms and peak transient bytes of each, and the
    largest difference of their outputs."""
    import torch
    import torch.nn.functional as F

    from mtpserve.workers.model.families.base import MoEConfig
    from mtpserve.workers.model.moe import Experts

    dt = torch.bfloat16 if not dry else torch.float32
    reps = 20 if not dry else 3
    res: dict = {}
    # (a) MoE: H 7168, 256 experts of 2048 / TP 8 = 256, top-8, 64 rows x 4 positions.
    H, E, inter, K, T = (7168, 256, 2048 // 8, 8, 256) if not dry else (256, 16, 64, 4, 16)
    with torch.device(device):
        experts = Experts(H, MoEConfig(num_experts=E, top_k=K, intermediate_size=inter,
                                       scoring="sigmoid", norm_topk_prob=True)).to(dt)
        torch.nn.init.normal_(experts.w13, std=0.02)
        torch.nn.init.normal_(experts.w2, std=0.02)
        x = torch.randn(T, H, dtype=dt)
        idx = torch.randint(0, E, (T, K))
        w = torch.rand(T, K, dtype=dt)
    with torch.no_grad():
        a = experts._gathered(x, w, idx)
        b = experts._grouped(x, w, idx)
        res["moe"] = {
            "shape": {"tokens": T, "top_k": K, "experts": E, "hidden": H, "inter": inter},
            "max_abs_diff": (a.float() - b.float()).abs().max().item(),
            "gathered_ms_peak": _timed_peak(lambda: experts._gathered(x, w, idx), device, reps),
            "grouped_ms_peak": _timed_peak(lambda: experts._grouped(x, w, idx), device, reps),
        }
    # (b) MLA: 128 heads / TP 8 = 16 local, latent 512 + rope 64, 32 rows x 4 queries, 4096
    # context.
    Hl, R, B, S, L = (16, 512, 32, 4, 4096) if not dry else (4, 32, 2, 4, 64)
    D = R + 64 if not dry else R + 8
    with torch.device(device):
        q = torch.randn(B, Hl, S, D, dtype=dt)
        lat = torch.randn(B, 1, L, D, dtype=dt)
        pos = torch.arange(L - S, L).view(1, S).expand(B, S)
        mask = (torch.arange(L).view(1, 1, -1) <= pos.unsqueeze(-1)).unsqueeze(1)

    def gqa():
        return F.scaled_dot_product_attention(q, lat, lat[..., :R], attn_mask=mask,
                                              enable_gqa=True)

    def folded():
        return F.scaled_dot_product_attention(
            q.reshape(B, 1, Hl * S, D), lat, lat[..., :R],
            attn_mask=mask.repeat(1, 1, Hl, 1)).view(B, Hl, S, R)

    with torch.no_grad():
        res["mla"] = {
            "shape": {"rows": B, "queries": S, "local_heads": Hl, "context": L, "dim": D},
            "max_abs_diff": (gqa().float() - folded().float()).abs().max().item(),
            "gqa_ms_peak": _timed_peak(gqa, device, reps),
            "folded_ms_peak": _timed_peak(folded, device, reps),
        }
    (out / "kernels.json").write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return res


def pd_sampled_part(out: Path, device: str, dry: bool) -> dict:
    """The fake-CUDA tier's P/D case on the real device (issue 41 item 8): a prefill engine
    samples a request's first token and drafts, the decode engine takes it as the puller
    hands it over (drafts and their q as host copies) beside a local sampled request, and
    both finish; seeded, the transferred request's tokens equal the same request run alone on
    one engine. Before the fix its first round stacked a host q with device q and failed."""
    import torch

    from mtpserve.workers.engine import Engine, EngineConfig
    from mtpserve.workers.sampling_params import SamplingParams
    from mtpserve.workers.scheduler import decode_slots, draft_slots

    model = _model()
    prompt = list(range(5, 37))
    sp = SamplingParams(max_tokens=24 if not dry else 8, temperature=1.0, top_p=0.9, seed=3)

    def engine(role: str) -> Engine:
        return Engine(EngineConfig(model=model, device=device, num_speculative_tokens=2,
                                   compile="off", role=role, num_kv_blocks=256))

    alone = engine("both")
    want = alone.add_request("x", prompt, sp)
    while alone.has_unfinished():
        alone.step()
    pre, dec = engine("prefill"), engine("decode")
    dec.add_request("local", prompt[::-1], sp)
    dec.step()
    pre.add_request("x", prompt, sp)
    (first,) = pre.step()
    held = pre.prefilled["x"]
    r = dec.make_request("x", prompt, sp)
    r.output_token_ids += first.new_token_ids
    r.num_computed_tokens = held.num_computed_tokens
    dec.add_transferred(r, max(draft_slots(held), decode_slots(r)))
    assert dec.scheduler.admit_transferred() == [r]
    n = len(held.block_ids)
    for s_, d in zip(pre.runner.kv_cache.layers, dec.runner.kv_cache.layers, strict=True):
        d[:, r.block_ids[:n]] = s_[:, held.block_ids]
    extras = {"draft_token_ids": torch.tensor(held.draft_token_ids, dtype=torch.long)}
    if held.draft_probs is not None:
        extras["draft_probs"] = held.draft_probs.float().to("cpu", copy=True)
    dec.activate_transferred(r, extras)
    q_device = None if r.draft_probs is None else str(r.draft_probs.device)
    errors = []
    while dec.has_unfinished():
        errors += [o.error for o in dec.step() if o.error]
    pre.release_prefilled("x")
    res = {"errors": errors, "tokens_equal_alone": r.output_token_ids == want.output_token_ids,
           "q_device": q_device}
    (out / "pd-sampled.json").write_text(json.dumps(res, indent=2))
    assert not errors and res["tokens_equal_alone"], res
    return res


def asyncio_run(coro):
    import asyncio

    return asyncio.run(coro)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-check")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                    help="cpu: a small dry run of the same steps (no GPU needed)")
    ap.add_argument("--fast-path-budget-s", type=float, default=210.0,
                    help="seconds the fast-path part may take (it skips what does not fit)")
    ap.add_argument("--only", help="comma-separated parts to run (default: all)")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "gpu_check.log", "a")  # noqa: SIM115 (open for the whole run)
    sys.stdout = _Tee(sys.__stdout__, log)
    sys.stderr = _Tee(sys.__stderr__, log)
    import torch

    dry = a.device == "cpu"
    n_gpus = torch.cuda.device_count() if not dry else 0
    print(f"gpu_check: device={a.device} visible GPUs={n_gpus} torch={torch.__version__}")
    parts: list[tuple[str, Callable[[], dict] | None, str]] = [
        ("engine", lambda: engine_part(out, a.device, dry), ""),
        ("hot-path", lambda: hot_path_part(out, a.device, dry), ""),
        ("fast-path", lambda: fast_path_part(out, a.device, dry, a.fast_path_budget_s), ""),
        ("disagg-gloo", lambda: app_part(out, a.device, dry, "gloo", 1, "disagg-gloo"), ""),
        ("kv", lambda: kv_part(out, a.device, dry), ""),
        ("pd-sampled", lambda: pd_sampled_part(out, a.device, dry), ""),
        ("kernels", lambda: kernels_part(out, a.device, dry), ""),
        ("nccl-kv", (lambda: app_part(out, a.device, dry, "nccl", 1, "nccl-kv"))
         if n_gpus >= 2 else None, "needs >= 2 GPUs (one NCCL rank per GPU)"),
        ("nccl-tp", (lambda: app_part(out, a.device, dry, "nccl", 2, "nccl-tp"))
         if n_gpus >= 4 else None, "needs >= 4 GPUs (prefill TP 2 + decode TP 2)"),
    ]
    if a.only:
        parts = [p for p in parts if p[0] in a.only.split(",")]
    summary: dict = {"device": a.device, "gpus": n_gpus, "parts": {}}
    for name, fn, why in parts:
        if fn is None:
            print(f"[{name}] skipped: {why}")
            summary["parts"][name] = {"status": "skipped", "reason": why}
            continue
        t0 = time.perf_counter()
        try:
            result = fn()
            summary["parts"][name] = {"status": "ok", "result": result}
        except Exception as e:
            traceback.print_exc()
            summary["parts"][name] = {"status": "failed", "error": f"{type(e).__name__}: {e}"}
        summary["parts"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] {summary['parts'][name]['status']} in "
              f"{summary['parts'][name]['seconds']}s")
        (out / "gpu_check.json").write_text(json.dumps(summary, indent=2, default=str))
    ok = all(p["status"] != "failed" for p in summary["parts"].values())
    print(f"gpu_check: {'all parts ok' if ok else 'some parts FAILED'}")


if __name__ == "__main__":
    main()
