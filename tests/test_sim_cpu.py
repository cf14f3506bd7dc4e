"""CPU sharing between co-located replicas in the simulator (cluster/sim/cpu.py): processor
sharing on the simulated clock, used only when `SimConfig.cpu` is set."""

from __future__ import annotations

import json

import numpy as np
import pytest

from mtpserve.cluster.sim.cluster import Simulator, run
from mtpserve.cluster.sim.config import SimConfig
from mtpserve.cluster.sim.cpu import CpuSharing, SharedCpu
from mtpserve.cluster.sim.events import EventQueue
from mtpserve.cluster.sim.replica_models import FittedReplicaModel, prefill_alone_s
from mtpserve.cluster.sim.workloads import Workload

PROFILE = {
    "name": "test", "tp_size": 1, "k_max": 1, "max_num_seqs": 8,
    "max_num_batched_tokens": 256, "perf_model": [0.01, 0.001, 0.0005, 0.0001],
    "prefill": [0.002, 1e-5, 1e-8], "decode_kv_tokens": 100_000,
    "kv_bytes_per_token": 1000.0, "kv_transfer": {"latency_s": 0.003, "bytes_per_s": 1e8},
    "start_s": 30.0,
}


class Clock:
    """The simulator's host interface, bare: a clock and an event queue."""

    def __init__(self) -> None:
        self.now = 0.0
        self.events = EventQueue()

    def schedule(self, t: float, fn, *args) -> None:
        self.events.push(t, fn, *args)

    def run(self) -> None:
        while len(self.events):
            self.now, fn, args = self.events.pop()
            fn(*args)


def _finish_times(sharing: CpuSharing, jobs: list[tuple[float, float]]) -> list[float]:
    """Start each (start time, work) job; the time each one finishes."""
    host = Clock()
    cpu = SharedCpu(host, sharing)
    done = [None] * len(jobs)

    def finished(i: int) -> None:
        done[i] = host.now

    for i, (t, w) in enumerate(jobs):
        host.schedule(t, lambda i=i, w=w: cpu.start(w, finished, i))
    host.run()
    return done


