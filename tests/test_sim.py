"""The cluster simulator (cluster/sim): determinism, conservation, exactness on one request,
that it runs the very policy objects the deployments are configured with, that its port of
Serve's autoscaling wrapper matches Ray's, and that it stays Ray-free."""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import random
import subprocess
import sys
from pathlib import Path

import pytest

from mtpserve.cluster.sim import serve_port
from mtpserve.cluster.sim.cluster import Simulator, run
from mtpserve.cluster.sim.config import SimConfig
from mtpserve.cluster.sim.decode_replica import observe_drafts, observe_rounds
from mtpserve.cluster.sim.model_arch import load_arch
from mtpserve.cluster.sim.replica_models import FittedReplicaModel, prefill_alone_s
from mtpserve.cluster.sim.requests import OK
from mtpserve.cluster.sim.results import gpu_seconds, timeline_gpu_seconds
from mtpserve.cluster.sim.workloads import ACCEPTANCE, Scenario, generate, single_request
from mtpserve.workers.adaptive_k import AdaptiveK
from mtpserve.workers.perf_model import PerfModel, expected_tokens

SIM_DIR = Path(__file__).resolve().parent.parent / "cluster" / "sim"

PROFILE = {
    "name": "test", "tp_size": 2, "k_max": 1, "max_num_seqs": 8,
    "max_num_batched_tokens": 256, "perf_model": [0.01, 0.001, 0.0005, 0.0001],
    "prefill": [0.002, 1e-5, 1e-8], "decode_kv_tokens": 100_000,
    "kv_bytes_per_token": 1000.0, "kv_transfer": {"latency_s": 0.003, "bytes_per_s": 1e8},
    "start_s": 30.0,
}


def _short(policy: str = "mtpserve", **kw) -> SimConfig:
    return SimConfig(scenario="burst", policy=policy, duration_s=120.0, rate_scale=0.5, **kw)


def _scaling_workload(seed: int = 0):
    """Five minutes whose middle 100 s carry 6x the load: replicas start, drain and stop."""
    sc = Scenario("step", 300.0, 4.0, lambda t: 6.0 if 100 <= t < 200 else 1.0,
                  lambda t: 0.5, "test")
    return generate(sc, seed)


def _scaling_config(policy: str) -> SimConfig:
    return SimConfig(scenario="step", policy=policy, upscale_delay_s=2.0,
                     downscale_delay_s=20.0, decode_replicas=(1, 1, 4),
                     prefill_replicas=(1, 1, 3), graceful_shutdown_timeout_s=5.0)


def test_same_seed_same_json_other_seed_other_json() -> None:
    a = json.dumps(run(_short(seed=3)), sort_keys=True)
    b = json.dumps(run(_short(seed=3)), sort_keys=True)
    c = json.dumps(run(_short(seed=4)), sort_keys=True)
    assert a == b
    assert a != c


@pytest.mark.parametrize("policy", ["mtpserve", "slo-planner"])
def test_every_request_finishes_once_and_gpu_seconds_integrate(policy: str) -> None:
    sim = Simulator(_scaling_config(policy), workload=_scaling_workload())
    done: dict[int, int] = {}
    orig = sim.request_done

    def counting(req, now):
        done[req.rid] = done.get(req.rid, 0) + 1
        orig(req, now)

    sim.request_done = counting
    res = sim.run()
    s = res["summary"]
    assert s["requests"] == len(sim.requests) > 1000
    assert s["finished"] + s["rejected"] == s["requests"] and s["unfinished"] == 0
    ok = [r for r in sim.requests if r.status == OK]
    assert all(done.get(r.rid) == 1 for r in ok)
    assert all(r.t_end is not None for r in sim.requests)
    assert all(r.arrival <= r.t_first <= r.t_end for r in ok)
    assert all(r.produced == r.output for r in ok)
    # The policy scaled: replicas were started and stopped.
    assert sum(s["replica_starts"].values()) > 2
    stopped = [r for role in sim.replicas for r in sim.replicas[role]
               if r.t_stopped < sim.t_end]
    assert stopped
    # GPU-seconds = replicas x TP x seconds alive = the integral of the replica timeline.
    log_total = timeline_gpu_seconds(sim.replica_log, sim.tp)
    assert math.isclose(gpu_seconds(sim), log_total, rel_tol=1e-9)
    assert math.isclose(s["gpu_seconds"], log_total, rel_tol=1e-6)
    assert sim.replica_log[-1][0] == sim.t_end


