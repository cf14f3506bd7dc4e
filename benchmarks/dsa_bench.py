"""DeepSeek Sparse Attention on a small random DeepSeek-V3.2 checkpoint (transformers' own class):

1. `LLM.generate` at k = 0 and k = 3 vs `transformers.generate`, batch 1 and 8, greedy, on
   prompts longer than the indexer's top-k (acceptance per MTP module printed; the MTP layer is
   random, so k = 3 measures the cost of speculation here, not its gain);
2. one decode step (batch 1 and 8) against context length: DSA (each query attends to its
   top-k, read from the pages) vs the same weights attending to every token (dense MLA, the
   indexer off), side by side in one run.

    python -m mtpserve.benchmarks.dsa_bench [--tokens 32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

SIZES = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128,
             kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
             intermediate_size=512, moe_intermediate_size=64, index_n_heads=8,
             index_head_dim=64, index_topk=64)
CONTEXTS = (128, 512, 2048, 8192)
BLOCK = 16


def _checkpoints(root: Path) -> tuple[Path, Path]:
    """The DSA checkpoint and a copy of it whose top-k covers every position (dense MLA)."""
    from tiny_models import make_hf_checkpoint
    from tiny_tokenizer import VOCAB_SIZE, make_tokenizer

    dsa = make_hf_checkpoint(root / "dsa", "deepseek_v32", num_mtp=1, vocab_size=VOCAB_SIZE,
                             max_positions=max(CONTEXTS) + 64, **SIZES)
    make_tokenizer(dsa)
    dense = root / "dense"
    shutil.copytree(dsa, dense)
    cfg = json.loads((dense / "config.json").read_text())
    cfg["index_topk"] = 1 << 30
    (dense / "config.json").write_text(json.dumps(cfg))
    return dsa, dense


def generate_rates(path: Path, tokens: int) -> list[dict]:
    import transformers

    from mtpserve.workers import LLM, SamplingParams

    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 200, (96,), generator=g).tolist() for _ in range(8)]
    ref = transformers.DeepseekV32ForCausalLM.from_pretrained(path).eval()
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    rows = []
    for batch in (1, 8):
        ids = torch.tensor(prompts[:batch])
        with torch.no_grad():
            ref.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            ref.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
            row = {"batch": batch, "transformers": batch * tokens / (time.perf_counter() - t0)}
        for k in (0, 3):
            llm = LLM(str(path), num_speculative_tokens=k, num_kv_blocks=256, block_size=BLOCK)
            llm.generate(prompts[:batch], SamplingParams(max_tokens=2, temperature=0))
            t0 = time.perf_counter()
            llm.generate(prompts[:batch], params)
            row[f"k{k}"] = batch * tokens / (time.perf_counter() - t0)
            if k:
                row["acceptance_per_module"] = llm.engine.stats()["acceptance_per_position"]
        rows.append(row)
    return rows


def step_times(path: Path, batch: int, reps: int = 20) -> dict[int, float]:
    """Milliseconds per one-token decode step at each context length (the cache filled with
    random values: a step's cost does not depend on them)."""
    from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

    per = -(-(max(CONTEXTS) + 1) // BLOCK)
    runner = ModelRunner(path, num_blocks=batch * per + 1, block_size=BLOCK,
                         decode_graphs=False)
    g = torch.Generator().manual_seed(1)
    for layer in runner.kv_cache.layers:
        layer.copy_(torch.randn(layer.shape, generator=g, dtype=layer.dtype))
    out = {}
    for ctx in CONTEXTS:
        n = -(-(ctx + 1) // BLOCK)
        tables = [list(range(b * per, b * per + n)) for b in range(batch)]
        batch_ = ForwardBatch("main", [[5]] * batch, [ctx] * batch, tables,
                              list(range(batch)))
        for _ in range(3):
            runner.execute(batch_)
        t0 = time.perf_counter()
        for _ in range(reps):
            runner.execute(batch_)
        out[ctx] = (time.perf_counter() - t0) / reps * 1e3
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        dsa, dense = _checkpoints(Path(tmp))
        gen = generate_rates(dsa, args.tokens)
        print(f"generate, {args.tokens} greedy tokens after 96-token prompts "
              f"(top-{SIZES['index_topk']}), tok/s:")
        print("| batch | transformers.generate | mtpserve k=0 | mtpserve k=3 | "
              "acceptance per module (k=3) |\n|---|---|---|---|---|")
        for r in gen:
            acc = ", ".join("-" if a is None else f"{a:.2f}" for a in r["acceptance_per_module"])
            print(f"| {r['batch']} | {r['transformers']:.0f} | {r['k0']:.0f} | {r['k3']:.0f} "
                  f"| {acc} |")
        steps = {}
        for batch in (1, 8):
            steps[batch] = {"dsa": step_times(dsa, batch), "dense": step_times(dense, batch)}
        print("\ndecode step, ms (one token per row):")
        print("| batch | context | DSA (top-k) | dense MLA | dense / DSA |\n|---|---|---|---|---|")
        for batch, s in steps.items():
            for ctx in CONTEXTS:
                a, b = s["dsa"][ctx], s["dense"][ctx]
                print(f"| {batch} | {ctx} | {a:.2f} | {b:.2f} | {b / a:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"sizes": SIZES, "tokens": args.tokens,
                                               "generate": gen, "steps": steps}, indent=2))


if __name__ == "__main__":
    main()
