"""Tiny chat checkpoints in the formats of the reasoning / tool-calling families we serve.

`make_chat_checkpoint(path, style)` writes a tiny random model (with MTP) plus a byte-level BPE
tokenizer that holds each family's real special tokens as single added tokens, and a Jinja
`chat_template` in `tokenizer_config.json` written here from the published formats (not copied
from any project). Styles:

- `"qwen3"`: Qwen3. `<|im_start|>role\\n...<|im_end|>\\n` turns; tools listed as JSON inside
  `<tools></tools>` in the system turn; calls as `<tool_call>\\n{"name": ..., "arguments":
  {...}}\\n</tool_call>`; tool results as `<tool_response>` blocks in a user turn. Thinking is
  on by default (the model opens `<think>` itself); `enable_thinking=False` appends an empty
  `<think>\\n\\n</think>\\n\\n` block after the generation prompt.
- `"qwen3_coder"`: Qwen3-Coder / Qwen3.5. The same turns; tools listed in XML
  (`<function><name>...`); calls as `<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n
  </parameter>\\n</function>\\n</tool_call>`. Qwen3.5-style thinking: the generation prompt
  opens `<think>\\n` itself (the output starts inside the reasoning) unless
  `enable_thinking=False` (then the empty block, as qwen3).
- `"glm45"`: GLM-4.5. `[gMASK]<sop>` then `<|system|>` / `<|user|>` / `<|assistant|>` /
  `<|observation|>` turns (no end-of-turn token: the next role token ends a turn); tools as
  JSON in `<tools>`; calls as `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>
  \\n</tool_call>`; history reasoning as `<think>...</think>`. `enable_thinking=False` adds
  `/nothink` to the last user turn and `\\n<think></think>` after `<|assistant|>`.
- `"deepseek_v3"`: DeepSeek-V3.1 (and R1's think-in-prompt). `<｜begin▁of▁sentence｜>`
  + system text, `<｜User｜>...<｜Assistant｜>`; with `thinking=True` the generation prompt
  ends in `<think>` (the output starts inside the reasoning, as DeepSeek-R1's does), otherwise
  in `</think>`. Calls as `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json
  args}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>`; tool results as
  `<｜tool▁output▁begin｜>...<｜tool▁output▁end｜>`. Assistant turns end in
  `<｜end▁of▁sentence｜>`.

Single tokens (`SINGLE_TOKENS[style]`; each encodes to exactly one id, everything else is
ordinary byte-level BPE text, e.g. Qwen3-Coder's `<function=` and `<parameter=` are plain text
as in the real vocabulary):

- qwen3, qwen3_coder: `<|endoftext|>`, `<|im_start|>`, `<|im_end|>` (special: skipped when
  decoding) and `<think>`, `</think>`, `<tool_call>`, `</tool_call>`, `<tool_response>`,
  `</tool_response>` (not special: kept in decoded text).
- glm45: `<|endoftext|>`, `[gMASK]`, `<sop>`, `<|system|>`, `<|user|>`, `<|assistant|>`,
  `<|observation|>` (special) and `<think>`, `</think>`, `<tool_call>`, `</tool_call>`,
  `<arg_key>`, `</arg_key>`, `<arg_value>`, `</arg_value>`, `<tool_response>`,
  `</tool_response>` (not special).
- deepseek_v3: `<|endoftext|>`, `<｜begin▁of▁sentence｜>`, `<｜end▁of▁sentence｜>`,
  `<｜User｜>`, `<｜Assistant｜>` (special) and `<think>`, `</think>`,
  `<｜tool▁calls▁begin｜>`, `<｜tool▁call▁begin｜>`, `<｜tool▁sep｜>`, `<｜tool▁call▁end｜>`,
  `<｜tool▁calls▁end｜>`, `<｜tool▁output▁begin｜>`, `<｜tool▁output▁end｜>` (not special).

`special_markers=True` (`make_chat_checkpoint`, `make_chat_tokenizer`) makes the second group of
each style (the reasoning and tool-call markers) special added tokens too, as some real
checkpoints register them (router/tool_parsers.py, "Markers as special tokens"): decoding with
`skip_special_tokens` then drops them, and the server has to keep them for its parsers.

The end-of-generation ids (config.json `eos_token_id` and generation_config.json): qwen3 styles
`<|im_end|>` + `<|endoftext|>`; glm45 `<|endoftext|>`, `<|user|>`, `<|observation|>`;
deepseek_v3 `<｜end▁of▁sentence｜>`.

The model is the family's own architecture by default (`family=`: qwen3 styles a dense Qwen3,
glm45 `glm4_moe`, deepseek_v3 `deepseek_v3`, the last two with one DeepSeek-named MTP layer), so
`model_type` is what a real checkpoint of the family has; pass `family="qwen3"` for the
cheapest engine under any template. Its weights are random: greedy output is arbitrary, so a
test forces text with the prompt, `logit_bias` or a grammar, or tests parsers as functions.
"""

