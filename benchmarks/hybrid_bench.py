"""Tiny hybrid (Qwen3-Next architecture) offline: tokens/s of `LLM.generate` at k = 0 and
k = 3 vs `transformers.generate` (batch 1 and 8, greedy), and the cost of a verify forward
over [last, d1..d3] (which keeps the recurrent state after every position) relative to a
one-token decode step, both through the state slots.

    python benchmarks/hybrid_bench.py [--tokens 32]

The tiny checkpoint's MTP layer is random, so its drafts are nearly always rejected: k = 3
here measures the cost of speculation on a hybrid, not its gain (acceptance is printed).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import transformers
    from test_qwen3_next import make_qwen3_next_checkpoint

    from mtpserve.workers import LLM, SamplingParams
    from mtpserve.workers.model_runner import ForwardBatch, ModelRunner

    path = make_qwen3_next_checkpoint(Path(tempfile.mkdtemp()) / "ckpt")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (32,), generator=g).tolist() for _ in range(8)]
    n = args.tokens
    ref = transformers.Qwen3NextForCausalLM.from_pretrained(path).eval()
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    for batch in (1, 8):
        ids = torch.tensor(prompts[:batch])
        with torch.no_grad():
            ref.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
            t0 = time.perf_counter()
            ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)
            hf = batch * n / (time.perf_counter() - t0)
        line = f"batch {batch}: transformers.generate {hf:.0f} tok/s"
        for k in (0, 3):
            llm = LLM(str(path), num_speculative_tokens=k, num_kv_blocks=256, block_size=16)
            llm.generate(prompts[:batch], SamplingParams(max_tokens=2, temperature=0))
            t0 = time.perf_counter()
            llm.generate(prompts[:batch], params)
            rate = batch * n / (time.perf_counter() - t0)
            acc = llm.engine.stats()["acceptance_rate"]
            line += f"; mtpserve k={k} {rate:.0f} tok/s" + (
                f" (acceptance {acc:.2f})" if k else "")
        print(line)
    runner = ModelRunner(path, num_blocks=256, block_size=16, num_state_slots=8)
    for batch in (1, 8):
        tables = [list(range(b * 8, b * 8 + 8)) for b in range(batch)]
        slots = list(range(batch))
        runner.execute(ForwardBatch("main", [prompts[b] for b in range(batch)], [0] * batch,
                                    tables, [0], state_slots=slots))
        _step_time(runner, batch, tables, 1, False, 3)
        plain = _step_time(runner, batch, tables, 1, False)
        verify = _step_time(runner, batch, tables, 4, True)
        print(f"batch {batch}: plain step {plain * 1e3:.2f} ms, verify k=3 (+ state rollback) "
              f"{verify * 1e3:.2f} ms = {verify / plain:.2f}x")


def _step_time(runner, batch: int, tables: list[list[int]], rows: int, keep: bool,
               reps: int = 30) -> float:
    """Seconds per main forward of `batch` rows of `rows` tokens at position 32 (+ keeping
    each row's state after its second token, as a verify round that accepted one draft)."""
    from mtpserve.workers.model_runner import ForwardBatch

    t0 = time.perf_counter()
    for _ in range(reps):
        runner.execute(ForwardBatch("main", [[5] * rows] * batch, [32] * batch, tables,
                                    list(range(batch * rows)), state_slots=list(range(batch))))
        if keep:
            runner.keep_states(list(range(batch)), [1] * batch)
    return (time.perf_counter() - t0) / reps

if __name__ == "__main__":
    main()
