"""The default model's card (README.md), written from the `train_result.json` of each stage,
the `eval-mtp` JSONs and the pilots' JSON, so every number in it comes from a command.

    python -m mtpserve.workers.training.model_card --model models/tiny-code-mtp \\
        --stage "<stage-1 command>" models/tiny-code-mtp/train_result_stage1.json \\
        --stage "<stage-2 command>" models/tiny-code-mtp/train_result_stage2.json \\
        --eval-command "<eval-mtp command>" --eval-json models/tiny-code-mtp/eval_mtp.json \\
        [--pip-eval-command "<eval-mtp --data .../pip command>" --pip-eval-json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
from pathlib import Path

from mtpserve.workers.paths import PACKAGE_ROOT
from mtpserve.workers.training.data import (
    EXCLUDED_DIRS,
    HELD_OUT_PERCENT,
    MAX_FILE_BYTES,
    MAX_SOURCE_BYTES,
    PIP_AND_VENDORED,
    corpus_files,
    corpus_sources,
    is_held_out,
    stdlib_root,
)

PILOTS_JSON = PACKAGE_ROOT / "benchmarks" / "results" / "model_pilots.json"
# The bars for the default model, checked on the pip evaluation.
TARGETS = [
    # (what, key, bar, higher is better, as a percentage)
    ("main top-1", "top1", 0.40, True, False),
    ("repeated lines (greedy continuations)", "repeated", 0.20, False, True),
    ("acceptance at position 1", "acc1", 0.8, True, False),
    ("E[tokens/round] at k=2", "etr2", 2.4, True, False),
]
VENDOR_DIRS = sorted(EXCLUDED_DIRS - {"test", "tests", "idle_test", "site-packages",
                                      "__pycache__", "testing"})


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


def _corpus(tc: dict) -> str:
    return tc.get("corpus") or "stdlib"  # results written before corpora existed: stdlib


def _stage(title: str, command: str, tr: dict) -> list[str]:
    tc = tr["config"]
    what = ("MTP self-distillation: base frozen (bit-identical), the MTP module learns the "
            "base model's own argmax for token t+2 (what greedy acceptance measures)."
            if tc["freeze_base"] else
            f"Joint training, loss = L_main + {tc['mtp_weight']} x L_MTP (DeepSeek-V3 lambda), "
            "MTP target = the true token t+2.")
    init = f" Initialised from `{tc['init_from']}`." if tc.get("init_from") else ""
    return [
        f"### {title}", "```", command, "```", f"- {what}{init}",
        f"- Data: the training split of the `{_corpus(tc)}` corpus.",
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
            lic = src.licence if len(src.licence) <= 60 else src.licence[:57] + "..."
            rows.append(f"| `{src.label}` | {lic} | {len(mine)} | {mb:.1f} |")
    return rows


def pilots_table(pilots_json: Path) -> list[str]:
    rows = ["| candidate | params | steps | tokens | minutes | held-out bits/byte |",
            "|---|---|---|---|---|---|"]
    for name, r in json.loads(pilots_json.read_text()).items():
        rows.append(f"| {name} | {r['params'] / 1e6:.1f}M | {r['steps']} | {r['tokens']:,} | "
                    f"{r['minutes']:.1f} | {r['heldout_bits_per_byte']:.3f} |")
    return rows


def _shape(cfg: dict) -> list[int]:
    """config.json in the pilots' shape order: layers, hidden, heads, KV heads, head dim,
    FFN, vocab."""
    return [cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"],
            cfg["vocab_size"]]


def pilots_section(cfg: dict, pilots_json: Path, note: str | None = None) -> list[str]:
    pilots = json.loads(pilots_json.read_text())
    shape = _shape(cfg)
    chosen = [name for name, r in pilots.items() if list(r["shape"]) == shape]
    best = min(pilots, key=lambda n: pilots[n]["heldout_bits_per_byte"])
    desc = (f"{cfg['num_hidden_layers']} layers x {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} query / {cfg['num_key_value_heads']} KV heads x "
            f"{cfg['head_dim']}, SwiGLU {cfg['intermediate_size']}, vocab {cfg['vocab_size']}")
    which = (f"pilot `{chosen[0]}`" if chosen else "not one of the pilots")
    lines = [
        "## Choosing the size",
        "Pilot runs (`python -m mtpserve.benchmarks.model_pilots`, results in "
        "`benchmarks/results/model_pilots.json`): each candidate (layers x hidden, vocab) "
        "trains for the same wall-clock budget, then its held-out main loss is "
        "measured in bits per byte (comparable across vocabularies).",
        "",
        *pilots_table(pilots_json),
        "",
        f"The chosen configuration is the one in `config.json`: {desc} ({which}).",
    ]
    if chosen and best != chosen[0]:
        lines.append(f"The lowest held-out bits/byte in these pilots is `{best}`'s "
                     f"({pilots[best]['heldout_bits_per_byte']:.3f}).")
    if note:
        lines.append(note)
    return [*lines, ""]


def data_section(corpus: str, vocab_size: int) -> tuple[list[str], list[str]]:
    """(the card's Data section, the standard-library held-out files)."""
    root = stdlib_root()
    files = corpus_files(corpus)
    held = [(rel, p) for rel, p in files if is_held_out(rel)]
    held_std = sorted(rel for rel, p in held if p.is_relative_to(root))
    n_train = len(files) - len(held)
    tokenizer = (f"- Tokenizer: byte-level BPE (`tokenizers`), vocab {vocab_size}, trained on "
                 "the training split; `<|endoftext|>` separates files.")
    split = (f"- Split by file: md5(relative path) % 100 < {HELD_OUT_PERCENT} is held out. "
             f"{n_train} training files, {len(held)} held-out files")
    if corpus == "stdlib":
        return [
            "## Data",
            f"- The CPython {platform.python_version()} standard library ({root}), `.py` "
            "files outside folders named `test`, `tests`, `testing`, `idle_test`, "
            f"`site-packages` and `__pycache__`; empty files and files over {MAX_FILE_BYTES:,} "
            "bytes dropped; deduplicated by content (SHA-1, the first copy kept); files and "
            "folders named like pip or a library it vendors skipped (such as "
            "`encodings/idna.py`), as for the `python` corpus.",
            split + " (listed below).",
            tokenizer,
            "",
        ], held_std
    names = ", ".join(f"`{n}`" for n in sorted(PIP_AND_VENDORED))
    dirs = ", ".join(f"`{d}`" for d in VENDOR_DIRS)
    lines = [
        "## Data",
        f"- Corpus `{corpus}`: the CPython {platform.python_version()} standard library "
        f"({root}) and the installed sources of permissively licensed packages (each "
        "distribution's declared licence, read from its metadata):",
        "",
        *corpus_table(corpus),
        "",
        "- `.py` files outside folders named `test`, `tests`, `testing`, `idle_test`, "
        f"`site-packages` and `__pycache__`; empty files and files over {MAX_FILE_BYTES:,} "
        f"bytes dropped; at most {MAX_SOURCE_BYTES / 1e6:g} MB per package (files past the "
        "cap dropped in md5 order). Files and MB above are after these rules and dedup.",
        "- Deduplicated by content (SHA-1 of the file; the first copy is kept, the standard "
        "library first).",
        split + f", {len(held_std)} of them from the standard library (listed below). "
        "Standard-library files keep their plain relative paths, so one is held out exactly "
        "when it was for the first default model; package files are split by "
        "`<package>/<relative path>`.",
        "- `pip` and every library it vendors are excluded entirely, because pip is the "
        "held-out evaluation set (below): no package named like them is a source, and in "
        "every source (the standard library included) no file is read from a folder named "
        f"{dirs} (where other packages keep vendored copies), nor from a folder named like "
        "pip or one of its vendored libraries, nor a file named like one (such as `six.py`). "
        f"The names: {names}.",
    ]
    tomllib = "tomllib/_parser.py"
    if (root / tomllib).is_file() and any(rel == tomllib and not is_held_out(rel)
                                          for rel, _ in files):
        lines.append("- The exclusion goes by name, so code copied under another name is "
                     "not caught: the standard library's `tomllib` (in the training split) "
                     "is a copy of `tomli`, which pip vendors.")
    return [*lines, tokenizer, ""], held_std


def _acceptance_table(ev: dict) -> list[str]:
    acc = ev["acceptance_per_position"]
    etr = ev["expected_tokens_per_round"]
    return [
        "| draft 1 | draft 2 | draft 3 | E[tokens/round] k=1 | k=2 | k=3 |",
        "|---|---|---|---|---|---|",
        f"| {acc[0]:.3f} (+-{ev['acceptance_1_stderr']:.3f}) | {acc[1]:.3f} | {acc[2]:.3f} | "
        f"{etr['1']:.3f} | {etr['2']:.3f} | {etr['3']:.3f} |",
    ]


def _top1(ev: dict) -> str:
    if ev.get("heldout_main_top1") is None:
        return ""
    mtp = (f", MTP {ev['heldout_mtp_top1']:.3f} (the token after next)"
           if ev.get("heldout_mtp_top1") is not None else "")
    return f" Top-1 accuracy: main {ev['heldout_main_top1']:.3f}{mtp}."


def _repetition(rep: dict) -> str:
    return (f"the first {rep['num_lines']} lines of {rep['num_files']} held-out files "
            f"continued greedily for {rep['max_tokens']} tokens: "
            f"{rep['repeated_line_share']:.1%} of non-empty lines repeated (a line counts when "
            "it equals an earlier non-empty line of the same continuation)")


def targets_table(ev: dict) -> list[str]:
    measured = {"top1": ev.get("heldout_main_top1"),
                "repeated": (ev.get("repetition") or {}).get("repeated_line_share"),
                "acc1": ev["acceptance_per_position"][0],
                "etr2": ev["expected_tokens_per_round"]["2"]}
    rows = ["| target | bar | measured | |", "|---|---|---|---|"]
    for what, key, bar, higher, pct in TARGETS:
        v = measured[key]
        fmt = (lambda x: f"{x:.1%}") if pct else (lambda x: f"{x:.3f}")
        bar_s = f"{'>=' if higher else '<='} {f'{bar:.0%}' if pct else f'{bar:g}'}"
        if v is None:
            rows.append(f"| {what} | {bar_s} | not measured | |")
            continue
        met = v >= bar if higher else v <= bar
        rows.append(f"| {what} | {bar_s} | {fmt(v)} | {'met' if met else 'not met'} |")
    return rows


def _pip_version(data: str) -> str | None:
    init = Path(data) / "__init__.py"
    if not init.is_file():
        return None
    m = re.search(r'__version__\s*=\s*"([^"]+)"', init.read_text())
    return m.group(1) if m else None


def _stream_files(model: Path, data: str, ends: list[int]) -> list[str | None]:
    """For each token count in `ends`: the file of `data` (relative path) that eval-mtp's
    token stream (sorted `.py` files, EOS after each) reaches at that count."""
    from mtpserve.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model))
    out: list[str | None] = [None] * len(ends)
    n = 0
    for f in sorted(Path(data).rglob("*.py")):
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # as read_texts does
        n += len(tok.encode(text)) + 1
        for i, end in enumerate(ends):
            if out[i] is None and end <= n:
                out[i] = f.relative_to(data).as_posix()
        if all(out):
            break
    return out


