"""The vLLM side of `peer_bench`, run by vLLM's own interpreter (it imports vLLM and the
standard library only, never mtpserve, whose environment has another torch build).

    VLLM_PYTHON benchmarks/peer_vllm.py --model DIR --prompts ids.json --batch-sizes 1 10 \
        --k 2 --max-tokens 128

Prints one JSON line: per batch size the best end-to-end tokens/s of `LLM.generate` over
`--reps` timed calls (after one untimed call that compiles and warms), and the mean tokens
per round when speculating (vLLM's own counters: 1 + accepted / drafts).
"""

from __future__ import annotations

import argparse
import json
import time


def _counter(metrics: list, name: str) -> float:
    return sum(getattr(m, "value", 0) or 0 for m in metrics if m.name == name)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--batch-sizes", type=int, nargs="+", required=True)
    ap.add_argument("--k", type=int, default=0, help="MTP draft tokens; 0: plain decoding")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = json.load(open(args.prompts))
    spec = {"method": "mtp", "num_speculative_tokens": args.k} if args.k else None
    llm = LLM(model=args.model, dtype=args.dtype, speculative_config=spec, seed=0,
              max_model_len=2048, max_num_seqs=max(args.batch_sizes),
              disable_log_stats=False)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for b in args.batch_sizes:
        batch = [TokensPrompt(prompt_token_ids=p) for p in (prompts * (b // len(prompts) + 1))[:b]]
        llm.generate(batch, params, use_tqdm=False)
        best = 0.0
        m0 = llm.get_metrics()
        for _ in range(args.reps):
            t = time.perf_counter()
            outs = llm.generate(batch, params, use_tqdm=False)
            dt = time.perf_counter() - t
            best = max(best, sum(len(o.outputs[0].token_ids) for o in outs) / dt)
        m1 = llm.get_metrics()
        drafts = (_counter(m1, "vllm:spec_decode_num_drafts")
                  - _counter(m0, "vllm:spec_decode_num_drafts"))
        accepted = (_counter(m1, "vllm:spec_decode_num_accepted_tokens")
                    - _counter(m0, "vllm:spec_decode_num_accepted_tokens"))
        rows.append({"batch_size": b, "tokens_per_s": best,
                     "tokens_per_round": 1 + accepted / drafts if drafts else 1.0,
                     "first_ids": outs[0].outputs[0].token_ids[:32]})
    print("PEER_RESULT " + json.dumps(rows), flush=True)


if __name__ == "__main__":
    main()