from __future__ import annotations

import json
from pathlib import Path

from tiny_models import make_hf_checkpoint, make_tiny_checkpoint
from tokenizers import AddedToken

from mtpserve.workers.training.tokenizer import EOS_TOKEN, train_tokenizer

STYLES = ("qwen3", "qwen3_coder", "glm45", "deepseek_v3")

BOS_DS, EOS_DS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
DS_TOOL = {
    "calls_begin": "<｜tool▁calls▁begin｜>", "call_begin": "<｜tool▁call▁begin｜>",
    "sep": "<｜tool▁sep｜>", "call_end": "<｜tool▁call▁end｜>",
    "calls_end": "<｜tool▁calls▁end｜>", "output_begin": "<｜tool▁output▁begin｜>",
    "output_end": "<｜tool▁output▁end｜>",
}
THINK = ["<think>", "</think>"]
QWEN_SPECIAL = [EOS_TOKEN, "<|im_start|>", "<|im_end|>"]
QWEN_MARKERS = [*THINK, "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
GLM_SPECIAL = [EOS_TOKEN, "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
               "<|observation|>"]
GLM_MARKERS = [*THINK, "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>", "<tool_response>", "</tool_response>"]
DS_SPECIAL = [EOS_TOKEN, BOS_DS, EOS_DS, "<｜User｜>", "<｜Assistant｜>"]
DS_MARKERS = [*THINK, *DS_TOOL.values()]

# (special tokens, non-special single-token markers, end-of-generation tokens, BOS)
_TOKENS = {
    "qwen3": (QWEN_SPECIAL, QWEN_MARKERS, ["<|im_end|>", EOS_TOKEN], None),
    "qwen3_coder": (QWEN_SPECIAL, QWEN_MARKERS, ["<|im_end|>", EOS_TOKEN], None),
    "glm45": (GLM_SPECIAL, GLM_MARKERS, [EOS_TOKEN, "<|user|>", "<|observation|>"], None),
    "deepseek_v3": (DS_SPECIAL, DS_MARKERS, [EOS_DS], BOS_DS),
}
SINGLE_TOKENS = {style: [*sp, *mk] for style, (sp, mk, _, _) in _TOKENS.items()}
END_TOKENS = {style: ends for style, (_, _, ends, _) in _TOKENS.items()}  # the config's EOS ids
DEFAULT_FAMILY = {"qwen3": "qwen3", "qwen3_coder": "qwen3", "glm45": "glm4_moe",
                  "deepseek_v3": "deepseek_v3"}

# Shared Jinja pieces ------------------------------------------------------------------------
# Arguments of a history tool call: a mapping (router.tools passes objects) or JSON text.
_ARGS_JSON = ("{%- if call.function.arguments is string %}{{- call.function.arguments }}"
              "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}")
_SYSTEM = ("{%- set sys = messages[0].content if messages and messages[0].role in "
           "['system', 'developer'] else none %}")
_THINK_OFF = "{%- set think_off = enable_thinking is defined and enable_thinking is false %}"

QWEN3_TEMPLATE = _SYSTEM + _THINK_OFF + """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if sys is not none %}{{- sys + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and '
    'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": '
    '<function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif sys is not none %}
{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if loop.first and sys is not none %}
{%- elif m.role == 'user' or m.role in ['system', 'developer'] %}
{{- '<|im_start|>' + ('user' if m.role == 'user' else 'system') + '\\n' + m.content
    + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif %}
{{- m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- if not loop.first or m.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n{\"name\": \"' + call.function.name + '\", \"arguments\": ' }}
""" + _ARGS_JSON + """
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if think_off %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

QWEN3_CODER_TEMPLATE = _SYSTEM + _THINK_OFF + """
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if sys is not none %}{{- sys + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou have access to the following functions:\\n\\n<tools>' }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{{- '\\n<function>\\n<name>' + fn.name + '</name>' }}
{%- if fn.description %}{{- '\\n<description>' + fn.description + '</description>' }}{%- endif %}
{{- '\\n<parameters>' }}
{%- if fn.parameters is defined and fn.parameters.properties is defined %}
{%- for pname, p in fn.parameters.properties.items() %}
{{- '\\n<parameter>\\n<name>' + pname + '</name>' }}
{%- if p.type is defined %}{{- '\\n<type>' + (p.type | string) + '</type>' }}{%- endif %}
{%- if p.description is defined %}{{- '\\n<description>' + p.description + '</description>' }}
{%- endif %}
{{- '\\n</parameter>' }}
{%- endfor %}
{%- endif %}
{{- '\\n</parameters>\\n</function>' }}
{%- endfor %}
{{- '\\n</tools>\\n\\nTo call a function, reply in this format and nothing after it:\\n\\n'
    '<tool_call>\\n<function=function_name>\\n<parameter=parameter_name>\\nvalue\\n'
    '</parameter>\\n</function>\\n</tool_call><|im_end|>\\n' }}
{%- elif sys is not none %}
{{- '<|im_start|>system\\n' + sys + '<|im_end|>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if loop.first and sys is not none %}
{%- elif m.role == 'user' or m.role in ['system', 'developer'] %}
{{- '<|im_start|>' + ('user' if m.role == 'user' else 'system') + '\\n' + m.content
    + '<|im_end|>\\n' }}
{%- elif m.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if m.reasoning_content %}{{- '<think>\\n' + m.reasoning_content + '\\n</think>\\n\\n' }}
{%- endif %}
{{- m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- if not loop.first or m.content %}{{- '\\n' }}{%- endif %}
{{- '<tool_call>\\n<function=' + call.function.name + '>\\n' }}
{%- if call.function.arguments is mapping %}
{%- for k, v in call.function.arguments.items() %}
{{- '<parameter=' + k + '>\\n' }}
{%- if v is string %}{{- v }}{%- else %}{{- v | tojson }}{%- endif %}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{%- endif %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if think_off %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""

GLM45_TEMPLATE = _THINK_OFF + """
{{- '[gMASK]<sop>' }}
{%- if tools %}
{{- '<|system|>\\n# Tools\\n\\nYou may call one or more functions to assist with the user '
    'query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:'
    '\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, output the function name and arguments within '
    'the following XML format:\\n<tool_call>{function-name}\\n<arg_key>{arg-key-1}</arg_key>'
    '\\n<arg_value>{arg-value-1}</arg_value>\\n<arg_key>{arg-key-2}</arg_key>\\n<arg_value>'
    '{arg-value-2}</arg_value>\\n...\\n</tool_call>' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}
{%- endif %}{%- endfor %}
{%- for m in messages %}
{%- if m.role in ['system', 'developer'] %}
{{- '<|system|>\\n' + m.content }}
{%- elif m.role == 'user' %}
{{- '<|user|>\\n' + m.content }}
{%- if think_off and loop.index0 == ns.last_user %}{{- '/nothink' }}{%- endif %}
{%- elif m.role == 'assistant' %}
{{- '<|assistant|>\\n<think>' + (m.reasoning_content or '') + '</think>\\n' + (m.content or '') }}
{%- for call in m.tool_calls or [] %}
{{- '\\n<tool_call>' + call.function.name + '\\n' }}
{%- if call.function.arguments is mapping %}
{%- for k, v in call.function.arguments.items() %}
{{- '<arg_key>' + k + '</arg_key>\\n<arg_value>' }}
{%- if v is string %}{{- v }}{%- else %}{{- v | tojson }}{%- endif %}
{{- '</arg_value>\\n' }}
{%- endfor %}
{%- endif %}
{{- '</tool_call>' }}
{%- endfor %}
{%- elif m.role == 'tool' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|observation|>' }}{%- endif %}
{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|assistant|>' }}
{%- if think_off %}{{- '\\n<think></think>' }}{%- endif %}
{%- endif %}
"""

DEEPSEEK_V3_TEMPLATE = """
{%- set think_on = thinking is defined and thinking %}
{{- bos_token }}
{%- for m in messages %}{%- if m.role in ['system', 'developer'] %}
{%- if not loop.first %}{{- '\\n\\n' }}{%- endif %}{{- m.content }}
{%- endif %}{%- endfor %}
{%- if tools %}
{{- '\\n\\n## Tools\\nYou have access to the following tools:\\n' }}
{%- for tool in tools %}
{%- set fn = tool.function if tool.function is defined else tool %}
{{- '\\n### ' + fn.name + '\\nDescription: ' + (fn.description or '') + '\\n\\nParameters: '
    + (fn.parameters | tojson) + '\\n' }}
{%- endfor %}
{{- '\\nIMPORTANT: use exactly this format for tool calls:\\n<｜tool▁calls▁begin｜>'
    '<｜tool▁call▁begin｜>tool_name<｜tool▁sep｜>arguments_as_json<｜tool▁call▁end｜>'
    '{more calls}<｜tool▁calls▁end｜>\\n' }}
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}
{{- '<｜User｜>' + m.content }}
{%- elif m.role == 'assistant' %}
{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<｜Assistant｜></think>' }}{%- endif %}
{{- m.content or '' }}
{%- if m.tool_calls %}
{{- '<｜tool▁calls▁begin｜>' }}
{%- for call in m.tool_calls %}
{{- '<｜tool▁call▁begin｜>' + call.function.name + '<｜tool▁sep｜>' }}""" + _ARGS_JSON + """
{{- '<｜tool▁call▁end｜>' }}
{%- endfor %}
{{- '<｜tool▁calls▁end｜>' }}
{%- endif %}
{{- '<｜end▁of▁sentence｜>' }}
{%- elif m.role == 'tool' %}
{{- '<｜tool▁output▁begin｜>' + m.content + '<｜tool▁output▁end｜>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{%- if messages[-1].role != 'tool' %}{{- '<｜Assistant｜>' }}{%- endif %}
{{- '<think>' if think_on else '</think>' }}
{%- endif %}
"""

TEMPLATES = {"qwen3": QWEN3_TEMPLATE, "qwen3_coder": QWEN3_CODER_TEMPLATE,
             "glm45": GLM45_TEMPLATE, "deepseek_v3": DEEPSEEK_V3_TEMPLATE}

WORDS = ["system", "user", "assistant", "weather", "city", "Paris", "London", "function",
         "parameter", "name", "arguments", "value", "unit", "celsius", "think", "answer",
         "hello", "world", "the", "is", "What", "tool", "call", "response", "json", "sunny",
         "reason", "step", "first", "then", "so", "café", "日本語", "{", "}", "\"", ":", ",",
         "\n", " ", "<", ">", "/", "=", "_"]
BASE_VOCAB = 360  # 256 bytes + EOS + merges


def make_chat_tokenizer(path: Path, style: str, special_markers: bool = False) -> Path:
    """tokenizer.json (byte-level BPE + the style's single tokens) and tokenizer_config.json
    with the style's chat template. `special_markers`: the style's markers (`<think>`, the
    tool-call tokens) are special added tokens, as real checkpoints register them (see the
    module docstring)."""
    special, markers, _, bos = _TOKENS[style]
    texts = [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(14)) + "\n"
             for i in range(240)]
    tok = train_tokenizer(texts, BASE_VOCAB)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in special if t != EOS_TOKEN])
    tok.add_tokens([AddedToken(t, special=special_markers, normalized=False) for t in markers])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    eos = _TOKENS[style][2][0]
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": bos,
        "pad_token": EOS_TOKEN,
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "chat_template": TEMPLATES[style],
    }, indent=2, ensure_ascii=False))
    return path