def test_one_request_on_one_replica_sees_exactly_the_model() -> None:
    model = FittedReplicaModel.from_profile(PROFILE)
    prompt, output = 700, 101
    cfg = SimConfig(policy="mtpserve", prefill_replicas=(1, 1, 1), decode_replicas=(1, 1, 1))
    sim = Simulator(cfg, workload=single_request(prompt, output, cls=0, at=0.5),
                    models=(model, model))
    res = sim.run()
    req = sim.requests[0]
    assert req.status == OK and res["summary"]["finished"] == 1
    # TTFT: the chunked prefill of the prompt (256-token budget: 3 chunks).
    assert req.ttft == pytest.approx(prefill_alone_s(model, prompt), rel=1e-12)
    # TPOT: the KV pull, then ceil((output - 1) / E(k)) rounds of T(1, k).
    k = 1  # drafting pays here: E(1) / T(1, 1) = 1.9 / 0.0116 > 1 / 0.011
    alphas = ACCEPTANCE["code"][:1]
    rounds = math.ceil((output - 1) / expected_tokens(alphas, k))
    pull = model.kv_transfer_s(prompt + k - 1)
    expected = (pull + rounds * model.round_s(1, k, 0)) / (output - 1)
    assert req.tpot == pytest.approx(expected, rel=1e-12)
    rep = sim.replicas["decode"][0]
    assert rep.rounds_total == rounds
    assert rep.windows.tpot_s.values() == pytest.approx(
        [rounds * model.round_s(1, k, 0) / (output - 1)])


def test_the_simulator_calls_the_policies_the_deployments_are_configured_with(
        monkeypatch) -> None:
    from mtpserve.cluster import app
    from mtpserve.cluster.autoscaling_policy import BOARD, DecodePolicy, PrefillPolicy

    sim = Simulator(_short())
    for role, cls in (("decode", DecodePolicy), ("prefill", PrefillPolicy)):
        opts = app.deployment_options(sim.cfg, role)
        ac = opts["autoscaling_config"]
        assert sim.autoscaling_configs[role] == ac
        assert sim.max_ongoing[role] == opts["max_ongoing_requests"]
        module, _, attr = ac["policy"]["policy_function"].partition(":")
        resolved = getattr(importlib.import_module(module), attr)
        policy = sim.autoscalers[role].policy
        assert resolved is cls and type(policy) is resolved
        kwargs = ac["policy"]["policy_kwargs"]
        assert policy.downscale_hold_s == kwargs["downscale_hold_s"]
        assert policy.max_age_s == kwargs["max_age_s"]
        assert policy.publish is False  # added: no Ray actor to publish to
        # Added: a demand board of this run, shared by its two policies (not the process's).
        assert policy.board is sim.autoscalers["decode"].policy.board is not BOARD
    assert sim.autoscalers["decode"].policy.target_tpot_s * 1000 == pytest.approx(
        ac_tpot := app.deployment_options(sim.cfg, "decode")["autoscaling_config"]
        ["policy"]["policy_kwargs"]["target_tpot_ms"])
    assert ac_tpot == sim.sim.tpot_slo_ms
    # Those very objects are what every control tick calls, with the context attributes
    # Serve's AutoscalingContext has.
    seen: list = []
    for cls in (DecodePolicy, PrefillPolicy):
        orig = cls.__call__

        def spy(self, ctx, _orig=orig):
            seen.append((self, ctx))
            return _orig(self, ctx)

        monkeypatch.setattr(cls, "__call__", spy)
    sim.run()
    objs = {id(o) for o, _ in seen}
    assert objs == {id(sim.autoscalers["decode"].policy), id(sim.autoscalers["prefill"].policy)}
    assert all(isinstance(ctx, serve_port.SimAutoscalingContext) for _, ctx in seen)


def test_serve_default_is_serves_own_policy() -> None:
    from ray.serve import autoscaling_policy
    from ray.serve.config import AutoscalingConfig

    sim = Simulator(_short("serve-default"))
    default = AutoscalingConfig().policy.policy_function
    module, _, attr = default.partition(":")
    resolved = getattr(importlib.import_module(module), attr)
    for role in ("decode", "prefill"):
        assert sim.autoscalers[role].policy is resolved
        assert resolved is autoscaling_policy.default_autoscaling_policy
    res = sim.run()
    assert res["summary"]["finished"] == res["summary"]["requests"]


def test_context_and_config_have_serves_fields() -> None:
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    ours = list(inspect.signature(serve_port.SimAutoscalingContext).parameters)
    theirs = list(inspect.signature(AutoscalingContext).parameters)
    assert ours == theirs
    ray_cfg = AutoscalingConfig()
    sim_cfg = serve_port.SimAutoscalingConfig()
    for f in sim_cfg.__dataclass_fields__:
        if f != "policy":
            assert getattr(sim_cfg, f) == getattr(ray_cfg, f), f


