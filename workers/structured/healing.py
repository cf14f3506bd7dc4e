"""Token healing: back off the prompt's trailing token(s) whose text a longer token extends.

A prompt that ends in `"\\n"` (what an editor sends before the next line) ends on a token the
model rarely saw there: in training the newline merged with the indentation after it, so a bare
`"\\n"` token ended files, and the model predicts end of text. Healing removes such trailing
tokens and constrains the first generated token(s) to spell their text out again
(`StructuredSpec.prefix`, a `PrefixConstraint`): the model then picks `"\\n    "` itself. The
caller strips the healed text from the output, so the client sees a plain continuation.

The default (a request that leaves `token_healing` unset, `LLM.generate` without the argument)
is the model's: `"mtpserve": {"token_healing": true}` in its config.json, on for the embedded
model. Not transformers' `generation_config.token_healing`: that one would turn on
`generate()`'s own healing (which re-tokenizes stripped prompts) for every transformers user of
the checkpoint. The default heals only a tail of whitespace holding a line break (the editor's
prompt it exists for); `token_healing: true` heals any healable tail. The server and the
offline `LLM` both call `heal_prompt` and `strip_healed`, so served text equals offline text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MAX_HEALED_TOKENS = 2
CONFIG_KEY = "mtpserve"  # config.json's section of mtpserve's per-model serving defaults


class HealingTable:
    """Which byte strings some token strictly extends, for one vocabulary."""

    def __init__(self, token_bytes: list[bytes]) -> None:
        self.token_bytes = token_bytes
        self.extendable: set[bytes] = set()
        for b in token_bytes:
            for i in range(1, len(b)):
                self.extendable.add(b[:i])

    def heal(self, prompt_ids: list[int], max_tokens: int = MAX_HEALED_TOKENS
             ) -> tuple[list[int], bytes]:
        """(the prompt without its healable tail, the tail's bytes); (prompt_ids, b"") when
        the last token is not extended by any token. At least one prompt token stays."""
        cut, tail = len(prompt_ids), b""
        while cut > 1 and len(prompt_ids) - cut < max_tokens:
            t = prompt_ids[cut - 1]
            b = self.token_bytes[t] if 0 <= t < len(self.token_bytes) else b""
            if not b or b + tail not in self.extendable:
                break
            cut, tail = cut - 1, b + tail
        return prompt_ids[:cut], tail


@dataclass(frozen=True)
class HealedPrompt:
    """A prompt after healing: the ids to run, the backed-off tail's bytes and text (b"" and
    "" when nothing was healed)."""

    ids: list[int]
    tail: bytes = b""
    text: str = ""

    @property
    def healed(self) -> bool:
        return bool(self.tail)


def model_default(config: dict[str, Any] | str | Path) -> bool:
    """The model's token healing default: `config.json`'s `mtpserve.token_healing` (False when
    absent). `config`: the parsed config.json, or the checkpoint folder."""
    if not isinstance(config, dict):
        f = Path(config) / "config.json"
        config = json.loads(f.read_text()) if f.is_file() else {}
    section = config.get(CONFIG_KEY)
    return bool(section.get("token_healing", False)) if isinstance(section, dict) else False


def may_heal(last_token_text: str, any_tail: bool) -> bool:
    """A cheap test from the prompt's last token's text, before any vocabulary is scanned (the
    table's token bytes load xgrammar, ~2 s): False when `heal_prompt` cannot heal it. The
    default's tail is whitespace, so its last token is."""
    return any_tail or (last_token_text != "" and not last_token_text.strip())


def heal_prompt(table: HealingTable, ids: list[int], any_tail: bool = True) -> HealedPrompt:
    """Heal `ids` with `table`; without `any_tail` (the default setting, not an explicit
    request) only a line-break tail is healed, other prompts keep their exact tokens."""
    healed, tail = table.heal(ids)
    if not tail or not (any_tail or (b"\n" in tail and not tail.strip())):
        return HealedPrompt(ids)
    try:
        text = tail.decode("utf-8")
    except UnicodeDecodeError:  # a token split inside a character: leave the prompt alone
        return HealedPrompt(ids)
    return HealedPrompt(healed, tail, text)


def strip_healed(text: str, prefix: str) -> tuple[str, str]:
    """Strip what is left of the healed `prefix` from the next piece of output `text`:
    (the text to show, the prefix still to strip). Streamed piece by piece it gives what the
    whole text gives at once. A piece that does not continue the prefix (impossible under the
    prefix constraint) ends the stripping, so real output is never eaten."""
    if not prefix or not text:
        return text, prefix
    n = min(len(text), len(prefix))
    if text[:n] == prefix[:n]:
        return text[n:], prefix[n:]
    return text, ""
