"""What one simulated replica costs: decode round time T(B, k, context), chunked-prefill step
time, KV capacity, KV transfer time and start delay. Two sources:

- `FittedReplicaModel`: a profile JSON of our engine. Its decode round time is the engine's own
  performance model (workers/perf_model.py: T = c0 + c1 B + c2 k + c3 B k, coefficients
  `pm_0..pm_3` as a replica reports them or as `mtpserve sim profile` fits them) plus an
  optional seconds-per-context-token term; prefill is p0 + p1 tokens + p2 attended positions.
- `RooflineReplicaModel`: named hardware (sim/hardware.py) and an architecture from a Hugging
  Face config.json (sim/model_arch.py). A forward costs max(FLOPs / (peak x MFU), bytes /
  (HBM bandwidth x MBU)) plus TP all-reduces over NVLink and a launch overhead. A speculative
  round is one verify forward over B(k+1) tokens, one MTP forward over them (padded to the
  verify shape) and k-1 one-token MTP steps (the engine's round, workers/perf_model.py), plus
  the engine's CPU time per round. Attention reads each request's KV once per forward, so the
  round grows with the batch's total context, not with k.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mtpserve.cluster.sim.hardware import Hardware
from mtpserve.cluster.sim.model_arch import ModelArch
from mtpserve.workers.perf_model import PerfModel

PROFILE_BATCHES = (1, 2, 4, 8)  # = EngineRecorder.profile's batch sizes
PROFILE_PROMPT = 16  # = profile_rounds' prompt_len


class ReplicaModel(Protocol):
    name: str
    tp: int
    k_max: int
    max_num_seqs: int
    max_num_batched_tokens: int
    decode_kv_tokens: int
    prefill_kv_tokens: int
    start_s: float

    def round_s(self, batch: int, k: float, ctx_tokens: float) -> float: ...

    def prefill_step_s(self, tokens: int, attended: float) -> float: ...

    def kv_transfer_s(self, tokens: int) -> float: ...


def chunk_plan(prompt: int, budget: int, start: int = 0) -> list[tuple[int, int]]:
    """(start, end) chunks of one prompt prefilled alone under a token budget."""
    out = []
    while start < prompt:
        end = min(prompt, start + budget)
        out.append((start, end))
        start = end
    return out


def attended(start: int, end: int) -> float:
    """Sum of the context lengths tokens start..end-1 attend (causal, inclusive)."""
    return (start + end + 1) * (end - start) / 2


def prefill_alone_s(model: ReplicaModel, prompt: int) -> float:
    """Compute time of one prompt prefilled alone (its TTFT on an idle replica)."""
    return sum(model.prefill_step_s(e - s, attended(s, e))
               for s, e in chunk_plan(prompt, model.max_num_batched_tokens))


def profile_samples(model: ReplicaModel) -> list[tuple[int, float, float]]:
    """What `EngineRecorder.profile` measures at replica start: every (batch, k) cell of
    batches 1, 2, 4, 8 (up to max_num_seqs) and k = 0..k_max, with 16-token prompts. The
    model is deterministic, so one sample per cell (the fit takes a median per cell)."""
    out = []
    for k in range(model.k_max + 1):
        for b in PROFILE_BATCHES:
            if b <= model.max_num_seqs:
                out.append((b, float(k), model.round_s(b, k, b * (PROFILE_PROMPT + 1))))
    return out


@dataclass
class FittedReplicaModel:
    name: str
    tp: int
    k_max: int
    max_num_seqs: int
    max_num_batched_tokens: int
    coef: tuple[float, float, float, float]
    ctx_s_per_token: float
    prefill: tuple[float, float, float]
    decode_kv_tokens: int
    prefill_kv_tokens: int
    kv_bytes_per_token: float
    kv_latency_s: float
    kv_bytes_per_s: float
    start_s: float

    def __post_init__(self) -> None:
        self._pm = PerfModel(list(self.coef))

    def round_s(self, batch: int, k: float, ctx_tokens: float) -> float:
        return self._pm.round_s(batch, k, 0.0) + self.ctx_s_per_token * ctx_tokens

    def prefill_step_s(self, tokens: int, attended: float) -> float:
        p0, p1, p2 = self.prefill
        return p0 + p1 * tokens + p2 * attended

    def kv_transfer_s(self, tokens: int) -> float:
        return self.kv_latency_s + tokens * self.kv_bytes_per_token / self.kv_bytes_per_s

    @classmethod
    def from_profile(cls, data: dict | str | Path) -> FittedReplicaModel:
        if not isinstance(data, dict):
            data = json.loads(Path(data).read_text())
        kv = data.get("kv_transfer", {})
        return cls(
            name=data.get("name", "fitted"), tp=int(data.get("tp_size", 1)),
            k_max=int(data["k_max"]), max_num_seqs=int(data["max_num_seqs"]),
            max_num_batched_tokens=int(data.get("max_num_batched_tokens", 512)),
            coef=tuple(float(c) for c in data["perf_model"]),
            ctx_s_per_token=float(data.get("ctx_s_per_token", 0.0)),
            prefill=tuple(float(c) for c in data["prefill"]),
            decode_kv_tokens=int(data["decode_kv_tokens"]),
            prefill_kv_tokens=int(data.get("prefill_kv_tokens", data["decode_kv_tokens"])),
            kv_bytes_per_token=float(data.get("kv_bytes_per_token", 0.0)),
            kv_latency_s=float(kv.get("latency_s", 0.0)),
            kv_bytes_per_s=float(kv.get("bytes_per_s", 1e12)),
            start_s=float(data.get("start_s", 60.0)))


class RooflineReplicaModel:
    """Roofline cost of one replica (one TP group) of `arch` on `hw`."""

    def __init__(self, hw: Hardware, arch: ModelArch, tp: int, k_max: int, max_num_seqs: int,
                 max_num_batched_tokens: int = 8192, role: str = "decode",
                 cold_start: bool = False) -> None:
        self.hw, self.arch, self.tp = hw, arch, tp
        self.k_max, self.max_num_seqs = k_max, max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.name = f"{arch.name}@{hw.name}x{tp}"
        a = arch
        self.peak = hw.flops(a.weight_bytes) * tp
        self.head_bytes = a.vocab * a.hidden * a.weight_bytes
        self.head_flops = 2 * a.vocab * a.hidden  # per position with logits
        self.body_flops = 2 * a.active_body_params()  # per token
        self.mtp_flops = 2 * a.mtp_layer_params(active=True) if a.mtp_layers else 0.0
        # MLA keeps one latent for all heads: every TP rank holds (and reads) all of it; GQA
        # splits KV heads over ranks (replicated where there are fewer heads than ranks).
        self.kv_repl = tp if a.mla else max(1.0, tp / a.kv_heads)
        self.kv_layer = a.kv_bytes_per_token_layer()
        self.kv_bytes_per_token = a.kv_bytes_per_token()
        self.attn_f = a.attn_flops_per_query_ctx()
        # Weight bytes per forward: the active parameters, plus (MoE) the extra experts that a
        # larger token count touches (ModelArch.body_weight_bytes, precomputed per round).
        self.body_bytes = a.active_body_params() * a.weight_bytes
        self.mtp_bytes = a.mtp_layer_params(active=True) * a.weight_bytes if a.mtp_layers \
            else 0.0
        self.expert_bytes = a.expert_params() * a.weight_bytes if a.moe else 0.0
        self.moe_layers = a.layers - a.first_dense if a.moe else 0
        # What the engine allocates per rank (memory plan), else the parameter count.
        planned = a.planned_weight_bytes(tp)
        weights = planned * tp if planned is not None else a.total_params() * a.weight_bytes
        free = hw.hbm_bytes * hw.mem_util * tp - weights - hw.activation_reserve_bytes * tp
        if free <= 0:
            raise ValueError(f"{arch.name} ({weights / 1e9:.0f} GB of weights) does not fit "
                             f"{tp} x {hw.name}")
        self.weight_bytes = weights
        self.decode_kv_tokens = int(free / (self.kv_bytes_per_token * self.kv_repl))
        self.prefill_kv_tokens = self.decode_kv_tokens
        # Start delay, part by part (sources: hardware.json `start`). Only decode replicas run
        # compiled graphs (prefill stays eager): warm from the on-disk compile cache by default,
        # compiled within the warm-up budget with `cold_start`.
        graphs = 0.0 if role == "prefill" else (hw.graph_cold_s if cold_start
                                                else hw.graph_warm_s)
        self.start_parts = {"process_s": hw.process_start_s,
                            "weights_s": weights / tp / hw.load_bw, "graphs_s": graphs}
        self.start_s = sum(self.start_parts.values())

    def _extra_experts(self, tokens: float) -> float:
        a = self.arch
        return (a.touched_experts(tokens) - a.top_k) * self.expert_bytes if a.moe else 0.0

    def _forward_s(self, tokens: float, flops: float, nbytes: float, mfu: float) -> float:
        hw = self.hw
        t = max(flops / (self.peak * mfu), nbytes / (hw.hbm_bw * hw.mbu * self.tp))
        if self.tp > 1:  # two all-reduces of the activations per layer (ring)
            msg = tokens * self.arch.hidden * 2
            t += 2 * self.arch.layers * (hw.allreduce_latency_s
                                         + 2 * (self.tp - 1) / self.tp * msg / hw.nvlink_bw)
        return t + hw.forward_overhead_s

    def _mtp_forward_s(self, tokens: float, logits: float, ctx_tokens: float,
                       queries: float) -> float:
        flops = (self.mtp_flops * tokens + self.head_flops * logits
                 + self.attn_f * queries * ctx_tokens)
        nbytes = (self.mtp_bytes + self._extra_experts(tokens) + self.head_bytes
                  + ctx_tokens * self.kv_layer * self.kv_repl)
        return self._forward_s(tokens, flops, nbytes, self.hw.decode_mfu)

    def round_s(self, batch: int, k: float, ctx_tokens: float) -> float:
        a, hw = self.arch, self.hw
        n = batch * (k + 1)
        flops = ((self.body_flops + self.head_flops) * n
                 + self.attn_f * a.layers * (k + 1) * ctx_tokens)
        nbytes = (self.body_bytes + self.moe_layers * self._extra_experts(n) + self.head_bytes
                  + ctx_tokens * self.kv_layer * a.layers * self.kv_repl)
        t = self._forward_s(n, flops, nbytes, hw.decode_mfu)
        if a.mtp_layers:
            # MTP over the verified positions (first draft), then k-1 one-token draft steps.
            t += self._mtp_forward_s(n, batch, ctx_tokens, k + 1)
            t += max(k - 1.0, 0.0) * self._mtp_forward_s(batch, batch, ctx_tokens, 1)
        return t + hw.round_overhead_s + hw.per_seq_overhead_s * batch

    def prefill_step_s(self, tokens: int, attended: float) -> float:
        a = self.arch
        flops = (self.body_flops * tokens + self.attn_f * a.layers * attended
                 + self.mtp_flops * tokens + self.attn_f * attended * min(a.mtp_layers, 1))
        extra = self._extra_experts(tokens)
        nbytes = (self.body_bytes + self.moe_layers * extra + self.head_bytes
                  + (self.mtp_bytes + extra if a.mtp_layers else 0.0)
                  + tokens * self.kv_bytes_per_token * self.kv_repl)
        return self._forward_s(tokens, flops, nbytes, self.hw.prefill_mfu)

    def kv_transfer_s(self, tokens: int) -> float:
        # Each decode rank pulls its KV slice from the prefill ranks over its own NIC, in
        # parallel (the prefill side is assumed to have the same TP size).
        per_rank = tokens * self.kv_bytes_per_token * self.kv_repl / self.tp
        return self.hw.kv_transfer_latency_s + per_rank / (self.hw.net_bw
                                                           * self.hw.net_efficiency)


def max_batch_meeting(model: ReplicaModel, tpot_s: float, tokens_per_round: float, k: int,
                      ctx_per_seq: float) -> int:
    """Largest batch (<= max_num_seqs) whose round time / tokens per round meets `tpot_s` (0 if
    none): a replica's capacity at an SLO, for the profiled baselines."""
    best = 0
    for b in range(1, model.max_num_seqs + 1):
        if model.round_s(b, k, b * ctx_per_seq) / tokens_per_round <= tpot_s:
            best = b
        else:
            break
    return best


def ceil_div(a: float, b: float) -> int:
    return int(math.ceil(a / b - 1e-12))
