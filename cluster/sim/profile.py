"""A fitted replica profile (the JSON `FittedReplicaModel` reads) measured on our own engine:
the decode round-time model from `workers.perf_model.profile_rounds` (the profile every decode
replica runs at start, fitted the same way) and prefill step times of lone prompts, fitted as
p0 + p1 tokens + p2 attended positions. Ray-free; runs the engine in this process.

The KV-transfer numbers are not measured here: they default to the CPU gloo pull measured in
benchmarks/results/datapath-cpu.json (1.24 GiB/s achieved; ~2 ms fixed per pull assumed).
"""

from __future__ import annotations

import time

import numpy as np

from mtpserve.cluster.sim.replica_models import attended, chunk_plan

DATAPATH_CPU_BYTES_PER_S = 1.24 * 2**30
PREFILL_LENGTHS = (32, 128, 256, 512, 1024)


def profile_engine(model: str | None = None, k_max: int = 2, max_num_seqs: int = 8,
                   num_kv_blocks: int = 1024, block_size: int = 16,
                   max_num_batched_tokens: int = 512, seed: int = 0,
                   rounds_per_cell: int = 4, prefill_reps: int = 3) -> dict:
    import torch

    from mtpserve.cluster.sim.model_arch import arch_from_config
    from mtpserve.workers.engine import Engine
    from mtpserve.workers.engine_config import EngineConfig
    from mtpserve.workers.paths import default_model_path
    from mtpserve.workers.perf_model import PerfModel, profile_rounds
    from mtpserve.workers.sampling_params import SamplingParams

    torch.set_num_threads(1)  # one thread: thread CPU time is then the step's cost
    path = str(model or default_model_path())
    engine = Engine(EngineConfig(model=path, num_speculative_tokens=k_max, adaptive_k=True,
                                 block_size=block_size, num_kv_blocks=num_kv_blocks,
                                 max_num_seqs=max_num_seqs,
                                 max_num_batched_tokens=max_num_batched_tokens))
    bs = [b for b in (1, 2, 4, 8) if b <= max_num_seqs]
    samples = profile_rounds(engine, bs, range(k_max + 1), rounds_per_cell=rounds_per_cell,
                             seed=seed, clock=time.thread_time)
    coef = PerfModel().fit(samples).coef
    # Prefill: lone prompts, one step per chunk.
    rng = np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    rows = []
    for n in PREFILL_LENGTHS:
        for rep in range(prefill_reps):
            rid = f"__prefill-{n}-{rep}"
            engine.add_request(rid, rng.integers(3, vocab, n).tolist(),
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
            for s, e in chunk_plan(n, max_num_batched_tokens):
                t0 = time.thread_time()
                engine.step()
                rows.append((e - s, attended(s, e), time.thread_time() - t0))
            while engine.has_unfinished():
                engine.step()
    x = np.array([[1.0, tok, att] for tok, att, _ in rows])
    y = np.array([sec for _, _, sec in rows])
    prefill, *_ = np.linalg.lstsq(x, y, rcond=None)
    prefill = np.maximum(prefill, 0.0)
    import json
    from pathlib import Path

    arch = arch_from_config(json.loads((Path(path) / "config.json").read_text()), "engine")
    kv_per_token = arch.kv_bytes_per_token() * (4 // arch.kv_dtype_bytes)  # float32 engine
    return {
        "name": f"{Path(path).name}-cpu-profile", "tp_size": 1, "k_max": k_max,
        "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
        "perf_model": [float(c) for c in coef], "ctx_s_per_token": 0.0,
        "prefill": [float(c) for c in prefill],
        "decode_kv_tokens": num_kv_blocks * block_size,
        "prefill_kv_tokens": num_kv_blocks * block_size,
        "kv_bytes_per_token": float(kv_per_token),
        "kv_transfer": {"latency_s": 0.002, "bytes_per_s": DATAPATH_CPU_BYTES_PER_S},
        "start_s": 20.0,
        "source": "mtpserve sim profile: workers.perf_model.profile_rounds (thread CPU time, "
                  "one torch thread) and lone-prompt prefill steps on this machine",
        "samples": len(samples),
    }