def token_id(path: Path, text: str) -> int:
    """The id of a single-token marker in the checkpoint's tokenizer.json."""
    data = json.loads((Path(path) / "tokenizer.json").read_text())
    for t in data["added_tokens"]:
        if t["content"] == text:
            return t["id"]
    raise KeyError(text)


def make_chat_checkpoint(path: Path, style: str, family: str | None = None,
                         max_positions: int = 2048, seed: int = 0,
                         special_markers: bool = False) -> Path:
    """A tiny random checkpoint (with MTP) whose tokenizer and chat template are `style`'s.

    `family`: the architecture (default: the style's own, see the module docstring).
    `special_markers`: the markers are special added tokens (`make_chat_tokenizer`)."""
    if style not in STYLES:
        raise ValueError(f"style must be one of {STYLES}, got {style!r}")
    family = family or DEFAULT_FAMILY[style]
    path = Path(path)
    make_chat_tokenizer(path, style, special_markers)
    vocab = len(json.loads((path / "tokenizer.json").read_text())["model"]["vocab"])
    vocab += len(json.loads((path / "tokenizer.json").read_text())["added_tokens"])
    vocab = -(-vocab // 16) * 16
    if family in ("qwen3", "llama", "qwen2"):
        make_tiny_checkpoint(path, family, vocab_size=vocab, max_positions=max_positions,
                             seed=seed)
    else:
        make_hf_checkpoint(path, family, num_mtp=1, vocab_size=vocab,
                           max_positions=max_positions, seed=seed)
    eos = [token_id(path, t) for t in _TOKENS[style][2]]
    bos = _TOKENS[style][3]
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    cfg["bos_token_id"] = token_id(path, bos) if bos else None
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = path / "generation_config.json"
    if gen.is_file():
        g = json.loads(gen.read_text())
        g["eos_token_id"] = cfg["eos_token_id"]
        g["bos_token_id"] = cfg["bos_token_id"]
        gen.write_text(json.dumps(g, indent=2))
    return path
