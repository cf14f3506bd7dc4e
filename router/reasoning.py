"""Reasoning parsers: a chat choice's output split into `reasoning_content` and `content`.

vLLM's parser names and behaviour, chosen by the config's `reasoning_parser` (`auto`: from the
checkpoint's `model_type` and whether its chat template writes `<think>`, see
`resolve_parser`; `none`: no split):

- `deepseek_r1`: the output starts inside the reasoning (DeepSeek-R1's template opens `<think>`
  in the prompt); a `<think>` the model writes first anyway is dropped; everything up to the
  first `</think>` is reasoning, the rest content. No `</think>` at all: all reasoning.
- `deepseek_v3`: DeepSeek-V3.1: `deepseek_r1` when the request's `chat_template_kwargs` turn
  `thinking` on (the template then ends the prompt in `<think>`), else no split.
- `qwen3`, `glm45`: the output is content unless it opens a block with `<think>` (after
  whitespace at most), or the prompt itself ends inside an open block (a template that writes
  `<think>` into the generation prompt: Qwen3.5, Qwen3-Thinking-2507); the block ends at the
  first `</think>`. Qwen3 with `enable_thinking: false` (the template closes an empty block in
  the prompt) is all content.

One reasoning block per choice: after `</think>`, markers are ordinary text. Whether the prompt
ends inside a block is read from its last few tokens (`PROMPT_TAIL_TOKENS`), the template's
generation prompt, not from markers a user typed earlier in the conversation.

**Token ids where the markers are single tokens** (`<think>` and `</think>` each encode to one
id: Qwen3, GLM-4.5, DeepSeek; special added tokens or not): the split is decided on ids, so text
that merely spells `</think>` out of ordinary tokens is not a marker, and the reasoning and the
content are detokenized separately (a marker can arrive anywhere inside a chunk: a speculative
round emits several tokens at once). **Text otherwise**: the split is found in the detokenized
text, and a possible start of a marker at a chunk's end is held back until the next chunk says
whether it is one (a `</think>` split across tokens or chunks).

Markers that are special tokens: the splitter's detokenizers keep `<think>` / `</think>` (and
the tool-call markers the router passes in `skip_ids`) as text, so a special marker reads as the
same text as a plain one (a `</think>` after the block is content, as it is when not special),
while the other special tokens (EOS, ...) stay skipped (`workers.detokenizer.marker_skip_ids`).

Stop strings apply to the content, not to the reasoning; tool calls are parsed from the content.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from mtpserve.workers.detokenizer import (
    IncrementalDetokenizer,
    decode,
    marker_skip_ids,
    single_token_id,
)

PARSERS = ("deepseek_r1", "deepseek_v3", "qwen3", "glm45")
START, END = "<think>", "</think>"
PROMPT_TAIL_TOKENS = 8  # the generation prompt's markers sit in the prompt's last tokens
_BEFORE, _REASONING, _CONTENT = "before", "reasoning", "content"


def template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template(s) as one text ('' when it has none)."""
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(v for v in t.values() if isinstance(v, str))
    return t if isinstance(t, str) else ""


def resolve_parser(setting: str, model_type: str | None, template: str) -> str | None:
    """The parser name for a config setting; None: no split. `auto` needs a template that
    writes `<think>`: DeepSeek (`model_type` deepseek*) is `deepseek_v3` when the template
    reads a `thinking` switch (V3.1), else `deepseek_r1`; GLM (glm*) `glm45`; any other
    (Qwen3, Qwen3.5, Qwen3-Next, ...) `qwen3`."""
    if setting == "none":
        return None
    if setting != "auto":
        if setting not in PARSERS:
            raise ValueError(f"unknown reasoning parser {setting!r}; known: {PARSERS}")
        return setting
    if START not in template:
        return None
    mt = (model_type or "").lower()
    if mt.startswith("deepseek"):
        return "deepseek_v3" if re.search(r"\bthinking\b", template) else "deepseek_r1"
    if mt.startswith("glm"):
        return "glm45"
    return "qwen3"