def test_two_jobs_on_one_core_each_take_twice_as_long() -> None:
    one = CpuSharing(cores=1)
    assert _finish_times(one, [(0.0, 1.0)]) == [1.0]
    assert _finish_times(one, [(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([2.0, 2.0])
    # Unequal work: both at half speed until the short one ends at 2, then the long one alone.
    assert _finish_times(one, [(0.0, 1.0), (0.0, 3.0)]) == pytest.approx([2.0, 4.0])
    # A job arriving midway: the first has done 0.5 alone and does the rest at half speed
    # (ends at 1.5), by when the second has done 0.5 and finishes alone (at 2.0).
    assert _finish_times(one, [(0.0, 1.0), (0.5, 1.0)]) == pytest.approx([1.5, 2.0])
    # Two cores: two jobs do not slow each other; a third does (2/3 speed each).
    two = CpuSharing(cores=2)
    assert _finish_times(two, [(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([1.0, 1.0])
    assert _finish_times(two, [(0.0, 1.0)] * 3) == pytest.approx([1.5] * 3)


def test_other_jobs_threads_share_fairly_or_keep_to_their_cores() -> None:
    # 2 cores, a training thread busy: a job alone runs at its measured speed (it was
    # measured so); two of ours get 2/3 of a core each instead of 1.
    cfs = CpuSharing(cores=2, other_threads=1)
    assert cfs.rate(1) == 1.0
    assert cfs.rate(2) == pytest.approx(2 / 3)
    assert _finish_times(cfs, [(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([1.5, 1.5])
    pinned = CpuSharing(cores=2, other_threads=1, pinned=True)
    assert pinned.rate(2) == pytest.approx(0.5)
    assert _finish_times(pinned, [(0.0, 1.0), (0.0, 1.0)]) == pytest.approx([2.0, 2.0])


def test_set_work_and_cancel() -> None:
    host = Clock()
    cpu = SharedCpu(host, CpuSharing(cores=1))
    ends: list[tuple[str, float]] = []
    a = cpu.start(4.0, lambda: ends.append(("a", host.now)))
    cpu.start(1.0, lambda: ends.append(("b", host.now)))
    host.schedule(1.0, lambda: cpu.set_work(a, 0.75))  # a has done 0.5: 0.25 left
    host.run()
    # b: 0.5 by t=1, 0.25 more by 1.5, its last 0.25 alone.
    assert ends == [("a", pytest.approx(1.5)), ("b", pytest.approx(1.75))]
    c = cpu.start(1.0, lambda: ends.append(("c", host.now)))
    host.schedule(host.now + 0.25, lambda: cpu.cancel(c))
    host.run()
    assert cpu.done_work(c) == pytest.approx(0.25) and len(ends) == 2 and not cpu.jobs


def test_contended_kinds_run_slower_only_while_decode_runs() -> None:
    # 2 cores, prefill 1.5x slower while a decode job runs; decode, prefill and a pull, work 1
    # each, from 0.
    host = Clock()
    cpu = SharedCpu(host, CpuSharing(cores=2, contended=(("prefill", 1.5),)))
    ends: dict[str, float] = {}
    cpu.start(1.0, lambda: ends.setdefault("decode", host.now), kind="decode")
    cpu.start(1.0, lambda: ends.setdefault("prefill", host.now), kind="prefill")
    cpu.start(1.0, lambda: ends.setdefault("pull", host.now), kind="pull")  # not contended
    host.run()
    # Three jobs on 2 cores: 2/3 speed each, prefill 4/9 while decode runs (to 1.5), then
    # its last 1/3 alone.
    assert ends["decode"] == pytest.approx(1.5) and ends["pull"] == pytest.approx(1.5)
    assert ends["prefill"] == pytest.approx(1.5 + (1 - 1.5 * 4 / 9))
    # Without a decode job the contended kind runs at its plain share.
    assert _finish_times(CpuSharing(cores=2, contended=(("", 2.0),)), [(0.0, 1.0)]) == [1.0]


def _finish_times_kinds(sharing: CpuSharing, jobs: list[tuple[float, str]]) -> list[float]:
    """Start each (work, kind) job at 0; the time each one finishes."""
    host = Clock()
    cpu = SharedCpu(host, sharing)
    done: list[float] = [0.0] * len(jobs)

    def finished(i: int) -> None:
        done[i] = host.now

    for i, (w, kind) in enumerate(jobs):
        cpu.start(w, finished, i, kind=kind)
    host.run()
    return done


def test_decode_runs_slower_only_while_prefill_runs() -> None:
    # 2 cores (two jobs: full speed each); decode 1.5x slower while a prefill job runs, which
    # is not itself slowed (no "prefill" entry). Decode work 1, prefill 0.5, both from 0.
    sharing = CpuSharing(cores=2, contended=(("decode", 1.5),))
    host = Clock()
    cpu = SharedCpu(host, sharing)
    ends: dict[str, float] = {}
    cpu.start(1.0, lambda: ends.setdefault("decode", host.now), kind="decode")
    cpu.start(0.5, lambda: ends.setdefault("prefill", host.now), kind="prefill")
    host.run()
    assert ends["prefill"] == pytest.approx(0.5)
    # 0.5 s at 2/3 speed (1/3 done), then the rest alone.
    assert ends["decode"] == pytest.approx(0.5 + (1 - 0.5 / 1.5))
    # Other kinds (a pull, the work outside the engines) do not slow decode.
    for kind in ("pull", "ingress", "stream"):
        assert _finish_times_kinds(sharing, [(1.0, "decode"), (0.5, kind)]) == \
            pytest.approx([1.0, 0.5])
    # Both directions at once: each engine slowed by the other while both run.
    host = Clock()
    cpu = SharedCpu(host, CpuSharing(cores=2, contended=(("decode", 2.0), ("prefill", 2.0))))
    ends = {}
    cpu.start(1.0, lambda: ends.setdefault("decode", host.now), kind="decode")
    cpu.start(1.0, lambda: ends.setdefault("prefill", host.now), kind="prefill")
    host.run()
    assert ends["decode"] == pytest.approx(2.0) and ends["prefill"] == pytest.approx(2.0)


def test_prefill_slows_a_decoding_requests_rounds_in_the_simulator() -> None:
    """A request decoding while another prefills: with the decode slowdown its TPOT grows,
    the prefilling request's TTFT does not change (2 cores: no sharing cost)."""
    wl = _workload([0.0, 0.3], [300, 3000], [200, 2])
    base = _sim(wl, CpuSharing(cores=2))
    slow = _sim(wl, CpuSharing(cores=2, contended=(("decode", 1.5),)))
    assert slow.requests[0].tpot > 1.02 * base.requests[0].tpot
    assert slow.requests[1].ttft == pytest.approx(base.requests[1].ttft, rel=1e-9)


def _workload(arrival: list[float], prompt: list[int], output: list[int]) -> Workload:
    n = len(arrival)
    return Workload(arrival=np.array(arrival), cls=np.zeros(n, dtype=np.int64),
                    prompt=np.array(prompt, dtype=np.int64),
                    output=np.array(output, dtype=np.int64), duration_s=max(arrival) + 1e-3)


def _sim(wl: Workload, cpu: CpuSharing | None, overhead: float = 0.02) -> Simulator:
    m = FittedReplicaModel.from_profile(PROFILE)
    cfg = SimConfig(scenario="test", prefill_replicas=(1, 1, 1), decode_replicas=(1, 1, 1),
                    ingress_overhead_s=overhead, cpu=cpu)
    sim = Simulator(cfg, workload=wl, models=(m, m), class_alphas=[(0.8,)])
    sim.run()
    return sim


def test_a_lone_request_runs_at_the_models_speed_with_sharing() -> None:
    """Nothing overlaps: ingress, prefill, KV pull and decode each run alone, so sharing one
    core changes nothing (up to rounding)."""
    wl = _workload([0.0], [300], [40])
    plain = _sim(wl, None).requests[0]
    shared = _sim(wl, CpuSharing(cores=1)).requests[0]
    m = FittedReplicaModel.from_profile(PROFILE)
    assert plain.ttft == pytest.approx(0.02 + prefill_alone_s(m, 300), rel=1e-12)
    assert shared.ttft == pytest.approx(plain.ttft, rel=1e-9)
    assert shared.tpot == pytest.approx(plain.tpot, rel=1e-9)


def test_co_located_requests_slow_each_other_down() -> None:
    """A request prefilling while another decodes: on one shared core both take longer than
    on separate machines; with many cores they do not."""
    wl = _workload([0.0, 0.3], [300, 300], [200, 200])
    plain = _sim(wl, None)
    one = _sim(wl, CpuSharing(cores=1))
    many = _sim(wl, CpuSharing(cores=64))
    second = [s.requests[1] for s in (plain, one, many)]
    assert second[1].ttft > 1.5 * second[0].ttft
    assert one.requests[0].tpot > plain.requests[0].tpot
    assert second[2].ttft == pytest.approx(second[0].ttft, rel=1e-9)
    for a, b in zip(plain.requests, many.requests, strict=True):
        assert b.tpot == pytest.approx(a.tpot, rel=1e-6)
    # Every request still finishes once.
    assert all(r.t_end is not None for r in one.requests)


def test_sharing_is_deterministic_and_reported_only_when_on() -> None:
    share = CpuSharing(cores=2, other_threads=1, stream_s_per_chunk=1e-4)
    cfg = SimConfig(scenario="burst", duration_s=60.0, rate_scale=0.02, cpu=share,
                    prefill_replicas=(1, 1, 2), decode_replicas=(1, 1, 2))
    a = json.dumps(run(cfg), sort_keys=True)
    b = json.dumps(run(cfg), sort_keys=True)
    assert a == b
    assert json.loads(a)["config"]["cpu_sharing"]["cores"] == 2
    plain = run(SimConfig(scenario="burst", duration_s=60.0, rate_scale=0.02,
                          prefill_replicas=(1, 1, 2), decode_replicas=(1, 1, 2)))
    assert "cpu_sharing" not in plain["config"]


def test_gpu_runs_build_no_shared_cpu() -> None:
    sim = Simulator(SimConfig(scenario="burst", duration_s=10.0, rate_scale=0.1))
    assert sim.cpu is None
    sim.run()
    assert all(r.cpu is None for role in sim.replicas for r in sim.replicas[role])
