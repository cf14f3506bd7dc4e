"""Offline interface: `LLM(path).generate(prompts, SamplingParams(...))`.

Text prompts are token-healed as the server heals `/v1/completions` text prompts (the model's
default, `workers.structured.healing`), so `text` is what the server answers for the same
prompt and settings.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import asdict, dataclass, field

from mtpserve.workers.allocator import hint_once
from mtpserve.workers.detokenizer import IncrementalDetokenizer
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.engine_config import compile_mode
from mtpserve.workers.messages import TokenLogprobs
from mtpserve.workers.paths import default_model_path
from mtpserve.workers.sampling_params import SamplingParams
from mtpserve.workers.structured.healing import (
    HealedPrompt,
    HealingTable,
    heal_prompt,
    may_heal,
    model_default,
    strip_healed,
)
from mtpserve.workers.structured.spec import StructuredSpec
from mtpserve.workers.tokenizer import load_tokenizer


@dataclass
class GenerationResult:
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    output_token_ids: list[int]
    finish_reason: str | None
    num_rounds: int
    drafted_per_position: list[int]
    accepted_per_position: list[int]
    decode_seconds: float
    ttft_seconds: float
    seed: int | None = None  # the seed that keyed this request's randomness
    logprobs: list[TokenLogprobs] | None = None  # per output token, if params.logprobs
    # Token healing: the prompt ran without its last `num_healed_tokens` tokens, the output
    # re-spells their text (`healed_text`, in `output_token_ids`, stripped from `text`).
    num_healed_tokens: int = 0
    healed_text: str = ""
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("extra", "logprobs")}
        if self.logprobs is not None:
            out["logprobs"] = [asdict(e) for e in self.logprobs]
        return out


# Decode tokens one generate call must ask for before `compile: auto` compiles for it. A
# decode graph saves ~2.2 ms per token at k=0 and ~1.3 ms at k=2 on the default model (2-core
# CPU), and batch 1 compiles 4 graphs in ~40-60 s cold: the compile pays back after ~18k-31k
# tokens. Graphs already in the on-disk compile cache load in well under a second each, so a
# smaller call uses those.
AUTO_COMPILE_MIN_TOKENS = 20_000


class LLM:
    """Runs the engine in this process (TP=1) until every prompt is done."""

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        path = str(model or default_model_path())
        self.engine = Engine(EngineConfig(model=path, **engine_kwargs))
        if self.engine.config.device.startswith("cpu"):
            hint_once()  # a process's malloc is fixed at its start (workers/allocator.py)
        self.tokenizer = load_tokenizer(path)
        self.token_healing = model_default(path)
        self._healing_table: HealingTable | None = None
        self._counter = 0

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | None = None,
        skip_special_tokens: bool = True,
        token_healing: bool | None = None,
    ) -> list[GenerationResult]:
        """Generate for every prompt. `text` reads as the server streams it: detokenized
        with the prompt's last tokens as context, special tokens (EOS) dropped unless
        `skip_special_tokens` is False. `token_healing` as the API's option: None (the
        model's default, `self.token_healing`: line-break tails only), True (any healable
        tail), False; text prompts only, and not under another constraint."""
        params = params or SamplingParams()
        if isinstance(prompts, str):
            prompts = [prompts]
        ids_list = [self.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        on = self.token_healing if token_healing is None else token_healing
        healed = [self._heal(ids, token_healing is not None)
                  if on and isinstance(p, str) and params.structured is None
                  else HealedPrompt(ids) for p, ids in zip(prompts, ids_list, strict=True)]
        # Compile what these prompts can hit before any of them runs (kept per engine). Under
        # `auto` only a call with enough tokens to decode pays for a cold compile; a smaller
        # one loads what the on-disk compile cache holds (a fraction of a second per graph)
        # and runs the rest eagerly (the engine never compiles inside a request).
        k = self.engine.config.num_speculative_tokens
        small = len(ids_list) * params.max_tokens < AUTO_COMPILE_MIN_TOKENS
        cached_only = small and compile_mode(self.engine.config.compile) == "auto"
        # compile: on compiles whatever it takes (no time budget).
        self.engine.warmup(len(ids_list), max((len(h.ids) for h in healed), default=0)
                           + params.max_tokens + 2 * k + 2, budget_s=math.inf,
                           cached_only=cached_only)
        reqs = []
        for p, h in zip(prompts, healed, strict=True):
            self._counter += 1
            sp = dataclasses.replace(params, structured=StructuredSpec.prefix(h.tail)
                                     ) if h.healed else params
            reqs.append((p if isinstance(p, str) else None,
                         self.engine.add_request(f"llm-{self._counter}", h.ids, sp)))
        logprobs: dict[str, list[TokenLogprobs]] = {}
        while self.engine.has_unfinished():
            outs = self.engine.step()
            if not outs and self.engine.compiling:  # only grammars compiling: wait for one
                self.engine.wait_grammars(0.5)
            for out in outs:
                if out.logprobs:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
        results = []
        for (text_prompt, r), ids, h in zip(reqs, ids_list, healed, strict=True):
            end = r.finish_time or time.monotonic()
            first = r.first_token_time or end
            text = detokenize(self.tokenizer, r.prompt_token_ids, r.output_token_ids,
                              skip_special_tokens)
            results.append(GenerationResult(
                prompt=text_prompt, prompt_token_ids=ids,
                text=strip_healed(text, h.text)[0],
                output_token_ids=list(r.output_token_ids),
                finish_reason=r.status.value, num_rounds=r.num_rounds,
                drafted_per_position=list(r.drafted_per_position),
                accepted_per_position=list(r.accepted_per_position),
                decode_seconds=end - first, ttft_seconds=first - r.arrival, seed=r.seed,
                logprobs=logprobs.get(r.request_id, []) if params.logprobs is not None
                else None,
                num_healed_tokens=len(ids) - len(h.ids), healed_text=h.text,
            ))
        return results

    def _heal(self, ids: list[int], any_tail: bool) -> HealedPrompt:
        """Heal one prompt as the ingress does (`router.structured.heal`)."""
        if not ids or not may_heal(self.tokenizer.decode(ids[-1:]), any_tail):
            return HealedPrompt(ids)
        if self._healing_table is None:
            # The engine's vocabulary bytes (xgrammar's, as the ingress reads them); its
            # prefix constraint masks with the same table.
            self._healing_table = HealingTable(self.engine.guide.cache.token_bytes)
        return heal_prompt(self._healing_table, ids, any_tail)


def detokenize(tokenizer, prompt_token_ids: list[int], output_token_ids: list[int],
               skip_special_tokens: bool = True) -> str:
    """The output's text exactly as the server's incremental detokenizer streams it."""
    d = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
    return d.add(output_token_ids) + d.flush()