@dataclass(frozen=True)
class Reasoner:
    """A parser bound to a tokenizer: what every choice of the server starts from."""

    name: str
    tokenizer: Any
    start_id: int | None  # both set: split on token ids
    end_id: int | None
    # Decoding that keeps the markers where they are special tokens (None: plain skipping).
    skip_ids: frozenset[int] | None = None

    @classmethod
    def build(cls, name: str, tokenizer: Any) -> Reasoner:
        start, end = single_token_id(tokenizer, START), single_token_id(tokenizer, END)
        skip = marker_skip_ids(tokenizer, (START, END))
        if start is None or end is None:
            start = end = None
        return cls(name, tokenizer, start, end, skip)

    @property
    def on_ids(self) -> bool:
        return self.end_id is not None

    def parser_for(self, template_kwargs: dict[str, Any] | None) -> str | None:
        """The behaviour for one request (deepseek_v3 depends on its `thinking` switch)."""
        if self.name == "deepseek_v3":
            kw = template_kwargs or {}
            return "deepseek_r1" if kw.get("thinking") or kw.get("enable_thinking") else None
        return self.name

    def prompt_opens_block(self, prompt_ids: list[int]) -> bool:
        """Whether the prompt's generation part leaves a `<think>` block open."""
        tail = list(prompt_ids[-PROMPT_TAIL_TOKENS:])
        if self.on_ids:
            last = [t for t in tail if t in (self.start_id, self.end_id)]
            return bool(last) and last[-1] == self.start_id
        text = self.tokenizer.decode(tail, skip_special_tokens=False)
        return text.rfind(START) > text.rfind(END)

    def grammar_gate(self, prompt_ids: list[int], template_kwargs: dict[str, Any] | None = None
                     ) -> tuple[str | None, str | None]:
        """(structured_after, structured_opener) for a constrained request: a grammar
        (response_format, forced tools) applies after the reasoning block, never inside it.
        Output that starts inside the block (the prompt opened it, DeepSeek-R1): after its
        end marker. Output that may open one (Qwen3 thinking, single-token markers): after the
        end marker if it opens, else from its first token. A block the prompt closed
        (enable_thinking false) or none expected: (None, None), the grammar from the start."""
        split = self.split(prompt_ids, template_kwargs)
        if split is None:
            return None, None
        if split.state == _REASONING:
            return END, None
        tail = list(prompt_ids[-PROMPT_TAIL_TOKENS:])
        if self.on_ids and self.end_id not in tail:
            return END, START
        return None, None

    def split(self, prompt_ids: list[int], template_kwargs: dict[str, Any] | None = None,
              skip_ids: frozenset[int] | None = None) -> ReasoningSplit | None:
        """A fresh per-choice splitter, or None when this request's output is not split.
        `skip_ids`: the choice's decoding (the router's, keeping its tool-call markers too);
        default: this reasoner's own."""
        name = self.parser_for(template_kwargs)
        if name is None:
            return None
        if name == "deepseek_r1" or self.prompt_opens_block(prompt_ids):
            state = _REASONING
        else:
            state = _BEFORE
        return ReasoningSplit(self, prompt_ids, state,
                              self.skip_ids if skip_ids is None else skip_ids)