def test_serve_wrapper_port_matches_ray() -> None:
    from ray.serve import autoscaling_policy as ap
    from ray.serve.config import AutoscalingConfig

    rng = random.Random(0)
    for _ in range(20):
        kw = {"min_replicas": 0, "max_replicas": 20,
              "upscale_delay_s": rng.choice([0.0, 1.0, 5.0]),
              "downscale_delay_s": rng.choice([0.0, 1.0, 10.0]),
              "downscale_to_zero_delay_s": rng.choice([None, 3.0]),
              "upscaling_factor": rng.choice([None, 0.5, 2.0]),
              "downscaling_factor": rng.choice([None, 0.5])}
        ray_cfg, sim_cfg = AutoscalingConfig(**kw), serve_port.SimAutoscalingConfig(**kw)
        s_ray: dict = {}
        s_sim: dict = {}
        target = 3
        for step in range(60):
            now = step * 0.5
            desired = rng.choice([0, 1, 2, 3, 4, 7, 2.5])
            current = rng.choice([0, target, target])
            a = ap._apply_scaling_factors(desired, current, ray_cfg)
            b = serve_port.apply_scaling_factors(desired, current, sim_cfg)
            assert a == b
            ra, s_ray = ap._apply_delay_logic(max(0, a), target, ray_cfg, s_ray, _now=now)
            rb, s_sim = serve_port.apply_delay_logic(max(0, b), target, sim_cfg, s_sim, now)
            assert ra == rb and s_ray == s_sim
            target = min(max(ra, 0), 20)


def test_serve_wrapper_port_composes_like_ray() -> None:
    """The whole wrapper (cold start, factors, delays, state merge) against Ray's, with zero
    delays so Ray's wall clock cannot matter."""
    from ray.serve import autoscaling_policy as ap
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    def policy_of(wants):
        def policy(ctx):
            return next(wants), {"mine": ctx.target_num_replicas}
        return policy

    seq = [3, 3, 1, 0, 5, 2.5, 2, 2, 7, 1]
    kw = {"min_replicas": 0, "max_replicas": 8, "upscale_delay_s": 0.0,
          "downscale_delay_s": 0.0, "upscaling_factor": 0.5}
    ours = serve_port.apply_autoscaling_config(policy_of(iter(seq)), lambda: 0.0)
    theirs = ap._apply_autoscaling_config(policy_of(iter(seq)))
    configs = {"ours": serve_port.SimAutoscalingConfig(**kw), "theirs": AutoscalingConfig(**kw)}
    state = {"ours": {}, "theirs": {}}
    target = {"ours": 2, "theirs": 2}
    for step in range(10):
        running = step % 3  # includes 0 running replicas (the cold-start path)
        for name, fn, cls in (("ours", ours, serve_port.SimAutoscalingContext),
                              ("theirs", theirs, AutoscalingContext)):
            ctx = cls(deployment_id=None, deployment_name="D", app_name="a",
                      current_num_replicas=running, target_num_replicas=target[name],
                      running_replicas=[], total_num_requests=4.0, total_queued_requests=0.0,
                      aggregated_metrics={}, raw_metrics={}, capacity_adjusted_min_replicas=0,
                      capacity_adjusted_max_replicas=8, policy_state=dict(state[name]),
                      last_scale_up_time=None, last_scale_down_time=None, current_time=0.0,
                      config=configs[name])
            n, state[name] = fn(ctx)
            target[name] = n
        assert target["ours"] == target["theirs"] and state["ours"] == state["theirs"]


def test_bulk_observations_equal_repeated_ones() -> None:
    a, b = PerfModel([0.01, 0.001, 0.002, 0.0001]), PerfModel([0.01, 0.001, 0.002, 0.0001])
    for _ in range(37):
        a.observe(12, 2.0, 0.031, 30_000.0)
    observe_rounds(b, 12, 2.0, 0.031, 37, 30_000.0)
    a._solve()
    b._solve()
    assert b.coef == pytest.approx(a.coef, rel=1e-9)
    assert b.ctx_per_seq == pytest.approx(a.ctx_per_seq, rel=1e-9) == 2500.0
    # AdaptiveK: 40 requests that all draft 3 and accept exactly 1 test positions 0 and 1.
    c, d = AdaptiveK(3), AdaptiveK(3)
    for _ in range(40):
        c.observe(3, 1)
    observe_drafts(d, [40.0, 40.0, 0.0], [40.0, 0.0, 0.0])
    assert d.drafted == pytest.approx(c.drafted) and d.accepted == pytest.approx(c.accepted)


