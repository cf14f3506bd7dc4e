"""Pilot runs that choose the default model's shape: each candidate (depth, width, vocab) trains
for the same wall-clock budget on the same corpus, then its held-out loss is measured in bits
per byte (comparable across vocabularies). Prints a table and writes JSON.

    python -m mtpserve.benchmarks.model_pilots --out runs/pilots --minutes 6 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

CANDIDATES = {
    # name: (layers, hidden, heads, kv heads, head dim, ffn, vocab)
    "12x256-v4k": (12, 256, 4, 2, 64, 768, 4096),
    "16x192-v4k": (16, 192, 4, 2, 48, 512, 4096),
    "12x384-v4k": (12, 384, 6, 2, 64, 1024, 4096),
    "12x256-v8k": (12, 256, 4, 2, 64, 768, 8192),
}


def _config(out: Path, shape: tuple, steps: int, threads: int, corpus: str):
    from mtpserve.workers.training.trainer import TrainConfig

    L, d, h, kv, hd, ffn, vocab = shape
    return TrainConfig(out=str(out), steps=steps, num_layers=L, hidden_size=d, num_heads=h,
                       num_kv_heads=kv, head_dim=hd, intermediate_size=ffn, vocab_size=vocab,
                       corpus=corpus, threads=threads, save_every=10_000, warmup=20)


def _prepare(root: Path, vocab: int, threads: int, corpus: str) -> Path:
    """Tokenizer + tokenized training split for one vocabulary, shared by its pilots."""
    from mtpserve.workers.training.trainer import prepare_data

    d = root / f"data-v{vocab}"
    d.mkdir(parents=True, exist_ok=True)
    tc = _config(d, (1, 64, 1, 1, 64, 64, vocab), 1, threads, corpus)
    prepare_data(tc, d)
    return d


def _seconds_per_step(tc) -> float:
    """Wall time of one optimizer step (eager), from 3 timed steps after 2 warm-up steps."""
    from mtpserve.workers.training.trainer import train

    probe = replace(tc, out=tc.out + "-probe", steps=1000, stop_after=5)
    Path(probe.out).mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json", "train_tokens.pt"):
        shutil.copy(Path(tc.out) / f, Path(probe.out) / f)
    t0 = time.perf_counter()
    train(replace(probe, stop_after=2))
    t1 = time.perf_counter()
    train(probe)
    t2 = time.perf_counter()
    shutil.rmtree(probe.out)
    return (t2 - t1) / 3 if t1 > t0 else t2 - t0


def heldout_bits_per_byte(model: Path, corpus: str, max_tokens: int) -> dict:
    from mtpserve.workers.tokenizer import load_tokenizer
    from mtpserve.workers.training.data import read_texts, split_files
    from mtpserve.workers.training.evaluate import losses

    tok = load_tokenizer(str(model))
    ids: list[int] = []
    nbytes = 0
    for text in read_texts(split_files(corpus=corpus)[1]):
        enc = tok.encode(text) + [tok.eos_token_id]
        if len(ids) + len(enc) > max_tokens:
            enc = enc[: max_tokens - len(ids)]
            text = tok.decode(enc)
        ids += enc
        nbytes += len(text.encode())
        if len(ids) >= max_tokens:
            break
    res = losses(str(model), ids, 512, max_tokens, "float32")
    nats = res["heldout_main_loss"] * res["heldout_tokens"]
    scale = len(ids) / res["heldout_tokens"]  # losses() skips the tail window
    return {"heldout_main_nats": res["heldout_main_loss"],
            "heldout_bits_per_byte": nats * scale / nbytes / math.log(2),
            "bytes_per_token": nbytes / len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="runs/pilots")
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--corpus", default="python")
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--json", default="benchmarks/results/model_pilots.json")
    args = ap.parse_args()
    from mtpserve.workers.training.trainer import train

    root = Path(args.out)
    torch.set_num_threads(args.threads)
    rows = json.loads(Path(args.json).read_text()) if Path(args.json).is_file() else {}
    for name, shape in CANDIDATES.items():
        if (args.only and name not in args.only) or name in rows:
            continue
        data = _prepare(root, shape[-1], args.threads, args.corpus)
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        for f in ("tokenizer.json", "tokenizer_config.json", "train_tokens.pt"):
            shutil.copy(data / f, out / f)
        tc = _config(out, shape, 1, args.threads, args.corpus)
        sps = _seconds_per_step(tc)
        steps = max(20, int(args.minutes * 60 / sps))
        t0 = time.perf_counter()
        res = train(replace(tc, steps=steps))
        wall = time.perf_counter() - t0
        ev = heldout_bits_per_byte(out, args.corpus, 60_000)
        params = sum(p.numel() for p in torch.load(out / "trainer_state.pt",
                                                   weights_only=False)["model"].values())
        rows[name] = {"shape": shape, "params": params, "steps": steps,
                      "tokens": steps * tc.batch_size * tc.seq_len, "minutes": wall / 60,
                      "train_main": res["final_train_main"], **ev}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
        (out / "trainer_state.pt").unlink()
        print(f"{name}: {rows[name]}", flush=True)
    print("| candidate | params | steps | tokens | minutes | held-out bits/byte | bytes/token |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['params'] / 1e6:.1f}M | {r['steps']} | {r['tokens']:,} | "
              f"{r['minutes']:.1f} | {r['heldout_bits_per_byte']:.3f} | "
              f"{r['bytes_per_token']:.2f} |")


if __name__ == "__main__":
    main()
