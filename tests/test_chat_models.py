"""The chat fixtures of tests/chat_models.py: every marker is one token, the templates render
the formats the module docstring describes, and each checkpoint loads in the engine."""

from __future__ import annotations

import pytest
from chat_models import SINGLE_TOKENS, STYLES

from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.tokenizer import load_tokenizer

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
HISTORY = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    {"role": "assistant", "content": "Sunny."},
    {"role": "user", "content": "London?"},
]
CALL_TEXT = {
    "qwen3": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
             '</tool_call>',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
                   "</parameter>\n</function>\n</tool_call>",
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
             "</tool_call>",
    "deepseek_v3": '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                   '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
}
# The end of the rendered prompt: (default kwargs, thinking off / on kwargs).
PROMPT_END = {
    "qwen3": ("<|im_start|>assistant\n", {"enable_thinking": False},
              "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "qwen3_coder": ("<|im_start|>assistant\n<think>\n", {"enable_thinking": False},
                    "<|im_start|>assistant\n<think>\n\n</think>\n\n"),
    "glm45": ("London?<|assistant|>", {"enable_thinking": False},
              "London?/nothink<|assistant|>\n<think></think>"),
    "deepseek_v3": ("<｜Assistant｜></think>", {"thinking": True}, "<｜Assistant｜><think>"),
}


@pytest.mark.parametrize("style", STYLES)
def test_markers_are_single_tokens_and_templates_render_the_format(chat_checkpoint, style):
    path = chat_checkpoint(style, "qwen3")
    tok = load_tokenizer(str(path))
    for marker in SINGLE_TOKENS[style]:
        ids = tok.encode(marker, add_special_tokens=False)
        assert len(ids) == 1, (marker, ids)
        assert tok.decode(ids, skip_special_tokens=False) == marker
    text = tok.apply_chat_template(HISTORY, tools=[WEATHER], tokenize=False,
                                   add_generation_prompt=True)
    assert CALL_TEXT[style] in text
    assert "get_weather" in text.split("Weather in Paris?")[0]  # tools listed up front
    assert "sunny" in text and "Be terse." in text
    default_end, kwargs, switched_end = PROMPT_END[style]
    assert text.endswith(default_end)
    switched = tok.apply_chat_template(HISTORY, tools=[WEATHER], tokenize=False,
                                       add_generation_prompt=True, **kwargs)
    assert switched.endswith(switched_end) and switched != text
    bare = tok.apply_chat_template(HISTORY[:2], tokenize=False, add_generation_prompt=False)
    assert bare.rstrip("\n").endswith(("Weather in Paris?", "Weather in Paris?<|im_end|>"))


@pytest.mark.parametrize("style", ["glm45", "deepseek_v3"])
def test_own_family_checkpoints_load(chat_checkpoint, style):
    path = chat_checkpoint(style)
    eng = Engine(EngineConfig(model=str(path), num_speculative_tokens=1, num_kv_blocks=32))
    tok = load_tokenizer(str(path))
    assert eng.model_config.vocab_size >= len(tok)
    assert eng.model_config.model_type == {"glm45": "glm4_moe", "deepseek_v3": "deepseek_v3"}[
        style]
    ends = {"glm45": "<|user|>", "deepseek_v3": "<｜end▁of▁sentence｜>"}[style]
    assert tok.convert_tokens_to_ids(ends) in eng.eos_ids
