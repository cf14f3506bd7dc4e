"""Reasoning parsers (router/reasoning.py): the split of each style's output on token ids and
on text, whatever the chunking (a `</think>` inside one multi-token chunk, or split across
tokens), the prompt's open block (DeepSeek-R1, Qwen3.5) and Qwen3's `enable_thinking: false`;
`auto` resolution; then through the API with the real `openai` client over an in-process
engine: `reasoning_content` non-streamed and streamed (a regex forces `</think>`),
`chat_template_kwargs` and `add_generation_prompt` on `/tokenize`, `return_token_ids` on chat.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from chat_models import TEMPLATES
from test_router_api import Server

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.local_orchestrator import LocalOrchestrator
from mtpserve.router.reasoning import Reasoner, resolve_parser, split_text
from mtpserve.router.tool_parsers import MARKERS
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.detokenizer import marker_skip_ids
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.tokenizer import load_tokenizer

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# style -> [(parser, template kwargs, output text, expected (reasoning or None, content))]
CASES = {
    "qwen3": [
        ("qwen3", {}, "<think>\nsunny first café\n</think>\n\nIt is sunny.",
         ("\nsunny first café\n", "\n\nIt is sunny.")),
        ("qwen3", {}, "\n<think>so</think>answer", ("so", "answer")),
        ("qwen3", {}, "It is sunny.", (None, "It is sunny.")),
        ("qwen3", {"enable_thinking": False}, "It is sunny.", (None, "It is sunny.")),
        ("qwen3", {}, "<think>\ntruncated reason", ("\ntruncated reason", "")),
    ],
    "qwen3_coder": [  # the prompt opens <think>\n: the output starts inside the reasoning
        ("qwen3", {}, "step first\n</think>\n\nanswer", ("step first\n", "\n\nanswer")),
        ("qwen3", {"enable_thinking": False}, "answer", (None, "answer")),
    ],
    "glm45": [
        ("glm45", {}, "\n<think>reason then</think>\nanswer", ("reason then", "\nanswer")),
        ("glm45", {"enable_thinking": False}, "\nanswer", (None, "\nanswer")),
    ],
    "deepseek_v3": [
        ("deepseek_v3", {"thinking": True}, "reason so</think>answer", ("reason so", "answer")),
        ("deepseek_v3", {"thinking": True}, "<think>reason</think>answer",
         ("reason", "answer")),
        ("deepseek_v3", {}, "answer</think>", None),  # thinking off: no split at all
        ("deepseek_r1", {}, "reason only", ("reason only", "")),
        ("deepseek_r1", {}, "<think>\nreason</think>\n\nanswer", ("\nreason", "\n\nanswer")),
    ],
}


def _prompt(tok, kwargs) -> list[int]:
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True, **kwargs)
    return list(tok.encode(text, add_special_tokens=False))


def _run(reasoner: Reasoner, prompt: list[int], ids: list[int], kwargs, chunk: int,
         skip_ids=None):
    split = reasoner.split(prompt, kwargs, skip_ids)
    if split is None:
        return None
    r = c = ""
    for i in range(0, len(ids), chunk):
        a, b = split.feed(ids[i:i + chunk], final=i + chunk >= len(ids))
        r, c = r + a, c + b
    return (r if split.saw_block else None), c


@pytest.mark.parametrize("special", [False, True], ids=["plain", "special"])
@pytest.mark.parametrize("style", list(CASES))
def test_split_on_token_ids_any_chunking(chat_checkpoint, style, special):
    """`special`: the markers are special added tokens (decoding with skip_special_tokens
    drops them): the split is the same, on their ids."""
    tok = load_tokenizer(str(chat_checkpoint(style, "qwen3", special_markers=special)))
    if special:
        assert tok.decode(tok.encode("<think>a</think>", add_special_tokens=False),
                          skip_special_tokens=True) == "a"
    for parser, kwargs, text, want in CASES[style]:
        reasoner = Reasoner.build(parser, tok)
        assert reasoner.on_ids  # <think> and </think> are single tokens in every style
        ids = list(tok.encode(text, add_special_tokens=False))
        prompt = _prompt(tok, kwargs)
        for chunk in range(1, len(ids) + 1):  # 1 token per chunk .. all in one
            assert _run(reasoner, prompt, ids, kwargs, chunk) == want, (text, chunk)


@pytest.mark.parametrize("special", [False, True], ids=["plain", "special"])
def test_markers_after_the_block_read_the_same_special_or_not(chat_checkpoint, special):
    """After the block, markers are ordinary text: a special `<think>` / `</think>` in the
    content decodes to its text as a plain one does, and so does a tool-call marker with the
    router's decoding of a request with tools (`marker_skip_ids`); EOS stays skipped."""
    tok = load_tokenizer(str(chat_checkpoint("glm45", "qwen3", special_markers=special)))
    reasoner = Reasoner.build("glm45", tok)
    assert (reasoner.skip_ids is not None) == special
    text = "<think>r</think>a<think>b</think>c<tool_call>"
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
    with_tools = marker_skip_ids(tok, [*MARKERS["glm45"], "<think>", "</think>"])
    for chunk in (1, 3, len(ids)):
        assert _run(reasoner, [], ids, {}, chunk, with_tools) == (
            "r", "a<think>b</think>c<tool_call>")
        assert _run(reasoner, [], ids, {}, chunk) == (
            "r", "a<think>b</think>c" + ("" if special else "<tool_call>"))


