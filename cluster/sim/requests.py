"""One simulated request and what happened to it."""

from __future__ import annotations

from dataclasses import dataclass

OK, REJECTED, UNFINISHED = "ok", "rejected", "unfinished"


@dataclass(eq=False)
class SimRequest:
    rid: int
    arrival: float
    cls: int  # acceptance class (workloads.CLASSES)
    prompt: int
    output: int  # tokens the request generates (first token included)
    alphas: tuple[float, ...]
    max_tokens: int = 8192
    # Timeline.
    t_first: float | None = None  # first token (end of prefill): TTFT = t_first - arrival
    t_join: float | None = None  # joined decode rounds on its latest decode replica
    t_end: float | None = None
    status: str = UNFINISHED
    # Placement and bookkeeping.
    prefill_replica: object | None = None  # holds the KV until decode pulled it
    kv_lost: bool = False  # the holder went away: decode recomputes the prompt
    produced: int = 1  # tokens emitted so far (the first comes from prefill)
    migrations: int = 0
    preemptions: int = 0
    # Decode replica state (owned by sim.decode_replica).
    join_progress: float = 0.0
    threshold: float = 0.0
    removed: bool = False
    seq: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.t_first is None else self.t_first - self.arrival

    @property
    def tpot(self) -> float | None:
        """User-visible time per output token after the first (includes KV transfer, decode
        queueing and any migration); None for one-token answers."""
        if self.t_end is None or self.t_first is None or self.output <= 1:
            return None
        return (self.t_end - self.t_first) / (self.output - 1)

    @property
    def context(self) -> int:
        return self.prompt + self.produced
