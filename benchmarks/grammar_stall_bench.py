"""Do constrained arrivals stall other streams? Inter-token latency of plain streams while new
requests bring grammars nobody compiled yet, or prompt tails nobody healed yet.

    python -m mtpserve.benchmarks.grammar_stall_bench \
        --json benchmarks/results/grammar-stall-cpu.json

One offline engine (the embedded model, k=2) runs `--streams` plain greedy streams; every
`--every` steps a new request arrives on the engine thread (as a served replica takes
arrivals between steps) with either a JSON schema of its own (distinct property names, so no
cache helps) or a token-healing prefix of its own. Variants, interleaved, best of
`--repeats` per variant:

- quiet: no arrivals;
- grammars on the engine thread (`grammar_compile_workers: 0`, the behaviour before issue 43):
  each arrival compiles at admission and every stream waits;
- grammars off the thread (the default pool of 2), its threads at the engine's priority and
  at the lower one they run at (the default);
- healing tails, sorted table (`PrefixMasks`, the default) and the per-tail vocabulary scan
  it replaced (the same rule written as the old loop, `_ScanMasks`).

ITL is the time between a plain stream's consecutive outputs (p50 / p99 over all streams),
and the mask cost per round compares constrained rounds with unconstrained ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.paths import default_model_path
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.structured import guide as guide_mod
from mtpserve.workers.structured.constraint import PrefixMasks
from mtpserve.workers.structured.spec import StructuredSpec
from mtpserve.workers.tokenizer import load_tokenizer
from mtpserve.workers.training.prompts import held_out_prompts

NICENESS = guide_mod.COMPILE_NICENESS


class _ScanMasks(PrefixMasks):
    """The healing mask as it was built before: one Python pass over the vocabulary per new
    tail, kept in an unbounded dict."""

    def packed(self, rest: bytes) -> np.ndarray:
        m = self._lru.get(rest)
        if m is None:
            ok = np.fromiter(((b != b"" and (b.startswith(rest) or rest.startswith(b)))
                              for b in self.token_bytes), dtype=bool,
                             count=len(self.token_bytes))
            pad = (-len(ok)) % 32
            m = np.packbits(np.concatenate([ok, np.zeros(pad, dtype=bool)]),
                            bitorder="little").view(np.int32)
            self._lru[rest] = m
        return m


def _schema(i: int) -> dict:
    props = {f"field_{i}_{j}": {"type": "string", "pattern": f"[a-z]{{1,{4 + j}}}"}
             for j in range(12)}
    return {"type": "object", "properties": props, "required": list(props)}


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def run(model: str, variant: str, streams: int, every: int, max_tokens: int, tag: int
        ) -> dict:
    workers = 0 if variant == "grammars-engine-thread" else 2
    # The pool's compile threads run at a lower priority (guide.COMPILE_NICENESS); this
    # variant runs them at the engine thread's, to measure that lever.
    guide_mod.COMPILE_NICENESS = 0 if variant == "grammars-pool-same-priority" else NICENESS
    eng = Engine(EngineConfig(model=model, num_speculative_tokens=2, compile="off",
                              grammar_compile_workers=workers))
    tok = load_tokenizer(model)
    if variant == "healing-scan":
        eng.guide._prefix_masks = _ScanMasks(eng.guide.cache.token_bytes)
    elif variant.startswith("healing"):
        eng.guide._prefix_masks = PrefixMasks(eng.guide.cache.token_bytes)
    eng.guide.cache.token_bytes  # noqa: B018 - load the tokenizer's tables before timing
    prompts = [tok.encode(p) for p in held_out_prompts(streams)]
    plain = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    reqs = [eng.add_request(f"p{i}", p, plain) for i, p in enumerate(prompts)]
    last = {r.request_id: None for r in reqs}
    gaps: list[float] = []
    steps = arrivals = 0
    step_s: list[float] = []
    while not all(r.finished for r in reqs):
        if variant != "quiet" and steps and steps % every == 0:
            arrivals += 1
            n = tag * 10_000 + arrivals
            if variant.startswith("grammars"):
                spec = StructuredSpec.json_schema(_schema(n))
            else:  # a tail of its own: distinct bytes, as distinct prompts' tails are
                spec = StructuredSpec.prefix(f"\n{' ' * (n % 7)}x{n}".encode())
            eng.add_request(f"c{n}", prompts[0], SamplingParams(
                max_tokens=4, temperature=0.0, structured=spec))
        t0 = time.perf_counter()
        outs = eng.step()
        now = time.perf_counter()
        step_s.append(now - t0)
        steps += 1
        for o in outs:
            if o.request_id in last and o.new_token_ids:
                if last[o.request_id] is not None:
                    gaps.append((now - last[o.request_id]) / len(o.new_token_ids))
                last[o.request_id] = now
    while eng.has_unfinished():  # the constrained tail end, not timed
        if not eng.step():
            eng.wait_grammars(1.0)
    eng.guide.close()
    return {"variant": variant, "itl_p50_ms": 1e3 * _percentile(gaps, 0.5),
            "itl_p99_ms": 1e3 * _percentile(gaps, 0.99),
            "step_mean_ms": 1e3 * statistics.fmean(step_s), "arrivals": arrivals,
            "steps": steps}


VARIANTS = ["quiet", "grammars-engine-thread", "grammars-pool-same-priority", "grammars-pool",
            "healing-scan", "healing-table"]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--every", type=int, default=4, help="steps between arrivals")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    best: dict[str, dict] = {}
    for rep in range(a.repeats):
        for v in VARIANTS:
            r = run(a.model, v, a.streams, a.every, a.max_tokens, tag=rep * 10 + 1)
            if v not in best or r["itl_p99_ms"] < best[v]["itl_p99_ms"]:
                best[v] = r
    quiet = best["quiet"]
    print(f"{a.streams} plain streams, an arrival every {a.every} steps, best of "
          f"{a.repeats}")
    print("| variant | ITL p50 ms | ITL p99 ms | p99 / quiet | mean step ms | arrivals |")
    print("|---|---|---|---|---|---|")
    for v in VARIANTS:
        r = best[v]
        print(f"| {v} | {r['itl_p50_ms']:.1f} | {r['itl_p99_ms']:.1f} | "
              f"{r['itl_p99_ms'] / quiet['itl_p99_ms']:.2f}x | {r['step_mean_ms']:.1f} | "
              f"{r['arrivals']} |")
    out = {"benchmark": "grammar_stall_bench", "streams": a.streams, "every": a.every,
           "max_tokens": a.max_tokens, "repeats": a.repeats, "results": best}
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
