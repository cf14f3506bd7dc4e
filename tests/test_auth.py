"""Auth fails closed: keys from config or environment, empty bearers, admin-only routes,
redacted stats, and `mtpserve up` / the ingress refusing to start without a configured key."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import httpx
import pytest
from pydantic import ValidationError
from test_router_api import Server
from tiny_tokenizer import make_tokenizer

import mtpserve.router.auth as auth
from mtpserve.cluster.config import AuthSettings, ClusterConfig
from mtpserve.router.api import IngressState, create_app, redact
from mtpserve.workers.paths import PACKAGE_ROOT as REPO_ROOT
from mtpserve.workers.tokenizer import load_tokenizer

KEY, ADMIN = "sk-user-key", "sk-admin-key"
STATS = {"prefill": {"used_blocks": 0, "kv_addresses": ["10.1.2.3:4567"],
                     "kv_sender": {"store_address": "10.1.2.3:4567", "num_sent": 3}},
         "decode": {"used_blocks": 0, "kv_receiver": {"peers": ["10.1.2.3:4567"],
                                                       "num_pulled": 3}}}


class StatsOrchestrator:
    async def generate(self, request):
        raise NotImplementedError
        yield

    async def stats(self) -> dict:
        return STATS

    async def kv_probe(self, num_bytes: int) -> dict:
        return {"bytes": num_bytes}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(str(make_tokenizer(tmp_path_factory.mktemp("tok"))))


def serve_app(tokenizer, **state) -> Server:
    return Server(create_app(IngressState(orchestrator=StatsOrchestrator(), tokenizer=tokenizer,
                                          model_name="m", max_model_len=64, **state)))


@pytest.fixture(scope="module")
def server(tokenizer):
    srv = serve_app(tokenizer, api_key=KEY, admin_api_key=ADMIN, enable_kv_probe=True,
                    kv_probe_max_bytes=1 << 20)
    yield srv
    srv.stop()


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# "Bearer " with trailing spaces cannot cross HTTP (clients refuse it, servers strip it): the
# unit test below covers it.
@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer \"\"", "Basic sk-user-key",
                                    "Bearer sk-user-ke", "Bearer sk-user-key2", "sk-user-key"])
def test_bad_or_empty_keys_are_401(server, header) -> None:
    headers = {} if header is None else {"Authorization": header}
    resp = httpx.get(server.url + "/v1/models", headers=headers)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    assert resp.headers["www-authenticate"] == "Bearer"


def test_good_keys_and_open_health(server) -> None:
    assert httpx.get(server.url + "/v1/models", headers=bearer(KEY)).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=bearer(ADMIN)).status_code == 200
    assert httpx.get(server.url + "/v1/models",
                     headers={"Authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_metrics_and_health_are_open_but_the_api_is_not(server) -> None:
    """Prometheus scrapes without a key (the NetworkPolicy limits who can); the API still
    refuses a request without one."""
    resp = httpx.get(server.url + "/metrics")
    assert resp.status_code == 200 and "vllm:num_requests_running" in resp.text
    assert httpx.get(server.url + "/health").status_code == 200
    resp = httpx.post(server.url + "/v1/completions", json={"model": "m", "prompt": "hi"})
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    # Only the exact paths are open, not what starts with them.
    assert httpx.get(server.url + "/metricsx").status_code == 401


def test_key_matches_never_accepts_empty() -> None:
    assert not auth.key_matches("Bearer ", "")
    assert not auth.key_matches("Bearer ", None)
    assert not auth.key_matches("Bearer   ", "x")
    assert not auth.key_matches("Bearer x", "")
    assert not auth.key_matches(None, "x")
    assert auth.key_matches("Bearer x", "x")


def test_comparison_is_constant_time(monkeypatch) -> None:
    calls = []
    real = auth.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    assert auth.key_matches("Bearer abc", "abd") is False
    assert calls == [(b"abc", b"abd")]


def test_stats_hide_addresses_unless_admin(server) -> None:
    user = httpx.get(server.url + "/v1/mtpserve/stats", headers=bearer(KEY))
    assert user.status_code == 200
    assert "10.1.2.3" not in user.text
    assert user.json()["decode"]["kv_receiver"] == {"num_pulled": 3}
    admin = httpx.get(server.url + "/v1/mtpserve/stats", headers=bearer(ADMIN))
    assert admin.json() == STATS
    assert redact({"a": [{"host": "h", "n": 1}]}) == {"a": [{"n": 1}]}


def test_kv_probe_needs_admin_and_is_capped(server, tokenizer) -> None:
    url = server.url + "/v1/mtpserve/kv_probe"
    resp = httpx.post(url, json={"num_bytes": 1024}, headers=bearer(KEY))
    assert resp.status_code == 403 and resp.json()["error"]["code"] == "permission_denied"
    assert httpx.post(url, json={"num_bytes": 1024}, headers=bearer(ADMIN)).json() == {
        "bytes": 1024}
    big = httpx.post(url, json={"num_bytes": (1 << 20) + 1}, headers=bearer(ADMIN))
    assert big.status_code == 400 and big.json()["error"]["param"] == "num_bytes"
    off = serve_app(tokenizer)  # the default: off, whoever asks
    try:
        resp = httpx.post(off.url + "/v1/mtpserve/kv_probe", json={"num_bytes": 8})
        assert resp.status_code == 404 and "error" in resp.json()
    finally:
        off.stop()


def test_config_fails_closed() -> None:
    with pytest.raises(ValidationError):
        AuthSettings(api_key="")
    with pytest.raises(ValidationError):
        ClusterConfig(admin={"enable_kv_probe": True})  # a probe without an admin key
    a = AuthSettings(api_key_env="MTPSERVE_TEST_KEY", admin_api_key="adm")
    with pytest.raises(RuntimeError, match="MTPSERVE_TEST_KEY"):
        a.resolve({})
    with pytest.raises(RuntimeError, match="missing or empty"):
        a.resolve({"MTPSERVE_TEST_KEY": "  "})
    assert a.resolve({"MTPSERVE_TEST_KEY": "k"}) == ("k", "adm")
    assert AuthSettings().resolve({}) == (None, None)


def test_ingress_refuses_to_start_without_its_key(monkeypatch) -> None:
    from mtpserve.router.ingress import OpenAIIngress

    monkeypatch.delenv("MTPSERVE_TEST_KEY", raising=False)
    cfg = ClusterConfig(auth={"api_key_env": "MTPSERVE_TEST_KEY"})
    # serve.ingress subclasses our class with an async __init__: call ours directly.
    cls = next(c for c in OpenAIIngress.func_or_class.__mro__ if "__init__" in vars(c)
               and not inspect.iscoroutinefunction(vars(c)["__init__"]))
    with pytest.raises(RuntimeError, match="refusing to start"):
        cls.__init__(object.__new__(cls), None, None, cfg)


def test_up_refuses_to_start_without_its_key(tmp_path) -> None:
    cfg = (REPO_ROOT / "configs" / "local-cpu.yaml").read_text().replace(
        "      http:\n", "      auth:\n        api_key_env: MTPSERVE_TEST_KEY\n      http:\n", 1)
    path = tmp_path / "c.yaml"
    path.write_text(cfg)
    env = {k: v for k, v in os.environ.items() if k != "MTPSERVE_TEST_KEY"}
    out = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "up", "--config",
                          str(path)],
                         capture_output=True, text=True, env=env, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "MTPSERVE_TEST_KEY" in out.stderr and "refusing to start" in out.stderr
