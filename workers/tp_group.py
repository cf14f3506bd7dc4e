"""One TP rank of a prefill or decode replica, and the rank-0 driver of the group.

Rank 0 (in the Serve replica) schedules and samples; it broadcasts every command (a forward, a
KV hold, a KV pull) to the other ranks, which execute the same command on their shard. Ranks
>= 1 run `worker_loop`. Ray-free: the Ray actors that host ranks live in `tp_workers.py`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from workers.model.parallel import set_tp
from workers.model_runner import ForwardBatch, ModelRunner

logger = logging.getLogger(__name__)

# An idle decode replica may wait a long time for its next command; collectives that hang
# because a peer died are ended by Serve's health check killing the replica (and its ranks).
IDLE_TIMEOUT = timedelta(hours=24)


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank needs to build its shard; the same for every rank of a group."""

    model: str
    role: Literal["prefill", "decode"]
    tp_size: int
    num_kv_blocks: int
    block_size: int = 16
    dtype: str = "float32"
    device: str = "cpu"
    init_method: str | None = None  # tcp://host:port of rank 0's rendezvous (tp_size > 1)
    kv_backend: str = "gloo"
    kv_host: str = "127.0.0.1"
    kv_timeout_s: float = 30.0
    kv_hold_ttl_s: float = 60.0
    num_threads: int | None = None


@dataclass
class HoldKV:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    extras: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class AwaitRelease:
    request_id: str
    timeout_s: float


@dataclass
class PullKV:
    request_id: str
    sender_addresses: list[str]
    block_ids: list[int]
    num_kv_heads: int
    timeout_s: float


@dataclass
class ProbeKV:
    """Raw send/recv of `num_bytes` on the same channel as KV pulls (bandwidth baseline)."""

    sender_address: str
    num_bytes: int


class Shutdown:
    pass


class RankCore:
    """Model shard + KV cache + this rank's KV sender (prefill) or receiver (decode)."""

    def __init__(self, spec: RankSpec, rank: int) -> None:
        from workers.engine import DTYPES
        from workers.kv_transfer import KVReceiver, KVSender

        self.spec, self.rank = spec, rank
        if spec.num_threads:
            torch.set_num_threads(spec.num_threads)
        if spec.device == "cuda":
            torch.cuda.set_device(0)  # Ray exposes this rank's GPU as device 0
        if spec.tp_size > 1:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            backend = "nccl" if spec.device == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=spec.init_method, rank=rank,
                                    world_size=spec.tp_size, timeout=IDLE_TIMEOUT)
            set_tp(rank, spec.tp_size, dist.group.WORLD)
        self.runner = ModelRunner(spec.model, spec.num_kv_blocks, spec.block_size,
                                  DTYPES[spec.dtype], spec.device)
        cfg = self.runner.config
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_start = rank * cfg.num_key_value_heads // spec.tp_size
        self.released: set[str] = set()
        self.sender = self.receiver = None
        if spec.role == "prefill":
            self.sender = KVSender(host=spec.kv_host, backend=spec.kv_backend,
                                   device=spec.device, hold_ttl_s=spec.kv_hold_ttl_s,
                                   transfer_timeout_s=spec.kv_timeout_s,
                                   on_release=self._on_release, name=f"prefill-r{rank}")
        else:
            self.receiver = KVReceiver(backend=spec.kv_backend, device=spec.device,
                                       name=f"decode-r{rank}")
        self.release_callback = None  # rank 0: engine-side hook

    @property
    def kv_address(self) -> str | None:
        return self.sender.address if self.sender else None

    def _on_release(self, request_id: str, reason: str) -> None:
        self.released.add(request_id)
        if self.release_callback is not None:
            self.release_callback(request_id, reason)

    def handle(self, cmd: Any) -> Any:
        if isinstance(cmd, ForwardBatch):
            return self.runner.execute(cmd)
        if isinstance(cmd, HoldKV):
            self.sender.hold(cmd.request_id, self.runner.kv_cache.layers, cmd.block_ids,
                             cmd.num_tokens, self.head_start, cmd.extras)
            return None
        if isinstance(cmd, AwaitRelease):
            deadline = time.monotonic() + cmd.timeout_s
            while cmd.request_id not in self.released and time.monotonic() < deadline:
                if cmd.request_id not in self.sender.held_request_ids():
                    break
                time.sleep(0.005)
            self.released.discard(cmd.request_id)
            return None
        if isinstance(cmd, PullKV):
            return self._pull(cmd)
        if isinstance(cmd, ProbeKV):
            return self.receiver.probe(cmd.sender_address, cmd.num_bytes)
        raise TypeError(f"unknown command {type(cmd).__name__}")

    def _pull(self, cmd: PullKV) -> tuple[bool, str | None, dict]:
        from workers.kv_transfer import pull_resharded, scatter_blocks

        ok, err, extras = True, None, {}
        try:
            kv, extras = pull_resharded(self.receiver, cmd.sender_addresses, cmd.request_id,
                                        cmd.num_kv_heads, self.spec.tp_size, self.rank,
                                        cmd.timeout_s)
            scatter_blocks(self.runner.kv_cache.layers, cmd.block_ids[: kv.shape[2]], kv)
        except Exception as e:  # this request fails; the replica goes on
            ok, err = False, f"KV transfer of {cmd.request_id} failed on rank {self.rank}: {e}"
            logger.warning(err)
        if self.spec.tp_size > 1:  # every rank must take the same decision
            flag = torch.tensor([1 if ok else 0])
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if not flag.item() and ok:
                ok, err = False, f"KV transfer of {cmd.request_id} failed on another rank"
        return ok, err, extras

    def close(self) -> None:
        for x in (self.sender, self.receiver):
            if x is not None:
                x.close()


def _broadcast(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def worker_loop(core: RankCore) -> None:
    """Ranks >= 1: execute rank 0's commands until `Shutdown`."""
    while True:
        cmd = _broadcast(None)
        if isinstance(cmd, Shutdown):
            core.close()
            return
        try:
            core.handle(cmd)
        except Exception:
            logger.exception("rank %d failed on %s", core.rank, type(cmd).__name__)


class TPDriver:
    """Rank 0: the `ModelRunner` interface the engine uses, plus KV commands, all mirrored to
    the other ranks. Must be called from one thread (the engine thread)."""

    def __init__(self, core: RankCore) -> None:
        self.core = core
        self.runner = core.runner
        self.config = core.runner.config
        self.kv_cache = core.runner.kv_cache
        self.tp_size = core.spec.tp_size

    def run(self, cmd: Any) -> Any:
        if self.tp_size > 1:
            _broadcast(cmd)
        return self.core.handle(cmd)

    def execute(self, batch: ForwardBatch) -> torch.Tensor:
        return self.run(batch)

    def shutdown(self) -> None:
        if self.tp_size > 1:
            _broadcast(Shutdown())
        self.core.close()
