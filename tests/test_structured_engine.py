"""Structured outputs in the engine, exact under speculation: greedy constrained output is the
same with MTP off and at k = 1..3, batched with unconstrained requests, prefilled on one engine
and decoded on another (the decode side rebuilds the matcher from the tokens), and resumed
after a migration; seeded sampling under a grammar follows the masked target distribution
(chi-square at every position); token healing lets newline-ending prompts continue."""

from __future__ import annotations

import functools
import json

import jsonschema
import pytest
import torch
from helpers import drain, make_engine, run_to_completion
from test_rejection_sampler import chi2

from mtpserve.workers.engine import Engine
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.request import Request
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.scheduler import decode_slots, draft_slots
from mtpserve.workers.spec_decode.sampling import processed_probs
from mtpserve.workers.structured.grammars import GrammarCache
from mtpserve.workers.structured.healing import HealingTable
from mtpserve.workers.structured.spec import StructuredSpec
from mtpserve.workers.tokenizer import load_tokenizer
from mtpserve.workers.training.prompts import held_out_prompts

SCHEMA = {"type": "object",
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999},
                         "name": {"type": "string", "maxLength": 16},
                         "ok": {"type": "boolean"}},
          "required": ["id", "name", "ok"], "additionalProperties": False}
SPEC = StructuredSpec.json_schema(SCHEMA)
NEW = 48


@pytest.fixture(scope="module")
def tok(default_model):
    return load_tokenizer(str(default_model))


@pytest.fixture(scope="module")
def prompts(tok) -> list[list[int]]:
    return [tok.encode(p)[:64] for p in held_out_prompts(4)]


