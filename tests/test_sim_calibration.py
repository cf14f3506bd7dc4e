"""benchmarks/sim_calibration.py without Ray or a live cluster: the recorder against a fake
server (httpx.MockTransport), the measured-acceptance estimate, and the replay of a recorded
load through the simulator (deterministic; statistics as defined)."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import numpy as np
import pytest

from mtpserve.benchmarks import sim_calibration as cal
from mtpserve.cluster.sim.replica_models import FittedReplicaModel, prefill_alone_s
from mtpserve.router.metrics_api import render
from mtpserve.workers.perf_model import expected_tokens

PROFILE = {
    "name": "test", "tp_size": 1, "k_max": 2, "max_num_seqs": 8,
    "max_num_batched_tokens": 512, "perf_model": [0.005, 0.0004, 0.0003, 0.0005],
    "prefill": [0.001, 2e-4, 5e-8], "decode_kv_tokens": 16384,
    "kv_bytes_per_token": 7168.0, "kv_transfer": {"latency_s": 0.002, "bytes_per_s": 1.3e9},
    "start_s": 20.0,
}
CLUSTER = {"block_size": 16, "prefill_max_num_batched_tokens": 512,
           "prefill_num_kv_blocks": 512, "decode_max_num_seqs": 32,
           "decode_num_kv_blocks": 1024}


def _req(arrival: float, prompt: int, output: int = 33, ttft: float = 0.05,
         tpot: float = 0.005, rounds: int = 12, drafted: int = 24, accepted: int = 20) -> dict:
    return {"arrival_s": arrival, "prompt_tokens": prompt, "output_tokens": output,
            "ttft_s": ttft, "tpot_s": tpot, "num_rounds": rounds, "num_drafted": drafted,
            "num_accepted": accepted}


def _counters(drafts=100.0, draft_tokens=200.0, pos=(80.0, 60.0)) -> dict:
    return {"drafts": drafts, "draft_tokens": draft_tokens,
            **{f"accepted_pos_{i}": p for i, p in enumerate(pos)}}


def _recording(reqs: list[dict]) -> dict:
    return {"k_max": 2, "cluster": CLUSTER,
            "phases": [{"name": "p", "rate": 2.0, "requests": reqs, "counters": _counters()}]}


def test_position_alphas_from_vllm_counters() -> None:
    # Every round drafts 2: alpha_0 = accepted_0 / rounds, alpha_1 = accepted_1 / accepted_0.
    assert cal.position_alphas(_counters(), 2) == pytest.approx([0.8, 0.75])
    # Mean k 1.5: half the rounds that accepted draft 0 tested draft 1.
    assert cal.position_alphas(_counters(draft_tokens=150.0, pos=(80.0, 30.0)), 2) == \
        pytest.approx([0.8, 0.75])
    assert cal.position_alphas(_counters(drafts=0.0), 2) is None


def test_request_alphas_reproduce_the_requests_own_acceptance() -> None:
    shape = [0.8, 0.75]
    for rounds, drafted, accepted in ((12, 24, 20), (20, 30, 9), (10, 20, 0), (5, 10, 10)):
        a = cal.request_alphas({"num_rounds": rounds, "num_drafted": drafted,
                                "num_accepted": accepted}, shape, 2)
        got = cal.accepted_per_round(list(a), cal.reach(drafted / rounds, 2))
        assert got == pytest.approx(accepted / rounds, abs=1e-9)
        assert all(0.0 <= x <= 1.0 for x in a)
    # No decode rounds: the phase's alphas.
    assert cal.request_alphas({"num_rounds": 0}, shape, 2) == tuple(shape)


def test_replay_is_deterministic_and_statistics_are_percentiles() -> None:
    reqs = [_req(0.0, 40), _req(0.01, 300), _req(0.02, 700, ttft=0.2), _req(1.5, 120),
            _req(1.51, 90, tpot=0.009)]
    rec = _recording(reqs)
    v = cal.Variant("t", PROFILE, ingress_overhead_s=0.01)
    a = cal.run_variant(rec, v)
    b = cal.run_variant(rec, v)
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    pred = a["predicted"][0]
    assert len(pred) == len(reqs) and all(p["status"] == "ok" for p in pred)
    row = a["rows"][0]
    assert row["requests"] == 5 and row["rate"] == 2.0
    ttft = [r["ttft_s"] * 1000 for r in reqs]
    assert row["ttft_ms_p50_measured"] == pytest.approx(float(np.percentile(ttft, 50)))
    assert row["tpot_ms_p99_measured"] == pytest.approx(
        float(np.percentile([r["tpot_s"] * 1000 for r in reqs], 99)))
    p50 = float(np.percentile([p["ttft_s"] * 1000 for p in pred], 50))
    assert row["ttft_ms_p50_predicted"] == pytest.approx(p50)
    assert row["ttft_p50_error_pct"] == pytest.approx(100 * (p50 - row["ttft_ms_p50_measured"])
                                                      / row["ttft_ms_p50_measured"])
    # Queueing: the 700-token prompt arrived behind two others on one prefill replica.
    m = FittedReplicaModel.from_profile(PROFILE)
    assert pred[2]["ttft_s"] > 0.01 + prefill_alone_s(m, 700)


def test_a_lone_request_replays_to_the_models_ttft_and_tpot() -> None:
    req = _req(0.0, 200, output=41, rounds=16, drafted=32, accepted=32)  # accepts everything
    rec = _recording([req])
    v = cal.Variant("t", PROFILE, ingress_overhead_s=0.02, decode_coef=[0.004, 0.0, 0.0, 0.001],
                    prefill_scale=2.0, kv_bytes_per_s=1e8, kv_latency_s=0.0)
    pred = cal.run_variant(rec, v)["predicted"][0][0]
    p, d = cal.build_models(v, CLUSTER)
    assert pred["ttft_s"] == pytest.approx(0.02 + 2.0 * prefill_alone_s(
        FittedReplicaModel.from_profile(PROFILE), 200), rel=1e-9)
    # Acceptance 1 at both positions: k = 2 and 3 tokens per round.
    rounds = math.ceil(40 / expected_tokens((1.0, 1.0), 2))
    tpot = (d.kv_transfer_s(200 + 1) + rounds * (0.004 + 0.001 * 2)) / 40
    assert pred["tpot_s"] == pytest.approx(tpot, rel=1e-9)


def _fake_server(n_tokens: int) -> httpx.MockTransport:
    """/v1/completions streams `max_tokens` tokens in chunks of 3 (usage + mtp_stats last);
    /metrics and /v1/mtpserve/stats count requests."""
    state = {"requests": 0}

    def snapshot() -> dict:
        n = state["requests"]
        return {"role": "decode", "replica": "d", "time": time.time() + 5,
                "counters": {"spec_decode_num_drafts": 10 * n,
                             "spec_decode_num_draft_tokens": 20 * n,
                             "kv_transfer_bytes": 1000 * n},
                "per_pos": [8 * n, 6 * n],
                "hists": {"time_to_first_token_seconds": {
                    "bounds": [1.0], "counts": [n, 0], "sum": 0.01 * n, "count": n}},
                "gauges": {}}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/metrics":
            return httpx.Response(200, text=render({"snapshots": [snapshot()]}, "m"))
        if request.url.path == "/v1/mtpserve/stats":
            snap = snapshot()
            return httpx.Response(200, json={
                "replicas": [{"time": snap["time"]}],
                "prefill": {"num_waiting": 0},
                "decode": {"num_speculative_tokens": 2, "kv_puller": {"pulls": 0},
                           "autoscaling": {"k_max": 2.0, "pm_0": 0.005, "pm_1": 0.0004,
                                           "pm_2": 0.0003, "pm_3": 0.0005}}})
        body = json.loads(request.content)
        state["requests"] += 1
        n = body["max_tokens"]
        lines = []
        for i in range(0, n, 3):
            ids = list(range(i, min(i + 3, n)))
            lines.append({"choices": [{"index": 0, "text": "x" * len(ids), "token_ids": ids}]})
        lines.append({"choices": [], "usage": {"prompt_tokens": 17, "completion_tokens": n},
                      "mtp_stats": {"num_drafted": 6, "num_accepted": 5, "num_rounds": 3}})
        text = "".join(f"data: {json.dumps(x)}\n\n" for x in lines) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    return httpx.MockTransport(handler)


def test_recorder_reads_streams_and_counters(monkeypatch) -> None:
    transport = _fake_server(10)
    real = httpx.AsyncClient
    monkeypatch.setattr(httpx, "AsyncClient",
                        lambda **kw: real(transport=transport, **{k: v for k, v in kw.items()
                                                                  if k != "limits"}))
    plan = {"warmup": ["w"], "probes": ["a", "b"],
            "phases": [{"name": "p", "rate": 100.0, "duration_s": 0.05,
                        "requests": [{"offset_s": 0.0, "prompt": "x"},
                                     {"offset_s": 0.02, "prompt": "y"}]}]}
    rec = asyncio.run(cal.record_load("http://fake", plan, max_tokens=10))
    assert rec["k_max"] == 2
    assert [p["output_tokens"] for p in rec["probes"]["requests"]] == [1, 1]
    assert rec["probes"]["counters"]["engine_ttft_count"] == 2
    ph = rec["phases"][0]
    assert ph["counters"]["drafts"] == 20 and ph["counters"]["accepted_pos_1"] == 12
    for r in ph["requests"]:
        assert r["output_tokens"] == r["streamed_tokens"] == 10
        assert r["prompt_tokens"] == 17 and r["num_accepted"] == 5 and r["num_rounds"] == 3
        assert r["ttft_s"] >= 0 and r["tpot_s"] >= 0 and r["arrival_s"] >= r["offset_s"] - 1e-3
    assert cal.coef_of(rec["start_stats"]) == [0.005, 0.0004, 0.0003, 0.0005]
    # The decode-contended probe: pairs of the stream alone and with prompts prefilling.
    reps = rec["decode_contended_probe"]["reps"]
    assert len(reps) == cal.DECODE_PROBE_REPS
    for rep in reps:
        assert rep["alone"]["output_tokens"] == rep["contended"]["output_tokens"] == \
            cal.DECODE_PROBE_TOKENS
        assert all(p["output_tokens"] == 1 and "start_s" in p for p in rep["prompts"])


def test_decode_chunk_cost_from_the_stream_probe() -> None:
    # Two streams decoding over the same span (batch 2), 3 tokens per round at k=2: each
    # request's round takes decode TPOT x 3; the cost is what exceeds the model's T(2, 2).
    from mtpserve.workers.perf_model import PerfModel

    reqs = [{"ttft_s": 0.1, "last_s": 1.1, "output_tokens": 61, "num_rounds": 20,
             "num_drafted": 40} for _ in range(2)]
    tpot = 0.01
    sp = {"streams": 2, "requests": reqs,
          "counters": {"decode_tpot_sum": 2 * tpot, "decode_tpot_count": 2.0}}
    got = cal.decode_chunk_cost(sp, PROFILE, scale=1.5)
    assert got["stream_probe_batch"] == pytest.approx(2.0, abs=0.01)
    model = 1.5 * PerfModel(PROFILE["perf_model"]).round_s(got["stream_probe_batch"], 2.0)
    assert got["stream_probe_round_s"] == pytest.approx(tpot * 3)
    assert got["decode_s_per_chunk"] == pytest.approx(
        (tpot * 3 - model) / (got["stream_probe_batch"] - 1))
    # Moved from T's intercept to its batch slope: T(1, k) unchanged, T(2, k) + the cost.
    v = cal.Variant("t", PROFILE, decode_scale=1.5)
    c = cal.replace(v, decode_s_per_chunk=0.004)
    (_, d0), (_, d1) = cal.build_models(v, CLUSTER), cal.build_models(c, CLUSTER)
    assert d1.round_s(1, 2.0, 0.0) == pytest.approx(d0.round_s(1, 2.0, 0.0))
    assert d1.round_s(3, 2.0, 0.0) == pytest.approx(d0.round_s(3, 2.0, 0.0) + 0.008)
    # A probe that lost a stream tells nothing.
    assert cal.decode_chunk_cost(dict(sp, streams=3), PROFILE, 1.5) == {}


def _contended_pair(alone_round: float, rounds: int, span: float, busy: list[tuple[float, float]],
                    share: float = 0.8) -> dict:
    """A decode-contended probe pair: a 61-token stream of `rounds` rounds alone at
    `alone_round` s per round, and again decoding over `span` (first token at 0.1 s after its
    send) while prompts keep the prefill engine busy over `busy` (engine intervals, relative
    to the stream's first token); each prompt's client TTFT is its engine time / `share`."""
    tokens = 61
    prompts, engine = [], 0.0
    for a, b in busy:
        ttft = (b - a) / share
        prompts.append({"start_s": 0.1 + b - ttft, "ttft_s": ttft, "output_tokens": 1})
        engine += b - a
    stream = {"ttft_s": 0.1, "last_s": 0.1 + span, "output_tokens": tokens,
              "num_rounds": rounds, "num_drafted": 2 * rounds}
    c_alone = {"decode_tpot_sum": alone_round * rounds / (tokens - 1), "decode_tpot_count": 1,
               "engine_ttft_sum": 0.05, "engine_ttft_count": 1}
    c_cont = {"decode_tpot_sum": span / (tokens - 1), "decode_tpot_count": 1,
              "engine_ttft_sum": 0.05 + engine, "engine_ttft_count": 1 + len(prompts)}
    return {"alone": dict(stream, last_s=0.1 + alone_round * rounds), "contended": stream,
            "prompts": prompts, "counters_alone": c_alone, "counters_contended": c_cont}


def test_decode_slowdown_from_the_decode_contended_probe() -> None:
    """Inverts what the simulator does: decode alone 1.0 s of work; prefill busy for the
    first 0.5 s at rate(2) = r2, decode at r2 / s then: span = 0.5 + (1 - 0.5 r2 / s)."""
    for r2, s in ((1.0, 1.5), (2 / 3, 1.2)):
        span = 0.5 + (1.0 - 0.5 * r2 / s)
        pair = _contended_pair(0.02, 50, span, [(0.0, 0.25), (0.25, 0.5)])
        got = cal.decode_contention({"reps": [pair] * 3}, r2)
        p = got["decode_contended_pairs"][0]
        assert p["prefill_busy_fraction"] == pytest.approx(0.5 / span)
        assert p["rho"] == pytest.approx(span / 1.0)
        assert got["contended_decode_slowdown"] == pytest.approx(s)
    # Prompts outside the stream's decode span count only where they overlap it.
    span = 0.5 + (1.0 - 0.5 / 1.5)
    pair = _contended_pair(0.02, 50, span, [(-0.3, 0.0), (0.0, 0.5), (span, span + 0.2)])
    assert cal.decode_contention({"reps": [pair]}, 1.0)["contended_decode_slowdown"] == \
        pytest.approx(1.5)
    # Decode no slower with prompts prefilling: no slowdown (never a speed-up); a pair whose
    # prompts the prefill engine did not all time tells nothing.
    fast = _contended_pair(0.02, 50, 0.9, [(0.0, 0.5)])
    assert cal.decode_contention({"reps": [fast]}, 1.0)["contended_decode_slowdown"] == 1.0
    lost = dict(fast, counters_contended=dict(fast["counters_contended"], engine_ttft_count=1))
    assert "contended_decode_slowdown" not in cal.decode_contention({"reps": [lost]}, 1.0)


def test_ttft_by_arrival_groups_requests_by_what_was_in_flight() -> None:
    """A arrives alone; B during A's prefill; C while only A decodes (B done); D after all."""
    def req(arrival: float, ttft: float, last: float) -> dict:
        return {"arrival_s": arrival, "ttft_s": ttft, "last_s": last}

    a, b = req(0.0, 0.10, 0.50), req(0.05, 0.20, 0.25)
    c, d = req(0.40, 0.12, 0.60), req(2.0, 0.08, 0.40)
    reqs = [a, b, c, d]
    assert [cal.arrival_state(r, [o for o in reqs if o is not r]) for r in reqs] == \
        ["alone", "behind-prefill", "during-decode", "alone"]
    pred = [{"ttft_s": t} for t in (0.05, 0.30, 0.06, 0.08)]
    got = cal.ttft_by_arrival(reqs, pred)
    assert got["alone"]["requests"] == 2
    assert got["alone"]["ttft_ms_p50_measured"] == pytest.approx(90.0)
    assert got["alone"]["ttft_ms_p50_predicted"] == pytest.approx(65.0)
    assert got["during-decode"]["ttft_p50_error_pct"] == pytest.approx(-50.0)
    assert got["behind-prefill"]["ttft_p50_error_pct"] == pytest.approx(50.0)