class ReasoningSplit:
    """One choice's output ids in, (reasoning text, content text) deltas out. Detokenizes
    itself (in place of the choice's detokenizer). Mutates only itself."""

    def __init__(self, reasoner: Reasoner, prompt_ids: list[int], state: str,
                 skip_ids: frozenset[int] | None = None) -> None:
        self.r = reasoner
        self.state = state
        self.leading = True  # nothing but whitespace seen in the current state yet
        self.skip_ids = skip_ids
        tok = reasoner.tokenizer
        self.ids: list[int] = list(prompt_ids[-PROMPT_TAIL_TOKENS:])  # context + output
        self._reasoning = self._detok()
        self._content = self._detok()
        self._held_ids: list[int] = []  # ids mode, before: whitespace that may precede <think>
        self._held = ""  # text mode: text that may be the start of a marker
        self._text = IncrementalDetokenizer(tok, self.ids, skip_ids=skip_ids)  # text mode
        self.saw_block = state == _REASONING

    def _detok(self) -> IncrementalDetokenizer:
        """A detokenizer of what follows the ids so far (they are its context)."""
        return IncrementalDetokenizer(self.r.tokenizer, self.ids, skip_ids=self.skip_ids)

    # ids ------------------------------------------------------------------------------------
    def _feed_ids(self, token_ids: list[int], final: bool) -> tuple[str, str]:
        r_out, c_out = [], []
        r = self.r
        for t in token_ids:
            self.ids.append(t)
            if self.state == _REASONING:
                if t == r.end_id:
                    r_out.append(self._reasoning.flush())
                    self.state = _CONTENT
                    self._content = self._detok()
                elif t == r.start_id and self.leading:
                    pass  # the model re-opened the block the prompt opened
                else:
                    text = self._reasoning.add([t])
                    self.leading = self.leading and not text.strip() and not self._pending(
                        self._reasoning)
                    r_out.append(text)
            elif self.state == _BEFORE:
                if t == r.start_id:
                    self._held_ids = []  # whitespace before the block is dropped
                    self.state, self.leading, self.saw_block = _REASONING, True, True
                    self._reasoning = self._detok()
                    continue
                self._held_ids.append(t)
                held = decode(r.tokenizer, self._held_ids, self.skip_ids)
                if held.strip() or t == r.end_id:
                    self.state = _CONTENT
                    c_out.append(self._content.add(self._held_ids))
                    self._held_ids = []
            else:
                c_out.append(self._content.add([t]))
        if final:
            if self._held_ids:
                c_out.append(self._content.add(self._held_ids))
                self._held_ids = []
            r_out.append(self._reasoning.flush())
            c_out.append(self._content.flush())
        return "".join(r_out), "".join(c_out)

    @staticmethod
    def _pending(detok: IncrementalDetokenizer) -> bool:
        return detok.read_offset < len(detok.token_ids)  # bytes held for a whole character

    # text -----------------------------------------------------------------------------------
    def _feed_text(self, text: str, final: bool) -> tuple[str, str]:
        buf, self._held = self._held + text, ""
        r_out, c_out = [], []
        while buf:
            if self.state == _CONTENT:
                c_out.append(buf)
                break
            if self.state == _BEFORE:
                s = buf.lstrip()
                if s.startswith(START):
                    self.state, self.leading, self.saw_block = _REASONING, True, True
                    buf = s[len(START):]
                    continue
                if START.startswith(s) and not final:  # whitespace or a partial <think>
                    self._held = buf
                    break
                self.state = _CONTENT
                continue
            # reasoning
            if self.leading:
                s = buf.lstrip()
                if s.startswith(START):  # the model re-opened the prompt's block
                    buf, self.leading = s[len(START):], False
                    continue
                if START.startswith(s) and not final:  # whitespace or a partial <think>
                    self._held = buf
                    break
                self.leading = False
            i = buf.find(END)
            if i >= 0:
                r_out.append(buf[:i])
                buf, self.state = buf[i + len(END):], _CONTENT
                continue
            keep = 0 if final else _partial(buf, END)
            r_out.append(buf[: len(buf) - keep])
            self._held = buf[len(buf) - keep:]
            break
        if final and self._held:
            (c_out if self.state != _REASONING else r_out).append(self._held)
            self._held = ""
        return "".join(r_out), "".join(c_out)

    def feed(self, token_ids: list[int], final: bool) -> tuple[str, str]:
        """Consume one chunk's ids; returns the (reasoning, content) text now complete."""
        if self.r.on_ids:
            return self._feed_ids(list(token_ids), final)
        text = self._text.add(list(token_ids))
        if final:
            text += self._text.flush()
        return self._feed_text(text, final)


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def split_text(parser: str, text: str, starts_inside: bool = False) -> tuple[str | None, str]:
    """The non-streamed split of a whole output text (a reference for tests and offline use):
    (reasoning or None, content)."""
    state = _REASONING if parser == "deepseek_r1" or starts_inside else _BEFORE
    sp = ReasoningSplit.__new__(ReasoningSplit)
    sp.state, sp.leading, sp._held, sp.saw_block = state, True, "", state == _REASONING
    sp.skip_ids = None
    reasoning, content = sp._feed_text(text, final=True)
    return (reasoning if sp.saw_block else None), content
