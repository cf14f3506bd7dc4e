"""The committed default model: loads, `check` is clean, fits the size budget, and its model
card's numbers come from `eval-mtp` (a slice is re-run here and compared)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mtpserve.workers.paths import default_model_path

MODEL = default_model_path()
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").is_file(),
                                reason=f"no default model at {MODEL}")


def test_loads_and_check_is_clean() -> None:
    from mtpserve.workers.model.loader import load_model

    model = load_model(MODEL)
    assert len(model.mtp) == 1
    out = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "check", str(MODEL)],
                         capture_output=True, text=True)
    assert out.returncode == 0 and "0 problem(s)" in out.stdout, out.stdout


def test_size_budget() -> None:
    total = sum(f.stat().st_size for f in MODEL.iterdir() if f.is_file())
    assert total <= 40 * 2**20, f"{total / 2**20:.1f} MiB"


def test_card_numbers_come_from_eval_mtp() -> None:
    from mtpserve.workers.training.evaluate import acceptance, held_out_tokens, losses, prefixes

    ev = json.loads((MODEL / "eval_mtp.json").read_text())
    card = (MODEL / "README.md").read_text()
    acc = ev["acceptance_per_position"]
    assert f"| {acc[0]:.3f} (+-" in card
    assert f"{ev['expected_tokens_per_round']['2']:.3f}" in card
    assert f"main {ev['heldout_main_loss']:.3f}, MTP {ev['heldout_mtp_loss']:.3f}" in card
    # Issue bar: first-draft acceptance >= 0.65 and >= 2 tokens per round at k=2.
    assert acc[0] >= 0.65 and ev["expected_tokens_per_round"]["2"] >= 2.0

    ids = held_out_tokens(str(MODEL), None)
    n = 32
    again = acceptance(str(MODEL), prefixes(ids, ev["seq_len"], n), ev["dtype"])
    recorded = ev["accepted_per_prefix"][:n]
    # Greedy and fp32: only a near-tie flipped by a different thread count may differ.
    differ = sum(a != b for a, b in zip(again["accepted_per_prefix"], recorded, strict=True))
    assert differ <= 1, (again["accepted_per_prefix"], recorded)
    first = losses(str(MODEL), ids, ev["seq_len"], ev["seq_len"] + 3, ev["dtype"])
    assert first["loss_per_window"][0] == pytest.approx(ev["loss_per_window"][0], abs=1e-3)