def test_ids_mode_ignores_a_spelled_out_end_marker(chat_checkpoint):
    """On ids, `</think>` written with ordinary tokens is reasoning text, not the end."""
    tok = load_tokenizer(str(chat_checkpoint("deepseek_v3", "qwen3")))
    reasoner = Reasoner.build("deepseek_r1", tok)
    spelled = tok.encode("a</thi", add_special_tokens=False) + tok.encode(
        "nk>b", add_special_tokens=False)
    assert reasoner.end_id not in spelled
    ids = spelled + [reasoner.end_id] + tok.encode("answer", add_special_tokens=False)
    for chunk in (1, 2, len(ids)):
        assert _run(reasoner, [], ids, {}, chunk) == ("a</think>b", "answer")


def test_split_on_text_when_markers_are_not_single_tokens(tiny_qwen3_tok):
    tok = tiny_qwen3_tok
    reasoner = Reasoner.build("deepseek_r1", tok)
    assert not reasoner.on_ids  # a byte-level vocabulary without the markers
    for parser, text in [("deepseek_r1", "reason\n</think>\n\nanswer"),
                         ("deepseek_r1", "<think>r</think>a</think>b"),
                         ("deepseek_r1", "no end </thin"),
                         ("qwen3", "  <think>r</thi"), ("qwen3", "<thin plain"),
                         ("qwen3", "<think>\nr\n</think>\n\nc")]:
        ids = list(tok.encode(text))
        assert tok.decode(ids) == text
        want = split_text(parser, text)
        r = Reasoner.build(parser, tok)
        for chunk in range(1, len(ids) + 1):
            assert _run(r, [], ids, {}, chunk) == want, (text, chunk)
    assert split_text("deepseek_r1", "<think>r</think>a</think>b") == ("r", "a</think>b")
    assert split_text("deepseek_r1", "no end </thin") == ("no end </thin", "")
    assert split_text("qwen3", "  <think>r</thi") == ("r</thi", "")
    assert split_text("qwen3", "<thin plain") == (None, "<thin plain")


def test_auto_resolution():
    assert resolve_parser("auto", "qwen3", TEMPLATES["qwen3"]) == "qwen3"
    assert resolve_parser("auto", "qwen3_5_moe", TEMPLATES["qwen3_coder"]) == "qwen3"
    assert resolve_parser("auto", "glm4_moe", TEMPLATES["glm45"]) == "glm45"
    assert resolve_parser("auto", "deepseek_v3", TEMPLATES["deepseek_v3"]) == "deepseek_v3"
    r1 = "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}<｜Assistant｜><think>\n"
    assert resolve_parser("auto", "deepseek_v3", r1) == "deepseek_r1"
    assert resolve_parser("auto", "deepseek_v3", "{{ messages }}") is None  # V3: no <think>
    assert resolve_parser("auto", "llama", "") is None
    assert resolve_parser("none", "qwen3", TEMPLATES["qwen3"]) is None
    assert resolve_parser("glm45", "llama", "") == "glm45"


# Through the API ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_qwen3_tok(tmp_path_factory):
    from tiny_tokenizer import make_checkpoint_with_tokenizer

    path = make_checkpoint_with_tokenizer(tmp_path_factory.mktemp("tok") / "m")
    return load_tokenizer(str(path))


def _serve(path, **state):
    eng = AsyncEngine(Engine(EngineConfig(model=str(path), num_speculative_tokens=2,
                                          num_kv_blocks=128)))
    srv = Server(create_app(IngressState(
        orchestrator=LocalOrchestrator(eng), tokenizer=load_tokenizer(str(path)),
        model_name="m", max_model_len=eng.engine.max_model_len,
        vocab_size=eng.engine.model_config.vocab_size, **state)))
    return eng, srv


