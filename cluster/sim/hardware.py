"""Accelerators of the roofline replica model, read from `cluster/sim_data/hardware.json`.

Spec numbers (HBM size and bandwidth, dense BF16 / FP8 tensor FLOP/s, NVLink and NIC bandwidth)
are the vendors' published figures; the efficiencies and overheads (`assumptions` in the JSON)
are not measured here and are what the calibration benchmark (issue 19, item 6) will replace.
The parts of a replica's start delay (`start` in the JSON) state their sources there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields, replace
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "sim_data"
GB = 1e9
NOT_HARDWARE = ("_about", "assumptions", "start")


@dataclass(frozen=True)
class Hardware:
    name: str
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    bf16_flops: float  # dense FLOP/s
    fp8_flops: float
    nvlink_bw: float  # bytes/s per GPU per direction (TP all-reduces)
    net_bw: float  # bytes/s per GPU (KV transfer between prefill and decode nodes)
    decode_mfu: float
    prefill_mfu: float
    mbu: float  # achieved fraction of HBM bandwidth
    net_efficiency: float
    mem_util: float  # share of HBM the engine may use
    activation_reserve_bytes: float  # per GPU, kept out of the KV cache
    forward_overhead_s: float  # launch cost of one (graph-captured) forward
    round_overhead_s: float  # engine CPU time per decode round (schedule, sample, bookkeeping)
    per_seq_overhead_s: float  # ... per running request
    allreduce_latency_s: float
    kv_transfer_latency_s: float  # per transfer: control messages + rendezvous
    # Start delay parts (hardware.json `start`, sources there): the replica process and its
    # Serve actor up, weights read at `load_bw`, then (decode) the compiled graphs loaded from
    # the on-disk cache (`graph_warm_s`) or compiled cold (`graph_cold_s`).
    process_start_s: float
    load_bw: float  # bytes/s per GPU reading weights
    graph_warm_s: float
    graph_cold_s: float

    def flops(self, weight_bytes: int) -> float:
        return self.fp8_flops if weight_bytes == 1 else self.bf16_flops


def available() -> list[str]:
    data = json.loads((DATA_DIR / "hardware.json").read_text())
    return sorted(k for k in data if k not in NOT_HARDWARE)


def load_hardware(name: str, **overrides: float) -> Hardware:
    """`name`: a key of hardware.json (h100, h200). `overrides`: any Hardware field."""
    data = json.loads((DATA_DIR / "hardware.json").read_text())
    key = name.lower()
    if key not in data or key in NOT_HARDWARE:
        raise ValueError(f"unknown hardware {name!r}; known: {', '.join(available())}")
    spec, a, st = data[key], data["assumptions"], data["start"]
    hw = Hardware(
        name=key, hbm_bytes=spec["hbm_gb"] * GB, hbm_bw=spec["hbm_tbs"] * 1e12,
        bf16_flops=spec["bf16_tflops"] * 1e12, fp8_flops=spec["fp8_tflops"] * 1e12,
        nvlink_bw=spec["nvlink_gbs"] * GB, net_bw=spec["net_gbs"] * GB,
        decode_mfu=a["decode_mfu"], prefill_mfu=a["prefill_mfu"], mbu=a["mbu"],
        net_efficiency=a["net_efficiency"], mem_util=a["mem_util"],
        activation_reserve_bytes=a["activation_reserve_gb"] * GB,
        forward_overhead_s=a["forward_overhead_s"], round_overhead_s=a["round_overhead_s"],
        per_seq_overhead_s=a["per_seq_overhead_s"],
        allreduce_latency_s=a["allreduce_latency_s"],
        kv_transfer_latency_s=a["kv_transfer_latency_s"],
        process_start_s=st["process_start_s"], load_bw=st["load_gbs_per_gpu"] * GB,
        graph_warm_s=st["graph_load_warm_s"], graph_cold_s=st["graph_compile_cold_s"])
    known = {f.name for f in fields(Hardware)}
    bad = set(overrides) - known
    if bad:
        raise ValueError(f"unknown hardware fields {sorted(bad)}")
    return replace(hw, **overrides)
