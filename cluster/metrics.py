"""Prometheus metrics of the servers (exported by Ray as `ray_mtpserve_*`)."""

from __future__ import annotations

from functools import lru_cache

_MS_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000]


@lru_cache(maxsize=1)
def metrics() -> dict:
    """Created lazily inside a replica (Ray metrics need a running Ray worker)."""
    from ray.serve.metrics import Counter, Gauge, Histogram

    return {
        "ttft_ms": Histogram("mtpserve_ttft_ms", "Prefill latency to the first token (ms).",
                             boundaries=_MS_BUCKETS),
        "tpot_ms": Histogram("mtpserve_tpot_ms", "Decode time per output token (ms).",
                             boundaries=_MS_BUCKETS),
        "acceptance": Gauge("mtpserve_spec_acceptance_rate",
                            "Accepted / drafted tokens of this replica (recent requests)."),
        "tokens": Counter("mtpserve_generated_tokens", "Output tokens emitted."),
        "kv_used": Gauge("mtpserve_kv_blocks_used", "KV blocks in use on this replica."),
        "k": Gauge("mtpserve_num_speculative_tokens", "Current speculation depth k."),
    }


class EMA:
    """Exponential moving average that knows whether it has seen anything."""

    def __init__(self, alpha: float = 0.2) -> None:
        self.alpha, self.value = alpha, None

    def update(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
