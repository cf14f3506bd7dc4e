"""Structured outputs under MTP speculation, and token healing, on the offline engine.

    python -m mtpserve.benchmarks.structured_bench --json benchmarks/results/structured-cpu.json

Prints (1) tokens/s and draft acceptance of JSON-schema-constrained greedy generation against
unconstrained greedy generation of as many tokens per prompt, same prompts, same k (a batch of
held-out code prompts; runs alternate, the fastest of each kept), and (2) the rate of
immediate end of text (EOS as the first generated token) over the 40 held-out prompts
(`held_out_prompts(40)`, the default model's evaluation split, each cut at a line end)
through `LLM.generate`: healing off, the model's default (on for the embedded model: a
line-break tail), and healing any healable tail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.llm import LLM
from mtpserve.workers.paths import default_model_path
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.structured.spec import StructuredSpec
from mtpserve.workers.tokenizer import load_tokenizer
from mtpserve.workers.training.prompts import held_out_prompts

SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "line": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "kind": {"enum": ["function", "class", "constant", "import"]},
                         "public": {"type": "boolean"}},
          "required": ["name", "line", "kind", "public"],
          "additionalProperties": False}


def _run(eng: Engine, prompts: list[list[int]], params: list[SamplingParams], tag: str
         ) -> tuple[list[list[int]], float]:
    reqs = [eng.add_request(f"{tag}{i}", p, sp) for i, (p, sp) in
            enumerate(zip(prompts, params, strict=True))]
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return [r.output_token_ids for r in reqs], time.perf_counter() - t0


def throughput(model: str, k: int, num_prompts: int, max_tokens: int, repeats: int = 2
               ) -> dict:
    """Both variants on one engine each, runs alternating (the machine's load drifts), the
    fastest run of each kept."""
    tok = load_tokenizer(model)
    prompts = [tok.encode(p)[:96] for p in held_out_prompts(num_prompts)]
    spec = StructuredSpec.json_schema(SCHEMA)
    variants = {"unconstrained": SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True),
                "json_schema": SamplingParams(max_tokens=max_tokens, temperature=0,
                                              structured=spec)}
    engines = {}
    for name, sp in variants.items():
        eng = engines[name] = Engine(EngineConfig(model=model, num_speculative_tokens=k,
                                                  num_kv_blocks=1024, max_num_seqs=num_prompts))
        eng.guide.cache.compile(spec)  # as the ingress does before the request runs
        _run(eng, prompts[:1], [dataclasses.replace(sp, max_tokens=4)], "warm")
    best: dict[str, tuple[float, list[list[int]], dict]] = {}
    lengths: list[int] = []
    for rep in range(repeats):
        for name in ("json_schema", "unconstrained"):
            eng, sp = engines[name], variants[name]
            # The unconstrained run generates as many tokens per prompt as the constrained one
            # did (EOS ignored), so both amortise the same prefill over the same outputs.
            each = [sp] * len(prompts) if name == "json_schema" else [
                dataclasses.replace(sp, max_tokens=n) for n in lengths]
            before = dict(eng.totals)
            outs, secs = _run(eng, prompts, each, f"r{rep}-")
            if name == "json_schema":
                lengths = [len(o) for o in outs]
            t = {key: eng.totals[key] - before[key] for key in eng.totals}
            if name not in best or secs < best[name][0]:
                best[name] = (secs, outs, t)
    out: dict = {}
    for name, (secs, outs, t) in best.items():
        n = sum(len(o) for o in outs)
        out[name] = {"tokens": n, "seconds": round(secs, 3), "tokens_per_s": round(n / secs, 1),
                     "acceptance_rate": round(t["accepted"] / t["drafted"], 3)
                     if t["drafted"] else None,
                     "mean_accepted_length": round((t["accepted"] + t["rounds"]) / t["rounds"],
                                                   3) if t["rounds"] else None}
        if name == "json_schema":
            valid = sum(_valid(tok.decode(o, skip_special_tokens=True)) for o in outs)
            out[name]["valid_json"] = f"{valid}/{len(outs)}"
    out["ratio_tokens_per_s"] = round(out["json_schema"]["tokens_per_s"]
                                      / out["unconstrained"]["tokens_per_s"], 3)
    return out


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == set(SCHEMA["required"])


def healing(model: str, k: int, num_prompts: int) -> dict:
    """Immediate end of text over the held-out prompts through `LLM.generate` (which heals as
    the server does): healing off, the model's default (line-break tails), any healable tail."""
    texts = held_out_prompts(num_prompts)
    llm = LLM(model, num_speculative_tokens=k, num_kv_blocks=1024, max_num_seqs=num_prompts)
    eos = llm.engine.eos_ids
    params = SamplingParams(max_tokens=4, temperature=0)
    runs = {name: llm.generate(texts, params, token_healing=flag)
            for name, flag in (("off", False), ("default", None), ("any_tail", True))}
    return {"num_prompts": len(texts),
            "ending_in_newline": sum(t.endswith("\n") for t in texts),
            "model_default_on": llm.token_healing,
            "healed": sum(r.num_healed_tokens > 0 for r in runs["default"]),
            "immediate_eos_without_healing": sum(r.output_token_ids[0] in eos
                                                 for r in runs["off"]),
            "immediate_eos_with_healing": sum(r.output_token_ids[0] in eos
                                              for r in runs["default"]),
            "immediate_eos_healing_any_tail": sum(r.output_token_ids[0] in eos
                                                  for r in runs["any_tail"])}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    res = {"model": Path(a.model).name, "k": a.k,
           "throughput": throughput(a.model, a.k, a.num_prompts, a.max_tokens),
           "healing": healing(a.model, a.k, 40)}
    tp, h = res["throughput"], res["healing"]
    print(f"k={a.k}, {a.num_prompts} prompts batched, greedy, up to {a.max_tokens} tokens")
    print(f"{'':16}{'tokens':>8}{'tok/s':>9}{'accept':>8}{'tok/round':>10}")
    for name in ("unconstrained", "json_schema"):
        r = tp[name]
        print(f"{name:16}{r['tokens']:>8}{r['tokens_per_s']:>9}{r['acceptance_rate']!s:>8}"
              f"{r['mean_accepted_length']!s:>10}")
    print(f"constrained / unconstrained tokens/s: {tp['ratio_tokens_per_s']}; valid JSON: "
          f"{tp['json_schema']['valid_json']}")
    print(f"token healing, {h['num_prompts']} held-out prompts ({h['ending_in_newline']} end in "
          f"a newline, {h['healed']} healed): immediate EOS {h['immediate_eos_without_healing']}"
          f" without, {h['immediate_eos_with_healing']} with the default, "
          f"{h['immediate_eos_healing_any_tail']} healing any tail")
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")
    return res


if __name__ == "__main__":
    main()
