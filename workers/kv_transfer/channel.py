"""PairChannel: one point-to-point stream between two processes, without a default group.

Built directly on a TCPStore + PrefixStore rendezvous (notes/ray-platform.md §3), because
`init_process_group` can run once per process and a cluster adds and removes replicas.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mtpserve.workers.kv_transfer.mailbox import QueueReader, post
from mtpserve.workers.kv_transfer.packing import as_bytes

SENDER_RANK = 0  # the prefill side of every pair
RECEIVER_RANK = 1  # the decode side
_TAG = 0  # NCCL ignores tags; order alone matches sends to receives
# Largest bandwidth probe: bigger than any single KV pull, small enough to hold twice.
MAX_PROBE_BYTES = 1 << 30
# NCCL watchdog timeout of a pair; transfers time out (and abort the pair) well before it.
NCCL_GROUP_TIMEOUT_S = 600.0
# TORCH_NCCL_ASYNC_ERROR_HANDLING: 2 = abort the failed communicator, keep the process.
NCCL_ASYNC_ERROR_HANDLING = "2"


class KVTransferError(RuntimeError):
    """A KV transfer failed or timed out. Only the named request fails; a broken channel is
    rebuilt on its next use."""


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV sender address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def connect_store(address: str, timeout_s: float) -> dist.TCPStore:
    """A client connection to the TCPStore at `address` ('host:port')."""
    host, port = parse_address(address)
    try:
        return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout_s))
    except dist.DistError as e:
        raise KVTransferError(f"cannot reach KV store at {address}: {_first_line(e)}") from e


class PairChannel:
    """One ordered stream between a prefill rank (rank 0) and a decode rank (rank 1).

    Control messages (small JSON) travel through the rendezvous store as two queues, one per
    direction; bulk bytes travel through a two-rank process group (gloo on CPU, NCCL on CUDA)
    built on `PrefixStore(f"{namespace}/g{generation}/pg", store)`. Every op takes a timeout.
    A failed or timed-out op raises KVTransferError and marks the channel broken; a broken
    channel is useless (gloo closes a pair after a timeout) until `reconnect` moves queues and
    group to a fresh generation namespace, where late messages of the old one cannot be read.

    Not thread-safe: the owner serializes ops, which also keeps the single ordered stream per
    pair that NCCL needs. The caller owns `store`; a waiting op blocks that store client.
    """

    def __init__(
        self,
        store: dist.Store,
        namespace: str,
        rank: int,
        *,
        peer: str,
        backend: str = "gloo",
        interface: str | None = None,
        generation: int = 0,
    ) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"unknown KV transfer backend {backend!r}")
        self.namespace = namespace
        self.rank = rank
        self.peer = peer
        self.backend = backend
        self.generation = generation
        self.broken = False
        self._store = store
        # Callers pass the node's interface (workers/replica/addresses.py); loopback only
        # when nothing says otherwise (single-process tests).
        self._interface = interface or os.environ.get("GLOO_SOCKET_IFNAME") or "lo"
        self._group: Any = None
        self._inbox: QueueReader | None = None

    @classmethod
    def for_pair(
        cls,
        store: dist.Store,
        receiver_id: str,
        rank: int,
        *,
        peer: str,
        backend: str,
        interface: str | None,
        generation: int,
    ) -> PairChannel:
        """This side (`rank`) of the channel between a KVSender and decode rank `receiver_id`.

        Both sides name the pair here, so they always meet in the same namespace.
        """
        return cls(
            store,
            f"pair/{receiver_id}",
            rank,
            peer=peer,
            backend=backend,
            interface=interface,
            generation=generation,
        )

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._group is not None and not self.broken

    def inbox_name(self, rank: int | None = None) -> str:
        """The control queue read by `rank` (default: this side) in the current generation."""
        rank = self.rank if rank is None else rank
        return f"{self.namespace}/g{self.generation}/to{rank}"

    def connect(self, timeout_s: float) -> None:
        """Build the process group of the current generation; collective with the peer."""
        self._inbox = QueueReader(self._store, self.inbox_name())
        prefix = dist.PrefixStore(f"{self.namespace}/g{self.generation}/pg", self._store)
        try:
            self._group = _make_group(self.backend, prefix, self.rank, timeout_s, self._interface)
        except (RuntimeError, dist.DistError) as e:
            self.broken = True
            raise self._error(f"building the channel timed out or failed ({_first_line(e)})") from e
        self.broken = False

    def reconnect(self, generation: int, timeout_s: float) -> None:
        """Drop the old group and connect again under generation `generation`."""
        assert generation > self.generation, "a rebuilt channel needs a fresh namespace"
        self._shutdown_group()
        self.generation = generation
        self.connect(timeout_s)

    def mark_broken(self) -> None:
        """Poison the channel and close its group now, so a peer blocked on it fails fast."""
        self.broken = True
        self._shutdown_group()

    def close(self) -> None:
        self.broken = True
        self._shutdown_group()

    # -- ops -------------------------------------------------------------------------------------

    def put(self, msg: dict[str, Any]) -> None:
        """Send a control message to the peer (non-blocking)."""
        try:
            post(self._store, self.inbox_name(1 - self.rank), msg)
        except (RuntimeError, dist.DistError) as e:
            self.mark_broken()
            what = msg.get("op", "a reply")
            raise self._error(f"posting {what} failed ({_first_line(e)})") from e

    def take(self, timeout_s: float, what: str) -> dict[str, Any]:
        """Next control message from the peer (or a stop message posted by our owner)."""
        msg = self.poll(timeout_s, what)
        if msg is None:
            self.mark_broken()
            raise self._error(f"waiting for {what} timed out after {timeout_s:.1f}s")
        return msg

    def poll(self, timeout_s: float, what: str) -> dict[str, Any] | None:
        """Like `take`, but a timeout returns None and leaves the channel usable (idle waits)."""
        assert self._inbox is not None, "poll() before connect()"
        try:
            return self._inbox.get(timeout_s)
        except TimeoutError:
            return None
        except (RuntimeError, dist.DistError) as e:
            self.mark_broken()
            raise self._error(f"waiting for {what} failed ({_first_line(e)})") from e

    def send(self, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
        self._p2p("send", tensor, timeout_s, what)

    def recv(self, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
        """Receive into `tensor` (contiguous, exactly the size the peer sends)."""
        self._p2p("recv", tensor, timeout_s, what)

    def _p2p(self, op: str, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
        if not self.connected:
            raise self._error(f"cannot {op} {what}: channel is not connected")
        buf = as_bytes(tensor)  # [nbytes] uint8 view; shares memory with `tensor`
        try:
            if op == "send":
                work = self._group.send([buf], 1 - self.rank, _TAG)
            else:
                work = self._group.recv([buf], 1 - self.rank, _TAG)
            work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        except (RuntimeError, dist.DistError) as e:
            self.mark_broken()
            kind = "timed out" if "timed out" in str(e).lower() else "failed"
            raise self._error(
                f"{op} of {what} ({buf.numel()} bytes) {kind} "
                f"(limit {timeout_s:.1f}s: {_first_line(e)})"
            ) from e

    # -- helpers ---------------------------------------------------------------------------------

    def _error(self, detail: str) -> KVTransferError:
        return KVTransferError(
            f"KV channel to {self.peer} [{self.namespace}/g{self.generation}]: {detail}; "
            "channel marked broken"
        )

    def _shutdown_group(self) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        try:
            # gloo: closes the sockets so the peer's pending op fails now instead of timing out;
            # NCCL: aborts the communicator instead of hanging on it.
            (group.abort if self.backend == "nccl" else group.shutdown)()
        except (RuntimeError, AttributeError):
            pass


def _make_group(
    backend: str, store: dist.Store, rank: int, timeout_s: float, interface: str
) -> Any:
    timeout = timedelta(seconds=max(timeout_s, 1e-3))
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=interface)]
        opts._timeout = timeout  # also bounds the rendezvous: a missing peer fails in time
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    # NCCL: the same direct construction as distributed_c10d.py uses internally; the
    # communicator is created lazily on the first send/recv of the pair. Failure containment
    # (tested on GPUs only): each op waits at most the *transfer* timeout (`work.wait` in
    # `_p2p`), after which the channel aborts and rebuilds only this pair's communicator. The
    # group's own watchdog timeout is longer, so it never fires first, and async error
    # handling 2 (clean up only) makes a failed op raise instead of tearing the process down.
    if not hasattr(dist, "ProcessGroupNCCL"):
        raise RuntimeError("this torch build has no NCCL; use backend='gloo'")
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", NCCL_ASYNC_ERROR_HANDLING)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=max(timeout_s * 4, NCCL_GROUP_TIMEOUT_S))
    # Connect timeout: a blocking ncclCommInitRank (run inside the pair's first send/recv)
    # waits for a peer that may never come, with no time limit. Non-blocking init polls
    # instead, for at most TORCH_NCCL_NONBLOCKING_TIMEOUT seconds (default 30 min), which is
    # set to the connect timeout; a peer that does not arrive fails this pair only.
    cfg = getattr(opts, "config", None)
    if cfg is not None and hasattr(cfg, "blocking"):
        cfg.blocking = 0
        os.environ.setdefault("TORCH_NCCL_NONBLOCKING_TIMEOUT", str(max(1, int(timeout_s))))
    return dist.ProcessGroupNCCL(store, rank, 2, opts)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
