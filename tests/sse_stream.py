"""A streaming completion read on its own thread (tests that kill, drain or migrate while
tokens flow): records the token ids, text, finish reason, event count and the first error."""

from __future__ import annotations

import json
import threading

import httpx


class StreamingCompletion(threading.Thread):
    def __init__(self, base_url: str, prompt: str, max_tokens: int,
                 headers: dict[str, str] | None = None, timeout_s: float = 120) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/v1/completions"
        self.body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                     "ignore_eos": True, "stream": True, "return_token_ids": True}
        self.headers = headers or {}
        self.timeout_s = timeout_s
        self.token_ids: list[int] = []
        self.text = ""
        self.finish_reason: str | None = None
        self.num_events = 0
        self.error: str | None = None
        self.done = False  # saw `data: [DONE]`

    def run(self) -> None:
        try:
            with httpx.stream("POST", self.url, json=self.body, headers=self.headers,
                              timeout=self.timeout_s) as resp:
                if resp.status_code != 200:
                    self.error = f"{resp.status_code}: {resp.read()[:300]!r}"
                    return
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = self.error or event["error"]["message"]
                            continue
                        choice = event["choices"][0]
                        self.num_events += 1
                        self.token_ids += choice.get("token_ids") or []
                        self.text += choice["text"]
                        self.finish_reason = choice.get("finish_reason") or self.finish_reason
        except Exception as e:  # reported by the test, never swallowed
            self.error = f"{type(e).__name__}: {e}"
