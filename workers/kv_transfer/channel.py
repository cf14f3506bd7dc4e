"""PairChannel: one point-to-point stream between two processes, without a default group.

Built directly on a TCPStore + PrefixStore rendezvous (notes/ray-platform.md §3), because
`init_process_group` can run once per process and a cluster adds and removes replicas.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from mtpserve.workers.device import runtime
from mtpserve.workers.kv_transfer.auth import KVAuth
from mtpserve.workers.kv_transfer.mailbox import BadMessage, QueueReader, post
from mtpserve.workers.kv_transfer.packing import as_bytes

logger = logging.getLogger(__name__)

SENDER_RANK = 0  # the prefill side of every pair
RECEIVER_RANK = 1  # the decode side
_TAG = 0  # NCCL ignores tags; order alone matches sends to receives
# Largest bandwidth probe: bigger than any single KV pull, small enough to hold twice.
MAX_PROBE_BYTES = 1 << 30
# NCCL watchdog timeout of a pair; transfers time out (and abort the pair) well before it.
NCCL_GROUP_TIMEOUT_S = 600.0
# TORCH_NCCL_ASYNC_ERROR_HANDLING: 2 = abort the failed communicator, keep the process.
NCCL_ASYNC_ERROR_HANDLING = "2"
# Deadlines of data ops: NCCL's `work.wait(timeout)` does not enforce the timeout (only with
# blocking wait), so NCCL ops are polled (`is_completed()`) against their deadline and the
# pair's communicator is aborted past it. gloo honours `wait(timeout)`; this variable makes gloo
# take the polled path too, so CPU tests run the exact control flow NCCL pairs run (on gloo
# an aborted group's pending op still ends only at the group's own timeout; NCCL's abort
# ends its kernels; either way the caller has moved on at its deadline).
POLL_COMPLETION_ENV = "MTPSERVE_KV_POLL_COMPLETION"
_POLL_MAX_PAUSE_S = 5e-4  # longest sleep between polls: the latency a polled op may add
_NONCE_BYTES = 32
_OP_SLACK_S = 1.0  # how long past its deadline an abandoned gloo op may still run


class KVTransferError(RuntimeError):
    """A KV transfer failed or timed out. Only the named request fails; a broken channel is
    rebuilt on its next use."""


def parse_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"KV sender address must be 'host:port', got {address!r}")
    return host.strip("[]"), int(port)


def listen_store(host: str, port: int | tuple[int, int], timeout: timedelta) -> dist.TCPStore:
    """A TCPStore server on `port` (0: any free port), or on the first free port of an
    inclusive range (`kv_transfer.store_port_range`, for firewalls that open a fixed range
    between nodes). It listens on `host` only, not on every interface (TCPStore's own server
    binds all of them): the socket is bound here and handed to the store, which owns it from
    then on and closes it when the last reference to the server object goes."""
    ports = range(port[0], port[1] + 1) if isinstance(port, tuple) else [port]
    last: Exception | None = None
    for p in ports:
        try:
            sock = _bound_socket(host, p)
        except OSError as e:  # in use: try the next one
            last = e
            continue
        bound = sock.getsockname()[1]
        # detach: the store owns the descriptor and closes it with itself.
        return dist.TCPStore(host, bound, None, True, timeout, wait_for_workers=False,
                             master_listen_fd=sock.detach())
    raise RuntimeError(f"no free KV store port in {ports}: {last}")


def _bound_socket(host: str, port: int) -> socket.socket:
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


def wait_work(work: Any, timeout_s: float, poll: bool) -> None:
    """Wait for a p2p op within `timeout_s`; TimeoutError past it (the op is then still
    pending: the caller aborts the pair's group, which fails it).

    `poll`: check `is_completed()` against the deadline instead of trusting
    `wait(timeout)` (NCCL: required, see POLL_COMPLETION_ENV). Once complete, `wait()`
    raises the op's error, if any, and orders the current stream after it."""
    if not poll:
        work.wait(timedelta(seconds=max(timeout_s, 1e-3)))
        return
    deadline = time.monotonic() + timeout_s
    pause = 2e-5
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"op not completed within {timeout_s:.1f}s (polled; timed out)")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_PAUSE_S)
    work.wait()


