"""`mtpserve up`: starts a local Ray cluster and the app, prints the URL once /health answers,
serves requests (the openai SDK's structured-output and tool examples among them), and on
SIGTERM drains (a running stream finishes, new requests get 503) and stops Ray and every
process it started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sse_stream import StreamingCompletion
from test_structured_api import OPENAI_EXAMPLES

pytestmark = pytest.mark.ray


def _session_members(sid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # field 6 of /proc/PID/stat: session id
            out.append(int(stat.parent.name))
    return out


DRAIN_TOKENS = 160


@dataclass
class Up:
    url: str
    proc: subprocess.Popen
    startup_lines: list[str]


@pytest.fixture(scope="module")
def up(default_model) -> Iterator[Up]:
    """`mtpserve up` with the default config (the embedded model, MTP on), serving once it
    printed its URL; the module's tests share it and the last one stops it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, MTPSERVE_MODEL=str(default_model))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mtpserve.cluster.cli", "up", "--port", str(port),
         "--num-cpus", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 400
        line = ""
        lines = []
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            lines.append(line)
            if "is serving" in line or not line:
                break
        assert f"http://127.0.0.1:{port}/v1" in line, line
        yield Up(f"http://127.0.0.1:{port}", proc, lines)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_up_warms_the_request_path_before_it_reports_serving(up) -> None:
    """Before `is serving` (and before any client request: this is the module's first test),
    `up` streamed its warm-up requests through prefill -> KV transfer -> decode: the KV pair's
    channel is built, every transfer was acknowledged and no KV block is left held."""
    from mtpserve.cluster.cli_serve import WARM_REQUESTS

    assert any("warmed the request path" in line for line in up.startup_lines), up.startup_lines
    stats = httpx.get(up.url + "/v1/mtpserve/stats", timeout=30).json()
    sender, receiver = stats["prefill"]["kv_sender"], stats["decode"]["kv_receiver"]
    assert sender["acked"] == sender["transfers"] == WARM_REQUESTS, sender
    assert receiver["pulls"] == WARM_REQUESTS and receiver["channel_builds"] == 1, receiver
    # The last warm-up stream went where a lone short prompt goes with the default config:
    # prefilled on the decode replica (conditional disaggregation).
    assert stats["orchestrator"]["num_local_prefills"] == 1, stats["orchestrator"]
    assert sender["held"] == 0
    assert stats["prefill"]["used_blocks"] == stats["decode"]["used_blocks"] == 0


def test_warm_streams_through_a_running_server(up) -> None:
    """`mtpserve warm` (for a `serve deploy`) against the running server: the model comes from
    /v1/models, its streams go prefill -> KV transfer -> decode (each one a KV transfer that
    was acknowledged), and nothing stays held."""
    from mtpserve.cluster.cli_serve import WARM_REQUESTS

    acked, pulls, local = _paths(up.url)
    r = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "warm", "--url", up.url,
                        "--wait", "30"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "warmed the request path" in r.stdout
    assert _paths(up.url) == (acked + WARM_REQUESTS, pulls + WARM_REQUESTS, local + 1)
    stats = httpx.get(up.url + "/v1/mtpserve/stats", timeout=30).json()
    assert stats["prefill"]["kv_sender"]["held"] == 0
    assert stats["prefill"]["used_blocks"] == stats["decode"]["used_blocks"] == 0


def _paths(url: str) -> tuple[int, int, int]:
    """(KV transfers acknowledged by prefill, pulled by decode, prompts prefilled on decode)."""
    stats = httpx.get(url + "/v1/mtpserve/stats", timeout=30).json()
    return (stats["prefill"]["kv_sender"]["acked"], stats["decode"]["kv_receiver"]["pulls"],
            stats["orchestrator"]["num_local_prefills"])


def test_conditional_disaggregation(up) -> None:
    """The default config prefills a lone short prompt on the decode replica (no KV transfer)
    and sends it through the prefill replica when another request is in flight or the client
    asks (`disaggregate: true`); each path gives the same greedy and the same seeded sampled
    text. `disaggregate: false` beyond decode.max_local_prefill_length is a 400, and no KV
    block stays in use."""
    prompt = "def parse_args(argv):\n    "

    def complete(**kw) -> tuple[str, tuple[int, int, int]]:
        before = _paths(up.url)
        r = httpx.post(f"{up.url}/v1/completions", json={
            "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True} | kw,
            timeout=120)
        assert r.status_code == 200, r.text
        after = _paths(up.url)
        moved = tuple(a - b for a, b in zip(after, before, strict=True))
        return r.json()["choices"][0]["text"], moved

    local_text, moved = complete()
    assert moved == (0, 0, 1)
    remote_text, moved = complete(disaggregate=True)
    assert moved == (1, 1, 0)
    assert remote_text == local_text
    assert complete(disaggregate=False) == (local_text, (0, 0, 1))
    sampled = {"temperature": 0.8, "top_p": 0.95, "seed": 7}
    (local_sampled, m1), (remote_sampled, m2) = complete(**sampled), complete(
        **sampled, disaggregate=True)
    assert (m1, m2) == ((0, 0, 1), (1, 1, 0)) and local_sampled == remote_sampled

    # Busy: a request arriving while another streams goes through the prefill replica.
    stream = StreamingCompletion(up.url, prompt, 400)
    stream.start()
    deadline = time.monotonic() + 120
    while stream.num_events < 2 and stream.error is None:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.01)
    busy_text, moved = complete()
    assert not stream.done, "the first stream ended before the second request arrived"
    assert moved == (1, 1, 0) and busy_text == local_text
    stream.join(timeout=120)
    assert stream.error is None and len(stream.token_ids) == 400

    long_prompt = "def f(x):\n    return x + 1\n\n" * 120  # > 512 tokens, < the window
    r = httpx.post(f"{up.url}/v1/completions", json={
        "prompt": long_prompt, "max_tokens": 4, "disaggregate": False}, timeout=120)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "disaggregate"
    assert "max_local_prefill_length" in r.json()["error"]["message"]
    end = time.monotonic() + 30
    while True:
        stats = httpx.get(up.url + "/v1/mtpserve/stats", timeout=30).json()
        if stats["prefill"]["used_blocks"] == stats["decode"]["used_blocks"] == 0:
            break
        assert time.monotonic() < end, stats
        time.sleep(0.1)


