"""Grammars compile off the engine thread (issue 43 item 6): a request whose grammar is not
compiled yet waits in `Engine.compiling` while every other request keeps stepping; a compile
past `grammar_compile_timeout_s` fails that request alone; a spec that cannot be built fails
at admission, as before. The compile itself is the real one, held back by a gate the test
opens (a stand-in for a slow grammar, whose duration no test should guess)."""

from __future__ import annotations

import threading

import pytest
from helpers import GREEDY, drain, make_engine

from mtpserve.workers.engine import EngineError
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.structured.spec import StructuredSpec

PROMPT = [5, 17, 99, 3, 250, 7, 42, 8]


def _gated(eng) -> threading.Event:
    """Hold every compile of `eng`'s grammar cache until the returned event is set."""
    gate = threading.Event()
    cache = eng.guide.cache
    real = cache.compile

    def slow(spec):
        assert gate.wait(60), "the test never opened the gate"
        return real(spec)

    cache.compile = slow
    return gate


def _regex(n: int) -> SamplingParams:
    # Distinct per test: the in-memory cache must not have it yet.
    return SamplingParams(max_tokens=6, temperature=0.0,
                          structured=StructuredSpec("regex", f"(ab|cd){{{n},{n + 9}}}"))


def test_a_compiling_grammar_stalls_no_other_request(default_model) -> None:
    eng = make_engine(default_model, k=2)
    gate = _gated(eng)
    slow = eng.add_request("slow", PROMPT, _regex(1))
    plain = eng.add_request("plain", PROMPT[:5], GREEDY)
    assert slow.grammar is not None and "slow" in eng.compiling
    steps = 0
    while not plain.finished:  # the plain request runs to its end under the held compile
        eng.step()
        steps += 1
        assert steps < 200
    assert not slow.output_token_ids and "slow" in eng.compiling
    gate.set()
    while eng.has_unfinished():
        if not eng.step():
            eng.wait_grammars(1.0)
    assert slow.constraint is None and slow.finished  # released at its end
    assert len(slow.output_token_ids) > 0
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks


def test_a_compile_past_its_deadline_fails_that_request_alone(default_model) -> None:
    eng = make_engine(default_model, k=2, grammar_compile_timeout_s=0.2)
    gate = _gated(eng)
    try:
        eng.add_request("slow", PROMPT, _regex(2))
        plain = eng.add_request("plain", PROMPT[:5], GREEDY)
        failed = []
        while eng.has_unfinished():
            failed += [o for o in eng.step() if o.error]
            if not eng.scheduler.num_unfinished:
                eng.wait_grammars(0.05)
        assert [o.request_id for o in failed] == ["slow"]
        assert "did not compile within 0.2s" in failed[0].error
        assert plain.finished and len(plain.output_token_ids) == GREEDY.max_tokens
        assert "slow" not in eng.requests and not eng.compiling
    finally:
        gate.set()


def test_a_spec_that_cannot_be_built_fails_at_admission(default_model) -> None:
    eng = make_engine(default_model, k=2)
    bad = SamplingParams(max_tokens=4, structured=StructuredSpec("regex", "(unclosed"))
    with pytest.raises(EngineError):
        eng.add_request("bad", PROMPT, bad)
    assert not eng.compiling and "bad" not in eng.requests


def test_aborting_a_waiting_request_forgets_it(default_model) -> None:
    eng = make_engine(default_model, k=2)
    gate = _gated(eng)
    req = eng.add_request("slow", PROMPT, _regex(3))
    assert eng.abort("slow") and not eng.compiling and req.grammar is None
    gate.set()
    assert not eng.has_unfinished() and eng.step() == []


def test_grammar_after_a_marker_is_exact_under_speculation(default_model) -> None:
    """`structured_after` (a reasoning block's end): tokens up to the marker are the plain
    greedy ones, the rest matches the grammar, and k = 0..3 give the same tokens (the marker
    lands mid-round for some k)."""
    import re

    from helpers import run_to_completion

    from mtpserve.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(str(default_model))
    prompt = tok.encode("def add(a, b):\n    return")
    plain = run_to_completion(make_engine(default_model, k=0), [prompt],
                              SamplingParams(max_tokens=24, temperature=0.0))[0]
    text = tok.decode(plain)
    marker = next(text[i: i + 2] for i in range(len(text) - 1) if text[i: i + 2].strip())
    cut = next(j for j in range(1, len(plain) + 1) if marker in tok.decode(plain[:j]))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                            structured=StructuredSpec("regex", "[0-9]{3,40}"),
                            structured_after=marker)
    outs = {k: run_to_completion(make_engine(default_model, k=k), [prompt], params)[0]
            for k in range(4)}
    assert all(o == outs[0] for o in outs.values()), outs
    out = outs[0]
    assert out[:cut] == plain[:cut]
    assert re.fullmatch("[0-9]{3,40}", tok.decode(out[cut:])), tok.decode(out[cut:])


@pytest.mark.parametrize("k", [0, 2])
def test_a_grammar_that_completes_before_min_tokens_ends_the_output(chat_checkpoint, k,
                                                                   tmp_path) -> None:
    """min_tokens bans EOS, the grammar allows only EOS once it is complete: the grammar's end
    wins (before, every token was -inf there and token 0 came out, breaking the constraint;
    a checkpoint whose EOS is not token 0 shows it)."""
    import json
    import shutil

    from mtpserve.workers.tokenizer import load_tokenizer

    path = tmp_path / "ckpt"
    shutil.copytree(chat_checkpoint("qwen3", "qwen3"), path)
    for name in ("config.json", "generation_config.json"):
        cfg = json.loads((path / name).read_text())
        cfg["eos_token_id"] = [t for t in cfg["eos_token_id"] if t != 0]
        (path / name).write_text(json.dumps(cfg))
    tok = load_tokenizer(str(path))
    eng = make_engine(path, k=k)
    assert 0 not in eng.eos_ids
    params = SamplingParams(max_tokens=12, min_tokens=8, temperature=0.0,
                            structured=StructuredSpec("regex", "ab|cd"))
    req = eng.add_request("r", PROMPT, params)
    outs = []
    while eng.has_unfinished():
        outs += eng.step() or ([] if not eng.compiling else eng.wait_grammars(1.0) or [])
    text = tok.decode([t for t in req.output_token_ids if t not in eng.eos_ids])
    assert text in ("ab", "cd"), req.output_token_ids
    assert req.output_token_ids[-1] in eng.eos_ids and outs[-1].finish_reason == "stop"


def test_warm_loads_what_the_first_healed_request_would_load(default_model, tmp_path) -> None:
    # A replica warms its guide before it reports ready: the first healed prompt then finds
    # the grammar cache and the healing masks built (before, it imported xgrammar and read
    # the tokenizer on the engine thread: a 2.4 s stall of every stream in the batch).
    eng = make_engine(default_model)
    guide = eng.guide
    assert guide._cache is None and guide._prefix_masks is None  # built on demand
    guide.warm()
    masks, cache = guide._prefix_masks, guide._cache
    assert masks is not None and cache is not None
    req = eng.add_request("healed", [5, 6, 7], SamplingParams(
        max_tokens=4, temperature=0.0, structured=StructuredSpec.prefix(b"de")))
    assert req.constraint is not None
    assert guide._prefix_masks is masks and guide._cache is cache  # nothing built again
    drain(eng)
    # A model folder without a tokenizer: nothing to preload, and no error.
    from mtpserve.workers.structured.guide import StructuredGuide

    StructuredGuide(str(tmp_path), 100, [0]).warm()
