"""The default model's card (README.md), written from `train_result.json` and the
`eval-mtp` JSON so every number in it comes from a command."""

from __future__ import annotations

import json
import platform
from pathlib import Path

from mtpserve.workers.training.data import (
    HELD_OUT_PERCENT,
    corpus_files,
    corpus_sources,
    python_files,
    split_files,
    stdlib_root,
)


def param_counts(path: Path) -> dict[str, int]:
    from safetensors import safe_open

    main = mtp = 0
    cfg = json.loads((path / "config.json").read_text())
    L = cfg["num_hidden_layers"]
    with safe_open(path / "model.safetensors", framework="pt") as f:
        for name in f.keys():
            n = f.get_slice(name).get_shape()
            count = 1
            for d in n:
                count *= d
            is_mtp = name.startswith("model.layers.") and int(name.split(".")[2]) >= L
            mtp += count if is_mtp else 0
            main += 0 if is_mtp else count
    return {"main": main, "mtp": mtp}


def _stage(title: str, command: str, tr: dict) -> list[str]:
    tc = tr["config"]
    what = ("MTP self-distillation: base frozen (bit-identical), the MTP module learns the "
            "base model's own argmax for token t+2 (what greedy acceptance measures)."
            if tc["freeze_base"] else
            f"Joint training, loss = L_main + {tc['mtp_weight']} x L_MTP (DeepSeek-V3 lambda), "
            "MTP target = the true token t+2.")
    return [
        f"### {title}", "```", command, "```", f"- {what}",
        f"- {tc['steps']} steps x {tc['batch_size']} x {tc['seq_len']} tokens, AdamW "
        f"(0.9/0.95, wd {tc['weight_decay']}), peak LR {tc['lr']}, {tc['warmup']} warm-up "
        f"steps, cosine to {tc['min_lr_ratio']:g}x, bf16 autocast, seed {tc['seed']}.",
        f"- Final training loss (mean of the last 20 steps): main "
        f"{tr['final_train_main']:.3f}, MTP {tr['final_train_mtp']:.3f} nats/token"
        + (" (MTP against the base's argmax)." if tc["freeze_base"] else "."),
        "",
    ]


def corpus_table(corpus: str) -> list[str]:
    """The model card's data table: each source's licence, files and bytes after dedup."""
    files = corpus_files(corpus)
    rows = ["| source | licence | files | MB |", "|---|---|---|---|"]
    for src in corpus_sources(corpus):
        mine = [p for rel, p in files
                if (src.label == "stdlib" and p.is_relative_to(src.root))
                or rel.startswith(src.label + "/")]
        if mine:
            mb = sum(p.stat().st_size for p in mine) / 1e6
            rows.append(f"| `{src.label}` | {src.licence[:60]} | {len(mine)} | {mb:.1f} |")
    return rows


def pilots_table(pilots_json: Path) -> list[str]:
    rows = ["| candidate | params | steps | tokens | minutes | held-out bits/byte |",
            "|---|---|---|---|---|---|"]
    for name, r in json.loads(pilots_json.read_text()).items():
        rows.append(f"| {name} | {r['params'] / 1e6:.1f}M | {r['steps']} | {r['tokens']:,} | "
                    f"{r['minutes']:.1f} | {r['heldout_bits_per_byte']:.3f} |")
    return rows


def write_card(path: Path, stages: list[tuple[str, Path]], eval_command: str,
               eval_json: Path) -> str:
    """`stages`: (exact command, its train_result.json) in order."""
    cfg = json.loads((path / "config.json").read_text())
    ev = json.loads(eval_json.read_text())
    counts = param_counts(path)
    train_files, held = split_files()
    root = stdlib_root()
    held_rel = sorted(r for r, p in python_files() if p in set(held))
    acc = ev["acceptance_per_position"]
    etr = ev["expected_tokens_per_round"]
    lines = [
        f"# {path.name}",
        "",
        "The embedded default model of mtpserve: a small Python code model (Qwen3 architecture)",
        "with one DeepSeek-V3-style MTP module, trained by `mtpserve train` on this machine's",
        "CPU. It exists so that everything runs on a laptop CPU with no download; its code is",
        "plausible-looking Python, not useful Python.",
        "",
        "## Architecture",
        f"- Qwen3: {cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, "
        f"{cfg['num_attention_heads']} query heads x {cfg['head_dim']}, "
        f"{cfg['num_key_value_heads']} KV heads, SwiGLU {cfg['intermediate_size']}, "
        f"RoPE theta {cfg['rope_theta']:g}, tied embeddings, vocab {cfg['vocab_size']}.",
        f"- MTP: `num_nextn_predict_layers: {cfg['num_nextn_predict_layers']}`, DeepSeek-V3 "
        f"naming (`model.layers.{cfg['num_hidden_layers']}.{{enorm,hnorm,eh_proj,"
        "shared_head.norm,...}`), sharing the embedding and LM head.",
        f"- Parameters: main {counts['main']:,}, MTP {counts['mtp']:,}; weights in "
        f"{cfg.get('torch_dtype', 'bfloat16')}.",
        "- `config.json` loads with `transformers.AutoModelForCausalLM` (main model; the MTP",
        "  tensors are reported as unused there) and with mtpserve's loader (main + MTP).",
        "",
        "## Data",
        f"- The CPython {platform.python_version()} standard library ({root}), `.py` files "
        "outside `test`, `tests`, `idle_test` and `site-packages`.",
        f"- Split by file: md5(relative path) % 100 < {HELD_OUT_PERCENT} is held out. "
        f"{len(train_files)} training files, {len(held)} held-out files (listed below).",
        f"- Tokenizer: byte-level BPE (`tokenizers`), vocab {cfg['vocab_size']}, trained on the "
        "training split; `<|endoftext|>` separates files.",
        "",
        "## Training",
        "",
        *[line for i, (cmd, res) in enumerate(stages) for line in
          _stage(f"Stage {i + 1}", cmd, json.loads(Path(res).read_text()))],
        "## Held-out evaluation",
        "```",
        eval_command,
        "```",
        f"- Held-out loss ({ev['heldout_tokens']:,} tokens, fp32): main "
        f"{ev['heldout_main_loss']:.3f}, MTP {ev['heldout_mtp_loss']:.3f} nats/token.",
        f"- Greedy acceptance over {ev['num_positions']} held-out prefixes, measured with the "
        "engine (prefill drafts, one speculative round), conditional on earlier drafts:",
        "",
        "| draft 1 | draft 2 | draft 3 | E[tokens/round] k=1 | k=2 | k=3 |",
        "|---|---|---|---|---|---|",
        f"| {acc[0]:.3f} (+-{ev['acceptance_1_stderr']:.3f}) | {acc[1]:.3f} | {acc[2]:.3f} | "
        f"{etr['1']:.3f} | {etr['2']:.3f} | {etr['3']:.3f} |",
        "",
        "The raw per-prefix results are in `eval_mtp.json` (tests re-run a slice of them).",
        "",
        "## Held-out files",
        "",
        *[f"- `{r}`" for r in held_rel],
        "",
    ]
    text = "\n".join(lines)
    (path / "README.md").write_text(text)
    return text
