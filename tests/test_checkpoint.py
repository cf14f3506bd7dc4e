"""Checkpoint loading: MTP naming conventions, sharded files, and the inventory errors."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from mtpserve.workers.model.checkpoint import inventory
from mtpserve.workers.model.loader import CheckpointError, load_model
from mtpserve.workers.model_runner import ForwardBatch, ModelRunner


def _rewrite(path, fn) -> None:
    tensors = load_file(path / "model.safetensors")
    save_file(fn(tensors), path / "model.safetensors", metadata={"format": "pt"})


def test_missing_mtp_tensor_is_named(tiny_qwen3, tmp_path) -> None:
    bad = tmp_path / "bad"
    shutil.copytree(tiny_qwen3, bad)
    name = "model.layers.2.eh_proj.weight"
    _rewrite(bad, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.") + ": missing"):
        load_model(bad)
    out = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "check", str(bad)],
                         capture_output=True, text=True)
    assert out.returncode == 1
    assert any(name in line and "missing" in line for line in out.stdout.splitlines())
    ok = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "check", str(tiny_qwen3)],
                        capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout
    assert "0 problem(s)" in ok.stdout


def test_unused_and_misshaped_tensors_are_errors(tiny_qwen3, tmp_path) -> None:
    extra = tmp_path / "extra"
    shutil.copytree(tiny_qwen3, extra)
    _rewrite(extra, lambda t: {**t, "model.layers.9.mlp.up_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.9\.mlp\.up_proj\.weight: unused"):
        load_model(extra)
    shaped = tmp_path / "shaped"
    shutil.copytree(tiny_qwen3, shaped)
    _rewrite(shaped, lambda t: {**t, "model.layers.2.enorm.weight": torch.ones(63)})
    with pytest.raises(CheckpointError, match=r"enorm\.weight: shape mismatch"):
        load_model(shaped)


def test_config_promising_more_mtp_modules_than_present(tiny_qwen3, tmp_path) -> None:
    more = tmp_path / "more"
    shutil.copytree(tiny_qwen3, more)
    cfg = json.loads((more / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 2
    (more / "config.json").write_text(json.dumps(cfg))
    problems = [e for e in inventory(more) if e.is_problem]
    assert problems and all(e.tensor.startswith("model.layers.3.") for e in problems)
    assert all(e.status == "missing" for e in problems)


@pytest.mark.parametrize("target", ["mimo", "qwen3_next"])
def test_other_mtp_namings_load_identically(tiny_qwen3, tmp_path, target: str) -> None:
    """Renaming DeepSeek-V3 MTP tensors to MiMo / Qwen3-Next names gives the same drafts
    (MiMo's hidden-first concat is undone by swapping eh_proj's halves)."""
    out = tmp_path / target
    shutil.copytree(tiny_qwen3, out)
    own = {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "eh_proj": "input_proj",
           "shared_head.norm": "final_layernorm"}
    if target == "qwen3_next":
        own = {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden",
               "eh_proj": "fc", "shared_head.norm": "norm"}

    def rename(t):
        res = {}
        for k, v in t.items():
            if not k.startswith("model.layers.2."):
                res[k] = v
                continue
            rest = k[len("model.layers.2."):]
            stem = rest.rsplit(".", 1)[0]
            if target == "mimo":
                if stem == "eh_proj":  # hidden-first concat: swap the two input halves
                    v = torch.cat([v[:, 64:], v[:, :64]], dim=1)
                res["model.mtp_layers.0." + own.get(stem, stem) + ".weight"
                    if stem in own else "model.mtp_layers.0." + rest] = v
            else:
                res["mtp." + own[stem] + ".weight" if stem in own
                    else "mtp.layers.0." + rest] = v
        return res

    _rewrite(out, rename)
    cfg = json.loads((out / "config.json").read_text())
    cfg.pop("num_nextn_predict_layers")
    if target == "mimo":
        cfg["num_nextn_predict_layers"], cfg["mtp_naming"] = 1, "mimo"
    else:
        cfg["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg))
    assert not [e for e in inventory(out) if e.is_problem]

    def mtp_logits(path):
        r = ModelRunner(path, num_blocks=8, block_size=4)
        r.execute(ForwardBatch("main", [[5, 6, 7, 8]], [0], [[0]], [3]))
        return r.execute(ForwardBatch("mtp", [[6, 7, 8, 9]], [0], [[0]], [3],
                                      hidden_from="main", hidden_rows=[[0, 1, 2, 3]]))

    assert torch.allclose(mtp_logits(out), mtp_logits(tiny_qwen3), atol=1e-5)


def test_sharded_checkpoint_with_index(tiny_qwen3, tmp_path) -> None:
    out = tmp_path / "sharded"
    shutil.copytree(tiny_qwen3, out)
    tensors = load_file(out / "model.safetensors")
    (out / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for fname, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in keys})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    a, b = load_model(out), load_model(tiny_qwen3)
    for (na, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), na
