"""Offline and served read the same: `LLM.generate` / `mtpserve generate` text is what the
server's incremental detokenizer streams (special tokens such as EOS dropped), unless asked to
keep them."""

from __future__ import annotations

import json
import subprocess
import sys

from mtpserve.workers.detokenizer import IncrementalDetokenizer
from mtpserve.workers.llm import LLM, detokenize
from mtpserve.workers.sampling_params import SamplingParams

# Prompts ending in a newline: the default model often ends them with EOS at once.
PROMPTS = ["def add(a, b):\n", "import os\n", "class Stack:\n", "x = 1\n", "for i in range(3):\n"]


def test_offline_text_is_the_served_stream(default_model) -> None:
    llm = LLM(str(default_model), num_speculative_tokens=2)
    tok = llm.tokenizer
    for r in llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0)):
        served = IncrementalDetokenizer(tok, r.prompt_token_ids)
        streamed = "".join(served.add([t]) for t in r.output_token_ids) + served.flush()
        assert r.text == streamed


def test_special_tokens_are_dropped_unless_kept(default_model) -> None:
    tok = LLM(str(default_model), num_speculative_tokens=0).tokenizer
    eos = tok.eos_token_id
    prompt, out = tok.encode(PROMPTS[0]), tok.encode("    return a + b\n") + [eos]
    assert detokenize(tok, prompt, out) == "    return a + b\n"
    assert detokenize(tok, prompt, out, skip_special_tokens=False).endswith(tok.eos_token)


def test_cli_generate_json_text_has_no_special_tokens(default_model) -> None:
    def run(*extra: str) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "mtpserve.cluster.cli", "generate", "--model",
             str(default_model), "--prompt", PROMPTS[0], "--max-tokens", "8", "--json",
             "--compile", "off", *extra], capture_output=True, text=True, timeout=300,
            check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    plain, kept = run(), run("--keep-special-tokens")
    assert plain["output_token_ids"] == kept["output_token_ids"]
    llm = LLM(str(default_model), num_speculative_tokens=0)
    prompt = llm.tokenizer.encode(PROMPTS[0])
    assert plain["text"] == detokenize(llm.tokenizer, prompt, plain["output_token_ids"])
    assert kept["text"] == detokenize(llm.tokenizer, prompt, plain["output_token_ids"], False)
