"""Pydantic models of the OpenAI API subset we serve, plus two extensions.

Requests ignore unknown fields (OpenAI clients send new ones; forward compatible) but reject
values of the wrong type (`"max_tokens": "ten"` → 400, no silent coercion of strings). Fields that
would change the output and that we do not implement (`echo`, `suffix`, penalties, `logit_bias`,
...) are rejected with 400 by `check_supported()` rather than ignored.

Structured outputs and tools (router.structured, router.tools): chat `response_format`
(json_object, json_schema), `tools` / `tool_choice` / `parallel_tool_calls`, `tool` messages and
assistant `tool_calls` in the history; on both endpoints vLLM's `structured_outputs` (json,
regex, choice, grammar) and the `token_healing` extension (bool; unset: the server default).
vLLM's older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` /
`guided_json_object` map to the same path (router.structured.guided_spec), never ignored.
Chat `chat_template_kwargs` go to the chat template (router.chat_template); chat responses
carry `reasoning_content` / `reasoning` (router.reasoning).

Log probabilities (completions `logprobs: N`, chat `logprobs: true` + `top_logprobs: N`, N <= 20)
are those of the target model's raw logits at each emitted position, exact under speculation;
streams carry them per chunk. `stop_token_ids` and `min_tokens` follow vLLM.

Extensions (request):
  - `mtp: {"num_speculative_tokens": int >= 0 | null, "disable": bool}` caps this request's
    drafts per speculative round at `num_speculative_tokens` (never above the server's k), or
    turns speculation off (`disable: true`, same as a cap of 0). Output is identical either way
    (greedy) or identically distributed (sampling); only speed changes.
  - `ignore_eos: bool` keeps generating past EOS (benchmarks with fixed output lengths).
  - `disaggregate: bool | null` overrides conditional disaggregation
    (`decode.max_local_prefill_length`): true prefills on a prefill replica, false on the
    decode replica (a 400 if the server does not allow that prompt there); null lets the
    server choose. Output is the same either way.
  - `return_token_ids: bool` adds `token_ids` (generated ids, all of them, including any past a
    stop string) to every choice, and `prompt_token_ids` to the response.
Extension (response): `mtp_stats` (see `MTPStats`) on every finished choice, and summed over the
choices on the response (non-streaming) or on the usage chunk (streaming, with `include_usage`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    field_validator,
    model_validator,
)

from mtpserve.router.errors import APIError


def check_text(text: str) -> str:
    """`text` if it is valid Unicode; JSON may carry a lone surrogate (`"\\ud800"`), which no
    tokenizer can encode."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text is not valid Unicode (lone surrogate at {e.start})") from None
    return text


Int = Annotated[int, Strict()]
Float = Annotated[float, Strict()]  # strict float still takes JSON integers
Bool = Annotated[bool, Strict()]
# Every string a client sends is valid Unicode, or the request is a 400 naming the field.
Str = Annotated[str, Strict(), AfterValidator(check_text)]

MAX_N = 16
MAX_CHOICES = 64  # prompts x n in one request
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 512  # per stop string: the matcher's work per delta grows with its length
MAX_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_STOP_TOKEN_IDS = 64


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class MTPOptions(BaseModel):
    """Per-request speculation control (extension). Unknown keys are an error: a typo here
    would otherwise silently change nothing."""

    model_config = ConfigDict(extra="forbid")
    num_speculative_tokens: Int | None = Field(None, ge=0, description="cap on drafts per round")
    disable: Bool = Field(False, description="no speculation for this request")

    @property
    def cap(self) -> int | None:
        return 0 if self.disable else self.num_speculative_tokens


class StreamOptions(_Request):
    include_usage: Bool | None = False


