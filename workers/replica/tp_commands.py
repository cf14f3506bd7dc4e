"""Commands rank 0 sends to every rank of a TP group (pickled on the control plane, rare and
small: KV holds, releases, pull batches, probes, test faults) and what finished pulls report.
Ray-free and torch-light, so the shells and the KV data path share them with `tp_group`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class HoldKV:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    # Hybrid models: the request's state slot; every rank adds its shard of the recurrent
    # state to the extras it holds (workers/kv_transfer/states.py).
    state_slot: int | None = None


@dataclass
class ReleaseKV:
    """Drop a hold now (decode will not pull it)."""

    request_id: str


@dataclass
class RenewKV:
    """Extend a hold's lease (decode is busy, the orchestrator is still waiting for it)."""

    request_id: str
    ttl_s: float | None = None


@dataclass
class PullKV:
    """Pull a held request's KV into `block_ids`: the request's blocks after the first
    `skip_blocks`, which this replica's prefix cache already holds (not sent)."""

    request_id: str
    sender_addresses: list[str]
    block_ids: list[int]
    num_kv_heads: int
    timeout_s: float
    skip_blocks: int = 0
    hold_id: str | None = None  # the prefill's name for the held KV (None: request_id)
    # Hybrid models: the slot the pulled recurrent state goes to (kv_transfer/states.py);
    # `prefill_tp_size` the holder's TP size, which the state shards follow.
    state_slot: int | None = None
    prefill_tp_size: int = 1


@dataclass
class StartPulls:
    """Start these pulls on every rank's transfer thread (one command per engine step)."""

    pulls: list[PullKV]


@dataclass
class InjectFault:
    """Tests only: delay the next `count` KV sends (prefill) or pulls (decode) on every rank."""

    delay_s: float
    count: int = 1


@dataclass
class WarmGraph:
    """Build and run one decode graph bucket on every rank in step (a warm-up forward runs the
    graph's collectives); `key` None ends the warm-up (buckets not built run eagerly)."""

    key: Any  # workers.model.decode_graph.GraphKey | None


@dataclass
class GreedyRound:
    """A whole greedy round as one graph on every rank (`ModelRunner.greedy_round`)."""

    input_ids: list[list[int]]
    starts: list[int]
    tables: list[list[int]]
    room: list[int]


@dataclass
class KeepStates:
    """Hybrid models, after a verify forward: every rank keeps each row's recurrent state at
    its last accepted token (`ModelRunner.keep_states`)."""

    rows: list[int]
    positions: list[int]


@dataclass
class ProbeKV:
    """Raw send/recv of `num_bytes` on the same channel as KV pulls (bandwidth baseline)."""

    sender_address: str
    num_bytes: int


@dataclass
class PullOutcome:
    """A pull that every rank has finished: ok on all ranks, or failed on at least one."""

    request_id: str
    ok: bool
    error: str | None
    extras: dict[str, torch.Tensor]  # rank 0's copy (replicated), on the host
