"""Token healing: back off the prompt's trailing token(s) whose text a longer token extends.

A prompt that ends in `"\\n"` (what an editor sends before the next line) ends on a token the
model rarely saw there: in training the newline merged with the indentation after it, so a bare
`"\\n"` token ended files, and the model predicts end of text. Healing removes such trailing
tokens and constrains the first generated token(s) to spell their text out again
(`StructuredSpec.prefix`, a `PrefixConstraint`): the model then picks `"\\n    "` itself. The
caller strips the healed text from the output, so the client sees a plain continuation.
"""

from __future__ import annotations

MAX_HEALED_TOKENS = 2


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
