"""Log probabilities: equal to log_softmax of the plain forward at the same positions (fp32,
within 1e-4) with and without speculation, greedy and sampled; rendered in the OpenAI formats
through both endpoints, streamed per chunk; stop_token_ids and min_tokens through the API."""

from __future__ import annotations

import openai
import pytest
import torch
from helpers import drain
from test_router_api import Server
from tiny_tokenizer import make_checkpoint_with_tokenizer

from mtpserve.router.api import IngressState, create_app
from mtpserve.router.local_orchestrator import LocalOrchestrator
from mtpserve.workers.async_engine import AsyncEngine
from mtpserve.workers.engine import Engine, EngineConfig
from mtpserve.workers.model.loader import load_model
from mtpserve.workers.sampling_params import SamplingParams

PROMPT = [12, 40, 7, 300, 9, 41]
TOP = 4


def reference(path, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain full forward: row t predicts token t + 1. [len(ids), V]"""
    model = load_model(path)
    with torch.no_grad():
        h = model(torch.tensor([ids]), torch.arange(len(ids)).unsqueeze(0))
        return torch.log_softmax(model.compute_logits(h[0]), dim=-1)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_equal_the_plain_forward(default_model, k: int, temperature: float) -> None:
    eng = Engine(EngineConfig(model=str(default_model), num_speculative_tokens=k,
                              num_kv_blocks=128, block_size=4))
    req = eng.add_request("x", PROMPT, SamplingParams(
        max_tokens=24, temperature=temperature, seed=3, ignore_eos=True, logprobs=TOP))
    entries = []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.logprobs is not None and len(out.logprobs) == len(out.new_token_ids)
            entries += out.logprobs
    out_ids = req.output_token_ids
    assert [e.token_id for e in entries] == out_ids
    ref = reference(default_model, PROMPT + out_ids)[len(PROMPT) - 1 : -1]  # [n_out, V]
    got = torch.tensor([e.logprob for e in entries])
    want = ref.gather(1, torch.tensor(out_ids).unsqueeze(1)).squeeze(1)
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    top_v, top_i = ref.topk(TOP, dim=-1)
    for j, e in enumerate(entries):
        assert [t for t, _ in e.top] == top_i[j].tolist()
        assert torch.allclose(torch.tensor([v for _, v in e.top]), top_v[j], atol=1e-4)
    if k:
        assert req.num_accepted > 0  # some tokens really came from accepted drafts


def test_no_logprobs_unless_asked(default_model) -> None:
    eng = Engine(EngineConfig(model=str(default_model), num_speculative_tokens=2,
                              num_kv_blocks=64, block_size=4))
    eng.add_request("x", PROMPT, SamplingParams(max_tokens=5, temperature=0))
    outs = drain(eng)
    assert all(o.logprobs is None for o in outs)


@pytest.fixture(scope="module")
def api(tmp_path_factory):
    ckpt = make_checkpoint_with_tokenizer(tmp_path_factory.mktemp("lp") / "tiny")
    engine = AsyncEngine(Engine(EngineConfig(model=str(ckpt), num_speculative_tokens=2,
                                             num_kv_blocks=128)))
    from mtpserve.workers.tokenizer import load_tokenizer

    tok = load_tokenizer(str(ckpt))
    srv = Server(create_app(IngressState(
        orchestrator=LocalOrchestrator(engine), tokenizer=tok, model_name="m",
        max_model_len=engine.engine.max_model_len)))
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
    yield client, ckpt, tok
    srv.stop()
    engine.shutdown()


def test_completions_logprobs(api) -> None:
    client, ckpt, tok = api
    kw = dict(model="m", prompt="def hello", max_tokens=12, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    resp = client.completions.create(**kw)
    c = resp.choices[0]
    ids = c.model_extra["token_ids"]
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) == 12
    prompt_ids = list(tok.encode("def hello"))
    ref = reference(ckpt, prompt_ids + ids)[len(prompt_ids) - 1 : -1]
    want = ref.gather(1, torch.tensor(ids).unsqueeze(1)).squeeze(1)
    assert torch.allclose(torch.tensor(lp.token_logprobs), want, atol=1e-4)
    assert all(len(t) <= 3 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # Greedy: the chosen token is the most likely one.
    assert all(abs(max(t.values()) - v) < 1e-5 for t, v in zip(lp.top_logprobs,
                                                                lp.token_logprobs, strict=True))
    # Streaming carries the same numbers, chunk by chunk.
    chunks = list(client.completions.create(stream=True, **kw))
    streamed = [v for ch in chunks if ch.choices and ch.choices[0].logprobs
                for v in ch.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    assert sum(1 for ch in chunks if ch.choices and ch.choices[0].logprobs) > 2


def test_chat_logprobs_streamed(api) -> None:
    client, _, _ = api
    kw = dict(model="m", messages=[{"role": "user", "content": "print hello"}],
              max_tokens=10, temperature=0, logprobs=True, top_logprobs=2,
              extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(full) == 10
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in full)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob for e in full)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in full]


def test_stop_token_ids_and_min_tokens_through_the_api(api) -> None:
    client, _, _ = api
    kw = dict(model="m", prompt="import value", max_tokens=20, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    ids = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    stop = ids[3]
    first = ids.index(stop)
    c = client.completions.create(**{**kw, "extra_body": {**kw["extra_body"],
                                                          "stop_token_ids": [stop]}}).choices[0]
    assert c.model_extra["token_ids"] == ids[: first + 1] and c.finish_reason == "stop"
    c = client.completions.create(**{**kw, "extra_body": {
        **kw["extra_body"], "stop_token_ids": [stop], "min_tokens": first + 2}}).choices[0]
    assert stop not in c.model_extra["token_ids"][: first + 2]


def test_seeded_api_request_equals_the_offline_engine_alone(api) -> None:
    """Through HTTP (batched with the other choice, streamed) a seeded choice gives the tokens
    the offline engine gives running it alone with the same seed (choice i: seed + i) and k."""
    from mtpserve.workers.llm import LLM

    client, ckpt, tok = api
    resp = client.completions.create(model="m", prompt="class value", max_tokens=16,
                                     temperature=1.0, top_p=0.9, seed=11, n=2,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})
    offline = LLM(str(ckpt), num_speculative_tokens=2, num_kv_blocks=64)
    for c in resp.choices:
        ref = offline.generate(["class value"], SamplingParams(
            max_tokens=16, temperature=1.0, top_p=0.9, seed=11 + c.index, ignore_eos=True))[0]
        assert c.model_extra["token_ids"] == ref.output_token_ids
    assert resp.choices[0].model_extra["token_ids"] != resp.choices[1].model_extra["token_ids"]