def test_shipped_architectures_match_published_sizes() -> None:
    mimo, qwen, ds = (load_arch(n) for n in ("mimo-7b-like", "qwen3-32b-like",
                                              "deepseek-v3-like"))
    no_mtp = (lambda a: a.total_params() - a.mtp_layers * a.mtp_layer_params())
    assert 7.4e9 < no_mtp(mimo) < 7.8e9  # MiMo-7B
    assert 32.5e9 < no_mtp(qwen) < 33.0e9  # Qwen3-32B: 32.8B
    assert 668e9 < no_mtp(ds) < 674e9  # DeepSeek-V3: 671B total
    assert 36e9 < ds.active_body_params() + ds.embed_params() < 38.5e9  # 37B active
    assert ds.kv_bytes_per_token_layer() == (512 + 64) * 2  # MLA latent + rope key


def test_cli_writes_json_and_png(tmp_path) -> None:
    """The PNG needs matplotlib (the `bench` extra); without it only the JSON is checked."""
    import importlib.util

    from mtpserve.cluster.cli import main

    out, png = tmp_path / "r.json", tmp_path / "r.png"
    plot = importlib.util.find_spec("matplotlib") is not None
    rc = main(["sim", "autoscale", "--scenario", "diurnal", "--policy", "mtpserve",
               "--duration-s", "90", "--rate-scale", "0.25", "--json", str(out)]
              + (["--png", str(png)] if plot else []))
    assert rc == 0
    res = json.loads(out.read_text())
    for key in ("slo_attainment", "goodput_rps", "gpu_seconds", "ttft_ms_p50", "ttft_ms_p99",
                "tpot_ms_p50", "tpot_ms_p99"):
        assert key in res["summary"]
    assert res["replica_timeline"]["rows"] and res["timeline"]
    if plot:
        assert png.stat().st_size > 10_000


def _module_ray_imports(path: Path) -> tuple[list[str], list[str]]:
    """(module-level Ray imports, functions that import Ray) of one source file."""
    tree = ast.parse(path.read_text())
    top, funcs = [], []

    def is_ray(node: ast.AST) -> bool:
        if isinstance(node, ast.Import):
            return any(a.name.split(".")[0] == "ray" for a in node.names)
        return isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "ray"

    for node in tree.body:
        if is_ray(node):
            top.append(path.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(is_ray(n) for n in ast.walk(node)):
            funcs.append(f"{path.name}:{node.name}")
    return top, funcs


def test_simulator_is_ray_free() -> None:
    top, funcs = [], []
    for path in sorted(SIM_DIR.glob("*.py")):
        t, f = _module_ray_imports(path)
        top += t
        funcs += f
    assert top == []
    # Only Serve's default policy (and the real context it reads) come from Ray.
    assert sorted(funcs) == ["policies.py:_ray_context", "policies.py:_ray_default_policy"]
    code = ("import sys, json\n"
            "from mtpserve.cluster.sim.config import SimConfig\n"
            "from mtpserve.cluster.sim.cluster import run\n"
            "for p in ('mtpserve', 'slo-planner'):\n"
            "    run(SimConfig(scenario='burst', policy=p, duration_s=30, rate_scale=0.2))\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'ray')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_replica_start_delay_is_made_of_stated_parts() -> None:
    """Process + weights at the stated bandwidth + (decode only) graphs: warm from the on-disk
    compile cache by default, compiled within the warm-up budget with cold_start; every part
    is in hardware.json `start` with a source."""
    from mtpserve.cluster.sim.cluster import build_models
    from mtpserve.cluster.sim.hardware import DATA_DIR, load_hardware

    hw = load_hardware("h200")
    arch = load_arch("mimo-7b-like")
    pre, dec = build_models(SimConfig())
    # A rank's weights as the engine allocates them (the memory plan), at the stated bandwidth.
    weights_s = arch.planned_weight_bytes(pre.tp) / hw.load_bw
    assert weights_s == pytest.approx(arch.total_params() * arch.weight_bytes / pre.tp
                                      / hw.load_bw, rel=0.01)
    assert pre.start_parts == pytest.approx(
        {"process_s": hw.process_start_s, "weights_s": weights_s, "graphs_s": 0.0})
    assert dec.start_parts["graphs_s"] == hw.graph_warm_s
    assert dec.start_s == pytest.approx(hw.process_start_s + weights_s + hw.graph_warm_s)
    _, cold = build_models(SimConfig(cold_start=True))
    assert cold.start_s - dec.start_s == pytest.approx(hw.graph_cold_s - hw.graph_warm_s)
    _, fast = build_models(SimConfig(load_gbs=hw.load_bw / 1e9 * 2))
    assert fast.start_parts["weights_s"] == pytest.approx(weights_s / 2)
    start = json.loads((DATA_DIR / "hardware.json").read_text())["start"]
    assert set(start["sources"]) == set(start) - {"sources"}
