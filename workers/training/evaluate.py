"""`mtpserve eval-mtp`: held-out MTP quality, measured the way decoding uses it.

Acceptance is measured with the engine itself: each held-out prefix is prefilled (first token
g1 and drafts d1..d3 from the MTP KV cache) and one greedy speculative round verifies the
drafts against the main model's own continuation g2..g4. Per-position acceptance is
conditional on the earlier drafts being accepted; E[tokens/round](k) = 1 + sum_j prod_{i<=j}
alpha_i. Losses are cross-entropies (nats/token) on the true next token (main) and on the
token after it (MTP module 0) over the held-out tokens.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.tokenizer import load_tokenizer
from mtpserve.workers.training.data import read_texts, split_files

K_EVAL = 3
PREFIX_STRIDE = 64
FIRST_PREFIX = 32


def held_out_tokens(model: str, data: str | None) -> list[int]:
    tok = load_tokenizer(model)
    files = sorted(Path(data).rglob("*.py")) if data else split_files()[1]
    ids: list[int] = []
    for text in read_texts(files):
        ids += tok.encode(text) + [tok.eos_token_id]
    return ids


def prefixes(ids: list[int], seq_len: int, max_positions: int) -> list[list[int]]:
    """Deterministic prefixes: each seq_len window, cut at 32, 96, 160, ... tokens."""
    out = []
    for s in range(0, len(ids) - seq_len, seq_len):
        window = ids[s : s + seq_len]
        for cut in range(FIRST_PREFIX, seq_len - K_EVAL - 2, PREFIX_STRIDE):
            out.append(window[:cut])
            if len(out) == max_positions:
                return out
    return out


@torch.inference_mode()
def acceptance(model: str, prompts: list[list[int]], dtype: str) -> dict:
    eng = Engine(EngineConfig(model=model, dtype=dtype, num_speculative_tokens=K_EVAL,
                              num_kv_blocks=4096, max_num_seqs=32))
    params = SamplingParams(max_tokens=K_EVAL + 2, temperature=0, ignore_eos=True)
    accepted: list[int] = []  # drafts accepted in the first round of each prefix
    for i in range(0, len(prompts), 32):
        reqs = [eng.add_request(f"e{i + j}", p, params) for j, p in enumerate(prompts[i:i + 32])]
        first: dict[str, int] = {}
        while len(first) < len(reqs):
            eng.step()
            # A step runs at most one round per request: read each request right after its
            # first round and stop it, so later rounds (which see the model's own loops) never
            # count.
            for r in reqs:
                if r.request_id not in first and (r.num_rounds == 1 or r.finished):
                    first[r.request_id] = sum(r.accepted_per_position)
                    eng.abort(r.request_id)
        accepted += [first[r.request_id] for r in reqs]
    res = summarise_acceptance(accepted)
    res["accepted_per_prefix"] = accepted
    return res


def summarise_acceptance(accepted: list[int]) -> dict:
    """Conditional per-position acceptance and E[tokens/round] from accepted counts."""
    reached = [0] * (K_EVAL + 1)  # reached[j]: rounds where draft j+1 was tested
    for n_acc in accepted:
        for j in range(min(n_acc + 1, K_EVAL)):
            reached[j] += 1
        reached[K_EVAL] += n_acc == K_EVAL
    alphas = []
    for j in range(K_EVAL):
        tested, passed = reached[j], reached[j + 1]
        alphas.append(passed / tested if tested else 0.0)
    expected, chain, per_k = 1.0, 1.0, {}
    for j, a in enumerate(alphas, start=1):
        chain *= a
        expected += chain
        per_k[str(j)] = expected
    n = len(accepted)
    return {"num_positions": n, "acceptance_per_position": alphas,
            "acceptance_1_stderr": math.sqrt(alphas[0] * (1 - alphas[0]) / n) if n else None,
            "expected_tokens_per_round": per_k}


@torch.inference_mode()
def losses(model: str, ids: list[int], seq_len: int, max_tokens: int, dtype: str) -> dict:
    from mtpserve.workers.engine import DTYPES
    from mtpserve.workers.model.loader import load_model

    m = load_model(model, dtype=DTYPES[dtype])
    tot_main = tot_mtp = 0.0
    count = correct = correct_mtp = 0
    per_window = []
    for s in range(0, min(len(ids), max_tokens) - seq_len - 2, seq_len):
        w = torch.tensor([ids[s : s + seq_len + 2]])
        x = w[:, :seq_len]
        pos = torch.arange(seq_len).unsqueeze(0)
        h = m(x, pos)
        logits = m.compute_logits(h)[0]
        main = F.cross_entropy(logits, w[0, 1 : seq_len + 1]).item()
        correct += int((logits.argmax(-1) == w[0, 1 : seq_len + 1]).sum())
        mtp = None
        if m.mtp:
            hm = m.forward_mtp(0, w[:, 1 : seq_len + 1], h, pos)
            mtp_logits = m.compute_mtp_logits(0, hm)[0]
            mtp = F.cross_entropy(mtp_logits, w[0, 2 : seq_len + 2]).item()
            correct_mtp += int((mtp_logits.argmax(-1) == w[0, 2 : seq_len + 2]).sum())
            tot_mtp += mtp * seq_len
        tot_main += main * seq_len
        per_window.append([main, mtp])
        count += seq_len
    return {"heldout_tokens": count, "heldout_main_loss": tot_main / count,
            "heldout_mtp_loss": tot_mtp / count if m.mtp else None,
            # Top-1: the main model's argmax is the true next token (MTP: the one after it).
            "heldout_main_top1": correct / count,
            "heldout_mtp_top1": correct_mtp / count if m.mtp else None,
            "loss_per_window": per_window}


def evaluate(model: str, data: str | None, max_positions: int, seq_len: int = 512,
             dtype: str = "float32", max_loss_tokens: int = 200_000) -> dict:
    ids = held_out_tokens(model, data)
    res = {"model": model, "data": data or "CPython stdlib held-out split", "dtype": dtype,
           "seq_len": seq_len}
    res.update(losses(model, ids, seq_len, max_loss_tokens, dtype))
    res.update(acceptance(model, prefixes(ids, seq_len, max_positions), dtype))
    return res


def repetition_check(model: str, files: list[Path], num_lines: int = 12,
                     max_tokens: int = 96, dtype: str = "float32") -> dict:
    """The model card's demo check: the first `num_lines` lines of each file, continued
    greedily for `max_tokens` tokens; the share of the continuation's non-empty lines that
    repeat an earlier non-empty line of the continuation (a looping model scores high)."""
    from mtpserve.workers.llm import LLM

    llm = LLM(model, dtype=dtype, num_speculative_tokens=0)
    samples, repeated, total = [], 0, 0
    texts = read_texts(files)
    prompts = ["".join(t.splitlines(keepends=True)[:num_lines]) for t in texts]
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                ignore_eos=True))
    for f, prompt, out in zip(files, prompts, outs, strict=True):
        lines = [x.strip() for x in out.text.splitlines() if x.strip()]
        # The first line may finish the prompt's last line: count it like the rest.
        rep = sum(1 for i, x in enumerate(lines) if x in lines[:i])
        repeated += rep
        total += len(lines)
        samples.append({"file": f.name, "prompt": prompt, "continuation": out.text,
                        "lines": len(lines), "repeated": rep})
    return {"num_files": len(files), "num_lines": num_lines, "max_tokens": max_tokens,
            "repeated_line_share": repeated / total if total else 0.0, "samples": samples}


def format_report(res: dict) -> str:
    a = res["acceptance_per_position"]
    e = res["expected_tokens_per_round"]
    return "\n".join([
        f"held-out tokens: {res['heldout_tokens']}, positions: {res['num_positions']}",
        f"held-out loss (nats/token): main {res['heldout_main_loss']:.3f}, "
        f"mtp {res['heldout_mtp_loss']:.3f}; top-1: main {res['heldout_main_top1']:.3f}, "
        f"mtp {res['heldout_mtp_top1']:.3f}",
        "acceptance (greedy, conditional): " + ", ".join(
            f"draft {i + 1}: {x:.3f}" for i, x in enumerate(a))
        + f" (stderr of draft 1: {res['acceptance_1_stderr']:.3f})",
        "expected tokens per round: " + ", ".join(f"k={k}: {v:.3f}" for k, v in e.items()),
    ])
