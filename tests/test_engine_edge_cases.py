"""Engine edge cases: EOS / stop tokens inside accepted drafts, EOS from
generation_config.json, min_tokens, large k at the end of the context window, and depth-module
(N = 2) models that must not read MTP KV slots they never wrote."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model.config import ModelConfig
from mtpserve.workers.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8, 1, 77, 31]


def engine(path, k: int, **kw) -> Engine:
    cfg = dict(model=str(path), num_speculative_tokens=k, num_kv_blocks=256, block_size=4,
               max_num_batched_tokens=64)
    return Engine(EngineConfig(**{**cfg, **kw}))


def rounds(eng: Engine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The tokens each step emitted for one request (a decode step = one round)."""
    eng.add_request("x", prompt, params)
    out = []
    while eng.has_unfinished():
        out += [o.new_token_ids for o in eng.step() if o.new_token_ids]
    return out


def accepted_draft_position(chunks: list[list[int]]) -> int:
    """An output index whose token was an accepted draft (not its round's last token) and
    appears there for the first time."""
    flat = [t for c in chunks for t in c]
    i = 0
    for c in chunks:
        for j, t in enumerate(c):
            if j < len(c) - 1 and flat.index(t) == i + j and i + j > 0:
                return i + j
        i += len(c)
    raise AssertionError("no accepted draft to cut at")


@pytest.fixture(scope="module")
def greedy_chunks(default_model):
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    chunks = rounds(engine(default_model, 3), [12, 40, 7, 300, 9, 41], params)
    flat = [t for c in chunks for t in c]
    assert flat == [t for c in rounds(engine(default_model, 0), [12, 40, 7, 300, 9, 41],
                                      params) for t in c]
    return chunks


def test_stop_token_inside_accepted_drafts(default_model, greedy_chunks) -> None:
    flat = [t for c in greedy_chunks for t in c]
    j = accepted_draft_position(greedy_chunks)
    eng = engine(default_model, 3)
    req = eng.add_request("x", [12, 40, 7, 300, 9, 41], SamplingParams(
        max_tokens=48, temperature=0, ignore_eos=True, stop_token_ids=(flat[j],)))
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == flat[: j + 1]
    assert req.status.value == "stop"
    # Only drafts that were emitted count as accepted: of the j + 1 tokens, the first is no
    # draft and each earlier round ended with one recovered/bonus token; the last round was
    # cut inside its accepted drafts (it would count all of them otherwise).
    assert req.num_accepted == j - (req.num_rounds - 1)
    assert eng.totals["accepted"] == req.num_accepted


def with_generation_config(src: Path, dst: Path, eos: list[int]) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).symlink_to(f.resolve())
    (dst / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return dst


def test_eos_from_generation_config_inside_accepted_drafts(default_model, greedy_chunks,
                                                          tmp_path) -> None:
    flat = [t for c in greedy_chunks for t in c]
    j = accepted_draft_position(greedy_chunks)
    path = with_generation_config(Path(default_model), tmp_path / "m", [flat[j]])
    cfg_eos = ModelConfig.from_pretrained(default_model).eos_token_ids
    assert ModelConfig.from_pretrained(path).eos_token_ids == (*cfg_eos, flat[j])
    eng = engine(path, 3)
    req = eng.add_request("x", [12, 40, 7, 300, 9, 41],
                          SamplingParams(max_tokens=48, temperature=0))
    while eng.has_unfinished():
        eng.step()
    assert req.output_token_ids == flat[: j + 1] and req.status.value == "stop"
    assert req.num_accepted == j - (req.num_rounds - 1)


def test_min_tokens_suppresses_stop_tokens_exactly(default_model, greedy_chunks) -> None:
    """The first token that would stop the request is banned until min_tokens; speculative
    and plain decoding still agree token for token (the same mask on p and q)."""
    flat = [t for c in greedy_chunks for t in c]
    stop = flat[1]
    outs = []
    for k in (0, 3):
        eng = engine(default_model, k)
        req = eng.add_request("x", [12, 40, 7, 300, 9, 41], SamplingParams(
            max_tokens=30, temperature=0, ignore_eos=True, stop_token_ids=(stop,),
            min_tokens=12))
        while eng.has_unfinished():
            eng.step()
        outs.append(req.output_token_ids)
        assert stop not in req.output_token_ids[:12]
    assert outs[0] == outs[1]
    assert outs[0][0] == flat[0] and outs[0][1] != stop


@pytest.mark.parametrize("num_mtp", [1, 2])
def test_large_k_at_the_window_end(tiny_factory, num_mtp: int) -> None:
    """k up to 8 runs into a 48-token window: drafting is capped by the room left, greedy
    output equals plain decoding and stops exactly at the window."""
    path = tiny_factory(max_positions=48, num_mtp=num_mtp)
    prompt = PROMPT * 3  # 33 tokens
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    want = rounds(engine(path, 0), prompt, params)
    for k in (4, 8):
        got = rounds(engine(path, k), prompt, params)
        assert [t for c in got for t in c] == [t for c in want for t in c]
        assert len(prompt) + sum(len(c) for c in got) == 48
    sampled = engine(path, 8)
    req = sampled.add_request("s", prompt, SamplingParams(max_tokens=100, seed=1))
    while sampled.has_unfinished():
        sampled.step()
    assert req.status.value in ("length", "stop")
    assert req.num_tokens <= 48 and (req.status.value == "stop" or req.num_tokens == 48)


def test_depth_modules_never_read_unwritten_slots(tiny_factory) -> None:
    """N = 2 depth modules through the engine: greedy equals plain decoding, and with every
    KV slot poisoned with NaN beforehand, no MTP forward ever sees one."""
    path = tiny_factory(num_mtp=2)
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    want = [t for c in rounds(engine(path, 0), PROMPT, params) for t in c]
    for temperature in (0.0, 1.0):
        eng = engine(path, 3)
        for layer in eng.runner.kv_cache.layers:
            layer.fill_(float("nan"))
        execute = eng.proposer.execute

        def checked(batch, execute=execute):
            logits = execute(batch)
            assert torch.isfinite(logits).all(), f"MTP module {batch.module} read NaN KV"
            return logits

        eng.proposer.execute = checked
        p = SamplingParams(max_tokens=30, temperature=temperature, seed=4, ignore_eos=True)
        got = [t for c in rounds(eng, PROMPT, p) for t in c]
        if temperature == 0:
            assert got == want
        assert eng.totals["drafted"] > 0


def test_generation_config_without_eos_changes_nothing(tmp_path, default_model) -> None:
    path = with_generation_config(Path(default_model), tmp_path / "m", [])
    (path / "generation_config.json").unlink()
    (path / "generation_config.json").write_text(json.dumps({"temperature": 0.7}))
    assert (ModelConfig.from_pretrained(path).eos_token_ids
            == ModelConfig.from_pretrained(default_model).eos_token_ids)


def test_out_of_vocabulary_stop_token_ids_are_refused(tiny_qwen3) -> None:
    from mtpserve.workers.engine_config import EngineError

    eng = engine(tiny_qwen3, 2)
    vocab = eng.model_config.vocab_size
    for bad in (vocab, -1):
        with pytest.raises(EngineError, match="stop_token_ids"):
            eng.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4,
                                                           stop_token_ids=(bad,)))
    assert not eng.requests and eng.block_manager.num_free_blocks == eng.config.num_kv_blocks