class SamplingRequest(_Request):
    """Fields shared by completions and chat completions. `None` means the default."""

    model: Str | None = None
    temperature: Float | None = Field(None, ge=0, le=2)
    top_p: Float | None = Field(None, gt=0, le=1)
    top_k: Int | None = Field(None, ge=-1, description="extension; 0 or -1 disables")
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    n: Int | None = Field(None, ge=1, le=MAX_N)
    stream: Bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    logit_bias: dict[str, Any] | None = None
    mtp: MTPOptions | None = None
    ignore_eos: Bool | None = False
    disaggregate: Bool | None = Field(
        None, description="extension: true prefills on a prefill replica, false on the decode "
        "replica; null: the server's conditional disaggregation decides")
    return_token_ids: Bool | None = False
    stop_token_ids: list[Int] | None = Field(
        None, max_length=MAX_STOP_TOKEN_IDS,
        description="extension (vLLM): token ids that end the choice (included in the output)")
    min_tokens: Int | None = Field(
        None, ge=0, description="extension (vLLM): EOS and stop tokens cannot end the choice "
        "before this many tokens")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="extension (vLLM): one of json (schema), regex, choice, grammar")
    token_healing: Bool | None = Field(
        None, description="extension: back off a prompt's trailing token whose text a longer "
        "token extends and make the output begin with it (text prompts of completions)")
    # vLLM's older names for `structured_outputs` (router.structured.guided_spec maps them).
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_json_object: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        for s in [v] if isinstance(v, str) else v or []:
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return v

    @property
    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return [s for s in stop if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def num_logprobs(self) -> int | None:
        """Alternatives per token the engine returns (None: no logprobs at all)."""
        return None

    def generate_options(self) -> dict[str, Any]:
        """`SamplingParams` fields taken from this body as they are."""
        return {"stop_token_ids": tuple(self.stop_token_ids or ()),
                "min_tokens": self.min_tokens or 0, "logprobs": self.num_logprobs}

    def check_supported(self) -> None:
        """Reject, rather than ignore, parameters that would change the output."""
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise APIError(f"'{name}' is not supported (use 0)", 400, param=name)
        if self.logit_bias:
            raise APIError("'logit_bias' is not supported", 400, param="logit_bias")


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`. A list of strings (or of token-id lists) is a batch: each prompt
    gets `n` choices, ordered prompt-major (choice index = prompt index * n + i)."""

    prompt: Str | list[Str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(None, ge=1)
    echo: Bool | None = False
    logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS,
                                 description="log probabilities of each token + the N best")
    suffix: Str | None = None
    best_of: Int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_count(cls, v: Any) -> Any:
        # Before the items are validated: a body of a million tiny prompts is refused at
        # once, not parsed, tokenized and only then counted.
        if isinstance(v, list) and len(v) > MAX_CHOICES and not isinstance(v[0], int):
            raise ValueError(f"at most {MAX_CHOICES} prompts per request")
        return v

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be an empty list")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        return [p] if isinstance(p[0], int) else list(p)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_tokens

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise APIError("'echo' is not supported", 400, param="echo")
        if self.suffix:
            raise APIError("'suffix' is not supported", 400, param="suffix")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise APIError("'best_of' is not supported", 400, param="best_of")


class ContentPart(_Request):
    type: Str
    text: Str | None = None

    @model_validator(mode="after")
    def _text_only(self) -> ContentPart:
        if self.type != "text" or self.text is None:
            raise ValueError(f"only text content parts are supported, got type '{self.type}'")
        return self


class FunctionCallIn(_Request):
    name: Str
    arguments: Str = "{}"


class ToolCallIn(_Request):
    id: Str = ""
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: Str | None = None  # a tool result: the call it answers
    name: Str | None = None

    @property
    def text(self) -> str:
        """Content as one string; text parts are joined with newlines."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text or "" for p in self.content)


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`. `max_completion_tokens` wins over `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = Field(None, ge=1)
    max_completion_tokens: Int | None = Field(None, ge=1)
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: Bool | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="extension (vLLM): extra variables for the chat template, e.g. "
        "enable_thinking, thinking")

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("'top_logprobs' needs 'logprobs': true", 400, param="top_logprobs")


class KVProbeRequest(_Request):
    num_bytes: Int = Field(ge=1, le=1 << 31)


# Responses ---------------------------------------------------------------------------------
class MTPStats(BaseModel):
    """Speculation statistics of one choice (or summed over the choices of a response).

    `num_drafted` MTP draft tokens were verified, `num_accepted` of them accepted;
    `acceptance_rate = num_accepted / num_drafted`; `num_rounds` speculative decode rounds ran;
    `mean_accepted_length = (num_accepted + num_rounds) / num_rounds` is the tokens emitted per
    round (accepted drafts plus the one recovered/bonus token). Rates are null when undefined.
    """

    num_drafted: int
    num_accepted: int
    num_rounds: int
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None

    @classmethod
    def of(cls, num_drafted: int, num_accepted: int, num_rounds: int) -> MTPStats:
        return cls(
            num_drafted=num_drafted, num_accepted=num_accepted, num_rounds=num_rounds,
            acceptance_rate=num_accepted / num_drafted if num_drafted else None,
            mean_accepted_length=(num_accepted + num_rounds) / num_rounds if num_rounds
            else None,
        )

    @classmethod
    def total(cls, stats: list[MTPStats]) -> MTPStats:
        return cls.of(sum(s.num_drafted for s in stats), sum(s.num_accepted for s in stats),
                      sum(s.num_rounds for s in stats))


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # OpenAI's field: prompt tokens served from the prefix cache.
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions format: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = None
    mtp_stats: MTPStats | None = None
    mtpserve_trace: dict[str, float] | None = None  # streamed, MTPSERVE_TRACE_HOPS=1 only


class CompletionResponse(BaseModel):
    """A completion, or (`object` the same, per OpenAI) one streamed chunk of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    mtp_stats: MTPStats | None = None
    prompt_token_ids: list[list[int]] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    # The reasoning block (router.reasoning), under vLLM's old and current names.
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] | None = None
    mtp_stats: MTPStats | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    mtp_stats: MTPStats | None = None
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A streamed tool call: the first delta has id, type and name; later ones the next
    fragment of the arguments (JSON text; concatenated they are the call's arguments)."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "tool_calls"] | None = None
    token_ids: list[int] | None = None
    mtp_stats: MTPStats | None = None
    mtpserve_trace: dict[str, float] | None = None  # MTPSERVE_TRACE_HOPS=1 only


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    mtp_stats: MTPStats | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "mtpserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# Tokenizer routes (vLLM's shapes) -----------------------------------------------------------
class TokenizeRequest(_Request):
    """`POST /tokenize`: a prompt, or chat messages rendered by the chat template."""

    model: Str | None = None
    prompt: Str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: Bool = True
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False
    tools: list[Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' and 'messages'")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Request):
    model: Str | None = None
    tokens: list[Int] = Field(max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str
