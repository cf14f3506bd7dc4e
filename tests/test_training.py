"""Training: joint main + MTP loss goes down, exported folders load (ours and transformers),
`--freeze-base` keeps the base bit-identical, and resuming equals an uninterrupted run."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mtpserve.workers.model.checkpoint import inventory
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.training.trainer import TrainConfig, train

DATA = str(Path(sysconfig.get_paths()["stdlib"]) / "json")


def tiny(out: Path, **kw) -> TrainConfig:
    base = dict(out=str(out), steps=12, batch_size=4, seq_len=64, vocab_size=300, num_layers=2,
                hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                intermediate_size=128, data_root=DATA, save_every=4, warmup=2, lr=1e-2)
    return TrainConfig(**(base | kw))


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("train") / "joint"
    return out, train(tiny(out))


def test_losses_go_down_and_folder_loads(trained) -> None:
    out, res = trained
    hist = json.loads((out / "train_result.json").read_text())["history_tail"]
    first, last = hist[0], hist[-1]
    assert last["main"] < first["main"] - 0.5
    assert last["mtp"][0] < first["mtp"][0] - 0.5
    assert not [e for e in inventory(out) if e.is_problem]
    model = load_model(out)
    assert len(model.mtp) == 1
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (1, 16))
    with torch.no_grad():
        ours = model.compute_logits(model(ids, torch.arange(16).unsqueeze(0)))
        assert (ours - ref(ids).logits).abs().max() < 1e-4
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert tok.decode(tok.encode("def f(x):\n    return x")) == "def f(x):\n    return x"
    check = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "check", str(out)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout


def test_freeze_base_adds_mtp_and_keeps_base_bit_identical(tmp_path) -> None:
    base = tmp_path / "base"
    train(tiny(base, num_mtp=0, steps=4))
    assert load_model(base).mtp.__len__() == 0
    added = tmp_path / "added"
    train(tiny(added, init_from=str(base), freeze_base=True, steps=6))
    before, after = load_file(base / "model.safetensors"), load_file(added / "model.safetensors")
    for name, t in before.items():
        assert torch.equal(t, after[name]), name
    new = sorted(set(after) - set(before))
    assert new and all(n.startswith("model.layers.2.") for n in new)  # DeepSeek-V3 naming
    assert "model.layers.2.eh_proj.weight" in new
    assert not [e for e in inventory(added) if e.is_problem]
    assert len(load_model(added).mtp) == 1
    hist = json.loads((added / "train_result.json").read_text())["history_tail"]
    assert hist[-1]["mtp"][0] < hist[0]["mtp"][0]  # self-distillation learns


def test_resume_equals_uninterrupted(tmp_path) -> None:
    whole = tmp_path / "whole"
    train(tiny(whole, steps=6, save_every=2))
    split = tmp_path / "split"
    train(tiny(split, steps=6, save_every=2, stop_after=3))
    assert not (split / "model.safetensors").exists()
    train(tiny(split, steps=6, save_every=2))  # resumes from step 3
    a = torch.load(whole / "trainer_state.pt", weights_only=False)
    b = torch.load(split / "trainer_state.pt", weights_only=False)
    assert a["step"] == b["step"] == 6
    for k, v in a["model"].items():
        assert torch.equal(v, b["model"][k]), k
    assert [h["main"] for h in a["history"]] == [h["main"] for h in b["history"]]


def test_python_corpus_holds_out_pip_and_vendored_code() -> None:
    """The `python` corpus: the stdlib plus permissively licensed packages, deduplicated; pip
    (the evaluation set) and every vendored folder are never read."""
    from mtpserve.workers.training.data import PIP_AND_VENDORED, corpus_files, corpus_sources

    sources = corpus_sources("python")
    assert sources[0].label == "stdlib" and len(sources) > 1
    assert not {s.label.split("/")[0] for s in sources} & PIP_AND_VENDORED
    files = corpus_files("python")
    rels = [rel for rel, _ in files]
    assert len(set(rels)) == len(rels)
    assert not [r for r in rels if r.split("/")[0] in PIP_AND_VENDORED]
    assert not [p for _, p in files if "site-packages/pip/" in p.as_posix()
                or "_vendor" in p.parts or "thirdparty_files" in p.parts]
    # No copy of a library pip vendors, wherever another package keeps it.
    names = [part.removesuffix(".py") for rel, _ in files for part in rel.split("/")]
    assert not set(names) & PIP_AND_VENDORED
    blobs = [p.read_bytes() for _, p in files[:: max(1, len(files) // 500)]]
    assert len(set(blobs)) == len(blobs)  # deduplicated by content
