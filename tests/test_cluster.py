"""The disaggregated cluster on a real local Ray cluster, over real HTTP.

Three topologies (prefill TP -> decode TP): 1 -> 1, 2 -> 2 and 1 -> 2 (KV heads re-sharded);
each must produce the single-process engine's greedy output. The 1 -> 2 app also serves the
`openai` client tests, the disconnect test and the full-stack error cases.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

pytestmark = pytest.mark.ray

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def ray_cluster(shared_serve) -> str:
    return shared_serve.url()


@pytest.fixture(scope="module")
def prompts(default_model) -> list[str]:
    from mtpserve.workers.training.prompts import held_out_prompts

    return held_out_prompts(4, num_chars=300)


@pytest.fixture(scope="module")
def offline(default_model, prompts) -> list[str]:
    from mtpserve.workers import LLM, SamplingParams

    llm = LLM(str(default_model), num_speculative_tokens=2)
    res = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return [r.text for r in res]


def deploy(default_model, prefill_tp: int, decode_tp: int, draft_vocab_size: int | None = None,
           **extra):
    from mtpserve.cluster.app import build_app
    from mtpserve.cluster.config import ClusterConfig

    cfg = ClusterConfig(
        model=str(default_model),
        prefill={"tp_size": prefill_tp, "cpus_per_rank": 0.5, "num_kv_blocks": 256},
        decode={"tp_size": decode_tp, "cpus_per_rank": 0.5, "num_kv_blocks": 256},
        speculation={"num_speculative_tokens": 2, "adaptive": False,
                     "draft_vocab_size": draft_vocab_size},
        kv_transfer={"timeout_s": 30, "hold_ttl_s": 30}, **extra,
    )
    serve.run(build_app(cfg), name="mtpserve", route_prefix="/")
    return cfg


def complete(base: str, prompt: str, **kw) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0} | kw
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def stats(base: str, headers: dict | None = None) -> dict:
    r = httpx.get(f"{base}/v1/mtpserve/stats", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def wait_blocks_free(base: str, headers: dict | None = None, deadline_s: float = 30.0) -> dict:
    end = time.monotonic() + deadline_s
    while True:
        s = stats(base, headers)
        if s["decode"]["used_blocks"] == 0 and s["prefill"]["used_blocks"] == 0:
            return s
        assert time.monotonic() < end, f"KV blocks still in use: {s}"
        time.sleep(0.1)


# 1 -> 2 runs in `resharded_app` below; 2 -> 1 pulls from two prefill ranks per decode rank.
# 2 -> 2 also drafts over a draft vocabulary (every rank gathers the head once): greedy output
# is still the offline engine's, which drafts over the whole vocabulary. 1 -> 1 and 2 -> 2 are
# the slow tier: test_multinode runs 1 -> 1 through Serve (across nodes), test_disagg_datapath
# in-process; test_draft_vocab covers drafting over the subset.
@pytest.mark.parametrize("prefill_tp,decode_tp", [
    pytest.param(1, 1, marks=pytest.mark.slow), pytest.param(2, 2, marks=pytest.mark.slow),
    (2, 1)])
def test_disaggregated_equals_single_process(ray_cluster, default_model, prompts, offline,
                                             prefill_tp: int, decode_tp: int) -> None:
    dv = 1024 if prefill_tp == decode_tp == 2 and (default_model / "draft_vocab.json").is_file() \
        else None
    deploy(default_model, prefill_tp, decode_tp, draft_vocab_size=dv)
    try:
        got = [complete(ray_cluster, p)["choices"][0]["text"] for p in prompts]
        assert got == offline
        s = wait_blocks_free(ray_cluster)
        # Every request really went prefill -> KV pull -> decode (no silent recompute).
        # Decode rank 0 pulls from every prefill rank that holds some of its KV heads.
        pulls_per_request = max(prefill_tp // decode_tp, 1)
        assert s["decode"]["kv_receiver"]["pulls"] == len(prompts) * pulls_per_request
        assert s.get("orchestrator", {}).get("num_migrations", 0) == 0
        assert s.get("orchestrator", {}).get("num_kv_recomputes", 0) == 0
    finally:
        serve.delete("mtpserve")


@pytest.fixture(scope="module")
def resharded_app(ray_cluster, default_model):
    deploy(default_model, 1, 2, auth={"api_key": "sekret", "admin_api_key": "admin-sekret"},
           admin={"enable_kv_probe": True}, ingress={"replicas": 2, "cpus": 0.25})
    yield ray_cluster
    serve.delete("mtpserve")


def auth_headers() -> dict:
    return {"Authorization": "Bearer sekret"}


def test_resharded_openai_client(resharded_app, default_model, prompts, offline) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{resharded_app}/v1", api_key="sekret")
    model = client.models.list().data[0].id
    assert model == default_model.name
    # Completion, prefill TP=1 -> decode TP=2: equal to the single-process engine.
    for p, want in zip(prompts, offline, strict=True):
        out = client.completions.create(model=model, prompt=p, max_tokens=MAX_TOKENS,
                                        temperature=0)
        assert out.choices[0].text == want
        assert out.usage.completion_tokens == MAX_TOKENS
    # Streaming gives the same text.
    stream = client.completions.create(model=model, prompt=prompts[0], max_tokens=MAX_TOKENS,
                                       temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces, usage = [], None
    for chunk in stream:
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        usage = chunk.usage or usage
    assert "".join(pieces) == offline[0]
    assert usage is not None and usage.completion_tokens == MAX_TOKENS
    # Chat works through the default template and returns an assistant message.
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "def add(a, b):"}],
        max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 8


def test_resharded_errors_and_auth(resharded_app) -> None:
    base = resharded_app
    r = httpx.post(f"{base}/v1/completions", json={"prompt": "x", "max_tokens": 4})
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.post(f"{base}/v1/completions", headers=auth_headers(),
                   json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = httpx.post(f"{base}/v1/completions", headers=auth_headers(),
                   json={"prompt": "x " * 5000, "max_tokens": 4})
    assert r.status_code == 400 and "2048" in r.json()["error"]["message"]
    r = httpx.post(f"{base}/v1/completions", headers=auth_headers(), content=b"{not json")
    assert r.status_code == 400
    # Conditional disaggregation is off by default: a request cannot ask for decode's prefill.
    r = httpx.post(f"{base}/v1/completions", headers=auth_headers(),
                   json={"prompt": "x", "max_tokens": 4, "disaggregate": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "disaggregate"
    assert "max_local_prefill_length is 0" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/health").status_code == 200


def test_client_disconnect_frees_decode_blocks(resharded_app, prompts) -> None:
    base = resharded_app
    body = {"prompt": prompts[1], "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(base_url=base, headers=auth_headers(), timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            seen = 0
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line[6:])
                    seen += 1
                if seen == 12:  # past the first token: decode is streaming
                    # Checked while reading: leaving iter_lines() closes the response.
                    assert stats(base, auth_headers())["decode"]["used_blocks"] > 0
                    break
    s = wait_blocks_free(base, auth_headers())
    assert s["decode"]["num_running"] == 0


def test_kv_probe_measures_the_channel(resharded_app) -> None:
    r = httpx.post(f"{resharded_app}/v1/mtpserve/kv_probe",
                   headers={"Authorization": "Bearer admin-sekret"},  # an admin-only route
                   json={"num_bytes": 1 << 20}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["bytes"] == 1 << 20 and r.json()["gib_per_s"] > 0


def test_resharded_seeded_sampling_equals_single_process(resharded_app, default_model,
                                                         prompts) -> None:
    """Randomness is keyed by (seed, position, slot): a seeded request gives the offline
    engine's output through prefill TP=1 -> decode TP=2 as well."""
    from mtpserve.workers import LLM, SamplingParams

    llm = LLM(str(default_model), num_speculative_tokens=2)
    want = [r.text for r in llm.generate(prompts[:2], SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.8, top_p=0.95, seed=1234))]
    got = []
    for p in prompts[:2]:
        r = httpx.post(f"{resharded_app}/v1/completions", headers=auth_headers(), timeout=120,
                       json={"prompt": p, "max_tokens": MAX_TOKENS, "temperature": 0.8,
                             "top_p": 0.95, "seed": 1234})
        assert r.status_code == 200, r.text
        got.append(r.json()["choices"][0]["text"])
    assert got == want


