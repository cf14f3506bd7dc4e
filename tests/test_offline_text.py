"""Offline and served read the same: `LLM.generate` / `mtpserve generate` text is what the
server's choice streams (special tokens such as EOS dropped, unless asked to keep them), token
healing included: the embedded model heals a line-break tail by default, offline as served."""

from __future__ import annotations

import json

from mtpserve.router.generation import Choice
from mtpserve.workers.llm import LLM, GenerationResult, detokenize
from mtpserve.workers.messages import GenerateRequest, TokenChunk
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.structured.healing import model_default

# Prompts ending in a newline: without healing the default model often ends them at once.
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "x = 1\n", "for i in range(3):\n"]


def served_text(tok, r: GenerationResult) -> str:
    """What the server's `Choice` streams for r's tokens, one token per chunk: the prompt it
    ran (healed) as the detokenizer's context, the re-spelled tail stripped."""
    ran = r.prompt_token_ids[:len(r.prompt_token_ids) - r.num_healed_tokens]
    choice = Choice(0, GenerateRequest("r", ran, SamplingParams()), tok, [])
    choice.strip_prefix = r.healed_text
    ids = r.output_token_ids
    return "".join(choice.feed(TokenChunk([t], finished=i == len(ids) - 1,
                                          finish_reason=r.finish_reason if i == len(ids) - 1
                                          else None))
                   for i, t in enumerate(ids))


def test_offline_text_is_the_served_stream(default_model) -> None:
    llm = LLM(str(default_model), num_speculative_tokens=2)
    tok = llm.tokenizer
    assert llm.token_healing  # the embedded model's default (config.json)
    eos = tok.eos_token_id
    for r in llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0)):
        assert r.num_healed_tokens >= 1 and "\n" in r.healed_text, r
        assert r.prompt.endswith(r.healed_text)
        assert r.output_token_ids[0] != eos  # the first token re-spells the tail
        assert r.text == served_text(tok, r)
        # An untokenized continuation: the healed prompt and the output decode to the prompt's
        # text followed by `text`.
        ran = r.prompt_token_ids[:len(r.prompt_token_ids) - r.num_healed_tokens]
        assert tok.decode(ran + r.output_token_ids, skip_special_tokens=True) == r.prompt + r.text
    off = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0),
                       token_healing=False)
    assert all(r.num_healed_tokens == 0 and r.text == served_text(tok, r) for r in off)
    ids = [tok.encode(p) for p in PROMPTS]
    assert [r.output_token_ids for r in off] == [
        r.output_token_ids for r in llm.generate(ids, SamplingParams(max_tokens=24,
                                                                     temperature=0))]


def test_healing_default_is_the_models(default_model, tmp_path) -> None:
    assert model_default(default_model) is True
    assert model_default(tmp_path) is False  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert model_default(tmp_path) is False
    assert model_default({"mtpserve": {"token_healing": True}}) is True


def test_special_tokens_are_dropped_unless_kept(default_model) -> None:
    tok = LLM(str(default_model), num_speculative_tokens=0).tokenizer
    eos = tok.eos_token_id
    prompt, out = tok.encode(PROMPTS[0]), tok.encode("    return a + b\n") + [eos]
    assert detokenize(tok, prompt, out) == "    return a + b\n"
    assert detokenize(tok, prompt, out, skip_special_tokens=False).endswith(tok.eos_token)


def test_cli_generate_json_text_heals_and_has_no_special_tokens(default_model, capsys) -> None:
    from mtpserve.cluster.cli import main

    def run(*extra: str) -> dict:
        # In this process (the CLI's own entry point, parser included): a subprocess would
        # add an interpreter and a torch import per call.
        capsys.readouterr()
        assert main(["generate", "--model", str(default_model), "--prompt", PROMPTS[0],
                     "--max-tokens", "8", "--json", "--compile", "off", *extra]) in (0, None)
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    healed, kept = run(), run("--keep-special-tokens", "--no-token-healing")
    llm = LLM(str(default_model), num_speculative_tokens=0)
    tok = llm.tokenizer
    prompt = tok.encode(PROMPTS[0])
    assert healed["prompt_token_ids"] == kept["prompt_token_ids"] == prompt
    assert healed["num_healed_tokens"] == 1 and kept["num_healed_tokens"] == 0
    assert healed["text"] == detokenize(tok, prompt[:-1], healed["output_token_ids"]
                                        )[len(healed["healed_text"]):]
    assert kept["text"] == detokenize(tok, prompt, kept["output_token_ids"], False)
    # The offline API gives the CLI's tokens (greedy, k = 2 there and 0 here: exact).
    ref = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=0))[0]
    assert ref.output_token_ids == healed["output_token_ids"] and ref.text == healed["text"]