def _coverage(model: Path, ev: dict) -> str:
    """Which files of the pip stream the losses and the acceptance prefixes reach."""
    from mtpserve.workers.training.evaluate import prefixes

    if not Path(ev["data"]).is_dir():
        return ""
    n_tokens = ev["heldout_tokens"] + 2  # losses() reads seq_len + 2 tokens per window
    stream = list(range(ev["seq_len"] * (ev["num_positions"] + 2)))  # token indices
    last = prefixes(stream, ev["seq_len"], ev["num_positions"])
    acc_end = last[-1][-1] + 1 if last else 0
    loss_file, acc_file = _stream_files(model, ev["data"], [n_tokens, acc_end])
    if loss_file is None or acc_file is None:
        return ""
    return (f" In that order the losses end in `{loss_file}` and the acceptance prefixes in "
            f"`{acc_file}`, so the vendored libraries (`_vendor/`, sorted after "
            "`_internal/`) are in neither." if "_vendor/" not in loss_file + acc_file
            else f" In that order the losses end in `{loss_file}` and the acceptance "
            f"prefixes in `{acc_file}`.")


def pip_section(command: str, ev: dict, json_name: str | None, model: Path) -> list[str]:
    version = _pip_version(ev["data"])
    what = f"pip {version}" if version else "pip"
    lines = [
        "## Held-out Python the model never saw (pip)",
        f"{what} and the libraries it vendors were excluded from training (see Data).",
        "```", command, "```",
        f"- Data: the `.py` files under `{ev['data']}` (its `_vendor` folder included), read "
        "in sorted path order into one token stream: the losses cover its first "
        f"{ev['heldout_tokens']:,} tokens, the acceptance {ev['num_positions']} prefixes "
        "from its start." + _coverage(model, ev),
        f"- Loss ({ev['heldout_tokens']:,} tokens, {ev['dtype']}): main "
        f"{ev['heldout_main_loss']:.3f}, MTP {ev['heldout_mtp_loss']:.3f} nats/token."
        + _top1(ev),
        f"- Greedy acceptance over {ev['num_positions']} prefixes (conditional on earlier "
        "drafts) and expected tokens per round:",
        "",
        *_acceptance_table(ev),
        "",
    ]
    if ev.get("repetition"):
        lines += [f"- Repetition check: {_repetition(ev['repetition'])}.", ""]
    lines += ["Targets:", "", *targets_table(ev), ""]
    if json_name:
        lines += [f"The raw results are in `{json_name}`.", ""]
    return lines


