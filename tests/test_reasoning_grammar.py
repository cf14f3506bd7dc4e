"""Grammars after reasoning (issue 43 item 3): a constrained request of a reasoning model is
masked from the end of its `<think>` block on, never inside it. The gate each prompt gets
(`Reasoner.grammar_gate`) per style and thinking switch, then engines on the chat
checkpoints: the block is free, what follows it matches the schema, and k = 0..3 give the
same tokens (the marker may land mid-round)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import run_to_completion

from mtpserve.router.reasoning import END, START, Reasoner, resolve_parser, template_text
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.structured.constraint import AfterMarker, PrefixConstraint, PrefixMasks
from mtpserve.workers.structured.spec import StructuredSpec
from mtpserve.workers.tokenizer import load_tokenizer

USER = [{"role": "user", "content": "Give me the weather as JSON."}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
          "required": ["city"], "additionalProperties": False}


def _prompt(tok, **kwargs) -> list[int]:
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tok.encode(text, add_special_tokens=False))


def _reasoner(path) -> Reasoner:
    tok = load_tokenizer(str(path))
    model_type = json.loads((path / "config.json").read_text())["model_type"]
    return Reasoner.build(resolve_parser("auto", model_type, template_text(tok)), tok)


@pytest.mark.parametrize(("style", "kwargs", "gate"), [
    ("qwen3", {}, (END, START)),  # Qwen3 may think: the gate opens at </think> if it does
    ("qwen3", {"enable_thinking": False}, (None, None)),  # the prompt closed the block
    ("qwen3_coder", {}, (END, None)),  # the prompt opens <think>: output starts inside
    ("deepseek_v3", {"thinking": True}, (END, None)),
    ("deepseek_v3", {}, (None, None)),  # thinking off: no reasoning, the grammar at once
])
def test_the_gate_each_prompt_gets(chat_checkpoint, style, kwargs, gate) -> None:
    path = chat_checkpoint(style, "qwen3")
    r = _reasoner(path)
    prompt = _prompt(r.tokenizer, **kwargs)
    assert r.grammar_gate(prompt, kwargs) == gate


@pytest.mark.parametrize("style", ["glm45", "deepseek_v3"])
def test_special_markers_gate_on_their_ids(chat_checkpoint, style) -> None:
    """Markers that are special tokens: the reasoner still splits on ids (so the gate is the
    same as for plain markers) and the engine's gate resolves `</think>` / `<think>` to their
    ids, not to the byte path (`StructuredGuide.gated`)."""
    from types import SimpleNamespace

    from mtpserve.workers.structured.guide import StructuredGuide

    path = chat_checkpoint(style, "qwen3", special_markers=True)
    r = _reasoner(path)
    tok = r.tokenizer
    start, end = tok.convert_tokens_to_ids(START), tok.convert_tokens_to_ids(END)
    assert tok.decode([start, end], skip_special_tokens=True) == ""  # special indeed
    assert (r.start_id, r.end_id) == (start, end)
    kwargs = {"thinking": True} if style == "deepseek_v3" else {}
    after, opener = r.grammar_gate(_prompt(tok, **kwargs), kwargs)
    assert (after, opener) == ((END, None) if style == "deepseek_v3" else (END, START))
    cfg = json.loads((path / "config.json").read_text())
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], list) else [cfg["eos_token_id"]]
    guide = StructuredGuide(str(path), cfg["vocab_size"], eos)
    req = SimpleNamespace(params=SimpleNamespace(structured_after=END, structured_opener=START))
    masks = PrefixMasks(guide.cache.token_bytes)
    gate = guide.gated(req, PrefixConstraint(b"{", masks))
    assert (gate.marker_id, gate.opener_id) == (end, start)
    assert guide.cache.token_bytes[end] == END.encode()  # a special token keeps its text


def test_an_opener_first_waits_for_the_marker_any_other_token_is_the_grammar() -> None:
    vocab = [b"", b"a", b"b", b"ab", b"", b""]  # 4: <think>, 5: </think> (special)
    masks = PrefixMasks(vocab)
    bm = torch.zeros(1, masks._words, dtype=torch.int32)
    c = AfterMarker(PrefixConstraint(b"ab", masks), 5, b"</think>", vocab, opener_id=4)
    assert c.fill(bm, 0)  # undecided: the grammar's first tokens and the opener
    allowed = [bool(bm[0, t // 32] >> (t % 32) & 1) for t in range(len(vocab))]
    assert allowed == [False, True, False, True, True, False]
    assert c.accept(4) and not c.fill(bm, 0) and c.accept(2) and c.accept(5)  # free inside
    assert c.open and not c.accept(2) and c.accept(3)
    c.rollback(4)
    assert c.undecided and not c.accept(2) and c.accept(1) and c.open  # no block: grammar


@pytest.mark.parametrize(("style", "kwargs"), [("qwen3", {}), ("qwen3_coder", {}),
                                             ("qwen3", {"enable_thinking": False})])
def test_json_after_reasoning_exact_under_speculation(chat_checkpoint, style, kwargs) -> None:
    """The tiny random model may never close its block: then the whole output is the free
    reasoning (no JSON forced into it); when it closes it (or thinks not at all), what follows
    is the schema's JSON. Either way k = 0..3 agree token for token."""
    path = chat_checkpoint(style, "qwen3")
    r = _reasoner(path)
    tok = r.tokenizer
    prompt = _prompt(tok, **kwargs)
    after, opener = r.grammar_gate(prompt, kwargs)
    params = SamplingParams(max_tokens=40, temperature=0.0,
                            structured=StructuredSpec.json_schema(SCHEMA),
                            structured_after=after, structured_opener=opener)
    outs = {}
    for k in range(4):
        eng = Engine(EngineConfig(model=str(path), num_speculative_tokens=k))
        outs[k] = run_to_completion(eng, [prompt], params)[0]
    assert all(o == outs[0] for o in outs.values()), outs
    out = outs[0]
    start, end = tok.convert_tokens_to_ids(START), tok.convert_tokens_to_ids(END)
    inside = after is not None and (opener is None or out[0] == start)
    if inside and end not in out:  # the reasoning ran to the budget: it was left free
        assert not tok.decode(out, skip_special_tokens=True).lstrip().startswith("{")
        return
    rest = out[out.index(end) + 1:] if inside else out
    text = tok.decode(rest, skip_special_tokens=True).strip()
    assert text.startswith("{"), (style, kwargs, tok.decode(out))
    if text.endswith("}"):
        assert set(json.loads(text)) == {"city"}
