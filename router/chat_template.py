"""Chat messages → prompt token ids.

The tokenizer's own chat template when it has one (`tokenizer.chat_template`), so a chat model
sees the format it was trained on. Otherwise `DEFAULT_CHAT_TEMPLATE`, a plain format that a base
model (such as the embedded code model) can at least continue sensibly:

    <|system|>
    You are terse.
    <|user|>
    Hello
    <|assistant|>

one `<|role|>` line then the content and a newline per message, ending with `<|assistant|>\\n`
so generation starts the assistant's turn (left out with `add_generation_prompt=False`). The
role markers are ordinary text, not special tokens, so any tokenizer can encode them.
"""

from __future__ import annotations

from typing import Any

DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
GENERATION_PROMPT = "<|assistant|>\n"


def render_default(messages: list[dict[str, str]]) -> str:
    return "".join(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=m["content"])
                   for m in messages) + GENERATION_PROMPT


# Names a request's `chat_template_kwargs` may not set: they are the renderer's own arguments
# (`chat_template` would let a client swap the template itself).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation", "max_length",
})


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """`chat_template_kwargs` as the template gets them; ValueError names a reserved key."""
    out = dict(kwargs or {})
    for key in out:
        if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
            raise ValueError(f"'{key}' cannot be set through chat_template_kwargs")
    return out


def apply_chat_template(tokenizer: Any, messages: list[dict[str, Any]], *,
                        tools: list[dict] | None = None, add_generation_prompt: bool = True,
                        template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Prompt ids for `messages` ({"role", "content"} dicts), ready for generation unless
    `add_generation_prompt` is false. `tools` and `template_kwargs` (a request's
    `chat_template_kwargs`, e.g. `enable_thinking`) go to the checkpoint's template; the
    default template has no variables and ignores them."""
    if getattr(tokenizer, "chat_template", None):
        # Render to text then encode: the template already writes any BOS it wants.
        text = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt,
            **check_template_kwargs(template_kwargs))
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = render_default(messages)
    if not add_generation_prompt:
        text = text[: len(text) - len(GENERATION_PROMPT)]
    return list(tokenizer.encode(text))