def draft_vocab_section(path: Path, command: str | None) -> list[str]:
    """`draft_vocab.json`'s source, and the share of the held-out standard-library tokens its
    top N covers."""
    from mtpserve.workers.spec_decode.draft_vocab import FILE_NAME
    from mtpserve.workers.training.evaluate import held_out_tokens

    f = path / FILE_NAME
    if not f.is_file():
        return []
    dv = json.loads(f.read_text())
    ranking = dv["token_ids"]
    ids = held_out_tokens(str(path), None)
    shares = []
    for n in (256, 512, 1024, 1536, 2048):
        if n < len(ranking):
            top = set(ranking[:n])
            shares.append(f"{n} {sum(t in top for t in ids) / len(ids):.1%}")
    return [
        "## Draft vocabulary",
        f"`{FILE_NAME}` ranks all {len(ranking)} token ids by frequency over the "
        f"{dv.get('source', 'unrecorded corpus')}, for `speculation.draft_vocab_size`"
        + (f"; built with `{command}`." if command else "."),
        "Share of the held-out standard-library tokens covered by the top N: "
        + ", ".join(shares) + ".",
        "",
    ]


def write_card(path: Path, stages: list[tuple[str, Path]], eval_command: str,
               eval_json: Path, pip_eval_command: str | None = None,
               pip_eval_json: Path | None = None,
               pilots_json: Path | None = PILOTS_JSON,
               draft_vocab_command: str | None = None, size_note: str | None = None) -> str:
    """`stages`: (exact command, its train_result.json) in order; the data section describes
    the first stage's corpus. The pip section is written when `pip_eval_json` is given, the
    size section when `pilots_json` exists."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    ev = json.loads(Path(eval_json).read_text())
    results = [json.loads(Path(res).read_text()) for _, res in stages]
    counts = param_counts(path)
    data, held_std = data_section(_corpus(results[0]["config"]), cfg["vocab_size"])
    stdlib_eval = ev.get("data") == "CPython stdlib held-out split"
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
        *(pilots_section(cfg, Path(pilots_json), size_note)
          if pilots_json is not None and Path(pilots_json).is_file() else []),
        *data,
        "## Training",
        "",
        *[line for i, ((cmd, _), tr) in enumerate(zip(stages, results, strict=True))
          for line in _stage(f"Stage {i + 1}", cmd, tr)],
        "## Held-out evaluation" + (": standard library" if stdlib_eval else ""),
        "```",
        eval_command,
        "```",
        ("- Data: the standard-library files of the held-out split (listed at the end)."
         if stdlib_eval else f"- Data: `{ev['data']}`."),
        f"- Held-out loss ({ev['heldout_tokens']:,} tokens, {ev['dtype']}): main "
        f"{ev['heldout_main_loss']:.3f}, MTP {ev['heldout_mtp_loss']:.3f} nats/token."
        + _top1(ev),
        f"- Greedy acceptance over {ev['num_positions']} held-out prefixes, measured with the "
        "engine (prefill drafts, one speculative round), conditional on earlier drafts:",
        "",
        *_acceptance_table(ev),
        "",
        *([f"- Repetition check: {_repetition(ev['repetition'])}.", ""]
          if ev.get("repetition") else []),
        f"The raw per-prefix results are in `{Path(eval_json).name}` (tests re-run a slice of "
        "them).",
        "",
        *(pip_section(pip_eval_command or "", json.loads(Path(pip_eval_json).read_text()),
                      Path(pip_eval_json).name
                      if Path(pip_eval_json).resolve().parent == path.resolve() else None,
                      path)
          if pip_eval_json is not None else []),
        *draft_vocab_section(path, draft_vocab_command),
        "## Held-out files" + (" (standard library)" if len(held_std) else ""),
        "",
        *[f"- `{r}`" for r in held_std],
        "",
    ]
    text = "\n".join(lines)
    (path / "README.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m mtpserve.workers.training.model_card",
        description="Write <model>/README.md from the training results and eval-mtp JSONs.")
    ap.add_argument("--model", type=Path, required=True, help="the model folder")
    ap.add_argument("--stage", nargs=2, action="append", required=True,
                    metavar=("COMMAND", "RESULT_JSON"),
                    help="a training stage's exact command and its train_result.json, in "
                         "order (repeat per stage; the first stage's corpus is the Data)")
    ap.add_argument("--eval-command", required=True,
                    help="the exact eval-mtp command of the standard-library evaluation")
    ap.add_argument("--eval-json", type=Path, required=True, help="its --json output")
    ap.add_argument("--pip-eval-command", help="the exact eval-mtp --data <pip> command")
    ap.add_argument("--pip-eval-json", type=Path,
                    help="its --json output (the pip section is omitted without it)")
    ap.add_argument("--draft-vocab-command",
                    help="the exact `mtpserve draft-vocab` command that wrote draft_vocab.json")
    ap.add_argument("--pilots-json", type=Path, default=PILOTS_JSON,
                    help="the size pilots (benchmarks/results/model_pilots.json)")
    ap.add_argument("--size-note", help="why this size was chosen, after the pilots table")
    args = ap.parse_args(argv)
    if (args.pip_eval_command is None) != (args.pip_eval_json is None):
        ap.error("--pip-eval-command and --pip-eval-json go together")
    if not args.pilots_json.is_file():
        print(f"warning: no {args.pilots_json}: the card has no 'Choosing the size' section",
              file=sys.stderr)
    write_card(args.model, [(cmd, Path(res)) for cmd, res in args.stage], args.eval_command,
               args.eval_json, args.pip_eval_command, args.pip_eval_json, args.pilots_json,
               args.draft_vocab_command, args.size_note)
    print(f"wrote {args.model / 'README.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
