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
so generation starts the assistant's turn. The role markers are ordinary text, not special
tokens, so any tokenizer can encode them.
"""

from __future__ import annotations

from typing import Any

DEFAULT_CHAT_TEMPLATE = "<|{role}|>\n{content}\n"
GENERATION_PROMPT = "<|assistant|>\n"


def render_default(messages: list[dict[str, str]]) -> str:
    return "".join(DEFAULT_CHAT_TEMPLATE.format(role=m["role"], content=m["content"])
                   for m in messages) + GENERATION_PROMPT


def apply_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """Prompt token ids for `messages` ({"role", "content"} dicts), ready for generation."""
    if getattr(tokenizer, "chat_template", None):
        # Render to text then encode: the template already writes any BOS it wants.
        text = tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(render_default(messages)))
