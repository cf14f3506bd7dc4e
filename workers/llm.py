"""Offline interface: `LLM(path).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.messages import TokenLogprobs
from mtpserve.workers.paths import default_model_path
from mtpserve.workers.sampling_params import SamplingParams
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
    extra: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out = {k: v for k, v in self.__dict__.items() if k not in ("extra", "logprobs")}
        if self.logprobs is not None:
            out["logprobs"] = [asdict(e) for e in self.logprobs]
        return out


class LLM:
    """Runs the engine in this process (TP=1) until every prompt is done."""

    def __init__(self, model: str | None = None, **engine_kwargs) -> None:
        path = str(model or default_model_path())
        self.engine = Engine(EngineConfig(model=path, **engine_kwargs))
        self.tokenizer = load_tokenizer(path)
        self._counter = 0

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | None = None,
    ) -> list[GenerationResult]:
        params = params or SamplingParams()
        if isinstance(prompts, str):
            prompts = [prompts]
        reqs = []
        for p in prompts:
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            self._counter += 1
            reqs.append((p if isinstance(p, str) else None,
                         self.engine.add_request(f"llm-{self._counter}", ids, params)))
        logprobs: dict[str, list[TokenLogprobs]] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.logprobs:
                    logprobs.setdefault(out.request_id, []).extend(out.logprobs)
        results = []
        for text_prompt, r in reqs:
            end = r.finish_time or time.monotonic()
            first = r.first_token_time or end
            results.append(GenerationResult(
                prompt=text_prompt, prompt_token_ids=r.prompt_token_ids,
                text=self.tokenizer.decode(r.output_token_ids),
                output_token_ids=list(r.output_token_ids),
                finish_reason=r.status.value, num_rounds=r.num_rounds,
                drafted_per_position=list(r.drafted_per_position),
                accepted_per_position=list(r.accepted_per_position),
                decode_seconds=end - first, ttft_seconds=first - r.arrival, seed=r.seed,
                logprobs=logprobs.get(r.request_id, []) if params.logprobs is not None
                else None,
            ))
        return results