def constrained(**kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": NEW, "temperature": 0, "structured": SPEC, **kw})


def _text(tok, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


@functools.cache
def _reference(path: str, prompts: tuple[tuple[int, ...], ...]) -> list[list[int]]:
    return run_to_completion(make_engine(path, 0, num_kv_blocks=256), [list(p) for p in prompts],
                             constrained())


def test_greedy_constrained_equal_for_every_k_and_batched(default_model, prompts, tok) -> None:
    want = _reference(str(default_model), tuple(map(tuple, prompts)))
    for ids in want:  # valid under the schema (EOS ends each one: the object is complete)
        jsonschema.validate(json.loads(_text(tok, ids)), SCHEMA)
    for k in (1, 2, 3):
        eng = make_engine(default_model, k, num_kv_blocks=256)
        assert run_to_completion(eng, prompts, constrained()) == want, f"k={k}"
        assert eng.totals["constrained_drafted"] > 0
        assert eng.block_manager.num_free_blocks == 256
    # Batched with unconstrained requests (which keep their own outputs too).
    eng = make_engine(default_model, 2, num_kv_blocks=256)
    free = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True)
    alone = run_to_completion(make_engine(default_model, 2, num_kv_blocks=256), prompts[:2],
                              free)
    mixed = run_to_completion(eng, prompts + prompts[:2], [constrained()] * 4 + [free] * 2)
    assert mixed[:4] == want and mixed[4:] == alone


def test_masked_drafts_accept_more_and_change_nothing(default_model, prompts) -> None:
    """Drafting under the grammar (MTP logits masked, matcher advanced along the chain) gives
    the same tokens as unmasked drafts (verification masks anyway) and accepts more of them:
    forced keys, quotes and braces are drafted right."""
    masked = make_engine(default_model, 2, num_kv_blocks=256)
    want = run_to_completion(masked, prompts, constrained())
    unmasked = make_engine(default_model, 2, num_kv_blocks=256)
    unmasked.proposer.guide = None  # drafts as if unconstrained
    assert run_to_completion(unmasked, prompts, constrained()) == want
    m, u = masked.totals, unmasked.totals
    assert m["constrained_accepted"] / m["constrained_drafted"] > (
        u["constrained_accepted"] / u["constrained_drafted"])


def _transfer(src: Engine, dst: Engine, rid: str, prompt: list[int], params: SamplingParams,
              first: list[int]) -> Request:
    """What the prefill and decode servers do, in-process (as in test_seeded_reproducibility):
    KV blocks and drafts copied; the decode side's matcher comes from the tokens alone."""
    held = src.prefilled[rid]
    r = dst.make_request(rid, prompt, params)
    r.output_token_ids += first
    r.num_computed_tokens = held.num_computed_tokens
    r.draft_token_ids = list(held.draft_token_ids)
    r.draft_probs = held.draft_probs
    dst.add_transferred(r, max(draft_slots(held), decode_slots(r)))
    assert dst.scheduler.admit_transferred() == [r]
    n_blocks = len(held.block_ids)
    for s, d in zip(src.runner.kv_cache.layers, dst.runner.kv_cache.layers, strict=True):
        d[:, r.block_ids[:n_blocks]] = s[:, held.block_ids]
    dst.activate_transferred(r)
    src.release_prefilled(rid)
    return r


@pytest.mark.parametrize("params", [constrained(), constrained(temperature=1.0, seed=7)],
                         ids=["greedy", "seeded"])
def test_prefill_decode_and_resume_equal_alone(default_model, prompts, params) -> None:
    kw = dict(num_kv_blocks=256, block_size=4)
    prompt = prompts[0]
    want = run_to_completion(make_engine(default_model, 2, **kw), [prompt], params)[0]
    pre = make_engine(default_model, 2, role="prefill", **kw)
    dec = make_engine(default_model, 2, role="decode", **kw)
    pre.add_request("x", prompt, params)
    outs = drain(pre)
    first = [t for o in outs for t in o.new_token_ids]
    assert first == want[:1]
    assert pre.prefilled["x"].draft_token_ids  # drafted under the grammar on the prefill side
    r = _transfer(pre, dec, "x", prompt, params, first)
    drain(dec)
    assert r.output_token_ids == want
    # Migration: resumed elsewhere after some tokens, it continues the same way.
    cut = len(want) // 2
    eng = make_engine(default_model, 2, **kw)
    rest = dataclass_replace(params, max_tokens=params.max_tokens - cut)
    req = eng.add_resumed("y", prompt, rest, want[:cut])
    drain(eng)
    assert req.output_token_ids == want


def dataclass_replace(params: SamplingParams, **kw) -> SamplingParams:
    import dataclasses

    return dataclasses.replace(params, **kw)


# Distribution under a mask ----------------------------------------------------------------
VOCAB = ["a", "b", "<eos>", "c", "d", "e"]  # the tiny model's 6 ids as text; 2 is EOS
REGEX = "[ace][bde][acd][be][abcde]"
ALLOWED = [{0, 3, 5}, {1, 4, 5}, {0, 3, 4}, {1, 5}, {0, 1, 3, 4, 5}]
PROMPT = [1, 4, 3, 2]


def _masked_marginals(path, params: SamplingParams) -> list[torch.Tensor]:
    model = load_model(path)

    @functools.cache
    def probs(ids: tuple[int, ...]) -> torch.Tensor:
        with torch.no_grad():
            h = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
            logits = model.compute_logits(h[:, -1])
        depth = len(ids) - len(PROMPT)
        logits[:, [t for t in range(len(VOCAB)) if t not in ALLOWED[depth]]] = float("-inf")
        return processed_probs(logits, [params])[0].double()

    out = [torch.zeros(len(VOCAB), dtype=torch.float64) for _ in ALLOWED]

    def walk(prefix: tuple[int, ...], mass: float, depth: int) -> None:
        p = probs(prefix)
        out[depth] += mass * p
        if depth + 1 < len(ALLOWED):
            for t in (p > 0).nonzero().flatten().tolist():
                walk(prefix + (t,), mass * float(p[t]), depth + 1)

    walk(tuple(PROMPT), 1.0, 0)
    return out


def test_seeded_sampling_under_a_grammar_matches_the_masked_target(tiny_factory) -> None:
    path = tiny_factory(vocab_size=6, seed=5)
    params = SamplingParams(temperature=1.0, max_tokens=len(ALLOWED),
                            structured=StructuredSpec("regex", REGEX))
    exact = _masked_marginals(path, params)
    n = 1500
    eng = make_engine(path, 3, num_kv_blocks=8192, block_size=4, max_num_seqs=n,
                      max_num_batched_tokens=4096)
    eng.guide._cache = GrammarCache.of_vocab(VOCAB, [2])  # a tokenizer-less model
    reqs = [eng.add_request(f"s{i}", PROMPT, dataclass_replace(
        params, seed=20_000 + i, num_speculative_tokens=1 + i % 3)) for i in range(n)]
    drain(eng)
    assert all(r.num_output_tokens == len(ALLOWED) for r in reqs)
    assert sum(r.num_accepted for r in reqs) > 100  # drafts (masked q) were accepted
    for pos in range(len(ALLOWED)):
        stat, limit = chi2(torch.tensor([r.output_token_ids[pos] for r in reqs]),
                           exact[pos].float())
        assert stat < limit, (pos, stat, limit)


# Token healing ------------------------------------------------------------------------------
def test_healing_lets_newline_prompts_continue(default_model, tok) -> None:
    table = HealingTable(GrammarCache.of_tokenizer(tok, len(tok), [0]).token_bytes)
    texts = [p for p in held_out_prompts(12) if p.endswith("\n")]
    eng = make_engine(default_model, 2, num_kv_blocks=256)
    healed_ids, specs = [], []
    for t in texts:
        ids, tail = table.heal(tok.encode(t))
        assert tail and tok.decode(ids) + tail.decode() == t
        healed_ids.append(ids)
        specs.append(SamplingParams(max_tokens=12, temperature=0,
                                    structured=StructuredSpec.prefix(tail)))
    outs = run_to_completion(eng, healed_ids, specs)
    plain = run_to_completion(make_engine(default_model, 0, num_kv_blocks=256), healed_ids,
                              [dataclass_replace(s, num_speculative_tokens=0) for s in specs])
    assert outs == plain  # exact under speculation
    eos = set(eng.eos_ids)
    for ids, out, t in zip(healed_ids, outs, texts, strict=True):
        assert out[0] not in eos
        # The continuation re-spells the healed tail: prompt + output is the text + more.
        full = tok.decode(ids + out)
        assert full.startswith(t), (t[-20:], full[len(t) - 20:])
