"""`mtpserve train`: joint main + MTP training (L = L_main + lambda * sum_k L_MTP_k), or adding
an MTP module to a checkpoint that has none (`--init-from --freeze-base`, self-distillation on
the base model's own argmax).

Deterministic: batch i is drawn from a generator seeded with (seed, i), so a resumed run sees
the same batches as an uninterrupted one. State is saved every `save_every` steps.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.model.transformer import CausalLM
from mtpserve.workers.training.data import read_texts, split_files
from mtpserve.workers.training.export import save_hf
from mtpserve.workers.training.tokenizer import EOS_TOKEN, save_tokenizer, train_tokenizer

IGNORE = -100


@dataclass
class TrainConfig:
    out: str
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 2e-3
    warmup: int = 40
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    mtp_weight: float = 0.3
    seed: int = 0
    vocab_size: int = 4096
    num_layers: int = 6
    hidden_size: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 768
    num_mtp: int = 1
    init_from: str | None = None
    freeze_base: bool = False
    compile: bool = False
    bf16: bool = True
    save_every: int = 100
    stop_after: int | None = None  # stop (resumably) after this step; for tests and pauses
    data_root: str | None = None
    corpus: str = "stdlib"  # stdlib | python (see workers/training/data.py)
    save_dtype: str = "bfloat16"
    threads: int | None = None


def qwen3_config(tc: TrainConfig, eos_id: int) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": tc.vocab_size, "hidden_size": tc.hidden_size,
        "intermediate_size": tc.intermediate_size, "num_hidden_layers": tc.num_layers,
        "num_attention_heads": tc.num_heads, "num_key_value_heads": tc.num_kv_heads,
        "head_dim": tc.head_dim, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": True, "attention_bias": False,
        "hidden_act": "silu", "bos_token_id": eos_id, "eos_token_id": eos_id,
        "num_nextn_predict_layers": tc.num_mtp, "use_cache": True,
        # Our BPE merges runs of newlines/spaces, so a prompt ending in one leaves the model a
        # token boundary it never saw in training: heal it by default (issue 32).
        "mtpserve": {"token_healing": True},
    }


def _init_weights(model: CausalLM) -> None:
    for name, p in model.named_parameters():
        if p.dim() == 1:
            torch.nn.init.ones_(p) if name.endswith("weight") else torch.nn.init.zeros_(p)
        else:
            torch.nn.init.normal_(p, std=0.02)


def lr_at(step: int, tc: TrainConfig) -> float:
    if step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup)
    return tc.lr * (tc.min_lr_ratio + (1 - tc.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def prepare_data(tc: TrainConfig, out: Path):
    """Tokenizer (trained once, or the base model's) and the tokenized train split."""
    from tokenizers import Tokenizer

    cache = out / "train_tokens.pt"
    root = Path(tc.data_root) if tc.data_root else None
    train_files, _ = split_files(root, tc.corpus)
    if tc.init_from:
        tok = Tokenizer.from_file(str(Path(tc.init_from) / "tokenizer.json"))
    elif (out / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        tok = train_tokenizer(read_texts(train_files), tc.vocab_size)
        save_tokenizer(tok, out)
    if cache.is_file():
        return tok, torch.load(cache)
    eos = tok.token_to_id(EOS_TOKEN)
    ids: list[int] = []
    for enc in tok.encode_batch(read_texts(train_files)):
        ids.extend(enc.ids)
        ids.append(eos)
    data = torch.tensor(ids, dtype=torch.int32)
    torch.save(data, cache)
    return tok, data


def batch_at(data: torch.Tensor, step: int, tc: TrainConfig, window: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(tc.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - window, (tc.batch_size,), generator=g)
    return torch.stack([data[s : s + window] for s in starts.tolist()]).long()


def mtp_losses(
    model: CausalLM, w: torch.Tensor, seq_len: int, freeze_base: bool
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(main loss, [MTP loss per module]) on windows `w` [B, S + 1 + N]."""
    S = seq_len
    ids = w[:, :S]
    pos = torch.arange(S).expand_as(ids)
    with torch.set_grad_enabled(not freeze_base):
        h = model(ids, pos)
        logits = model.compute_logits(h)
    main = F.cross_entropy(logits.flatten(0, 1), w[:, 1 : S + 1].flatten())
    if freeze_base:
        # Self-distillation: module m at entry t learns the base model's argmax for t+2+m.
        greedy = logits.argmax(-1)  # [B, S]: prediction for token t+1
    losses, prev = [], h.detach() if freeze_base else h
    for m in range(len(model.mtp)):
        hm = model.forward_mtp(m, w[:, 1 + m : S + 1 + m], prev, pos)
        if freeze_base:
            tgt = torch.full_like(ids, IGNORE)
            tgt[:, : S - 1 - m] = greedy[:, 1 + m :]
        else:
            tgt = w[:, 2 + m : S + 2 + m]
        lg = model.compute_mtp_logits(m, hm)
        losses.append(F.cross_entropy(lg.flatten(0, 1), tgt.flatten(), ignore_index=IGNORE))
        prev = hm
    return main, losses


def build_model(tc: TrainConfig, hf_config: dict) -> CausalLM:
    torch.manual_seed(tc.seed)
    if tc.init_from:
        base = load_model(tc.init_from)
        model = CausalLM(ModelConfig.from_dict(hf_config))
        missing = model.load_state_dict(base.state_dict(), strict=False).missing_keys
        assert all(k.startswith("mtp.") for k in missing), missing
        for m, mod in enumerate(model.mtp):
            # New modules start from the last main layer; existing ones are fine-tuned.
            if any(k.startswith(f"mtp.{m}.") for k in missing):
                _init_weights(mod)
                mod.block.load_state_dict(base.model.layers[-1].state_dict())
        if tc.freeze_base:
            for name, p in model.named_parameters():
                p.requires_grad_(name.startswith("mtp.") and "embed" not in name
                                 and ".head." not in name)
        return model
    model = CausalLM(ModelConfig.from_dict(hf_config))
    _init_weights(model)
    return model


def train(tc: TrainConfig) -> dict:
    out = Path(tc.out)
    out.mkdir(parents=True, exist_ok=True)
    if tc.threads:
        torch.set_num_threads(tc.threads)
    tok, data = prepare_data(tc, out)
    eos = tok.token_to_id(EOS_TOKEN)
    if tc.init_from:
        hf_config = json.loads((Path(tc.init_from) / "config.json").read_text())
        hf_config["num_nextn_predict_layers"] = tc.num_mtp
        hf_config.pop("mtp_num_hidden_layers", None)
    else:
        hf_config = qwen3_config(tc, eos)
    model = build_model(tc, hf_config)
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": tc.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=tc.lr, betas=(0.9, 0.95),
    )
    state_file = out / "trainer_state.pt"
    start, history = 0, []
    if state_file.is_file():
        st = torch.load(state_file, weights_only=False)
        # How a run executes may change between pieces (threads, compile, where it pauses);
        # what it computes may not.
        free = ("stop_after", "threads", "compile", "save_every")
        st["config"].setdefault("corpus", "stdlib")  # states written before corpora existed
        if ({k: v for k, v in st["config"].items() if k not in free}
                != {k: v for k, v in asdict(tc).items() if k not in free}):
            raise ValueError(f"{state_file} was written with a different configuration")
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optimizer"])
        start, history = st["step"], st["history"]
    loss_fn = torch.compile(mtp_losses) if tc.compile else mtp_losses
    window = tc.seq_len + 1 + tc.num_mtp
    end = min(tc.steps, tc.stop_after) if tc.stop_after is not None else tc.steps
    model.train()
    bar = tqdm(range(start, end), initial=start, total=tc.steps, desc="train", mininterval=5)
    t0, tokens = time.perf_counter(), 0
    for step in bar:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        w = batch_at(data, step, tc, window)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=tc.bf16):
            main, mtps = loss_fn(model, w, tc.seq_len, tc.freeze_base)
        loss = sum(mtps) * tc.mtp_weight if tc.freeze_base else main + tc.mtp_weight * sum(mtps)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        tokens += tc.batch_size * tc.seq_len
        rec = {"step": step + 1, "main": main.item(), "mtp": [x.item() for x in mtps]}
        history.append(rec)
        bar.set_postfix(main=f"{rec['main']:.3f}",
                        mtp=" ".join(f"{x:.3f}" for x in rec["mtp"]) or "-",
                        tok_s=f"{tokens / (time.perf_counter() - t0):.0f}")
        if (step + 1) % tc.save_every == 0 or step + 1 == end:
            # Written aside, then renamed: a run stopped mid-save keeps its last good state.
            tmp = state_file.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                        "step": step + 1, "history": history, "config": asdict(tc)}, tmp)
            tmp.replace(state_file)
    result = {"steps_done": end, "history_tail": history[-20:],
              "final_train_main": _mean_tail(history, "main"),
              "final_train_mtp": _mean_tail(history, "mtp")}
    if end == tc.steps:
        model.eval()
        save_hf(model, hf_config, out, getattr(torch, tc.save_dtype))
        if not tc.init_from:
            save_tokenizer(tok, out)
        else:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                src = Path(tc.init_from) / f
                if src.is_file():
                    (out / f).write_bytes(src.read_bytes())
        (out / "train_result.json").write_text(json.dumps(
            {"config": asdict(tc), **result}, indent=2) + "\n")
    return result


def _mean_tail(history: list[dict], key: str, n: int = 20) -> float | None:
    vals = [h[key] if key == "main" else sum(h[key]) for h in history[-n:]]
    return sum(vals) / len(vals) if vals else None