def wait_stream(device: torch.device, timeout_s: float) -> None:
    """Wait until the current CUDA stream's work so far has run, within `timeout_s`
    (TimeoutError past it). Not `stream.synchronize()`: that blocks without bound behind an
    NCCL op whose peer died. Only this stream is waited for, never the device."""
    if device.type != "cuda":
        return
    event = runtime().record_event(device)
    deadline = time.monotonic() + timeout_s
    pause = 2e-5
    while not runtime().event_done(event):
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the pair's stream did not finish within {timeout_s:.1f}s")
        time.sleep(pause)
        pause = min(2 * pause, _POLL_MAX_PAUSE_S)


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
        auth: KVAuth | None = None,
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
        self._auth = auth or KVAuth(None)
        # Per-direction sequence numbers of signed messages in the current generation.
        self._sent_seq = self._recv_seq = 0
        self.rejected = 0  # messages refused: not signed with the secret, replayed, malformed
        self.poll_work = backend == "nccl" or os.environ.get(POLL_COMPLETION_ENV) == "1"

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
        auth: KVAuth | None = None,
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
            auth=auth,
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
        deadline = time.monotonic() + timeout_s
        self._inbox = QueueReader(self._store, self.inbox_name())
        self._sent_seq = self._recv_seq = 0
        prefix = dist.PrefixStore(f"{self.namespace}/g{self.generation}/pg", self._store)
        try:
            self._group = _make_group(self.backend, prefix, self.rank, timeout_s, self._interface)
        except (RuntimeError, dist.DistError) as e:
            self.broken = True
            raise self._error(f"building the channel timed out or failed ({_first_line(e)})") from e
        self.broken = False
        if self._auth.enabled:
            self._prove(max(deadline - time.monotonic(), 1e-3))

    def _prove(self, timeout_s: float) -> None:
        """Both ends show the secret over the group itself: whoever joined the rendezvous as
        our peer must answer our random nonce with its HMAC. Without this, a process that
        raced into the pair's rendezvous (the store accepts anyone) would receive the KV
        bytes that signed pulls ask for. Order matches on both sides (NCCL needs it)."""
        device = (torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl"
                  else torch.device("cpu"))
        context = f"{self.namespace}/g{self.generation}"
        mine = secrets.token_bytes(_NONCE_BYTES)
        theirs = torch.empty(_NONCE_BYTES, dtype=torch.uint8, device=device)
        proof = torch.empty(_NONCE_BYTES, dtype=torch.uint8, device=device)
        deadline = time.monotonic() + timeout_s

        def left() -> float:
            return max(deadline - time.monotonic(), 1e-3)

        def as_tensor(b: bytes) -> torch.Tensor:
            return torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device)

        def check(role: str) -> None:
            want = self._auth.challenge_reply(mine, role, context)
            if proof.cpu().numpy().tobytes() != want:
                self.rejected += 1
                self.mark_broken()
                raise self._error("the peer in the pair's group does not hold the KV secret")

        peer_role, my_role = ("r", "s") if self.rank == SENDER_RANK else ("s", "r")
        if self.rank == SENDER_RANK:
            self.send(as_tensor(mine), left(), "the pair's challenge")
            self.recv(theirs, left(), "the peer's challenge")
            reply = self._auth.challenge_reply(theirs.cpu().numpy().tobytes(), my_role, context)
            self.send(as_tensor(reply), left(), "the pair's proof")
            self.recv(proof, left(), "the peer's proof")
            check(peer_role)
        else:
            self.recv(theirs, left(), "the peer's challenge")
            self.send(as_tensor(mine), left(), "the pair's challenge")
            self.recv(proof, left(), "the peer's proof")
            check(peer_role)  # before we prove anything to an impostor
            reply = self._auth.challenge_reply(theirs.cpu().numpy().tobytes(), my_role, context)
            self.send(as_tensor(reply), left(), "the pair's proof")

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
        """Send a control message to the peer (non-blocking); signed when there is a secret."""
        if self._auth.enabled:
            self._sent_seq += 1
            msg = self._auth.sign({**msg, "seq": self._sent_seq}, self.inbox_name(1 - self.rank))
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
        """Like `take`, but a timeout returns None and leaves the channel usable (idle waits).
        Messages that are malformed or not signed with the secret are dropped (and counted):
        they come from someone else who reached the store, not from the peer."""
        assert self._inbox is not None, "poll() before connect()"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                msg = self._inbox.get(max(deadline - time.monotonic(), 1e-3))
            except TimeoutError:
                return None
            except BadMessage as e:
                self._refuse(str(e))
                continue
            except (RuntimeError, dist.DistError) as e:
                self.mark_broken()
                raise self._error(f"waiting for {what} failed ({_first_line(e)})") from e
            if self._accepts(msg):
                return msg
            self._refuse(f"unsigned or replayed {str(msg.get('op', 'reply'))[:20]!r}")

    def wake(self, store: dist.Store) -> None:
        """Post a stop to this side's own inbox through `store` (the owner's client), so the
        thread waiting in `poll` returns it."""
        post(store, self.inbox_name(), self._auth.stamp({"op": "stop"}, self.inbox_name()))

    def _accepts(self, msg: dict[str, Any]) -> bool:
        auth = self._auth
        if not auth.enabled:
            return True
        if not auth.verify(msg, self.inbox_name()):
            return False
        if msg.get("op") == "stop" and "seq" not in msg:  # our owner's wake-up (`wake`)
            return True
        seq = msg.get("seq")
        if not isinstance(seq, int) or seq <= self._recv_seq:
            return False
        self._recv_seq = seq
        return True

    def _refuse(self, why: str) -> None:
        self.rejected += 1
        logger.warning("KV channel to %s [%s/g%d]: dropped a message (%s)", self.peer,
                       self.namespace, self.generation, why)

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
            if self.poll_work:
                # A two-rank broadcast from the sending side: the same bytes as send/recv,
                # and its work reports completion while pending (gloo's p2p work does not
                # until waited on), so one polled path serves NCCL and its gloo test.
                opts = dist.BroadcastOptions()
                opts.rootRank = self.rank if op == "send" else 1 - self.rank
                opts.rootTensor = 0
                # gloo cannot abort a pending op: bound it by itself just past our deadline,
                # so an abandoned one ends soon after (NCCL's abort ends it at once).
                opts.timeout = timedelta(seconds=max(timeout_s, 1e-3) + _OP_SLACK_S)
                work = self._group.broadcast([buf], opts)
            elif op == "send":
                work = self._group.send([buf], 1 - self.rank, _TAG)
            else:
                work = self._group.recv([buf], 1 - self.rank, _TAG)
            wait_work(work, timeout_s, self.poll_work)
        except (RuntimeError, dist.DistError, TimeoutError) as e:
            # Past the deadline the op is still pending: aborting this pair's group (only
            # this pair's) fails it on both ends and frees the thread; the next use rebuilds.
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
        box = [group]
        del group  # `box` holds the last reference (see below)
        _abort(box[0], self.backend, self.namespace)
        if self.poll_work:
            # Past a deadline an op may still be pending, and the group's destructor waits
            # for it (gloo: until the op's own timeout, `_OP_SLACK_S` past the deadline):
            # drop the last reference on another thread, so this one (a pull lane, a pair
            # thread) is free now. Not a daemon: exit waits for it rather than tearing the
            # group down mid-destructor (which aborts the process).
            threading.Thread(target=box.clear, name="kv-pair-reaper").start()


def _abort(group: Any, backend: str, namespace: str) -> None:
    """gloo: close the sockets so the peer's pending op fails now instead of timing out;
    NCCL: abort the communicator (its pending kernels end) instead of hanging on it. Names
    differ across torch versions; the first one present is used."""
    for name in ("abort", "_abort", "shutdown") if backend == "nccl" else ("shutdown", "abort"):
        fn = getattr(group, name, None)
        if fn is None:
            continue
        try:
            fn()
        except RuntimeError:
            logger.debug("KV channel %s: %s() of the group raised", namespace, name,
                         exc_info=True)
        return


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