@pytest.fixture(scope="module")
def qwen3_server(chat_checkpoint):
    eng, srv = _serve(chat_checkpoint("qwen3", "qwen3"), model_type="qwen3")
    yield srv
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def text_server(default_model):
    """The embedded model (no <think> token) with the deepseek_r1 parser: splits on text."""
    eng, srv = _serve(default_model, reasoning_parser="deepseek_r1")
    yield srv
    srv.stop()
    eng.shutdown()


def _client(srv) -> openai.OpenAI:
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)


def test_reasoning_content_forced_end_non_streamed_and_streamed(text_server):
    client = _client(text_server)
    regex = "Hm, sunny\\.</think>\n\nIt is sunny\\."
    # enable_in_reasoning: the regex covers the block too (by default a constraint starts
    # after it: tests/test_reasoning_grammar.py).
    kw = dict(model="m", messages=USER, max_tokens=40, temperature=0,
              extra_body={"structured_outputs": {"regex": regex, "enable_in_reasoning": True}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert msg.reasoning_content == "Hm, sunny." and msg.model_extra["reasoning"] == "Hm, sunny."
    assert msg.content == "\n\nIt is sunny."
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning.append(c.delta.model_extra.get("reasoning_content") or "")
            content.append(c.delta.content or "")
    assert "".join(reasoning) == "Hm, sunny." and "".join(content) == "\n\nIt is sunny."


def test_reasoning_split_on_ids_matches_the_tokens(qwen3_server, chat_checkpoint):
    """Token-id mode through the API: whatever the random model writes under a regex that
    allows a block, the response equals the parser applied to the returned token ids, and the
    stream's deltas add up to it (k = 2: several tokens per chunk)."""
    tok = load_tokenizer(str(chat_checkpoint("qwen3", "qwen3")))
    client = _client(qwen3_server)
    kw = dict(model="m", messages=USER, max_tokens=24, temperature=0,
              extra_body={"structured_outputs": {"regex": "<think>[a-z ]{1,12}</think>[a-z ]+",
                                                 "enable_in_reasoning": True},
                          "return_token_ids": True})
    r = client.chat.completions.create(**kw)
    ids = r.choices[0].model_extra["token_ids"]
    assert r.model_extra["prompt_token_ids"][-2:] == tok.encode(
        "assistant\n", add_special_tokens=False)[-2:]
    reasoner = Reasoner.build("qwen3", tok)
    want = _run(reasoner, _prompt(tok, {}), ids, {}, len(ids))
    got = (r.choices[0].message.model_extra.get("reasoning_content"),
           r.choices[0].message.content or "")
    assert got[1] == want[1] and (got[0] or None) == (want[0] or None)
    reasoning, content = [], []
    for chunk in client.chat.completions.create(**kw, stream=True):
        for c in chunk.choices:
            reasoning.append(c.delta.model_extra.get("reasoning_content") or "")
            content.append(c.delta.content or "")
    assert "".join(reasoning) == (want[0] or "") and "".join(content) == want[1]


def test_tokenize_template_kwargs_generation_prompt_and_tools(qwen3_server):
    with httpx.Client(base_url=qwen3_server.url, timeout=60) as http:
        def tokens(**body) -> list[int]:
            r = http.post("/tokenize", json={"messages": USER, **body})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        on, off = tokens(), tokens(chat_template_kwargs={"enable_thinking": False})
        assert off[: len(on)] == on and len(off) > len(on)  # the empty <think></think> block
        bare = tokens(add_generation_prompt=False)
        assert on[: len(bare)] == bare and len(on) > len(bare)
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
        with_tools = tokens(tools=[tool])
        assert len(with_tools) > len(on)
        detok = http.post("/detokenize", json={"tokens": with_tools}).json()["prompt"]
        assert "get_weather" in detok and "<tools>" in detok
        r = http.post("/tokenize", json={"messages": USER,
                                         "chat_template_kwargs": {"chat_template": "x"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_template_kwargs_change_the_chat_prompt(qwen3_server):
    client = _client(qwen3_server)
    kw = dict(model="m", messages=USER, max_tokens=1, temperature=0)
    on = client.chat.completions.create(**kw, extra_body={"return_token_ids": True})
    off = client.chat.completions.create(**kw, extra_body={
        "return_token_ids": True, "chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens
    assert len(off.choices[0].model_extra["token_ids"]) == 1
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**kw, extra_body={
            "chat_template_kwargs": {"tokenize": True}})