@pytest.mark.parametrize("example", list(OPENAI_EXAMPLES))
def test_openai_structured_output_and_tool_examples(up, example: str) -> None:
    """The openai SDK's structured-output and tool-calling examples, unchanged, against the
    real CLI's cluster (prefill -> decode, speculation on): outputs validate."""
    import openai

    client = openai.OpenAI(base_url=up.url + "/v1", api_key="none", max_retries=0,
                           timeout=300)
    OPENAI_EXAMPLES[example](client)


def test_up_runs_its_engines_at_daemon_priority_on_the_faster_malloc(up) -> None:
    """The replicas and their engine processes run at nice 0 (Ray's default for workers is 15,
    below its own daemons) and, where the machine has tcmalloc or jemalloc, on it."""
    from mtpserve.workers.allocator import malloc_library

    lib = malloc_library()
    engines = []
    for pid in _session_members(up.proc.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        if "engine_core_proc" in cmd or "ServeReplica:mtpserve:PrefillServer" in cmd \
                or "ServeReplica:mtpserve:DecodeServer" in cmd:
            engines.append((cmd, int(fields[16]), maps))  # field 19 of /proc/PID/stat: nice
    assert len(engines) >= 2, [c for c, _, _ in engines]
    for cmd, nice, maps in engines:
        assert nice == 0, cmd
        if lib is not None:
            assert os.path.basename(lib).split(".so")[0] in maps, cmd


def test_up_serves_and_stops_cleanly(up) -> None:  # stops `up`: keep it the module's last user
    proc, url = up.proc, up.url
    r = httpx.post(f"{url}/v1/completions",
                   json={"prompt": "import os\n", "max_tokens": 8, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    assert len(_session_members(proc.pid)) > 3  # raylet, GCS, replicas, ...
    # SIGTERM drains: a stream running at the signal finishes, new requests are refused.
    stream = StreamingCompletion(url, "import os\n", DRAIN_TOKENS)
    stream.start()
    deadline = time.monotonic() + 120
    while stream.num_events < 3 and stream.error is None:
        assert time.monotonic() < deadline, "the stream did not start"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    refused = None
    while refused is None and time.monotonic() < deadline and not stream.done:
        try:
            r = httpx.post(f"{url}/v1/completions",
                           json={"prompt": "x", "max_tokens": 2}, timeout=10)
            if r.status_code == 503:
                refused = r
        except httpx.HTTPError:
            break
        time.sleep(0.05)
    stream.join(timeout=120)
    assert stream.error is None and stream.done, stream.error
    assert len(stream.token_ids) == DRAIN_TOKENS
    assert refused is not None and refused.json()["error"]["code"] == "service_unavailable"
    assert proc.wait(timeout=120) == 0
    end = time.monotonic() + 60
    while _session_members(proc.pid) and time.monotonic() < end:
        time.sleep(0.5)
    assert _session_members(proc.pid) == []


def test_up_refuses_a_config_the_cluster_cannot_place(tmp_path) -> None:
    """A config reserving more CPUs than the local Ray cluster has fails at once with a clear
    message, instead of waiting for replicas that can never be scheduled."""
    from mtpserve.cluster.config import ClusterConfig
    from mtpserve.cluster.serve_options import resource_demand

    cfg = tmp_path / "big.yaml"
    cfg.write_text("applications:\n  - name: mtpserve\n    import_path: "
                   "mtpserve.cluster.app:build_app\n    args:\n      prefill:\n"
                   "        replicas: 3\n        cpus_per_rank: 1\n")
    need = resource_demand(ClusterConfig(prefill={"replicas": 3, "cpus_per_rank": 1}))["CPU"]
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "up", "--config",
                          str(cfg), "--num-cpus", "2"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"reserves {need:g} CPU" in out.stderr and "has 2" in out.stderr, out.stderr
    assert time.monotonic() - t0 < 60


def test_warm_without_a_server_says_so_and_fails() -> None:
    """Nothing listening: exit 1 with the reason, after the --wait it was given."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "mtpserve.cluster.cli", "warm", "--url",
                        f"http://127.0.0.1:{port}", "--wait", "2"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert f"http://127.0.0.1:{port}/health did not answer 200 within 2s" in r.stderr
    assert time.monotonic() - t0 >= 2