def test_admin_stats_name_each_replicas_node(resharded_app) -> None:
    """Admins see the Ray node (id and address) each replica runs on; other clients see the
    node id but no address."""
    admin = stats(resharded_app, {"Authorization": "Bearer admin-sekret"})
    user = stats(resharded_app, auth_headers())
    for role in ("prefill", "decode"):
        assert len(admin[role]["node_id"]) > 8 and admin[role]["node_address"].count(".") == 3
        assert user[role]["node_id"] == admin[role]["node_id"]  # one node here
        assert "node_address" not in user[role]


def test_cpu_replicas_run_on_the_faster_malloc(resharded_app) -> None:
    """Prefill and decode engines (decode here in its TP group's rank-0 process) run on
    tcmalloc / jemalloc when the machine has one (their runtime_env preloads it)."""
    from mtpserve.workers.allocator import malloc_library

    lib = malloc_library()
    s = stats(resharded_app, {"Authorization": "Bearer admin-sekret"})
    for role in ("prefill", "decode"):
        if lib is None:
            assert s[role]["malloc"] == "glibc"
        else:
            assert os.path.basename(lib).split(".so")[0] in s[role]["malloc"], s[role]


def test_two_ingress_replicas_serve_concurrent_streams(resharded_app, prompts, offline) -> None:
    """The ingress scales out (`ingress.replicas`): Serve's proxy spreads 24 concurrent
    streams over two stateless ingress replicas, every one completes, exactly like offline."""
    import concurrent.futures

    app = serve.status().applications["mtpserve"]
    assert app.deployments["OpenAIIngress"].replica_states.get("RUNNING") == 2

    def one(i: int) -> str:
        body = {"prompt": prompts[i % len(prompts)], "max_tokens": MAX_TOKENS,
                "temperature": 0, "stream": True}
        text = ""
        with httpx.stream("POST", f"{resharded_app}/v1/completions", json=body,
                          headers=auth_headers(), timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    data = json.loads(line[6:])
                    assert "error" not in data, data
                    text += data["choices"][0]["text"] if data["choices"] else ""
        return text

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        texts = list(pool.map(one, range(24)))
    assert texts == [offline[i % len(prompts)] for i in range(24)]
