from __future__ import annotations

import pytest
from pydantic import ValidationError

from mtpserve.router.chat_template import apply_chat_template, render_default
from mtpserve.router.errors import APIError, from_exception
from mtpserve.router.protocol import ChatCompletionRequest, CompletionRequest, MTPStats


def test_prompt_forms():
    assert CompletionRequest(prompt="a").prompts == ["a"]
    assert CompletionRequest(prompt=[1, 2]).prompts == [[1, 2]]
    assert CompletionRequest(prompt=["a", "b"]).prompts == ["a", "b"]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts == [[1], [2, 3]]
    with pytest.raises(ValidationError):
        CompletionRequest(prompt=[])


@pytest.mark.parametrize("field,value", [
    ("max_tokens", "16"), ("max_tokens", 1.5), ("n", True), ("stream", 1), ("seed", "1"),
    ("temperature", "0.5"), ("top_p", 0), ("stop", ["a"] * 5), ("mtp", {"disable": "yes"}),
])
def test_wrong_types_are_rejected_not_coerced(field, value):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", field: value})


def test_unknown_fields_are_ignored_but_mtp_typos_are_not():
    req = CompletionRequest.model_validate({"prompt": "x", "new_openai_field": [1],
                                            "temperature": 0})
    assert req.temperature == 0.0
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "mtp": {"k": 1}})


def test_mtp_cap():
    assert CompletionRequest(prompt="x", mtp={"disable": True}).mtp.cap == 0
    assert CompletionRequest(prompt="x", mtp={"num_speculative_tokens": 1}).mtp.cap == 1
    assert CompletionRequest(prompt="x", mtp={}).mtp.cap is None


@pytest.mark.parametrize("extra,param", [
    ({"echo": True}, "echo"), ({"suffix": "s"}, "suffix"),
    ({"presence_penalty": 0.5}, "presence_penalty"), ({"logit_bias": {"1": 2}}, "logit_bias"),
])
def test_output_changing_unsupported_fields_are_400(extra, param):
    with pytest.raises(APIError) as e:
        CompletionRequest(prompt="x", **extra).check_supported()
    assert e.value.status == 400 and e.value.param == param
    CompletionRequest(prompt="x", presence_penalty=0, echo=False).check_supported()


def test_chat_messages():
    req = ChatCompletionRequest.model_validate({
        "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                  {"type": "text", "text": "b"}]}],
        "max_tokens": 5, "max_completion_tokens": 7})
    assert req.messages[0].text == "a\nb"
    assert req.max_output_tokens == 7
    with pytest.raises(ValidationError, match="only text"):
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    with pytest.raises(APIError) as e:  # top_logprobs alone is an error, as at OpenAI
        ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                              "top_logprobs": 2}).check_supported()
    assert e.value.param == "top_logprobs"


def test_logprobs_and_token_options():
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert ChatCompletionRequest.model_validate(chat).num_logprobs is None
    assert ChatCompletionRequest.model_validate({**chat, "logprobs": True}).num_logprobs == 0
    req = ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 5})
    req.check_supported()
    assert req.num_logprobs == 5
    cmpl = CompletionRequest(prompt="x", logprobs=3, stop_token_ids=[7, 9], min_tokens=4)
    cmpl.check_supported()
    assert cmpl.generate_options() == {"stop_token_ids": (7, 9), "min_tokens": 4,
                                       "logprobs": 3}
    assert CompletionRequest(prompt="x").generate_options() == {
        "stop_token_ids": (), "min_tokens": 0, "logprobs": None}
    for bad in ({"logprobs": 21}, {"logprobs": -1}, {"min_tokens": -1},
                {"stop_token_ids": ["a"]}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", **bad})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**chat, "logprobs": True, "top_logprobs": 21})


def test_mtp_stats():
    s = MTPStats.of(num_drafted=10, num_accepted=6, num_rounds=5)
    assert s.acceptance_rate == 0.6 and s.mean_accepted_length == 2.2
    none = MTPStats.of(0, 0, 0)
    assert none.acceptance_rate is None and none.mean_accepted_length is None
    assert MTPStats.total([s, MTPStats.of(2, 0, 2)]).acceptance_rate == 0.5


def test_exception_classification():
    class EngineError(ValueError):
        pass

    class BackPressureError(Exception):
        pass

    assert from_exception(EngineError("too long")).status == 400
    assert from_exception(TimeoutError()).status == 503
    busy = from_exception(BackPressureError("full"))  # Serve's queue is full: retry later
    assert busy.status == 429 and busy.headers.get("Retry-After")
    err = from_exception(RuntimeError("x" * 2000))
    assert err.status == 500 and len(err.message) < 600  # truncated detail


class _NoTemplate:
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [ord(c) for c in text]


class _WithTemplate(_NoTemplate):
    chat_template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, tools=None):
        assert not tokenize and add_generation_prompt and tools is None
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"


def test_chat_template_default_and_own():
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    assert render_default(msgs) == "<|system|>\ns\n<|user|>\nhi\n<|assistant|>\n"
    assert apply_chat_template(_NoTemplate(), msgs) == [ord(c) for c in render_default(msgs)]
    assert apply_chat_template(_WithTemplate(), msgs) == [ord(c) for c in
                                                         "[system]s[user]hi[assistant]"]
